"""The store's operations, written as Lua, as PL/pgSQL and as a Python reference, proven equal.

`sim.redis.REFERENCES` is the table: every script `engine/runtime/store.py` registers and
the `SimRedis` method the simulator runs in its place; `engine/runtime/pgstore.py` runs the
same operations as PL/pgSQL functions (`engine/runtime/migrations/`). Hypothesis drives all
three at once with random sequences of every operation in the table and of the plain reads
both stores have, on two evaluations and three workers (each writing with the token it
last got, current or stale), with leases lapsing and whole evaluations vanishing (past
their retention, or lost by Redis) at any moment. After every step each
reply must be the same, and so must a canonical dump of each evaluation: its state, fence
token, lease holder, plan, results, statuses, starts, published passes, whether its final
state was announced, what the running and retries indexes hold of it, and (Redis and the
reference) any key left without a TTL or of a kind the dump does not know.

Time is the one thing the three do not share: Redis's scripts read the worker's clock and
Redis's `TIME`, PostgreSQL's functions the database's clock, the reference the simulated
clock (held at 0 here). So the sequences use only delays and thresholds that decide the
same way on every clock (0, or far beyond the run), index scores are compared as
membership, and a lapsed lease is a deleted key (Redis, the reference) or a lease whose
time is long past (PostgreSQL).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import asyncpg
import hypothesis.strategies as st
import pytest
import redis as sync_redis
import simpy
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

import engine.runtime.store as store_module
from engine.core import PERMANENTLY_FAILED, RuleResult
from engine.plan import Plan, load_plan
from engine.runtime.pgstore import PostgresStore, migrations
from engine.runtime.store import (
    Begun,
    LeaseLost,
    RedisStore,
    eval_key,
    retry_member,
    split_member,
)
from sim.redis import REFERENCES, Fenced, SimRedis
from tests.live.conftest import ROOT, Live
from tests.live.test_pgstore_live import PgSandbox, sandbox

pytestmark = [pytest.mark.live, pytest.mark.slow]

WORKERS = ("w1", "w2", "w3")
PLAN: Plan = load_plan(ROOT / "plans" / "tiny.yaml")
RULES = PLAN.order
FAR_MS = 10**9  # a delay or threshold no step of a test run reaches, on either clock
STATES = ("running", "cancelled", "completed")
#: The plain reads and commands both live stores have besides the scripts, driven too.
READS = (
    "snapshot",
    "record",
    "stored_plan",
    "holder",
    "reinstate",
    "stale_evaluations",
    "overdue_retries",
)
#: (operation, refused by the fence) pairs the runs went through.
SEEN: set[tuple[str, bool]] = set()
STARTS = st.lists(st.tuples(st.sampled_from(RULES), st.integers(1, 3)), max_size=2)
_EVAL_KEYS = ("owner", "state", "plan", "fence", "final_published", "passes")


@pytest.fixture(scope="module")
def pg() -> Iterator[PgSandbox]:
    with sandbox() as box:
        yield box


def test_every_script_of_the_store_has_a_python_reference_and_a_function() -> None:
    source = Path(store_module.__file__).read_text(encoding="utf-8")
    registered = set(re.findall(r"self\.batch\.register\((_[A-Z_]+)\)", source))
    assert registered == set(REFERENCES), "a script without reference, or a stale entry"
    sql = "".join(m.sql for m in migrations())
    for method in REFERENCES.values():
        assert callable(getattr(SimRedis, method)), method
        assert callable(getattr(PostgresStore, method)), method
        assert f"CREATE FUNCTION eai.{method}(" in sql, method
    steps = {name for name in dir(Stores) if not name.startswith("_")}
    assert set(REFERENCES.values()) | set(READS) <= steps, "every operation is driven"
    public = {n for n in vars(RedisStore) if not n.startswith("_")}
    assert public <= set(dir(PostgresStore)), "PostgresStore has every RedisStore method"


class Stores(RuleBasedStateMachine):
    """Redis, PostgreSQL and the reference, driven alike. The event loop, the PostgreSQL
    store and its administrator's connection are shared by the examples of a run (each
    example has evaluations of its own)."""

    live_env: ClassVar[Live]
    reference: ClassVar[type[SimRedis]] = SimRedis
    loop: ClassVar[asyncio.AbstractEventLoop]
    pg: ClassVar[PostgresStore]
    admin: ClassVar[asyncpg.Connection]
    _n: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        Stores._n += 1
        self.ids = [f"{self.live_env.prefix}ref{Stores._n}{x}" for x in "ab"]
        config = dataclasses.replace(self.live_env.config(), stale_ms=600_000)
        self.store = RedisStore(config)
        self.raw = sync_redis.Redis.from_url(config.redis_url, decode_responses=True)
        self.sim = self.reference(
            simpy.Environment(),
            running_index=self.store.running_index,
            retries_index=self.store.retries_index,
            ttl_s=config.state_ttl_s,
            lease_ms=config.stale_ms,
        )
        self.tokens: dict[tuple[str, str], str] = {}  # (worker, evaluation) -> last token

    def teardown(self) -> None:
        for a in self.ids:
            keys = self.raw.keys(f"attempt:{a}:*")
            if keys:
                self.raw.delete(*keys)
            self.raw.zrem(self.store.running_index, a)
            for r in RULES:
                self.raw.zrem(self.store.retries_index, retry_member(a, r))
        self._sql(
            "DELETE FROM eai.runs WHERE namespace = $1 AND attempt_id = ANY($2)",
            self.pg.namespace,
            self.ids,
        )
        self.loop.run_until_complete(self.store.close())
        self.raw.close()

    # --- helpers ------------------------------------------------------------------------

    def _sql(self, query: str, *args: Any) -> Any:
        return self.loop.run_until_complete(self.admin.fetch(query, *args))

    def _call(self, coro: Any) -> Any:
        try:
            return self.loop.run_until_complete(coro)
        except LeaseLost:
            return "fenced"

    def _all(self, op: str, live: Any, pg: Any, sim: Any) -> Any:
        """One operation on the three stores; the replies must be equal; returns Redis's."""
        want = "fenced" if isinstance(sim, Fenced) else sim
        got = self._call(live)
        on_pg = self._call(pg)
        assert got == want, (op, "redis", got, want)
        assert on_pg == want, (op, "postgres", on_pg, want)
        SEEN.add((op, got == "fenced"))
        return got

    def _token(self, data: st.DataObject, a: str) -> tuple[str, str | None]:
        """A worker, and the token it last got for `a` (None: it never got one)."""
        holders = [w for w in WORKERS if (w, a) in self.tokens]
        if holders and data.draw(st.sampled_from([True, True, True, False])):  # mostly
            w = data.draw(st.sampled_from(holders))
        else:
            w = data.draw(st.sampled_from(WORKERS))
        return w, self.tokens.get((w, a))

    # --- the operations, one step each ---------------------------------------------------

    @rule(data=st.data(), with_plan=st.booleans())
    def begin(self, data: st.DataObject, with_plan: bool) -> None:
        a = data.draw(st.sampled_from(self.ids))
        self._begin(a, data.draw(st.sampled_from(WORKERS)), with_plan)

    @rule(data=st.data())
    def lapse(self, data: st.DataObject) -> None:
        """A lease expires (nobody renewed it in time)."""
        self._lapse(data.draw(st.sampled_from(self.ids)))

    @rule(data=st.data())
    def take_over(self, data: st.DataObject) -> None:
        """The owner's lease lapses and another worker resumes: the old token goes stale."""
        a = data.draw(st.sampled_from(self.ids))
        owner = self.raw.get(eval_key(a, "owner"))
        self._lapse(a)
        self._begin(a, data.draw(st.sampled_from([w for w in WORKERS if w != owner])), True)

    @rule(data=st.data())
    def forget(self, data: st.DataObject) -> None:
        """The evaluation is gone as a whole (past its retention; or Redis lost its writes),
        index entries included; workers still hold their tokens for it."""
        a = data.draw(st.sampled_from(self.ids))
        keys = self.raw.keys(f"attempt:{a}:*")
        if keys:
            self.raw.delete(*keys)
        for key in self.sim.keys(f"attempt:{a}:"):
            self.sim._del(key)
        self.raw.zrem(self.store.running_index, a)
        self.sim._zrem(self.store.running_index, a)
        for r in RULES:
            self.raw.zrem(self.store.retries_index, retry_member(a, r))
            self.sim._zrem(self.store.retries_index, retry_member(a, r))
        self._sql(
            "DELETE FROM eai.runs WHERE namespace = $1 AND attempt_id = $2", self.pg.namespace, a
        )

    def _begin(self, a: str, w: str, with_plan: bool) -> None:
        plan = PLAN.to_json() if with_plan else None
        sim = self.sim.begin(a, w, RULES, PLAN if with_plan else None, 0)
        got: Begun = self._all(
            "begin",
            _plan_blind(self.store.begin(a, w, RULES, plan)),
            _plan_blind(self.pg.begin(a, w, RULES, plan)),
            dataclasses.replace(sim, plan_json=None),
        )
        if got.fence:
            self.tokens[(w, a)] = got.fence

    def _lapse(self, a: str) -> None:
        self.raw.delete(eval_key(a, "owner"))
        self.sim._del(eval_key(a, "owner"))
        self._sql(
            "UPDATE eai.runs SET lease_until_ms = 0 WHERE namespace = $1 AND attempt_id = $2",
            self.pg.namespace,
            a,
        )

    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.ids))
        w, token = self._token(data, a)
        held = {a: token or ""}  # no token: lost, whatever the lease
        self._all(
            "renew", self.store.renew(held, w), self.pg.renew(held, w), self.sim.renew(held, w, 0)
        )

    @rule(data=st.data(), verdict=st.sampled_from(["pass", "fail"]))
    def write_result(self, data: st.DataObject, verdict: str) -> None:
        a = data.draw(st.sampled_from(self.ids))
        _, token = self._token(data, a)
        rule_id = data.draw(st.sampled_from(RULES))
        starts = data.draw(STARTS)
        result = RuleResult(rule_id, verdict, 0.5, 10)
        self._all(
            "write_result",
            self.store.write_result(a, result, starts, token),
            self.pg.write_result(a, result, starts, token),
            self.sim.write_result(a, result, starts, token),
        )

    @rule(data=st.data(), delay=st.sampled_from([None, 0, FAR_MS]))
    def write_status(self, data: st.DataObject, delay: int | None) -> None:
        a = data.draw(st.sampled_from(self.ids))
        _, token = self._token(data, a)
        rule_id = data.draw(st.sampled_from(RULES))
        n = data.draw(st.integers(1, 3))
        status = data.draw(st.sampled_from([f"failed_attempt_{n}", PERMANENTLY_FAILED]))
        sim = self.sim.write_status(a, rule_id, status, delay, token)
        # the due time is read off each store's clock: compare whether one was indexed
        self._all(
            "write_status",
            _due_blind(self.store.write_status(a, rule_id, status, delay, token)),
            _due_blind(self.pg.write_status(a, rule_id, status, delay, token)),
            sim if isinstance(sim, Fenced) else _due_seen(sim),
        )

    @rule(data=st.data())
    def mark_started(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.ids))
        _, token = self._token(data, a)
        starts = data.draw(STARTS)
        self._all(
            "mark_started",
            self.store.mark_started(a, starts, token),
            self.pg.mark_started(a, starts, token),
            self.sim.mark_started(a, starts, token),
        )

    @rule(data=st.data(), outcome=st.sampled_from(["complete", "partial"]))
    def mark_pass_published(self, data: st.DataObject, outcome: str) -> None:
        a = data.draw(st.sampled_from(self.ids))
        _, token = self._token(data, a)
        pass_id = data.draw(st.sampled_from(["quick", "deep"]))
        self._all(
            "mark_pass_published",
            self.store.mark_pass_published(a, pass_id, outcome, token),
            self.pg.mark_pass_published(a, pass_id, outcome, token),
            self.sim.mark_pass_published(a, pass_id, outcome, token),
        )

    @rule(data=st.data())
    def park(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.ids))
        w, token = self._token(data, a)
        waiting = data.draw(st.lists(st.sampled_from(RULES), unique=True, max_size=2))
        self._all(
            "park",
            self.store.park(a, w, token, waiting),
            self.pg.park(a, w, token, waiting),
            self.sim.park(a, w, token, waiting),
        )

    @rule(data=st.data(), status=st.sampled_from(["completed", "partial", "failed"]))
    def finish(self, data: st.DataObject, status: str) -> None:
        a = data.draw(st.sampled_from(self.ids))
        _, token = self._token(data, a)
        done = data.draw(st.lists(st.sampled_from(RULES), unique=True, max_size=2))
        results = {r: RuleResult(r, "pass", 0.9, 10) for r in done}
        failed = [r for r in RULES if r not in results][: data.draw(st.integers(0, 1))]
        self._all(
            "finish",
            self.store.finish(a, status, results, failed, token),
            self.pg.finish(a, status, results, failed, token),
            self.sim.finish(a, status, results, failed, token),
        )

    @rule(data=st.data())
    def done(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.ids))
        w = data.draw(st.sampled_from([*WORKERS, ""]))  # "": a client's cancel
        self._all("done", self.store.done(a, w), self.pg.done(a, w), self.sim.done(a, w))

    @rule(data=st.data(), state=st.sampled_from(STATES))
    def set_state(self, data: st.DataObject, state: str) -> None:
        a = data.draw(st.sampled_from(self.ids))
        self._all(
            "set_state",
            self.store.set_state(a, state),
            self.pg.set_state(a, state),
            self.sim.set_state(a, state),
        )

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.ids))
        w = data.draw(st.sampled_from(WORKERS))
        self._all(
            "release", self.store.release(a, w), self.pg.release(a, w), self.sim.release(a, w)
        )

    @rule(data=st.data())
    def unindex(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.ids))
        self._all("unindex", self.store.unindex(a), self.pg.unindex(a), self.sim.unindex(a))

    @rule(data=st.data(), older_than=st.sampled_from([0, FAR_MS]))
    def claim_stale(self, data: st.DataObject, older_than: int) -> None:
        a = data.draw(st.sampled_from(self.ids))
        self._all(
            "claim_stale",
            self.store.claim_stale(a, older_than),
            self.pg.claim_stale(a, older_than),
            self.sim.claim_stale(a, older_than, 0),
        )

    @rule(data=st.data(), grace=st.sampled_from([0, FAR_MS]))
    def claim_retry(self, data: st.DataObject, grace: int) -> None:
        member = retry_member(
            data.draw(st.sampled_from(self.ids)), data.draw(st.sampled_from(RULES))
        )
        self._all(
            "claim_retry",
            self.store.claim_retry(member, grace),
            self.pg.claim_retry(member, grace),
            self.sim.claim_retry(member, grace, 0),
        )

    # --- the plain reads and commands ----------------------------------------------------

    @rule(data=st.data())
    def snapshot(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.ids))
        self._all(
            "snapshot",
            self.store.snapshot(a, RULES),
            self.pg.snapshot(a, RULES),
            self.sim.snapshot(a, RULES),
        )

    @rule(data=st.data())
    def record(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.ids))
        state, plan, published = self.sim.record(a)
        self._all(
            "record",
            _record(self.store.record(a)),
            _record(self.pg.record(a)),
            (state, _plan_doc(plan), published),
        )

    @rule(data=st.data())
    def stored_plan(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.ids))
        self._all(
            "stored_plan",
            _parsed(self.store.stored_plan(a)),
            _parsed(self.pg.stored_plan(a)),
            _plan_doc(self.sim.stored_plan(a)),
        )

    @rule(data=st.data())
    def holder(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.ids))
        self._all("holder", self.store.holder(a), self.pg.holder(a), self.sim.holder(a))

    @rule(data=st.data())
    def reinstate(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.ids))
        self._all(
            "reinstate",
            self.store.reinstate(a, PLAN),
            self.pg.reinstate(a, PLAN),
            self.sim.reinstate(a, PLAN),
        )

    @rule(older_than=st.sampled_from([0, FAR_MS]))
    def stale_evaluations(self, older_than: int) -> None:
        self._all(
            "stale_evaluations",
            self._mine(self.store.stale_evaluations(older_than)),
            self._mine(self.pg.stale_evaluations(older_than)),
            sorted(a for a in self.sim.stale_evaluations(older_than, 0) if a in self.ids),
        )

    @rule(grace=st.sampled_from([0, FAR_MS]))
    def overdue_retries(self, grace: int) -> None:
        mine = [m for m in self.sim.overdue_retries(grace, 0) if split_member(m)[0] in self.ids]
        self._all(
            "overdue_retries",
            self._mine(self.store.overdue_retries(grace)),
            self._mine(self.pg.overdue_retries(grace)),
            sorted(mine),
        )

    async def _mine(self, listing: Any) -> list[str]:
        """The members of this example's evaluations in an index listing, sorted (their
        order is by score, which each store reads off its own clock)."""
        return sorted(m for m in await listing if split_member(m)[0] in self.ids)

    # --- what the three leave -------------------------------------------------------------

    @invariant()
    def the_evaluations_are_the_same(self) -> None:
        pg = self._pg_dumps()
        for a in self.ids:
            live, sim = self._redis_dump(a), self._sim_dump(a)
            assert live == sim, (a, "redis", live, "reference", sim)
            assert pg[a] == sim, (a, "postgres", pg[a], "reference", sim)

    def _redis_dump(self, a: str) -> dict[str, Any]:
        raw = self.raw
        out = _empty()
        prefix = f"attempt:{a}:"
        for key in raw.keys(f"{prefix}*"):
            what = key.removeprefix(prefix)
            kind = raw.type(key)
            value: Any = raw.hgetall(key) if kind == "hash" else raw.get(key)
            _put(out, what, value)
            if raw.ttl(key) <= 0:
                out["untimed"].append(what)
        out["running"] = raw.zscore(self.store.running_index, a) is not None
        out["retries"] = sorted(
            split_member(m)[1]
            for m in raw.zrange(self.store.retries_index, 0, -1)
            if split_member(m)[0] == a
        )
        return _settled(out)

    def _sim_dump(self, a: str) -> dict[str, Any]:
        out = _empty()
        prefix = f"attempt:{a}:"
        for key in self.sim.keys(prefix):
            what = key.removeprefix(prefix)
            value = self.sim.get(key)
            if isinstance(value, Plan):
                value = value.to_json()
            elif isinstance(value, dict):
                value = {k: str(v) for k, v in value.items()}
            _put(out, what, value)
            if self.sim.ttl_of(key) <= 0:
                out["untimed"].append(what)
        out["running"] = a in (self.sim.get(self.store.running_index) or {})
        out["retries"] = sorted(
            split_member(m)[1]
            for m in (self.sim.get(self.store.retries_index) or {})
            if split_member(m)[0] == a
        )
        return _settled(out)

    def _pg_dumps(self) -> dict[str, dict[str, Any]]:
        """Each evaluation's rows, as the administrator reads them (no policy applies)."""
        rows = self._sql(
            "SELECT r.attempt_id, r.state, r.plan, r.fence, r.final_published, r.passes::text,"
            " CASE WHEN r.lease_until_ms >= eai.now_ms() THEN r.owner END AS owner,"
            " r.running_ms IS NOT NULL AS running, r.expires_at > now() AS retained,"
            " (SELECT json_agg(json_build_array(c.rule_id, c.result, c.status,"
            "   c.retry_due_ms IS NOT NULL)) FROM eai.checkpoints c WHERE c.run_id = r.id)"
            "   AS checkpoints,"
            " (SELECT json_agg(json_build_array(s.rule_id, s.attempt, s.starts))"
            "   FROM eai.run_steps s WHERE s.run_id = r.id) AS steps"
            " FROM eai.runs r WHERE r.tenant_id = $1 AND r.namespace = $2"
            " AND r.attempt_id = ANY($3)",
            uuid.UUID(self.pg.tenant_id),
            self.pg.namespace,
            self.ids,
        )
        out = {a: _settled(_empty()) for a in self.ids}
        for row in rows:
            d = _empty()
            d.update(
                state=row["state"],
                plan=json.loads(row["plan"]) if row["plan"] is not None else None,
                fence=row["fence"],
                owner=row["owner"],
                final_published=row["final_published"],
                passes=json.loads(row["passes"]),
                running=row["running"],
                untimed=[] if row["retained"] else ["run"],
            )
            for rule_id, result, status, indexed in json.loads(row["checkpoints"] or "[]"):
                if result is not None:
                    d["results"][rule_id] = json.loads(result)
                if status is not None:
                    d["statuses"][rule_id] = status
                if indexed:
                    d["retries"].append(rule_id)
            for rule_id, attempt, starts in json.loads(row["steps"] or "[]"):
                d["starts"].setdefault(rule_id, {})[str(attempt)] = starts
            out[row["attempt_id"]] = _settled(d)
        return out


def _empty() -> dict[str, Any]:
    """The canonical dump of an evaluation nothing was written for."""
    return {
        "state": None,
        "plan": None,
        "fence": None,
        "owner": None,
        "final_published": False,
        "passes": {},
        "results": {},
        "statuses": {},
        "starts": {},
        "running": False,
        "retries": [],
        "untimed": [],  # what is kept with no TTL (Redis, the reference) or past retention
        "other": [],  # keys of a kind the dump does not know
    }


def _put(out: dict[str, Any], what: str, value: Any) -> None:
    """One Redis key (`what`: the part after `attempt:{a}:`) into the canonical dump."""
    if what in _EVAL_KEYS:
        if what == "plan":
            value = json.loads(value)
        elif what == "final_published":
            value = value == "1"
        elif what == "passes":
            value = dict(value)
        out[what] = value
        return
    head, _, tail = what.rpartition(":")
    if head.startswith("rule:") and tail in ("result", "status", "runs"):
        rule_id = head.removeprefix("rule:")
        if tail == "result":
            out["results"][rule_id] = json.loads(value)
        elif tail == "status":
            out["statuses"][rule_id] = value
        else:
            out["starts"][rule_id] = {k: int(v) for k, v in value.items()}
        return
    out["other"].append(what)


def _settled(out: dict[str, Any]) -> dict[str, Any]:
    out["retries"] = sorted(out["retries"])
    out["untimed"] = sorted(out["untimed"])
    out["other"] = sorted(out["other"])
    return out


def _plan_doc(plan: Any) -> Any:
    if isinstance(plan, Plan):
        return json.loads(plan.to_json())
    return json.loads(plan) if isinstance(plan, str) else plan


async def _parsed(plan: Any) -> Any:
    return _plan_doc(await plan)


async def _record(record: Any) -> tuple[Any, Any, bool]:
    got = await record
    return got.state, _plan_doc(got.plan_json), got.final_published


async def _plan_blind(begun: Any) -> Begun:
    got = await begun
    return dataclasses.replace(got, plan_json=None)


async def _due_blind(written: Any) -> Any:
    return _due_seen(await written)


def _due_seen(written: Any) -> tuple[Any, Any, bool]:
    kept, over, due = written
    return kept, over, due is not None


@contextlib.contextmanager
def _postgres(live: Live, box: PgSandbox) -> Iterator[None]:
    """The loop, the PostgreSQL store (a tenant of its own) and the admin connection the
    examples of one run share."""
    loop = asyncio.new_event_loop()
    config = dataclasses.replace(live.config(), stale_ms=600_000)
    Stores.loop = loop
    Stores.pg = PostgresStore(config, url=box.url, tenant_id=str(uuid.uuid4()))
    Stores.admin = loop.run_until_complete(box.owner())
    try:
        yield
    finally:
        loop.run_until_complete(Stores.pg.close())
        loop.run_until_complete(Stores.admin.close())
        loop.close()


def _run(
    live: Live,
    box: PgSandbox,
    reference: type[SimRedis],
    examples: int,
    shrink: bool = True,
    machine: type[Stores] = Stores,
) -> None:
    Stores.live_env, Stores.reference = live, reference
    with _postgres(live, box):
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=examples,
                phases=list(Phase) if shrink else [Phase.explicit, Phase.reuse, Phase.generate],
                report_multiple_bugs=False,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
                print_blob=False,
                derandomize=True,  # the same sequences each run: the coverage asserts never flake
            ),
        )


def test_the_scripts_the_functions_and_their_references_agree(live: Live, pg: PgSandbox) -> None:
    SEEN.clear()
    _run(live, pg, SimRedis, 100)
    ran = {op for op, _ in SEEN}
    assert ran == set(REFERENCES.values()) | set(READS), "every operation ran"
    fenced = {"write_result", "write_status", "mark_started", "mark_pass_published", "park"}
    assert {(op, False) for op in fenced | {"finish"}} <= SEEN, "every write landed"
    # and stale tokens were refused alike (`test_fencing_live` judges each refusal)
    assert any(refused for _, refused in SEEN)


class _ParkKeepsTheIndex(SimRedis):
    """A reference that drifted: its park forgets to take the evaluation off the index."""

    def park(
        self, a: str, me: str, fence: str | None = None, waiting: Sequence[str] = ()
    ) -> Fenced | None:
        refused = self._fenced(a, fence)
        if refused is None and self.get(eval_key(a, "state")) not in ("cancelled",):
            self._set(eval_key(a, "state"), "parked", self.ttl)
            self.release(a, me)
        return refused


def test_a_reference_that_drifted_is_caught(live: Live, pg: PgSandbox) -> None:
    with pytest.raises(AssertionError):
        _run(live, pg, _ParkKeepsTheIndex, 200, shrink=False)


def _function(name: str) -> str:
    """The migrations' definition of `eai.{name}`, as `CREATE OR REPLACE`."""
    sql = "".join(m.sql for m in migrations())
    start = sql.index(f"CREATE FUNCTION eai.{name}(")
    end = sql.index("\nEND $$;", start) + len("\nEND $$;")
    return sql[start:end].replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


#: eai.write_result's fence check, which the broken copy leaves out.
_FENCE_CHECK = """    IF v_other IS NOT NULL THEN
        RETURN ARRAY['!fenced', v_other];
    END IF;
"""


class _WhereFencesDecide(Stores):
    """The same comparison, driven only by acquisitions, lapses, take-overs and the owner's
    writes: where a stale token comes up often."""


for _name in (
    "mark_pass_published",
    "park",
    "finish",
    "done",
    "set_state",
    "release",
    "unindex",
    "claim_stale",
    "claim_retry",
    "forget",
    *READS,
):
    setattr(_WhereFencesDecide, _name, None)  # not a rule here


def test_a_function_that_drifted_is_caught(live: Live, pg: PgSandbox) -> None:
    """A write_result that skips the fence check (a stale owner's result lands) is swapped
    in for the real one: the comparison that passes with the real one fails, and on
    PostgreSQL's side."""
    _run(live, pg, SimRedis, 30, machine=_WhereFencesDecide)
    good = _function("write_result")
    assert good.count(_FENCE_CHECK) == 1
    broken = good.replace(_FENCE_CHECK, "")

    async def install(sql: str) -> None:
        conn = await pg.owner()
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(install(broken))
    try:
        with pytest.raises(AssertionError) as caught:
            _run(live, pg, SimRedis, 100, shrink=False, machine=_WhereFencesDecide)
        assert "postgres" in str(caught.value)
    finally:
        asyncio.run(install(good))


def test_plans_beyond_what_one_unpack_takes(live: Live) -> None:
    """The scripts that name every rule of a plan in one command (the retries index left in
    one ZREM, the results' presence in one EXISTS) do it by the thousand: Lua's `unpack`
    refuses some 8,000 values. 9,000 rules, each with a retry indexed; `begin` is given
    none of them (its own MGET of every rule's keys would not take that many). (The same
    plan on PostgreSQL: `test_pgstore_live.test_a_plan_of_thousands_of_rules`.)"""
    rules = [f"r{i}" for i in range(9000)]
    doc = {"passes": [{"id": "p", "rules": [{"id": r, "depends_on": []} for r in rules]}]}
    a = f"{live.prefix}big"
    store = RedisStore(live.config())
    written = set(rules[::3])

    async def scenario() -> tuple[list[str], list[str], list[str]]:
        begun = await store.begin(a, "w1", [], json.dumps(doc))
        fence = begun.fence
        assert fence
        await asyncio.gather(
            *(store.write_status(a, r, "failed_attempt_1", FAR_MS, fence) for r in rules)
        )
        indexed = await store.redis.zrange(store.retries_index, 0, -1)
        await asyncio.gather(
            *(store.write_result(a, RuleResult(r, "pass", 0.9, 10), (), fence) for r in written)
        )
        results = {r: RuleResult(r, "pass", 0.9, 10) for r in rules}
        kept, restored = await store.finish(a, "failed", results, [], fence)
        assert kept is None
        assert await store.done(a, "w1")
        left = await store.redis.zrange(store.retries_index, 0, -1)
        await store.close()
        return indexed, restored, left

    indexed, restored, left = asyncio.run(scenario())
    assert sum(split_member(m)[0] == a for m in indexed) == len(rules)
    assert restored == [r for r in rules if r not in written]
    assert not [m for m in left if split_member(m)[0] == a]
    assert live.redis.ttl(f"attempt:{a}:rule:{rules[-1]}:result") > 0
