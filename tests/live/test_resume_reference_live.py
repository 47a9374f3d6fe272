"""The resume from a checkpoint, as PL/pgSQL (`eai.resume`, the checkpoints' numbering
trigger: `migrations/0003_eai_resume.sql`) and as its Python reference
(`SimRedis.resume_from`, which the simulator runs), proven equal: random sequences of
begins, result and status writes, final states and resumes (from every checkpoint, one too
far, the last, of unknown and finished runs) give the same replies, and after each step the
same run: its state, fence, holder, results, statuses, passes, whether it is in the running
index, and its checkpoints in order. Redis has no resume: the design with it is PostgreSQL's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import simpy

from engine.config import EngineConfig
from engine.core import RuleResult
from engine.keys import eval_key, result_key, status_key
from engine.plan import Plan, load_plan
from engine.runtime.pgstore import PostgresStore
from sim.redis import SimRedis
from tests.live.conftest import ROOT
from tests.live.test_pgstore_live import PgSandbox, sandbox

pytestmark = [pytest.mark.live, pytest.mark.slow]

PLAN: Plan = load_plan(ROOT / "plans" / "code_review.yaml")
RULES = list(PLAN.order)
WORKERS = ("w1", "w2")


@pytest.fixture(scope="module")
def pg() -> Iterator[PgSandbox]:
    with sandbox() as box:
        yield box


class Pair:
    """One run on PostgreSQL and on the reference, driven alike."""

    def __init__(
        self, store: PostgresStore, admin: Any, loop: asyncio.AbstractEventLoop, a: str
    ) -> None:
        self.store, self.admin, self.loop, self.a = store, admin, loop, a
        config = store.config
        self.sim = SimRedis(
            simpy.Environment(),
            running_index=store.running_index,
            retries_index=store.retries_index,
            ttl_s=config.state_ttl_s,
            lease_ms=config.stale_ms,
        )
        self.sim.numbering = True
        self.tokens: dict[str, str] = {}

    def pg(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def begin(self, w: str) -> None:
        got = self.pg(self.store.begin(self.a, w, RULES, PLAN.to_json()))
        want = self.sim.begin(self.a, w, RULES, PLAN, 0)
        assert (got.holder, got.terminal, got.fence) == (want.holder, want.terminal, want.fence)
        if got.fence:
            self.tokens[w] = got.fence

    def write_result(self, w: str, rule: str, verdict: str) -> None:
        token = self.tokens.get(w)
        result = RuleResult(rule, verdict, 0.5, 10)
        try:
            got: Any = self.pg(self.store.write_result(self.a, result, (), token))
        except Exception as exc:  # LeaseLost
            got = type(exc).__name__
        want: Any = self.sim.write_result(self.a, result, (), token)
        if not isinstance(want, tuple):
            want = "LeaseLost"
        assert got == want, ("write_result", got, want)

    def write_status(self, w: str, rule: str) -> None:
        token = self.tokens.get(w)
        try:
            got: Any = self.pg(
                self.store.write_status(self.a, rule, "failed_attempt_1", None, token)
            )
        except Exception as exc:
            got = type(exc).__name__
        want: Any = self.sim.write_status(self.a, rule, "failed_attempt_1", None, token)
        if not hasattr(want, "kept"):
            want = "LeaseLost"
        assert got == want, ("write_status", got, want)

    def set_state(self, state: str) -> None:
        assert self.pg(self.store.set_state(self.a, state)) == self.sim.set_state(self.a, state)

    def resume(self, number: int | None) -> list[str]:
        (got,) = self.pg(self.store._apply_more([["resume", self.a, number, "test"]]))
        want = self.sim.resume_from(self.a, number, "test")
        assert got == want, ("resume", number, got, want)
        return got

    def dump_pg(self) -> dict[str, Any]:
        rec = self.pg(self.store.record(self.a))
        snap = self.pg(self.store.snapshot(self.a, RULES))
        holder = self.pg(self.store.holder(self.a))
        order = [r for _, r in self.pg(self.store.checkpoints(self.a))]
        row = self.pg(
            self.admin.fetchrow(
                "SELECT r.fence, r.passes::text AS passes, r.running_ms IS NOT NULL AS running"
                " FROM eai.runs r WHERE r.tenant_id = $1 AND r.namespace = $2"
                " AND r.attempt_id = $3",
                uuid.UUID(self.store.tenant_id),
                self.store.namespace,
                self.a,
            )
        )
        rows = None if row is None else (row["fence"], json.loads(row["passes"]), row["running"])
        fence, passes, running = rows if rows is not None else (None, {}, False)
        return {
            "state": rec.state,
            "fence": fence,
            "holder": holder,
            "results": {r: v.verdict for r, v in snap.results.items()},
            "statuses": dict(snap.statuses),
            "passes": passes,
            "running": running,
            "order": order,
        }

    def dump_sim(self) -> dict[str, Any]:
        s, a = self.sim, self.a
        results = {
            r: json.loads(s.get(result_key(a, r)))["verdict"]
            for r in RULES
            if s.get(result_key(a, r))
        }
        return {
            "state": s.get(eval_key(a, "state")),
            "fence": s.get(eval_key(a, "fence")),
            "holder": s.get(eval_key(a, "owner")),
            "results": results,
            "statuses": {r: s.get(status_key(a, r)) for r in RULES if s.get(status_key(a, r))},
            "passes": dict(s.get(eval_key(a, "passes")) or {}),
            "running": a in (s.get(s.running_index) or {}),
            "order": [r for r in s.get(eval_key(a, "checkpoints")) or () if r in results],
        }


def _steps(pair: Pair, rng: random.Random, steps: int) -> set[str]:
    """Random steps, the run compared after each; the resume replies seen."""
    seen: set[str] = set()
    for _ in range(steps):
        roll = rng.random()
        w = rng.choice(WORKERS)
        if roll < 0.15:
            pair.begin(w)
        elif roll < 0.55:
            pair.write_result(w, rng.choice(RULES), rng.choice(["pass", "fail"]))
        elif roll < 0.65:
            pair.write_status(w, rng.choice(RULES))
        elif roll < 0.68:
            pair.set_state(rng.choice(["cancelled", "completed"]))
        else:
            last = len(pair.dump_sim()["order"])
            number = rng.choice([None, 0, last + 1, *range(1, last + 1)])
            seen.add(pair.resume(number)[0])
        assert pair.dump_pg() == pair.dump_sim()
    return seen


def test_the_resume_and_its_reference_agree(pg: PgSandbox) -> None:
    loop = asyncio.new_event_loop()
    config = dataclasses.replace(EngineConfig(namespace=f"rr{uuid.uuid4().hex[:6]}."))
    store = PostgresStore(config, url=pg.url, tenant_id=str(uuid.uuid4()))
    admin = loop.run_until_complete(pg.owner())
    seen: set[str] = set()
    try:
        for seed in range(12):
            pair = Pair(store, admin, loop, f"run-{seed}")
            pair.resume(None)  # a run never begun: unknown to both
            seen |= _steps(pair, random.Random(seed), 60)
    finally:
        loop.run_until_complete(store.close())
        loop.run_until_complete(admin.close())
        loop.close()
    assert seen >= {"ok", "nocheckpoint", "terminal"}, seen
