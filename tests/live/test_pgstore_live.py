"""The PostgreSQL store on the machine's PostgreSQL: migrations, row-level security, group
commit, the clock, retention, concurrency (racing begins, a deadlock), the one-line
refusals, and workers on it (`python -m engine.worker --store postgres`) running, crashing
and being resumed by the sweeper.

Each module gets a database and a login role of its own (`PgSandbox`: neither superuser
nor BYPASSRLS, as the engine must connect), migrated by the administrator, both dropped at
the end, also on failure. The equality of every operation with its Redis script and its
Python reference is `test_store_reference_live.py`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from engine.config import EngineConfig, ServiceUnavailable
from engine.core import RuleResult
from engine.plan import Plan, load_plan
from engine.runtime.pgstore import (
    PostgresStore,
    migrate,
    migrations,
    schema_version,
)
from engine.runtime.store import LeaseLost
from engine.shell.replies import Renewal

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.live, pytest.mark.slow]

#: The machine's PostgreSQL as its administrator (local logins are trusted there).
ADMIN_URL = os.environ.get("EAI_TEST_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
TINY: Plan = load_plan(ROOT / "plans" / "tiny.yaml")
TENANT_A = "0a000000-0000-0000-0000-00000000000a"
TENANT_B = "0b000000-0000-0000-0000-00000000000b"


def _url(base: str, user: str, db: str) -> str:
    """`base` with another user and database (the host and port kept)."""
    rest = base.split("://", 1)[1].split("@", 1)[-1]
    host = rest.split("/", 1)[0]
    return f"postgresql://{user}@{host}/{db}"


class PgSandbox:
    """A database and an engine role of their own, the migrations applied by the admin."""

    def __init__(self, admin_url: str = ADMIN_URL) -> None:
        tag = uuid.uuid4().hex[:12]
        self.admin_url = admin_url
        self.db = f"eai_test_{tag}"
        self.role = f"eai_engine_{tag}"
        self.url = _url(admin_url, self.role, self.db)  # the engine's
        self.owner_url = _url(admin_url, admin_url.split("://", 1)[1].split("@")[0], self.db)

    async def create(self, migrated: bool = True) -> PgSandbox:
        admin = await asyncpg.connect(self.admin_url)
        try:
            await admin.execute(f'CREATE ROLE "{self.role}" LOGIN NOSUPERUSER NOBYPASSRLS')
            await admin.execute(f'CREATE DATABASE "{self.db}"')
        finally:
            await admin.close()
        if migrated:
            conn = await asyncpg.connect(self.owner_url)
            try:
                await migrate(conn, grant=[self.role])
            finally:
                await conn.close()
        return self

    async def drop(self) -> None:
        admin = await asyncpg.connect(self.admin_url)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)')
            await admin.execute(f'DROP ROLE IF EXISTS "{self.role}"')
        finally:
            await admin.close()

    async def owner(self) -> asyncpg.Connection:
        """A connection as the administrator (a superuser: no policy applies to it)."""
        return await asyncpg.connect(self.owner_url)


@contextlib.contextmanager
def sandbox(migrated: bool = True) -> Iterator[PgSandbox]:
    box = PgSandbox()
    try:
        asyncio.run(box.create(migrated))
        yield box
    finally:
        asyncio.run(box.drop())


@pytest.fixture(scope="module")
def pg() -> Iterator[PgSandbox]:
    with sandbox() as box:
        yield box


def _config(ns: str | None = None) -> EngineConfig:
    return EngineConfig(namespace=ns or f"t{uuid.uuid4().hex[:8]}.", stale_ms=600_000)


def _store(pg: PgSandbox, **kw: Any) -> PostgresStore:
    kw.setdefault("tenant_id", TENANT_A)
    return PostgresStore(kw.pop("config", None) or _config(), url=pg.url, **kw)


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


# --- migrations ---------------------------------------------------------------------------


def test_the_migrations_are_versioned_files_shipped_with_the_package(pg: PgSandbox) -> None:
    found = migrations()
    assert [m.version for m in found] == list(range(1, len(found) + 1))
    assert all(m.name.startswith(f"{m.version:04d}_") for m in found)
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["package-data"]["engine.runtime.migrations"]
    assert "*.sql" in patterns

    async def check() -> tuple[list[int], int]:
        conn = await pg.owner()
        try:
            again = await migrate(conn, grant=[pg.role])  # applied already: nothing to do
            return again, await conn.fetchval("SELECT max(version) FROM eai.schema_migrations")
        finally:
            await conn.close()

    again, version = _run(check())
    assert again == []
    assert version == schema_version()


def test_the_tables_are_the_documents_under_forced_row_level_security(pg: PgSandbox) -> None:
    async def read() -> list[asyncpg.Record]:
        conn = await pg.owner()
        try:
            return await conn.fetch(
                "SELECT c.relname, c.relrowsecurity, c.relforcerowsecurity, "
                "array_agg(a.attname::text) AS cols FROM pg_class c "
                "JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 "
                "WHERE c.relnamespace = 'eai'::regnamespace AND c.relkind = 'r' "
                "AND c.relname <> 'schema_migrations' GROUP BY 1, 2, 3"
            )
        finally:
            await conn.close()

    tables = {r["relname"]: r for r in _run(read())}
    assert {"runs", "run_steps", "checkpoints", "run_events"} <= set(tables)
    for name, row in tables.items():
        assert row["relrowsecurity"] and row["relforcerowsecurity"], name
        assert {"id", "tenant_id", "created_at", "updated_at"} <= set(row["cols"]), name


# --- row-level security ---------------------------------------------------------------------


def test_a_tenant_sees_and_writes_only_its_own_rows(pg: PgSandbox) -> None:
    config = _config()
    a = "att-rls"

    async def scenario() -> dict[str, Any]:
        mine = _store(pg, config=config, tenant_id=TENANT_A)
        theirs = _store(pg, config=config, tenant_id=TENANT_B)
        try:
            begun = await mine.begin(a, "w1", TINY.order, TINY)
            await mine.write_result(a, RuleResult("compiles", "pass", 0.9, 10), (), begun.fence)
            seen = {
                "record": await theirs.record(a),
                "snapshot": await theirs.snapshot(a, TINY.order),
                "stale": await theirs.stale_evaluations(0),
                "holder": await theirs.holder(a),
            }
            # the other tenant's begin makes a run of its own: the first one is untouched
            other = await theirs.begin(a, "w2", TINY.order, TINY)
            seen["other_fence"] = other.fence
            seen["mine"] = await mine.snapshot(a, TINY.order)
            seen["mine_holder"] = await mine.holder(a)
            conn = await asyncpg.connect(pg.url)  # the engine's role, no tenant set
            try:
                seen["untenanted"] = await conn.fetchval("SELECT count(*) FROM eai.runs")
                async with conn.transaction():
                    await conn.execute("SELECT set_config('app.tenant_id', $1, true)", TENANT_B)
                    seen["b_rows"] = await conn.fetchval("SELECT count(*) FROM eai.checkpoints")
                    with pytest.raises(asyncpg.InsufficientPrivilegeError):
                        await conn.execute(
                            "INSERT INTO eai.runs (tenant_id, namespace, attempt_id, "
                            "expires_at) VALUES ($1, 'x', 'y', now())",
                            uuid.UUID(TENANT_A),
                        )
            finally:
                await conn.close()
            return seen
        finally:
            await mine.close()
            await theirs.close()

    seen = _run(scenario())
    assert seen["record"].state is None and seen["record"].plan_json is None
    assert not seen["snapshot"].results and seen["stale"] == [] and seen["holder"] is None
    assert seen["other_fence"] == "1:w2"
    assert set(seen["mine"].results) == {"compiles"} and seen["mine_holder"] == "w1"
    assert seen["untenanted"] == 0
    assert seen["b_rows"] == 0


# --- group commit -----------------------------------------------------------------------------


def test_writes_made_together_go_as_one_batch_and_a_failing_one_fails_alone(
    pg: PgSandbox,
) -> None:
    config = _config()

    async def scenario() -> tuple[Any, ...]:
        store = _store(pg, config=config, lanes=1)
        try:
            ids = [f"att-gc{i}" for i in range(20)]
            begun = await asyncio.gather(*(store.begin(a, "w1", TINY.order, TINY) for a in ids))
            before = store.batch.batches

            async def unknown() -> Any:  # started with the others, in the same loop turn
                return await store.batch.call(["no_such_operation", ids[0]])

            results = await asyncio.gather(
                *(
                    store.write_result(a, RuleResult("compiles", "pass", 0.9, 10), (), b.fence)
                    for a, b in zip(ids, begun, strict=True)
                ),
                unknown(),
                store.write_status(ids[1], "feedback", "failed_attempt_1", 0, begun[1].fence),
                return_exceptions=True,
            )
            batches = store.batch.batches - before
            snaps = [await store.snapshot(a, TINY.order) for a in ids]
            return results, batches, snaps, store.batch.largest
        finally:
            await store.close()

    results, batches, snaps, largest = _run(scenario())
    assert batches == 1 and largest == 22  # one statement, one transaction for the 22
    assert isinstance(results[20], asyncpg.PostgresError)  # the unknown operation alone
    assert all(r == (None, [], None) for r in results[:20])
    assert all(set(s.results) == {"compiles"} for s in snaps)  # the others all landed
    assert snaps[1].statuses == {"feedback": "failed_attempt_1"}


# --- the clock, leases and retention -----------------------------------------------------------


def test_a_lease_lapses_by_the_clock_and_the_stale_token_is_fenced_off(pg: PgSandbox) -> None:
    config = _config()
    now = [1_000_000]
    lease = config.stale_ms

    async def scenario() -> list[Any]:
        store = _store(pg, config=config, clock=lambda: now[0])
        a = "att-clock"
        try:
            out: list[Any] = []
            first = await store.begin(a, "w1", TINY.order, TINY)
            out.append((await store.renew({a: first.fence}, "w1"))[a])
            now[0] += lease  # the last ms of the lease: still held
            out.append((await store.begin(a, "w2", TINY.order, None)).holder)
            out.append(await store.claim_stale(a, 0))  # held: not claimed
            now[0] += 1  # lapsed
            out.append(await store.holder(a))
            out.append(await store.claim_stale(a, 0))
            second = await store.begin(a, "w2", TINY.order, None)
            out.append(second.fence)
            try:
                await store.write_result(a, RuleResult("compiles", "pass", 1.0, 1), (), first.fence)
            except LeaseLost as exc:
                out.append(str(exc))
            out.append((await store.renew({a: first.fence}, "w1"))[a])
            out.append((await store.renew({a: second.fence}, "w2"))[a])
            return out
        finally:
            await store.close()

    out = _run(scenario())
    assert out[0] == 1 and out[0].expires_ms == 1_000_000 + lease
    assert out[1] == "w1"
    assert out[2] is False
    assert out[3] is None
    assert out[4] is True
    assert out[5] == "2:w2"
    assert out[6] == "att-clock: the lease is 2:w2's now"
    assert out[7] == Renewal(0)
    assert out[8] == 1 and out[8].expires_ms == now[0] + lease


def test_an_evaluation_past_its_retention_is_gone_and_purged(pg: PgSandbox) -> None:
    config = _config()

    async def scenario() -> tuple[Any, ...]:
        store = _store(pg, config=config)
        owner = await pg.owner()
        try:
            for a in ("att-old", "att-new"):
                b = await store.begin(a, "w1", TINY.order, TINY)
                await store.write_result(a, RuleResult("compiles", "pass", 1.0, 1), (), b.fence)
            old = await owner.fetchval(  # as the engine writes a row's retention: both columns
                "UPDATE eai.runs SET expires_at = now() - interval '1 s', "
                "expires_hour = eai._hour(now() - interval '1 s') "
                "WHERE namespace = $1 AND attempt_id = 'att-old' RETURNING id",
                config.namespace,
            )
            hanging = (
                "SELECT (SELECT count(*) FROM eai.checkpoints WHERE run_id = $1)"
                " + (SELECT count(*) FROM eai.run_steps WHERE run_id = $1)"
                " + (SELECT count(*) FROM eai.run_events WHERE run_id = $1)"
            )
            hung = await owner.fetchval(hanging, old)
            gone = await store.record("att-old")
            stale = await store.stale_evaluations(0)
            purged = await store.purge_expired()
            rows = await owner.fetchval(
                "SELECT count(*) FROM eai.runs WHERE namespace = $1", config.namespace
            )
            steps = await owner.fetchval(
                "SELECT count(*) FROM eai.checkpoints c "
                "JOIN eai.runs r ON r.id = c.run_id "
                "WHERE r.namespace = $1",
                config.namespace,
            )
            # what hung off the purged run went with it (migration 0006's cascade trigger)
            left = await owner.fetchval(hanging, old)
            return gone, stale, purged, rows, steps, hung, left
        finally:
            await owner.close()
            await store.close()

    gone, stale, purged, rows, steps, hung, left = _run(scenario())
    assert gone.state is None and gone.plan_json is None
    assert stale == ["att-new"]
    assert purged == 1
    assert rows == 1 and steps == 1
    assert hung > 0 and left == 0  # its checkpoints, steps and events went with it


def test_a_claim_skips_an_evaluation_someone_is_busy_with(pg: PgSandbox) -> None:
    """FOR UPDATE SKIP LOCKED: a run row locked by another transaction is not claimed, and
    the claim does not wait for it."""
    config = _config()

    async def scenario() -> tuple[bool, bool]:
        store = _store(pg, config=config)
        owner = await pg.owner()
        a = "att-busy"
        try:
            await store.begin(a, "w1", TINY.order, TINY)
            await store.release(a, "w1")
            tx = owner.transaction()
            await tx.start()
            await owner.execute(
                "SELECT 1 FROM eai.runs WHERE namespace = $1 AND attempt_id = $2 FOR UPDATE",
                config.namespace,
                a,
            )
            busy = await asyncio.wait_for(store.claim_stale(a, 0), 5)
            await tx.rollback()
            free = await store.claim_stale(a, 0)
            return busy, free
        finally:
            await owner.close()
            await store.close()

    assert _run(scenario()) == (False, True)


def test_a_plan_of_thousands_of_rules(pg: PgSandbox) -> None:
    """9,000 rules, each with a retry indexed: the final state restores the missing results
    in one statement, and the announcement takes every rule off the retries index."""
    rules = [f"r{i}" for i in range(9000)]
    doc = {"passes": [{"id": "p", "rules": [{"id": r, "depends_on": []} for r in rules]}]}
    written = set(rules[::3])

    async def scenario() -> tuple[int, list[str], list[str]]:
        store = _store(pg)
        a = "att-big"
        try:
            fence = (await store.begin(a, "w1", [], json.dumps(doc))).fence
            await asyncio.gather(
                *(store.write_status(a, r, "failed_attempt_1", 10**9, fence) for r in rules)
            )
            indexed = len(await store.overdue_retries(-(10**9) - 60_000, limit=10_000))
            await asyncio.gather(
                *(store.write_result(a, RuleResult(r, "pass", 0.9, 10), (), fence) for r in written)
            )
            results = {r: RuleResult(r, "pass", 0.9, 10) for r in rules}
            kept, restored = await store.finish(a, "failed", results, [], fence)
            assert kept is None
            assert await store.done(a, "w1")
            left = await store.overdue_retries(-(10**9) - 60_000, limit=10_000)
            return indexed, restored, left
        finally:
            await store.close()

    indexed, restored, left = _run(scenario())
    assert indexed == len(rules)
    assert restored == [r for r in rules if r not in written]
    assert left == []


# --- refusals, in one line ---------------------------------------------------------------------


def _refusal(url: str) -> str:
    store = PostgresStore(_config(), url=url, tenant_id=TENANT_A)
    with pytest.raises(ServiceUnavailable) as caught:
        _run(store.probe())
    line = str(caught.value)
    assert "\n" not in line
    return line


def test_a_superuser_or_bypassrls_role_is_refused(pg: PgSandbox) -> None:
    assert "is a superuser: row-level security would not hold" in _refusal(pg.owner_url)
    bypass = f"{pg.role}_bypass"

    async def make(sql: str) -> None:
        conn = await pg.owner()
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    _run(make(f'CREATE ROLE "{bypass}" LOGIN NOSUPERUSER BYPASSRLS'))
    try:
        line = _refusal(_url(ADMIN_URL, bypass, pg.db))
        assert f"role {bypass} is BYPASSRLS" in line
    finally:
        _run(make(f'DROP ROLE "{bypass}"'))


def test_a_schema_missing_or_newer_than_known_is_refused(pg: PgSandbox) -> None:
    with sandbox(migrated=False) as bare:
        assert "no schema eai" in _refusal(bare.url)

    async def bump(sql: str) -> None:
        conn = await pg.owner()
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    newer = schema_version() + 1
    _run(bump(f"INSERT INTO eai.schema_migrations VALUES ({newer}, 'from the future')"))
    try:
        line = _refusal(pg.url)
        assert f"schema eai is at version {newer}, newer than this engine knows" in line
    finally:
        _run(bump(f"DELETE FROM eai.schema_migrations WHERE version = {newer}"))
    _run(PostgresStore(_config(), url=pg.url, tenant_id=TENANT_A).probe())  # fine again


def test_unreachable_or_unknown_logins_are_one_line() -> None:
    assert "connection refused" in _refusal("postgresql://nobody@127.0.0.1:1/eai")
    line = _refusal(_url(ADMIN_URL, f"nobody_{uuid.uuid4().hex[:6]}", "postgres"))
    assert line.startswith("cannot log in to PostgreSQL") and "does not exist" in line
    line = _refusal(f"postgresql://postgres:s3cret@127.0.0.1:5432/nodb_{uuid.uuid4().hex[:6]}")
    assert "does not exist" in line and "s3cret" not in line


def test_the_migration_command_applies_and_grants(pg: PgSandbox) -> None:
    with sandbox(migrated=False) as bare:
        env = {**os.environ, "EAI_DATABASE_URL": bare.owner_url}
        done = subprocess.run(
            [sys.executable, "-m", "engine.runtime.pgstore", "migrate", "--grant", bare.role],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["version"] == schema_version()
        _run(PostgresStore(_config(), url=bare.url, tenant_id=TENANT_A).probe())


def test_the_topology_and_purge(pg: PgSandbox) -> None:
    config = _config()

    async def scenario() -> tuple[Any, ...]:
        store = _store(pg, config=config)
        try:
            await store.remember_topology(["queue:a", "exchange:b"])
            await store.remember_topology(["queue:a"])
            names = await store.topology()
            for a in ("cand-1", "cand-2", "other-1"):
                await store.begin(a, "w1", TINY.order, TINY)
            gone = await store.purge(["cand-"], namespace=False)
            left = await store.stale_evaluations(0)
            cleared = await store.purge([], namespace=True)
            return names, gone, left, cleared, await store.topology(), await store.record("other-1")
        finally:
            await store.close()

    names, gone, left, cleared, topology, other = _run(scenario())
    assert names == {"queue:a", "exchange:b"}
    assert gone == 2 and left == ["other-1"]
    assert cleared == 3 and topology == set()  # its running entry and two names
    assert other.state == "running"  # an evaluation is kept, only the indexes emptied


# --- the worker and the client on PostgreSQL ---------------------------------------------------


def _cli(module: str, *args: str, url: str, **env: str) -> subprocess.CompletedProcess[str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("ENGINE_", "EAI_"))}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env={**keep, "EAI_DATABASE_URL": url, "EAI_TENANT_ID": TENANT_A, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_worker_refuses_a_database_it_cannot_use_in_one_line(pg: PgSandbox) -> None:
    """Exit 3 and one line naming the problem, no traceback, the password never shown."""
    cases = {
        "postgresql://engine:s3cret@127.0.0.1:1/eai": "cannot reach PostgreSQL",
        pg.owner_url: "is a superuser: row-level security would not hold",
        _url(ADMIN_URL, f"nobody_{uuid.uuid4().hex[:6]}", pg.db): "cannot log in to PostgreSQL",
    }
    with sandbox(migrated=False) as bare:
        cases[bare.url] = "no schema eai: the migrations were never applied"
        for url, said in cases.items():
            done = _cli("engine.worker", "--store", "postgres", url=url)
            assert done.returncode == 3, (url, done.stderr)
            lines = done.stderr.strip().splitlines()
            assert len(lines) == 1 and said in lines[0], (url, done.stderr)
            assert lines[0].startswith("engine.worker: ") and "s3cret" not in lines[0]
    bad = _cli("engine.worker", "--store", "postgres", url="mysql://x@y/z")
    assert bad.returncode == 2 and "EAI_DATABASE_URL: expected a URL" in bad.stderr


@dataclass
class OnPostgres:
    """The live stack (`Live`: RabbitMQ, worker processes, the history) with the store on
    the module's database: workers are started with `--store postgres` and the database's
    URL in their environment, the client gets the same config."""

    live: Any
    config: EngineConfig

    def worker(self, *flags: str, **opts: Any) -> Any:
        return self.live.worker("--store", "postgres", *flags, **opts)

    def submit(self, plan: Plan, ids: list[str]) -> None:
        from engine.submit import EngineClient

        async def go() -> None:
            async with EngineClient(self.config) as client:
                for a in ids:
                    await client.submit(plan, a)

        _run(go())

    def wait(self, ids: list[str]) -> dict[str, str | None]:
        from engine.submit import EngineClient
        from tests.live.conftest import PATIENCE_S

        async def go() -> dict[str, str | None]:
            async with EngineClient(self.config) as client:
                return await client.wait(ids, PATIENCE_S)

        return _run(go())

    def snapshot(self, a: str) -> Any:
        async def go() -> Any:
            store = PostgresStore(self.config)
            try:
                return await store.snapshot(a, TINY.order)
            finally:
                await store.close()

        return _run(go())


@pytest.fixture
def on_pg(pg: PgSandbox, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[OnPostgres]:
    from tests.live.conftest import Live

    live = Live(tmp_path)
    monkeypatch.setenv("EAI_DATABASE_URL", pg.url)
    monkeypatch.setenv("EAI_TENANT_ID", TENANT_A)
    config = replace(live.config(), store="postgres", database_url=pg.url, tenant_id=TENANT_A)
    try:
        yield OnPostgres(live, config)
    finally:
        live.close()


def test_a_worker_on_postgres_runs_evaluations_to_their_end(
    pg: PgSandbox, on_pg: OnPostgres
) -> None:
    live = on_pg.live
    ids = live.ids(3, "pg")
    worker = on_pg.worker()
    assert f"ready: postgres postgresql://{pg.role}@" in worker.log_path.read_text()
    on_pg.submit(TINY, ids)
    assert on_pg.wait(ids) == dict.fromkeys(ids, "completed")
    assert all(set(on_pg.snapshot(a).results) == set(TINY.order) for a in ids)
    assert not live.redis.keys(f"attempt:{live.prefix}*")  # nothing went to Redis
    status = _cli(
        "engine.submit",
        "--store",
        "postgres",
        "--status",
        ids[0],
        url=pg.url,
        ENGINE_NAMESPACE=live.ns,
    )
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["state"] == "completed"

    async def events() -> list[str]:
        conn = await pg.owner()
        try:
            rows = await conn.fetch(
                "SELECT e.kind FROM eai.run_events e JOIN eai.runs r ON r.id = e.run_id "
                "WHERE r.namespace = $1 AND r.attempt_id = $2",
                live.ns,
                ids[0],
            )
            return [r["kind"] for r in rows]
        finally:
            await conn.close()

    assert {"run.transition", "lease.token", "run.announced"} <= set(_run(events()))


def test_a_worker_killed_after_the_ack_is_resumed_on_postgres(on_pg: OnPostgres) -> None:
    """The seed's hole, closed on PostgreSQL as on Redis: the first worker dies after two
    results, its lease lapses by the database's clock, a second worker's sweeper claims the
    evaluation, and the resume loads the two results instead of running them again."""
    from tests.live.conftest import PATIENCE_S

    live = on_pg.live
    [a] = live.ids(1, "kill")
    first = on_pg.worker(failpoints=["rule_after_write=crash,hit=2"])
    on_pg.submit(TINY, [a])
    assert first.wait_exit(PATIENCE_S) == -9
    finished = {
        e["rule_id"]
        for e in live.history(a)
        if e["ev"] == "result_persisted" and e["pid"] == first.pid
    }
    assert len(finished) == 2
    on_pg.worker()
    assert on_pg.wait([a]) == {a: "completed"}
    live.wait_for(lambda: live.events("sweeper_resumed", a), what="the sweeper's resume")
    assert all(live.starts(a)[r] == 1 for r in finished), live.starts(a)
    recovered = next(e for e in live.history(a) if e["ev"] == "recovered")
    assert set(recovered["loaded"]) == finished


def test_a_lost_retry_is_found_by_the_sweeper_on_postgres(on_pg: OnPostgres) -> None:
    """A worker dies between writing `failed_attempt_1` (its retry indexed as due) and
    publishing the retry: the next worker's sweeper finds it overdue, claims it and
    publishes attempt 2."""
    from tests.live.conftest import PATIENCE_S

    live = on_pg.live
    [a] = live.ids(1, "lost")
    first = on_pg.worker(
        agent={"fail_rules": {"unit_tests": 3}},
        failpoints=["after_status_write_before_retry_publish=crash"],
    )
    on_pg.submit(TINY, [a])
    assert first.wait_exit(PATIENCE_S) == -9
    assert on_pg.snapshot(a).statuses == {"unit_tests": "failed_attempt_1"}
    on_pg.worker()
    assert on_pg.wait([a]) == {a: "completed"}
    live.wait_for(lambda: live.events("sweeper_retried", a, attempt=2), what="the sweeper's retry")
    assert on_pg.snapshot(a).results["unit_tests"].attempt == 2


# --- concurrency ------------------------------------------------------------------------------


def test_workers_racing_for_a_new_evaluation_get_one_lease(pg: PgSandbox) -> None:
    """Eight workers (a pool each) begin the same new evaluation at once: its row is made
    once, one of them holds the lease with token 1, the others are told who holds it."""
    config = _config()

    async def scenario() -> list[Any]:
        stores = [_store(pg, config=config) for _ in range(8)]
        try:
            for s in stores:  # connected first, so that the begins meet in the database
                await s.holder("warm-up")
            return await asyncio.gather(
                *(s.begin("att-race", f"w{i}", TINY.order, TINY) for i, s in enumerate(stores))
            )
        finally:
            await asyncio.gather(*(s.close() for s in stores))

    begun = _run(scenario())
    winners = [b for b in begun if b.fence]
    assert len(winners) == 1 and winners[0].fence.startswith("1:w")
    holder = winners[0].fence.partition(":")[2]
    assert [b.holder for b in begun if not b.fence] == [holder] * 7


def test_a_deadlocked_batch_is_run_again(pg: PgSandbox) -> None:
    """A batch that locks X then Y meets a transaction holding Y and wanting X: PostgreSQL
    rolls the batch back (nothing of it lands), and the store runs it again, whole."""
    config = _config()

    async def scenario() -> tuple[Any, int, list[Any]]:
        store = _store(pg, config=config)
        admin = await pg.owner()
        try:
            for a in ("att-x", "att-y"):
                await store.set_state(a, "running")
            locked = "SELECT 1 FROM eai.runs WHERE namespace = $1 AND attempt_id = $2 FOR UPDATE"
            tx = admin.transaction()
            await tx.start()
            await admin.execute(locked, config.namespace, "att-y")
            batch = asyncio.ensure_future(
                store._apply([["set_state", "att-x", "parked"], ["set_state", "att-y", "parked"]])
            )
            while True:  # until the batch waits for att-y's lock
                waiting = await admin.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND application_name = 'engine' AND wait_event_type = 'Lock'"
                )
                if waiting:
                    break
                assert not batch.done(), batch
                await asyncio.sleep(0.01)
            # the batch waited first, so its deadlock check runs first (deadlock_timeout
            # after it began to wait) and rolls it back: this side then gets att-x
            await admin.execute(locked, config.namespace, "att-x")
            await tx.rollback()
            replies = await asyncio.wait_for(batch, 30)
            states = [(await store.record(a)).state for a in ("att-x", "att-y")]
            return replies, store.rolled_back, states
        finally:
            await admin.close()
            await store.close()

    replies, rolled_back, states = _run(scenario())
    assert replies == [None, None]
    assert states == ["parked", "parked"]
    assert rolled_back == 1
