"""PostgreSQL's time executing the store's batches, replayed: the cost of a schema change.

    python bench/store_replay.py [--rounds 3] [--evaluations 200]
    python bench/store_replay.py --against /tmp/before [--rounds 5]

`bench/rules_per_second.py --store postgres` measures the whole engine, and a change inside
PostgreSQL moves its ratio less than the machine's noise does. This one isolates the
database: it records the `eai.apply` calls of one round of that benchmark (code_review.yaml,
zero-latency agent, one worker, on a private PostgreSQL logging every statement with its
parameters), then replays them, in order and one after another, on a fresh private server
migrated to this checkout's schema, and with `--against DIR` to that checkout's too, in
interleaved rounds. Each replay runs twice on its server (the first warms the caches, the
tables and PL/pgSQL's plans, as a long-running worker has them; the second, on a namespace
of its own, is measured) and prints, per operation, the time PostgreSQL spent executing the
batches (pg_stat_statements) and the CPU of the backend that ran them (/proc: the steadier
figure on a shared machine), each round, then the medians and, with `--against`, their
ratios. The capture needs the machine's RabbitMQ, as that benchmark does.
`synchronous_commit` is off for the replay: the commits' flushes are the disk's, not the
schema's. Both schemas get the same calls, so the same operations on the same rows.

Measured (2026-12-07, 10:21 to 10:42 UTC, load under 1): migration 0006 against the schema
before it (`--against` a worktree of the commit before), 200 evaluations (about 220 batches,
4,404 operations), runs of 5 rounds: 88.8 and 95.7 us an operation executing inside
PostgreSQL against 133.1 and 159.1 (0.67x and 0.60x; the backend's CPU 0.68x and 0.62x); a
round's figure swings by up to a fifth, so read the medians. How the cuts were found:
pg_stat_statements with `track = all` and `track_planning = on` (which statement runs, and
which is planned again at every call), `track_functions = pl` (its self times inflate small
functions), and `perf record` of the replaying backend (the executor's start-up per
statement, the SQL-function executor, the foreign keys' checks).

The servers are stopped and their temp dirs deleted, also on a failure or Ctrl-C; only the
template data dir that `PostgresServer` caches stays.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import itertools
import json
import re
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import asyncpg  # noqa: E402

from chaos.systems.pg_store.postgres import PostgresServer, find_postgres_bin  # noqa: E402
from engine.runtime import pgstore  # noqa: E402

ROLE = "eai_engine"
DATABASE = "eai"
_APPLY = "SELECT eai.apply($1, $2, $3, $4, $5::jsonb, $6)"
# One logged execution of the engine's statement: the duration line, then its parameters
_LOGGED = re.compile(
    r"execute \S+: " + re.escape(_APPLY) + r"\n[^\n]*DETAIL:  parameters: ([^\n]*)\n"
)
_PARAM = re.compile(r"\$(\d) = (NULL|'((?:[^']|'')*)')")


@functools.cache
def _rules_per_second() -> Any:
    """bench/rules_per_second.py as a module (loaded once): its engine round is what is
    replayed, and its `_cpu_s` reads the backend's CPU."""
    spec = importlib.util.spec_from_file_location(
        "rules_per_second", ROOT / "bench" / "rules_per_second.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["rules_per_second"] = module
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Call:
    tenant: str
    namespace: str
    lease_ms: int
    ttl: int
    ops: str  # the batch's JSON
    now: int | None


def parse(log: str) -> list[Call]:
    calls = []
    for m in _LOGGED.finditer(log):
        p: dict[int, str | None] = {}
        for pm in _PARAM.finditer(m.group(1)):
            p[int(pm.group(1))] = None if pm.group(2) == "NULL" else pm.group(3).replace("''", "'")
        now = p.get(6)
        calls.append(
            Call(
                str(p[1]),
                str(p[2]),
                int(str(p[3])),
                int(str(p[4])),
                str(p[5]),
                None if now is None else int(now),
            )
        )
    return calls


@contextlib.contextmanager
def server(**settings: str) -> Iterator[PostgresServer]:
    s = PostgresServer(settings={"shared_preload_libraries": "pg_stat_statements", **settings})
    try:
        s.start()
        yield s
    finally:
        s.stop(graceful=False)


def capture(evaluations: int) -> list[Call]:
    """One engine round of bench/rules_per_second.py, its store's batches as PostgreSQL
    received them."""
    rps = _rules_per_second()
    logging = {"log_min_duration_statement": "0", "log_parameter_max_length": "-1"}
    with server(**logging) as s, tempfile.TemporaryDirectory() as tmp:
        password = s.create_role(ROLE)
        s.create_database(DATABASE)
        asyncio.run(_prepare(s, pgstore.migrations()))
        pg = rps.PrivatePostgres(s, s.url(ROLE, password, DATABASE), True, itertools.count())
        plan = ROOT / "plans" / "code_review.yaml"
        asyncio.run(rps.rule_rate(plan, evaluations, Path(tmp), ["--max-evaluations", "64"], pg=pg))
        logs = [p.read_text() for p in s._log_paths() if p.exists()]
    calls = parse("".join(logs))
    if not calls:
        raise SystemExit("no eai.apply call found in the capture's server log")
    return calls


async def _prepare(s: PostgresServer, migrations: list[pgstore.Migration]) -> None:
    """The schema from `migrations` (this checkout's or another's), granted to the engine's
    role as `migrate` grants it."""
    conn = await s.admin(database=DATABASE)
    try:
        await pgstore.migrate(conn, grant=[ROLE], known=migrations)
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    finally:
        await conn.close()


async def _replay(s: PostgresServer, url: str, calls: list[Call]) -> tuple[float, float]:
    """The calls on a namespace of their own, one after another: the milliseconds PostgreSQL
    spent executing them, and the CPU milliseconds of the backend that ran them (the steadier
    figure on a shared machine: time the backend waits for a core is not in it)."""
    admin = await s.admin(database=DATABASE)
    try:
        await admin.execute("SELECT pg_stat_statements_reset()")
    finally:
        await admin.close()
    conn = await asyncpg.connect(url, server_settings={"synchronous_commit": "off"})
    try:
        ns = f"r{uuid.uuid4().hex[:8]}."
        stmt = await conn.prepare(_APPLY)
        backend = await conn.fetchval("SELECT pg_backend_pid()")
        cpu0 = _rules_per_second()._cpu_s(backend)
        for c in calls:
            ops = c.ops.replace(json.dumps(c.namespace)[1:-1], ns)
            await stmt.fetchval(c.tenant, ns, c.lease_ms, c.ttl, ops, c.now)
        cpu_ms = (_rules_per_second()._cpu_s(backend) - cpu0) * 1000
    finally:
        await conn.close()
    admin = await s.admin(database=DATABASE)
    try:
        ms = await admin.fetchval(
            "SELECT coalesce(sum(total_exec_time), 0) FROM pg_stat_statements WHERE query = $1",
            _APPLY,
        )
    finally:
        await admin.close()
    return float(ms), cpu_ms


def measure(
    migrations: list[pgstore.Migration], calls: list[Call], ops: int
) -> tuple[float, float]:
    """Microseconds PostgreSQL spends executing an operation, and its backend's CPU an
    operation, on a fresh server with this schema: the second of two replays."""
    with server() as s:
        password = s.create_role(ROLE)
        s.create_database(DATABASE)
        asyncio.run(_prepare(s, migrations))
        url = s.url(ROLE, password, DATABASE)
        asyncio.run(_replay(s, url, calls))  # warms the caches, the tables and the plans
        ms, cpu_ms = asyncio.run(_replay(s, url, calls))
        return ms * 1000 / ops, cpu_ms * 1000 / ops


def their_migrations(root: Path) -> list[pgstore.Migration]:
    folder = root / "engine" / "runtime" / "migrations"
    found = pgstore.migrations(folder) if folder.is_dir() else []
    if not found:
        raise SystemExit(f"--against {root}: no migration in {folder}")
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--evaluations", type=int, default=200, help="of the captured round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--against", type=Path, help="another checkout whose schema to compare with")
    args = p.parse_args()
    if find_postgres_bin() is None:
        raise SystemExit("this benchmark needs PostgreSQL (postgres, initdb) on this machine")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    schemas = {"this checkout": pgstore.migrations()}
    if args.against is not None:
        schemas[f"{args.against}"] = their_migrations(args.against)
    t0 = time.perf_counter()
    calls = capture(args.evaluations)
    ops = sum(len(json.loads(c.ops)) for c in calls)
    kinds: dict[str, int] = {}
    for c in calls:
        for op in json.loads(c.ops):
            kinds[op[0]] = kinds.get(op[0], 0) + 1
    print(
        f"captured {len(calls)} batches, {ops} operations in {time.perf_counter() - t0:.1f} s: "
        + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda x: -x[1]))
    )
    us: dict[str, list[float]] = {name: [] for name in schemas}
    cpu: dict[str, list[float]] = {name: [] for name in schemas}
    for i in range(args.rounds):
        line = []
        for name, migrations in schemas.items():
            executing, backend = measure(migrations, calls, ops)
            us[name].append(executing)
            cpu[name].append(backend)
            line.append(f"{name} {executing:6.1f} us ({backend:6.1f} us of CPU)")
        print(f"round {i + 1}: " + ", ".join(line) + " an operation")
    for name in schemas:
        print(
            f"{name}: median {statistics.median(us[name]):.1f} us an operation executing "
            f"inside PostgreSQL (range {min(us[name]):.1f}..{max(us[name]):.1f}), the backend's "
            f"CPU {statistics.median(cpu[name]):.1f} us (range {min(cpu[name]):.1f}.."
            f"{max(cpu[name]):.1f}); {args.rounds} rounds, schema version {len(schemas[name])}"
        )
    if args.against is not None:
        theirs = f"{args.against}"
        ratio = statistics.median(us["this checkout"]) / statistics.median(us[theirs])
        cpu_ratio = statistics.median(cpu["this checkout"]) / statistics.median(cpu[theirs])
        print(
            f"this checkout / {theirs}: {ratio:.2f}x the time executing an operation, "
            f"{cpu_ratio:.2f}x the backend's CPU"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
