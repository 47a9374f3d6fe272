"""pg-store's SQL mutants on the machine's PostgreSQL: each really breaks its function.

`chaos.systems.pg_store.mutants.install` replaces a PL/pgSQL function by its broken twin as
the schema's owner, and its `restore()` puts the shipped one back. Each test drives the
store as the engine does (`PostgresStore`, as the engine's role: neither superuser nor
BYPASSRLS) through the same steps before the install, with the mutant installed and after
the restore: only the middle run misbehaves, as the mutant says. The database is a
sandbox of this module's own (`PgSandbox`, as in `test_pgstore_live.py`), dropped at the
end, also on failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterator
from typing import Any

import pytest

from chaos.systems.pg_store.mutants import SQL_MUTANTS, SeamGone, _definition, install
from engine.config import EngineConfig
from engine.core import RuleResult
from engine.runtime.pgstore import PostgresStore
from engine.runtime.store import LeaseLost
from tests.live.test_pgstore_live import TENANT_A, TINY, PgSandbox, sandbox

pytestmark = [pytest.mark.live, pytest.mark.slow]

LEASE_MS = 1000
#: The store's engine times, moved by the probe (the functions take them as `p_now`).
START_MS = 5_000_000


@pytest.fixture(scope="module")
def pg() -> Iterator[PgSandbox]:
    with sandbox() as box:
        yield box


async def _attempt(write: Awaitable[Any]) -> Any:
    """The write's reply, or "refused" when the fence refused it."""
    try:
        return await write
    except LeaseLost:
        return "refused"


async def _observe(pg: PgSandbox, tag: str) -> dict[str, Any]:
    """What the store does when w1's lease lapsed and w2 began after it (a new token): w1's
    stale status and result writes, a second result write, and w3 beginning while w2 holds
    the lease. Fresh evaluations of their own each time (`tag`)."""
    now = [START_MS]
    config = EngineConfig(namespace=f"{tag}.", stale_ms=LEASE_MS)
    store = PostgresStore(config, url=pg.url, tenant_id=TENANT_A, clock=lambda: now[0])
    out: dict[str, Any] = {}
    try:
        began = {}
        for a in ("status", "result", "begin"):
            began[a] = [await store.begin(a, "w1", TINY.order, TINY)]
        now[0] += LEASE_MS + 1  # w1's leases lapse (frozen past them)
        for a in ("status", "result", "begin"):
            began[a].append(await store.begin(a, "w2", TINY.order, None))
        out["tokens"] = [b.fence for b in began["status"]]
        first, second = began["status"]

        # w1 wakes and writes the status of its failed call with its old token
        landed = await _attempt(
            store.write_status("status", "compiles", "failed_attempt_1", 1000, first.fence)
        )
        out["stale_status"] = "refused" if landed == "refused" else "landed"
        snap = await store.snapshot("status", TINY.order)
        out["status_stored"] = snap.statuses.get("compiles")
        out["status_holder"] = await store.holder("status")

        # w2 writes compiles's result; w2 again (a rerun); then w1, awake, with its old token
        first, second = began["result"]
        ok = RuleResult("compiles", "pass", 0.9, 10)
        kept = []
        for result, fence in (
            (ok, second.fence),
            (RuleResult("compiles", "needs_review", 0.5, 10), second.fence),
            (RuleResult("compiles", "fail", 0.1, 10), first.fence),
        ):
            reply = await _attempt(store.write_result("result", result, (), fence))
            if reply != "refused":
                reply = "won" if reply[0] is None else reply[0].verdict
            kept.append(reply)
        out["result_writes"] = kept
        snap = await store.snapshot("result", TINY.order)
        out["result_stored"] = snap.results["compiles"].verdict
        out["result_holder"] = await store.holder("result")

        # w2 holds "begin" (its lease runs); w3 gets a delivery of it and begins
        third = await store.begin("begin", "w3", TINY.order, None)
        out["third_begin"] = third.fence if third.holder is None else f"held by {third.holder}"
        out["begin_holder"] = await store.holder("begin")
        return out
    finally:
        await store.close()


#: What the shipped functions do: every stale write refused, the first result kept.
CORRECT = {
    "tokens": ["1:w1", "2:w2"],
    "stale_status": "refused",
    "status_stored": None,
    "status_holder": "w2",
    "result_writes": ["won", "pass", "refused"],
    "result_stored": "pass",
    "result_holder": "w2",
    "third_begin": "held by w2",
    "begin_holder": "w2",
}


def _before_during_after(pg: PgSandbox, mutant: str) -> tuple[dict, dict, dict, bool]:
    """The observations before `mutant` is installed, with it, and after the restore; and
    whether the functions are the shipped ones again, text for text."""

    async def go() -> tuple[dict, dict, dict, bool]:
        functions = [f.function for f in SQL_MUTANTS[mutant].functions]
        owner = await pg.owner()
        try:
            shipped = [(await _definition(owner, f))[1] for f in functions]
            before = await _observe(pg, f"{mutant}-before")
            restore = await install(owner, mutant)
            assert restore is not None
            try:
                during = await _observe(pg, f"{mutant}-during")
            finally:
                await restore()
            after = await _observe(pg, f"{mutant}-after")
            same = [(await _definition(owner, f))[1] for f in functions] == shipped
            return before, during, after, same
        finally:
            await owner.close()

    return asyncio.run(go())


def test_pg_unfenced_lands_a_stale_status_until_restored(pg: PgSandbox) -> None:
    before, during, after, restored = _before_during_after(pg, "pg_unfenced")
    assert before == after == CORRECT and restored
    # w1's status lands over w2's evaluation; the lease stays w2's (no token took it back)
    assert during == {**CORRECT, "stale_status": "landed", "status_stored": "failed_attempt_1"}


def test_pg_overwrite_result_keeps_the_last_write_until_restored(pg: PgSandbox) -> None:
    before, during, after, restored = _before_during_after(pg, "pg_overwrite_result")
    assert before == after == CORRECT and restored
    # every write says it won, the stale one too, and the last one is what the store keeps
    assert during == {**CORRECT, "result_writes": ["won", "won", "won"], "result_stored": "fail"}


def test_pg_double_claim_lets_a_second_worker_take_a_held_run_until_restored(
    pg: PgSandbox,
) -> None:
    before, during, after, restored = _before_during_after(pg, "pg_double_claim")
    assert before == after == CORRECT and restored
    # w3 begins the run w2 holds: a new token, and the lease is w3's
    assert during == {**CORRECT, "third_begin": "3:w3", "begin_holder": "w3"}


def test_no_mutant_or_a_worker_mutant_installs_nothing(pg: PgSandbox) -> None:
    async def go() -> tuple[list[Any], bool]:
        owner = await pg.owner()
        try:
            every = sorted({f.function for m in SQL_MUTANTS.values() for f in m.functions})
            shipped = [(await _definition(owner, f))[1] for f in every]
            got = [await install(owner, name) for name in (None, "no_sweeper", "overwrite_result")]
            return got, [(await _definition(owner, f))[1] for f in every] == shipped
        finally:
            await owner.close()

    got, unchanged = asyncio.run(go())
    assert got == [None, None, None] and unchanged


def test_a_mutant_installed_twice_fails_loudly_and_is_still_restored(pg: PgSandbox) -> None:
    """The second install no longer finds the fence it removes: `SeamGone`, nothing more
    changed (its transaction rolled back), and the first install's restore still works."""

    async def go() -> tuple[str, bool, bool]:
        owner = await pg.owner()
        try:
            _, shipped = await _definition(owner, "eai.write_status")
            restore = await install(owner, "pg_unfenced")
            assert restore is not None
            _, broken = await _definition(owner, "eai.write_status")
            try:
                await install(owner, "pg_unfenced")
                error = ""
            except SeamGone as exc:
                error = str(exc)
            still = (await _definition(owner, "eai.write_status"))[1] == broken
            await restore()
            return error, still, (await _definition(owner, "eai.write_status"))[1] == shipped
        finally:
            await owner.close()

    error, still_broken, restored = asyncio.run(go())
    assert error.startswith("pg_unfenced: eai.write_status changed: ") and "not once" in error
    assert still_broken and restored


async def _queue_persistence(owner: Any) -> dict[str, str]:
    """`relpersistence` of `eai.jobs` and of what goes with it (its indexes, its identity
    sequence): p logged, u unlogged."""
    rows = await owner.fetch(
        "SELECT c.relname, c.relpersistence::text AS relpersistence FROM pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = 'eai' AND c.relname LIKE 'jobs%'"
    )
    return {r["relname"]: r["relpersistence"] for r in rows}


def test_pg_jobs_unlogged_makes_the_queue_unlogged_until_restored(pg: PgSandbox) -> None:
    """The queue's table, its indexes and its sequence unlogged (what a crash recovery
    truncates), the rows it held kept; installed twice, `SeamGone` and nothing more
    changed; restored, all logged again, rows and all. (The loss itself, after a SIGKILL of
    the run's own PostgreSQL: tests/test_chaos_runs.py.)"""

    async def go() -> tuple[dict, dict, str, dict, dict, list[int]]:
        owner = await pg.owner()
        try:
            await owner.execute(
                "INSERT INTO eai.jobs (tenant_id, namespace, queue, body, visible_ms)"
                " VALUES (gen_random_uuid(), 'unlogged-probe', 'q', '\\x00', 0)"
            )
            count = "SELECT count(*) FROM eai.jobs WHERE namespace = 'unlogged-probe'"
            before = await _queue_persistence(owner)
            restore = await install(owner, "pg_jobs_unlogged")
            assert restore is not None
            rows = [await owner.fetchval(count)]
            during = await _queue_persistence(owner)
            try:
                await install(owner, "pg_jobs_unlogged")
                error = ""
            except SeamGone as exc:
                error = str(exc)
            still = await _queue_persistence(owner)
            await restore()
            rows.append(await owner.fetchval(count))
            after = await _queue_persistence(owner)
            await owner.execute("DELETE FROM eai.jobs WHERE namespace = 'unlogged-probe'")
            return before, during, error, still, after, rows
        finally:
            await owner.close()

    before, during, error, still, after, rows = asyncio.run(go())
    assert {"jobs", "jobs_pkey", "jobs_ready", "jobs_seq_seq"} <= set(before)
    assert set(before.values()) == {"p"} and before == after
    assert during == still == dict.fromkeys(before, "u")
    assert error.startswith("pg_jobs_unlogged: eai.jobs is not a logged table")
    assert rows == [1, 1]
