"""PostgreSQL as the engine's store, behind the same shell: `PostgresStore` has every method of
`RedisStore`, with the same replies, each operation one PL/pgSQL function (the twin of one
Lua script; `engine/runtime/migrations/`), proven equal to the same Python references
(`sim.redis.REFERENCES`) by `tests/live/test_store_reference_live.py`.

The schema is the durable design's (`eai.runs`, `run_steps`, `checkpoints`, `run_events`,
each with `tenant_id` under forced row-level security); an evaluation is a run, a rule
attempt a run step, a rule's durable record (result, status, retry) a checkpoint. The URL
comes from `EAI_DATABASE_URL` only (credentials are never printed), the tenant from
`EAI_TENANT_ID` (a fixed default otherwise); every transaction sets the tenant with
`set_config('app.tenant_id', ..., true)`, never a session `SET` (it would outlive the
transaction on a pooled connection).

Group commit: the owner's writes made in one event-loop turn go out as one statement,
`eai.apply(batch)` (one round trip, one transaction, one WAL flush), as the Redis store
sends its scripts in one pipeline. Each operation is still all-or-nothing: one that fails
fails the transaction, which wrote nothing, and the batch's operations are then run again
one by one, so only that one's caller sees the error. Two lanes of batches go at once, an
evaluation always in the same lane, so that PostgreSQL executes them on two backends while
no operation overtakes an earlier one of its evaluation.

Migrations are versioned SQL files applied in order by an administrator
(`python -m engine.runtime.pgstore migrate --grant ROLE`); the engine connects as a role
that is neither a superuser nor BYPASSRLS (either would skip every policy) and refuses,
in one line, a schema missing, older or newer than it knows, or a role RLS would not hold.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import uuid
import zlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from importlib.abc import Traversable
from typing import Any

import asyncpg
import orjson
from asyncpg import exceptions as pgerr

from engine.config import (
    DEFAULT_DATABASE_URL,
    DEFAULT_TENANT_ID,
    EngineConfig,
    OneLineParser,
    ServiceUnavailable,
    network_reason,
    redacted,
    scrubbed,
)
from engine.core import RuleResult, Snapshot, status_rank
from engine.keys import split_member
from engine.plan import Plan
from engine.runtime.store import FENCED, EvaluationRecord
from engine.shell.replies import Begun, LeaseLost, Renewal, StatusWritten

#: The durable design's variable: the store's URL and its only place for credentials.
DATABASE_URL_ENV = "EAI_DATABASE_URL"
#: The tables whose rows are a tenant's: row-level security must be enabled and forced.
TENANT_TABLES = ("runs", "checkpoints", "run_steps", "run_events", "topology", "jobs", "consumers")

_APPLY = "SELECT eai.apply($1, $2, $3, $4, $5::jsonb, $6)"
_APPLY_MORE = "SELECT eai.apply_more($1, $2, $3, $4, $5::jsonb, $6)"


@dataclass(frozen=True)
class Resumed:
    """What `PostgresStore.resume` did: `kind` "ok" (from checkpoint `checkpoint`, 0 when
    the run had none, as its attempt `attempt`, the rules whose checkpoints were deleted in
    `deleted`), "unknown" (no such run), "terminal" (`state`: refused) or "nocheckpoint"
    (the run's last is `checkpoint`)."""

    kind: str
    checkpoint: int = 0
    attempt: int = 0
    deleted: tuple[str, ...] = ()
    state: str | None = None


_MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


# --- migrations -----------------------------------------------------------------------


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def migrations(folder: Traversable | None = None) -> list[Migration]:
    """The versioned SQL files shipped with the engine, in order (numbered from 1, no gaps:
    a schema is described by its version alone); those of `folder` (another checkout's, for
    a benchmark's A/B) when given."""
    if folder is None:
        folder = resources.files("engine.runtime").joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        m = _MIGRATION_NAME.match(entry.name)
        if m:
            found.append(Migration(int(m.group(1)), entry.name, entry.read_text("utf-8")))
    found.sort(key=lambda x: x.version)
    if [x.version for x in found] != list(range(1, len(found) + 1)):
        raise RuntimeError(f"{folder}: migration versions {[x.version for x in found]}")
    return found


def schema_version() -> int:
    """The schema version this engine knows and needs: its last migration's."""
    return len(migrations())


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def migrate(
    conn: asyncpg.Connection, grant: Iterable[str] = (), known: list[Migration] | None = None
) -> list[int]:
    """Apply the migrations the database lacks, in order, then grant the engine's roles what
    they use; the versions applied. One transaction: a migration that fails leaves the
    schema as it was. Run as the schema's owner (an administrator); a concurrent run waits
    for this one (an advisory lock). `SchemaTooNew` when the database is ahead. `known`:
    other migrations than this engine's (a benchmark comparing two schemas)."""
    known = migrations() if known is None else known
    applied: list[int] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext('eai.migrations'))")
        await conn.execute(
            "CREATE SCHEMA IF NOT EXISTS eai; "
            "CREATE TABLE IF NOT EXISTS eai.schema_migrations ("
            " version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        current = await conn.fetchval("SELECT coalesce(max(version), 0) FROM eai.schema_migrations")
        if current > len(known):
            raise SchemaTooNew(current, len(known))
        for m in known[current:]:
            await conn.execute(m.sql)
            await conn.execute(
                "INSERT INTO eai.schema_migrations (version, name) VALUES ($1, $2)",
                m.version,
                m.name,
            )
            applied.append(m.version)
        for role in grant:
            r = quote_ident(role)
            await conn.execute(
                f"GRANT USAGE ON SCHEMA eai TO {r}; "
                f"GRANT SELECT ON eai.schema_migrations TO {r}; "
                f"GRANT SELECT, INSERT, UPDATE, DELETE ON "
                f"{', '.join('eai.' + t for t in TENANT_TABLES)} TO {r}; "
                f"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA eai TO {r}; "
                # a checkpoint's number (migration 0006: the trigger runs as the caller)
                f"GRANT USAGE ON SEQUENCE eai.checkpoint_order TO {r}"
            )
    return applied


class SchemaTooNew(RuntimeError):
    def __init__(self, found: int, known: int) -> None:
        super().__init__(
            f"schema eai is at version {found}, newer than this engine knows ({known})"
        )


# --- refusals, in one line ----------------------------------------------------------------


class DatabaseRefused(ServiceUnavailable):
    """PostgreSQL answers but cannot be the store as it is (the schema, the role): one line,
    exit 3, like an outage."""

    def __init__(self, url: str, reason: str, todo: str) -> None:
        super().__init__("PostgreSQL", url, reason, DATABASE_URL_ENV, todo=todo)
        self.args = (f"cannot use PostgreSQL at {self.url} ({self.reason}); {todo}",)


def pg_unavailable(exc: BaseException, url: str, timeout_s: float) -> ServiceUnavailable:
    """What a failed first contact with PostgreSQL means, as the one line `ServiceUnavailable`."""
    if isinstance(exc, ServiceUnavailable):
        return exc
    env = DATABASE_URL_ENV
    text = scrubbed(str(exc), url)
    if isinstance(exc, pgerr.InvalidPasswordError):
        return ServiceUnavailable("PostgreSQL", url, "wrong user name or password", env, login=True)
    if isinstance(exc, pgerr.InvalidAuthorizationSpecificationError):
        return ServiceUnavailable("PostgreSQL", url, text, env, login=True)
    if isinstance(exc, pgerr.InvalidCatalogNameError):
        return ServiceUnavailable(
            "PostgreSQL", url, text, env, todo=f"create the database or fix {env}"
        )
    if isinstance(exc, pgerr.CannotConnectNowError | pgerr.TooManyConnectionsError):
        return ServiceUnavailable("PostgreSQL", url, text, env, todo="try again later")
    if isinstance(exc, pgerr.ClientConfigurationError | ValueError):
        return ServiceUnavailable("PostgreSQL", url, text, env, todo=f"fix {env}")
    reason = network_reason(exc, timeout_s)
    if reason is not None:
        return ServiceUnavailable("PostgreSQL", url, reason, env)
    return ServiceUnavailable(
        "PostgreSQL", url, f"{type(exc).__name__}: {text}", env, todo=f"check {env}"
    )


_MIGRATE_TODO = "apply them as the schema's owner: python -m engine.runtime.pgstore migrate"


async def check_database(conn: asyncpg.Connection, url: str) -> None:
    """Refuse (`DatabaseRefused`) a role that row-level security would not hold, a schema
    missing, older or newer than this engine's, or tables RLS does not guard."""
    role = await conn.fetchrow(
        "SELECT current_user AS name, rolsuper, rolbypassrls FROM pg_roles "
        "WHERE rolname = current_user"
    )
    if role is not None and (role["rolsuper"] or role["rolbypassrls"]):
        what = "a superuser" if role["rolsuper"] else "BYPASSRLS"
        raise DatabaseRefused(
            url,
            f"role {role['name']} is {what}: row-level security would not hold",
            "connect as a role without SUPERUSER and BYPASSRLS",
        )
    if await conn.fetchval("SELECT to_regclass('eai.schema_migrations')") is None:
        raise DatabaseRefused(
            url, "no schema eai: the migrations were never applied", _MIGRATE_TODO
        )
    found = await conn.fetchval("SELECT coalesce(max(version), 0) FROM eai.schema_migrations")
    known = schema_version()
    if found > known:
        raise DatabaseRefused(
            url, str(SchemaTooNew(found, known)), "run an engine that knows it, or another schema"
        )
    if found < known:
        raise DatabaseRefused(
            url, f"schema eai is at version {found}, this engine needs {known}", _MIGRATE_TODO
        )
    unguarded = await conn.fetch(
        "SELECT t FROM unnest($1::text[]) AS t LEFT JOIN pg_class c "
        "ON c.relname = t AND c.relnamespace = 'eai'::regnamespace "
        "WHERE c.oid IS NULL OR NOT (c.relrowsecurity AND c.relforcerowsecurity)",
        list(TENANT_TABLES),
    )
    if unguarded:
        names = ", ".join(f"eai.{r['t']}" for r in unguarded)
        raise DatabaseRefused(url, f"{names} not under forced row-level security", _MIGRATE_TODO)
    allowed = await conn.fetchval(
        "SELECT has_function_privilege("
        "'eai.apply(text, text, bigint, integer, jsonb, bigint)', 'EXECUTE')"
    )
    if not allowed:
        name = role["name"] if role is not None else "this role"
        raise DatabaseRefused(
            url,
            f"role {name} may not run the store's functions",
            f"grant them: python -m engine.runtime.pgstore migrate --grant {name}",
        )


async def probe_postgres(url: str, timeout_s: float) -> None:
    """Connect once without retries (within the connect timeout) and check the database;
    raise `ServiceUnavailable` saying why it cannot be the store."""
    try:
        conn = await asyncpg.connect(url, timeout=timeout_s, command_timeout=timeout_s)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, ValueError) as exc:
        raise pg_unavailable(exc, url, timeout_s) from None
    except TimeoutError as exc:
        raise pg_unavailable(exc, url, timeout_s) from None
    try:
        await check_database(conn, url)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
        raise pg_unavailable(exc, url, timeout_s) from None
    finally:
        conn.terminate()


# --- the store ------------------------------------------------------------------------------


#: An event of the outbox: its topic, message id and body (`engine.shell.effects.PublishEvent`).
Event = tuple[str, str, Mapping[str, Any]]


def _announcing(op: list[Any], event: Event | None) -> list[Any]:
    """`op` with the event its change announces, as one operation (`eai.apply`'s
    `announce`, migrations 0004 and 0005): the event's row is written by the operation's
    transaction if the operation took effect."""
    if event is None:
        return op
    topic, message_id, body = event
    return ["announce", op[1], topic, message_id, body, op]


async def _keep_session(conn: asyncpg.Connection) -> None:
    """The pool's reset of a connection given back, after asyncpg's own (listeners dropped,
    an open transaction rolled back): nothing. Its default sends a reset query on every
    release (advisory locks, cursors, LISTEN and settings undone), a round trip and a
    statement a batch for a session that holds none of them: every setting the store makes
    is its transaction's (`set_config(..., true)`), every lock a transaction's, and the
    queue listens on a connection of its own."""


def _retryable(exc: BaseException) -> bool:
    """A lost, refused or restarting server: the operation may be tried again on a new
    connection (as the Redis client's retries do; a write whose reply was lost may then be
    applied twice, as a script may be)."""
    if isinstance(
        exc,
        OSError
        | TimeoutError
        | pgerr.PostgresConnectionError
        | pgerr.CannotConnectNowError
        | pgerr.AdminShutdownError
        | pgerr.CrashShutdownError
        | pgerr.TooManyConnectionsError,
    ):
        return True
    return isinstance(exc, asyncpg.InterfaceError) and "closed" in str(exc)


class GroupCommit:
    """The operations called in one event-loop turn, sent as one `eai.apply` (one statement,
    one transaction); at most one batch in flight, so that calls made meanwhile make the
    next one, which is what makes batches grow under load (`AutoPipeline`'s rule)."""

    def __init__(self, run: Callable[[list[list[Any]]], Awaitable[list[Any]]]) -> None:
        self._run = run
        self._queue: list[tuple[list[Any], asyncio.Future[Any]]] = []
        self._flush_scheduled = False
        self._flushing: asyncio.Task[None] | None = None
        self.batches = 0  # how many went (tests and benchmarks read it)
        self.largest = 0

    def call(self, op: list[Any]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._queue.append((op, fut))
        if not self._flush_scheduled and self._flushing is None:
            self._flush_scheduled = True
            loop.call_soon(self._start_flush)
        return fut

    def _start_flush(self) -> None:
        self._flush_scheduled = False
        batch, self._queue = self._queue, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._flush(batch))
            self._flushing = task
            task.add_done_callback(self._flushed)

    def _flushed(self, _: asyncio.Task[None]) -> None:
        self._flushing = None
        if self._queue and not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._start_flush)

    async def _flush(self, batch: list[tuple[list[Any], asyncio.Future[Any]]]) -> None:
        self.batches += 1
        self.largest = max(self.largest, len(batch))
        try:
            replies = await self._run([op for op, _ in batch])
        except Exception as exc:
            if len(batch) == 1 or not isinstance(exc, asyncpg.PostgresError) or _retryable(exc):
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                return
            # One operation raised: the transaction wrote nothing. Each again on its own,
            # so that only the one that fails fails.
            for op, fut in batch:
                try:
                    (reply,) = await self._run([op])
                except Exception as one:
                    if not fut.done():
                        fut.set_exception(one)
                else:
                    if not fut.done():
                        fut.set_result(reply)
            return
        for (_, fut), reply in zip(batch, replies, strict=True):
            if not fut.done():
                fut.set_result(reply)


class Lanes:
    """Group commit on `n` connections at once: an evaluation's operations always take the same
    lane (by its attemptId), whose batches go one at a time, so none overtakes an earlier one
    of its evaluation; batches of other evaluations run meanwhile on another backend, which is
    what lets the database's execution of the operations use more than one core. A batch's
    operations are on distinct rows from those of the other lanes' batches (an operation
    touches its evaluation's rows only), so the lanes do not wait for each other's locks."""

    def __init__(self, run: Callable[[list[list[Any]]], Awaitable[list[Any]]], n: int) -> None:
        self.lanes = [GroupCommit(run) for _ in range(max(1, n))]

    def call(self, op: list[Any]) -> asyncio.Future[Any]:
        key = op[1] if len(op) > 1 and isinstance(op[1], str) else ""
        return self.lanes[zlib.crc32(key.encode()) % len(self.lanes)].call(op)

    @property
    def batches(self) -> int:
        return sum(lane.batches for lane in self.lanes)

    @property
    def largest(self) -> int:
        return max(lane.largest for lane in self.lanes)


def database_url(config: EngineConfig | None = None) -> str:
    """The store's URL: the config's (`env_config` reads `EAI_DATABASE_URL`), or without a
    config `EAI_DATABASE_URL` itself, else the local default."""
    if config is not None:
        return config.database_url
    return os.environ.get(DATABASE_URL_ENV) or DEFAULT_DATABASE_URL


class PostgresStore:
    """The store on PostgreSQL: `RedisStore`'s methods, signatures and replies.

    `tenant_id`, `url`: overrides of the config's (tests). `clock`: the engine's times come
    from it instead of the database's clock (tests that move time; never the worker).
    `retries`: how many times an operation is tried again on a lost connection (about
    40 s, as the Redis client's). `lanes`: how many batches may be in flight at once (each
    on its own connection; `Lanes`)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        url: str | None = None,
        tenant_id: str | None = None,
        clock: Callable[[], int] | None = None,
        retries: int = 40,
        lanes: int = 2,
    ) -> None:
        self.config = config
        self.ttl = config.state_ttl_s
        self.url = url or database_url(config)
        self.tenant_id = str(uuid.UUID(tenant_id or config.tenant_id or DEFAULT_TENANT_ID))
        self.namespace = config.namespace
        # the Redis store's names, for callers that show them; here the indexes are columns
        self.running_index = config.name("engine:running")
        self.retries_index = config.name("engine:retries")
        self.clock = clock
        self.retries = retries
        self.pool_size = lanes + 2  # the lanes' batches, and reads outside them
        self._pool: asyncpg.Pool | None = None
        self._pool_lock = asyncio.Lock()
        self.batch = Lanes(self._apply, lanes)
        self.rolled_back = 0  # transactions PostgreSQL rolled back (deadlocks), run again

    # --- connections --------------------------------------------------------------------

    async def _get_pool(self) -> asyncpg.Pool:
        if self._pool is None:
            async with self._pool_lock:
                if self._pool is None:
                    self._pool = await asyncpg.create_pool(
                        self.url,
                        min_size=0,
                        max_size=self.pool_size,
                        timeout=self.config.connect_timeout_s,
                        command_timeout=self.config.read_timeout_s,
                        server_settings={"application_name": "engine", "jit": "off"},
                        reset=_keep_session,
                    )
        return self._pool

    async def _apply(self, ops: list[list[Any]]) -> list[Any]:
        """One `eai.apply` of `ops` (one statement, one transaction)."""
        payload = orjson.dumps(ops).decode()
        ns, lease, ttl = self.namespace, self.config.stale_ms, self.ttl
        return await self.fetch_json(
            _APPLY, lambda now: (self.tenant_id, ns, lease, ttl, payload, now)
        )

    async def fetch_json(self, sql: str, args: Callable[[int | None], tuple[Any, ...]]) -> Any:
        """`sql`'s one JSON value, with `args(now)` (now: the store's clock, None for the
        database's); a lost connection is tried again with a backoff, a deadlock at once
        (the transaction wrote nothing). `engine.runtime.pgqueue` goes through it too."""
        failures = deadlocks = 0
        while True:
            try:
                pool = await self._get_pool()
                now = self.clock() if self.clock is not None else None
                return orjson.loads(await pool.fetchval(sql, *args(now)))
            except pgerr.TransactionRollbackError:
                self.rolled_back += 1
                deadlocks += 1
                if deadlocks > 20:
                    raise
            except Exception as exc:
                if not _retryable(exc):
                    raise
                failures += 1
                if failures > self.retries:
                    raise pg_unavailable(exc, self.url, self.config.connect_timeout_s) from exc
                await asyncio.sleep(min(1.0, 0.02 * 2**failures))

    async def _apply_more(self, ops: list[list[Any]]) -> list[Any]:
        """Operations of the later migrations (`eai.apply_more`), as `_apply`."""
        payload = orjson.dumps(ops).decode()
        ns, lease, ttl = self.namespace, self.config.stale_ms, self.ttl
        return await self.fetch_json(
            _APPLY_MORE, lambda now: (self.tenant_id, ns, lease, ttl, payload, now)
        )

    async def _read(self, name: str, attempt_id: str | None, *args: Any) -> Any:
        """A plain read or command: one `eai.apply` of its own, outside the batches (as the
        Redis store's reads go on a pooled connection of their own)."""
        (reply,) = await self._apply([[name, attempt_id, *args]])
        return reply

    async def _owner_call(self, op: list[Any]) -> list[Any]:
        """A fenced operation through the batch; `LeaseLost` when the fence refused it."""
        reply = await self.batch.call(op)
        if reply and reply[0] == FENCED:
            raise LeaseLost(f"{op[1]}: the lease is {reply[1]}'s now")
        return reply

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            try:
                await asyncio.wait_for(pool.close(), self.config.connect_timeout_s)
            except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                pool.terminate()

    async def probe(self) -> None:
        """Fail fast, in one line, when PostgreSQL is unreachable, refuses the credentials,
        lacks the schema (or has another version) or would not hold row-level security."""
        await probe_postgres(self.url, self.config.connect_timeout_s)

    # --- what the namespace left behind ---------------------------------------------------

    async def remember_topology(self, names: Iterable[str]) -> None:
        members = list(names)
        if members:
            await self._read("remember_topology", None, members)

    async def topology(self) -> set[str]:
        return set(await self._read("topology", None))

    async def purge(self, prefixes: Iterable[str], namespace: bool) -> int:
        """Delete the evaluations whose attemptId starts with one of `prefixes` and, with
        `namespace`, empty the namespace's indexes and topology; how many rows went."""
        return int(await self._read("purge", None, list(prefixes), namespace))

    async def purge_expired(self, limit: int = 1000) -> int:
        """Retention: delete up to `limit` evaluations past their 7 days (a key's TTL)."""
        return int(await self._read("purge_expired", None, limit))

    # --- rules ----------------------------------------------------------------------------

    async def write_result(
        self,
        attempt_id: str,
        result: RuleResult,
        starts: Sequence[tuple[str, int]] = (),
        fence: str | None = None,
    ) -> tuple[RuleResult | None, list[int], str | None]:
        """`RedisStore.write_result`: the result kept (None: this write won), the start counts,
        the terminal state (then nothing was counted)."""
        reply = await self._owner_call(
            [
                "write_result",
                attempt_id,
                result.rule_id,
                result.to_json(),
                [r for r, _ in starts],
                [n for _, n in starts],
                fence or "",
            ]
        )
        existing = RuleResult.from_json(reply[0]) if reply[0] else None
        return existing, [int(c) for c in reply[2:]], reply[1] or None

    async def write_status(
        self,
        attempt_id: str,
        rule_id: str,
        status: str,
        delay_ms: int | None = None,
        fence: str | None = None,
    ) -> StatusWritten:
        kept, over, due = await self._owner_call(
            [
                "write_status",
                attempt_id,
                rule_id,
                status,
                status_rank(status),
                delay_ms,
                fence or "",
            ]
        )
        return StatusWritten(kept or None, over or None, int(due) if due else None)

    async def mark_started(
        self, attempt_id: str, starts: Sequence[tuple[str, int]], fence: str | None = None
    ) -> tuple[list[int], str | None]:
        reply = await self._owner_call(
            [
                "mark_started",
                attempt_id,
                [r for r, _ in starts],
                [n for _, n in starts],
                fence or "",
            ]
        )
        return [int(c) for c in reply[1:]], reply[0] or None

    async def begin(
        self,
        attempt_id: str,
        me: str,
        rule_ids: Sequence[str],
        plan: Plan | str | None,
        *,
        event: Event | None = None,
    ) -> Begun:
        plan_json = plan.to_json() if isinstance(plan, Plan) else plan
        op = ["begin", attempt_id, me, list(rule_ids), plan_json or None]
        reply = await self.batch.call(_announcing(op, event))
        kind = reply[0]
        if kind == "held":
            return Begun(holder=reply[1])
        if kind == "terminal":
            return Begun(terminal=reply[1], published=bool(reply[2]))
        if kind == "noplan":
            return Begun(no_plan=True)
        n_passes = int(reply[3])
        passes = reply[4 : 4 + n_passes]
        values = reply[4 + n_passes :]
        n = len(rule_ids)
        results = {
            r: RuleResult.from_json(v) for r, v in zip(rule_ids, values[:n], strict=True) if v
        }
        statuses = {r: v for r, v in zip(rule_ids, values[n:], strict=True) if v}
        snap = Snapshot(results=results, statuses=statuses, published_passes=frozenset(passes))
        return Begun(plan_json=reply[1], snapshot=snap, fence=reply[2])

    async def stored_plan(self, attempt_id: str) -> str | None:
        return await self._read("stored_plan", attempt_id)

    async def done(self, attempt_id: str, me: str, *, event: Event | None = None) -> bool:
        return bool(await self.batch.call(_announcing(["done", attempt_id, me], event)))

    async def finish(
        self,
        attempt_id: str,
        status: str,
        results: Mapping[str, RuleResult],
        failed: Sequence[str],
        fence: str | None = None,
        *,
        event: Event | None = None,
    ) -> tuple[str | None, list[str]]:
        op = [
            "finish",
            attempt_id,
            status,
            list(results),
            [v.to_json() for v in results.values()],
            list(failed),
            fence or "",
        ]
        reply = await self._owner_call(_announcing(op, event))
        return reply[0] or None, list(reply[1:])

    async def park(
        self, attempt_id: str, me: str, fence: str | None = None, waiting: Sequence[str] = ()
    ) -> None:
        await self._owner_call(["park", attempt_id, me, list(waiting), fence or ""])

    async def snapshot(self, attempt_id: str, rule_ids: Sequence[str]) -> Snapshot:
        got = await self._read("snapshot", attempt_id, list(rule_ids))
        results = {
            r: RuleResult.from_json(v) for r, v in zip(rule_ids, got["results"], strict=True) if v
        }
        statuses = {r: v for r, v in zip(rule_ids, got["statuses"], strict=True) if v}
        return Snapshot(
            results=results, statuses=statuses, published_passes=frozenset(got["passes"])
        )

    # --- evaluations ----------------------------------------------------------------------

    async def record(self, attempt_id: str) -> EvaluationRecord:
        state, plan, published = await self._read("record", attempt_id)
        return EvaluationRecord(state=state, plan_json=plan, final_published=bool(published))

    async def states(self, attempt_ids: Sequence[str]) -> list[str | None]:
        """The states of many evaluations in one round trip (a client waiting for them)."""
        if not attempt_ids:
            return []
        replies = await self._apply([["record", a] for a in attempt_ids])
        return [state for state, _, _ in replies]

    async def set_state(
        self, attempt_id: str, state: str, *, event: Event | None = None
    ) -> str | None:
        return await self.batch.call(_announcing(["set_state", attempt_id, state], event))

    async def mark_pass_published(
        self,
        attempt_id: str,
        pass_id: str,
        outcome: str,
        fence: str | None = None,
        *,
        event: Event | None = None,
    ) -> None:
        op = ["mark_pass_published", attempt_id, pass_id, outcome, fence or ""]
        await self._owner_call(_announcing(op, event))

    # --- ownership, heartbeats, indexes ---------------------------------------------------

    async def renew(self, fences: Mapping[str, str], me: str) -> dict[str, int]:
        """The heartbeat: per evaluation a `Renewal`, 1 still ours, 0 lost, 2 forgotten and
        ours again, with when the lease runs out (by the database's clock)."""
        ids = list(fences)
        if not ids:
            return {}
        out = await asyncio.gather(*[self.batch.call(["renew", a, me, fences[a]]) for a in ids])
        return {
            a: Renewal(int(v[0]), int(v[1])) if len(v) > 1 else Renewal(int(v[0]))
            for a, v in zip(ids, out, strict=True)
        }

    async def reinstate(self, attempt_id: str, plan: Plan | str) -> bool:
        plan_json = plan if isinstance(plan, str) else plan.to_json()
        return bool(await self._read("reinstate", attempt_id, plan_json))

    async def holder(self, attempt_id: str) -> str | None:
        return await self._read("holder", attempt_id)

    async def release(self, attempt_id: str, me: str) -> None:
        await self.batch.call(["release", attempt_id, me])

    async def unindex(self, attempt_id: str) -> None:
        await self.batch.call(["unindex", attempt_id])

    async def stale_evaluations(self, older_than_ms: int, limit: int = 100) -> list[str]:
        return list(await self._read("stale_evaluations", None, older_than_ms, limit))

    async def claim_stale(self, attempt_id: str, older_than_ms: int) -> bool:
        return bool(await self.batch.call(["claim_stale", attempt_id, older_than_ms]))

    async def overdue_retries(self, grace_ms: int, limit: int = 100) -> list[str]:
        return list(await self._read("overdue_retries", None, grace_ms, limit))

    async def claim_retry(self, member: str, grace_ms: int) -> str | None:
        attempt_id, rule_id = split_member(member)
        status = await self.batch.call(["claim_retry", attempt_id, rule_id, grace_ms])
        return status or None

    # --- resuming (the durable design's `AgentLoop.resume`) -------------------------------

    async def resume(self, attempt_id: str, number: int | None, reason: str) -> Resumed:
        """Keep the run's checkpoints up to `number` (None: all), delete the rest, take the
        lease from its holder; the caller then publishes the work that resumes it."""
        ((kind, *rest),) = await self._apply_more([["resume", attempt_id, number, reason]])
        if kind == "ok":
            return Resumed("ok", int(rest[0]), int(rest[1]), tuple(rest[2:]))
        if kind == "terminal":
            return Resumed("terminal", state=rest[0])
        if kind == "nocheckpoint":
            return Resumed("nocheckpoint", checkpoint=int(rest[0]))
        return Resumed("unknown")

    async def checkpoints(self, attempt_id: str) -> list[tuple[int, str]]:
        """The run's checkpoints in the order they became durable: (number, rule id)."""
        ((rows),) = await self._apply_more([["checkpoints", attempt_id]])
        return [(int(n), str(r)) for n, r in rows]

    async def stale_heartbeats(self, older_than_ms: int, limit: int = 100) -> list[Any]:
        """Runs nobody renews: [attemptId, last owner, ms since its last stamp], oldest first."""
        ((rows),) = await self._apply_more([["stale_heartbeats", None, older_than_ms, limit]])
        return [tuple(r) for r in rows]


# --- python -m engine.runtime.pgstore ---------------------------------------------------------


async def _migrate_cli(url: str, grant: list[str], timeout_s: float) -> int:
    try:
        conn = await asyncpg.connect(url, timeout=timeout_s)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, ValueError) as exc:
        raise pg_unavailable(exc, url, timeout_s) from None
    except TimeoutError as exc:
        raise pg_unavailable(exc, url, timeout_s) from None
    try:
        applied = await migrate(conn, grant)
        version = await conn.fetchval("SELECT max(version) FROM eai.schema_migrations")
    except SchemaTooNew as exc:
        print(f"engine.runtime.pgstore: {exc}; nothing applied", file=sys.stderr)
        return 1
    finally:
        await conn.close()
    print(
        orjson.dumps({"applied": applied, "version": version, "granted": grant}).decode(),
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(
        prog="python -m engine.runtime.pgstore",
        description="Apply the store's migrations to the database at $EAI_DATABASE_URL (as "
        "the schema's owner) and grant the engine's role what it uses.",
    )
    p.add_argument("command", choices=["migrate"])
    p.add_argument(
        "--grant", action="append", default=[], metavar="ROLE", help="the engine's login role"
    )
    p.add_argument("--connect-timeout-s", type=float, default=5.0)
    args = p.parse_args(argv)
    url = database_url()
    try:
        return asyncio.run(_migrate_cli(url, args.grant, args.connect_timeout_s))
    except ServiceUnavailable as exc:
        print(f"engine.runtime.pgstore: {exc}", file=sys.stderr)
        return 3
    except asyncpg.PostgresError as exc:
        line = " ".join(scrubbed(str(exc), url).split())
        print(f"engine.runtime.pgstore: migrating {redacted(url)} failed: {line}", file=sys.stderr)
        return 1


__all__ = [
    "DATABASE_URL_ENV",
    "DatabaseRefused",
    "GroupCommit",
    "Lanes",
    "PostgresStore",
    "Resumed",
    "migrate",
    "migrations",
    "pg_unavailable",
    "probe_postgres",
    "schema_version",
]


if __name__ == "__main__":
    sys.exit(main())
