"""The store's operations, written once as Lua and once as a Python reference, proven equal.

`sim.redis.REFERENCES` is the table: every script `engine/runtime/store.py` registers and
the `SimRedis` method the simulator runs in its place. Hypothesis drives both at once with
random sequences of every operation in the table, on two evaluations and three workers
(each writing with the token it last got, current or stale), with leases lapsing at any
moment. After every step each reply must be the same, and so must the keys left: every
key of both evaluations (value, and whether it carries a TTL) and both indexes.

Time is the one thing the two do not share: the live scripts read the wall clock and
Redis's `TIME`, the reference the simulated clock (held at 0 here). So the sequences use
only delays and thresholds that decide the same way on both clocks (0, or far beyond the
run), index scores are compared as membership, and a lapsed lease is a deleted key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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

pytestmark = [pytest.mark.live, pytest.mark.slow]

WORKERS = ("w1", "w2", "w3")
PLAN: Plan = load_plan(ROOT / "plans" / "tiny.yaml")
RULES = PLAN.order
FAR_MS = 10**9  # a delay or threshold no step of a test run reaches, on either clock
STATES = ("running", "cancelled", "completed")
#: (operation, refused by the fence) pairs the runs went through.
SEEN: set[tuple[str, bool]] = set()
STARTS = st.lists(st.tuples(st.sampled_from(RULES), st.integers(1, 3)), max_size=2)


def test_every_script_of_the_store_has_a_python_reference() -> None:
    source = Path(store_module.__file__).read_text(encoding="utf-8")
    registered = set(re.findall(r"self\.batch\.register\((_[A-Z_]+)\)", source))
    assert registered == set(REFERENCES), "a script without reference, or a stale entry"
    for method in REFERENCES.values():
        assert callable(getattr(SimRedis, method)), method
    steps = {name for name in dir(Both) if not name.startswith("_")}
    assert set(REFERENCES.values()) <= steps, "every operation is driven by the test"


class Both(RuleBasedStateMachine):
    live_env: Live  # set by the test
    reference: type[SimRedis] = SimRedis

    def __init__(self) -> None:
        super().__init__()
        self.n = getattr(Both, "_n", 0) + 1
        Both._n = self.n  # type: ignore[attr-defined]
        self.ids = [f"{self.live_env.prefix}ref{self.n}{x}" for x in "ab"]
        config = dataclasses.replace(self.live_env.config(), stale_ms=600_000)
        self.loop = asyncio.new_event_loop()
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
        self.loop.run_until_complete(self.store.close())
        self.loop.close()
        self.raw.close()

    # --- helpers ------------------------------------------------------------------------

    def _both(self, op: str, live: Any, sim: Any) -> Any:
        """One operation on both stores; the replies must be equal; returns the live one."""
        try:
            got = self.loop.run_until_complete(live)
        except LeaseLost:
            got = "fenced"
        assert got == ("fenced" if isinstance(sim, Fenced) else sim), (op, got, sim)
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

    def _live_value(self, key: str) -> Any:
        kind = self.raw.type(key)
        if kind == "hash":
            return self.raw.hgetall(key)
        value = self.raw.get(key)
        if key.endswith(":plan"):
            return json.loads(value)
        return value

    def _sim_value(self, key: str) -> Any:
        value = self.sim.get(key)
        if isinstance(value, dict):
            return {k: str(v) for k, v in value.items()}
        if isinstance(value, Plan):
            return json.loads(value.to_json())
        return value

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

    def _begin(self, a: str, w: str, with_plan: bool) -> None:
        live = self.store.begin(a, w, RULES, PLAN.to_json() if with_plan else None)
        sim = self.sim.begin(a, w, RULES, PLAN if with_plan else None, 0)
        got: Begun = self._both(
            "begin", _plan_blind(live), dataclasses.replace(sim, plan_json=None)
        )
        if got.fence:
            self.tokens[(w, a)] = got.fence

    def _lapse(self, a: str) -> None:
        self.raw.delete(eval_key(a, "owner"))
        self.sim._del(eval_key(a, "owner"))

    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.ids))
        w, token = self._token(data, a)
        held = {a: token or ""}  # no token: lost, whatever the lease
        self._both("renew", self.store.renew(held, w), self.sim.renew(held, w, 0))

    @rule(data=st.data(), verdict=st.sampled_from(["pass", "fail"]))
    def write_result(self, data: st.DataObject, verdict: str) -> None:
        a = data.draw(st.sampled_from(self.ids))
        _, token = self._token(data, a)
        rule_id = data.draw(st.sampled_from(RULES))
        starts = data.draw(
            st.lists(st.tuples(st.sampled_from(RULES), st.integers(1, 3)), max_size=2)
        )
        result = RuleResult(rule_id, verdict, 0.5, 10)
        self._both(
            "write_result",
            self.store.write_result(a, result, starts, token),
            self.sim.write_result(a, result, starts, token),
        )

    @rule(data=st.data(), delay=st.sampled_from([None, 0, FAR_MS]))
    def write_status(self, data: st.DataObject, delay: int | None) -> None:
        a = data.draw(st.sampled_from(self.ids))
        _, token = self._token(data, a)
        rule_id = data.draw(st.sampled_from(RULES))
        n = data.draw(st.integers(1, 3))
        status = data.draw(st.sampled_from([f"failed_attempt_{n}", PERMANENTLY_FAILED]))
        live = self.store.write_status(a, rule_id, status, delay, token)
        sim = self.sim.write_status(a, rule_id, status, delay, token)
        # the due time is read off each store's clock: compare whether one was indexed
        self._both(
            "write_status", _due_blind(live), sim if isinstance(sim, Fenced) else _due_seen(sim)
        )

    @rule(data=st.data())
    def mark_started(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.ids))
        _, token = self._token(data, a)
        starts = data.draw(
            st.lists(st.tuples(st.sampled_from(RULES), st.integers(1, 3)), max_size=2)
        )
        self._both(
            "mark_started",
            self.store.mark_started(a, starts, token),
            self.sim.mark_started(a, starts, token),
        )

    @rule(data=st.data(), outcome=st.sampled_from(["complete", "partial"]))
    def mark_pass_published(self, data: st.DataObject, outcome: str) -> None:
        a = data.draw(st.sampled_from(self.ids))
        _, token = self._token(data, a)
        self._both(
            "mark_pass_published",
            self.store.mark_pass_published(a, "quick", outcome, token),
            self.sim.mark_pass_published(a, "quick", outcome, token),
        )

    @rule(data=st.data())
    def park(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.ids))
        w, token = self._token(data, a)
        waiting = data.draw(st.lists(st.sampled_from(RULES), unique=True, max_size=2))
        self._both(
            "park", self.store.park(a, w, token, waiting), self.sim.park(a, w, token, waiting)
        )

    @rule(data=st.data(), status=st.sampled_from(["completed", "partial", "failed"]))
    def finish(self, data: st.DataObject, status: str) -> None:
        a = data.draw(st.sampled_from(self.ids))
        _, token = self._token(data, a)
        done = data.draw(st.lists(st.sampled_from(RULES), unique=True, max_size=2))
        results = {r: RuleResult(r, "pass", 0.9, 10) for r in done}
        failed = [r for r in RULES if r not in results][: data.draw(st.integers(0, 1))]
        self._both(
            "finish",
            self.store.finish(a, status, results, failed, token),
            self.sim.finish(a, status, results, failed, token),
        )

    @rule(data=st.data())
    def done(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.ids))
        w = data.draw(st.sampled_from(WORKERS))
        self._both("done", self.store.done(a, w), self.sim.done(a, w))

    @rule(data=st.data(), state=st.sampled_from(STATES))
    def set_state(self, data: st.DataObject, state: str) -> None:
        a = data.draw(st.sampled_from(self.ids))
        self._both("set_state", self.store.set_state(a, state), self.sim.set_state(a, state))

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.ids))
        w = data.draw(st.sampled_from(WORKERS))
        self._both("release", self.store.release(a, w), self.sim.release(a, w))

    @rule(data=st.data())
    def unindex(self, data: st.DataObject) -> None:
        a = data.draw(st.sampled_from(self.ids))
        self._both("unindex", self.store.unindex(a), self.sim.unindex(a))

    @rule(data=st.data(), older_than=st.sampled_from([0, FAR_MS]))
    def claim_stale(self, data: st.DataObject, older_than: int) -> None:
        a = data.draw(st.sampled_from(self.ids))
        self._both(
            "claim_stale",
            self.store.claim_stale(a, older_than),
            self.sim.claim_stale(a, older_than, 0),
        )

    @rule(data=st.data(), grace=st.sampled_from([0, FAR_MS]))
    def claim_retry(self, data: st.DataObject, grace: int) -> None:
        member = retry_member(
            data.draw(st.sampled_from(self.ids)), data.draw(st.sampled_from(RULES))
        )
        self._both(
            "claim_retry",
            self.store.claim_retry(member, grace),
            self.sim.claim_retry(member, grace, 0),
        )

    # --- what both leave -----------------------------------------------------------------

    @invariant()
    def the_keys_are_the_same(self) -> None:
        for a in self.ids:
            live = sorted(self.raw.keys(f"attempt:{a}:*"))
            assert live == self.sim.keys(f"attempt:{a}:"), a
            for key in live:
                assert self._live_value(key) == self._sim_value(key), key
                assert (self.raw.ttl(key) > 0) == (self.sim.ttl_of(key) > 0), key
        for index in (self.store.running_index, self.store.retries_index):
            mine = [m for m in self.raw.zrange(index, 0, -1) if split_member(m)[0] in self.ids]
            sim = [m for m in (self.sim.get(index) or {}) if split_member(m)[0] in self.ids]
            assert sorted(mine) == sorted(sim), index


async def _plan_blind(begun: Any) -> Begun:
    got = await begun
    return dataclasses.replace(got, plan_json=None)


async def _due_blind(written: Any) -> Any:
    return _due_seen(await written)


def _due_seen(written: Any) -> tuple[Any, Any, bool]:
    kept, over, due = written
    return kept, over, due is not None


def _run(live: Live, reference: type[SimRedis], examples: int, shrink: bool = True) -> None:
    Both.live_env, Both.reference = live, reference
    run_state_machine_as_test(
        Both,
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


def test_the_scripts_and_their_references_agree(live: Live) -> None:
    SEEN.clear()
    _run(live, SimRedis, 100)
    ran = {op for op, _ in SEEN}
    assert ran == set(REFERENCES.values()), "every operation ran"
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


def test_a_reference_that_drifted_is_caught(live: Live) -> None:
    with pytest.raises(AssertionError):
        _run(live, _ParkKeepsTheIndex, 200, shrink=False)


def test_plans_beyond_what_one_unpack_takes(live: Live) -> None:
    """The scripts that name every rule of a plan in one command (the retries index left in
    one ZREM, the results' presence in one EXISTS) do it by the thousand: Lua's `unpack`
    refuses some 8,000 values. 9,000 rules, each with a retry indexed; `begin` is given
    none of them (its own MGET of every rule's keys would not take that many)."""
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
