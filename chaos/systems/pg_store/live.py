"""`pg-store` live: the same shell and RabbitMQ as `redis-rabbitmq`, PostgreSQL as the store.

What the runner asks of this design: the workers start with `--store postgres` and reach
PostgreSQL (`EAI_DATABASE_URL`) and RabbitMQ through proxies of their own; PostgreSQL and
the broker are killed, stopped, paused (the postmaster and every backend) and brought
back; "settled", "leases" and "announced" and the final state are read from the `eai`
tables. The runner's client, its consumer of `evaluation.completed` and the loss of
dead-lettered retries are `redis-rabbitmq`'s, on the same broker.

The harness reads the tables as the schema's owner (a superuser: row-level security does
not hide another tenant's rows from it); the engine never does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import asyncpg
import orjson

from chaos import acts
from chaos.checker import EvaluationFinal, FinalState
from chaos.links import Network
from chaos.scenario import LoadedScenario
from chaos.scenario.schema import service_action
from chaos.systems.pg_store.services import DATABASE, PgServices
from chaos.systems.redis_rabbitmq.live import SERVICE_STOP_TIMEOUT_S, TERMINAL, RedisRabbitLive
from chaos.workers import WorkerProcess
from engine.config import EngineConfig
from engine.core.results import RuleResult
from engine.keys import retry_member

if TYPE_CHECKING:
    from chaos.runner import ScenarioRun

#: How long a read of the tables may take before it counts as "the store is down".
READ_TIMEOUT_S = 2.0


def refusal(loaded: LoadedScenario, killable: set[str], standby: bool = False) -> str | None:
    """Why the scenario cannot run against these services, in one line (None: it can);
    `standby`: the design fails over to a standby of its own (`postgres.standby`)."""
    spec = loaded.spec
    if spec.postgres.standby != "none" and not standby:
        return (
            f"{loaded.path}: postgres.standby: {spec.system} has no standby; "
            "run it with --system pg"
        )
    needed = {on[0] for f in spec.faults if (on := service_action(f)) is not None}
    missing = needed - killable
    if missing:
        return (
            f"{loaded.path}: faults: kills {' and '.join(sorted(missing))}, but this run uses "
            "a shared service (AMQP_URL); unset it to let the run start its own"
        )
    if spec.broker.consumer_timeout_s is not None and "broker" not in killable:
        return (
            f"{loaded.path}: broker.consumer_timeout_s: needs the run's own broker, but this "
            "run uses a shared one (AMQP_URL); unset it to let the run start its own"
        )
    return None


class PgStoreLive(RedisRabbitLive):
    """The design's side of one live run (`chaos.systems.seam.LiveSystem`)."""

    def __init__(self, run: ScenarioRun, services: PgServices) -> None:
        self.run = run
        self.spec = spec = run.spec
        self.services = services  # type: ignore[assignment]
        self.pg = services
        self.sentinel = None
        self.run_prefix = ""  # a namespace of its own: the rows are the run's alone
        self._client = None
        self._events_conn = None
        self._events_queue = None
        self._stopped: set[str] = set()
        self._admin: asyncpg.Connection | None = None
        self._restore_mutant: Callable[..., Awaitable[None]] | None = None
        self.network = Network(
            run.ns,
            run.seed,
            spec.workers,
            None,
            services.amqp_url,
            spec.engine.amqp_heartbeat_s,
            upstreams={"postgres": services.database_url},
        )
        self.refused = refusal(run.loaded, services.killable)

    # --- set-up -------------------------------------------------------------------------

    def config(self) -> EngineConfig:
        return self.spec.engine_config(
            amqp_url=self.pg.amqp_url,
            namespace=self.run.ns,
            policy=self.spec.retry.policy(self.run.seed),
            store="postgres",
            database_url=self.pg.database_url,
        )

    async def start(self) -> None:
        """The broker and PostgreSQL as the scenario sets them, the proxies, and a mutant of
        a store function installed (`chaos.systems.pg_store.mutants`) when one is asked."""
        pg = self.spec.postgres
        await asyncio.to_thread(self.pg.configure, self.spec.broker.consumer_timeout_s)
        await asyncio.to_thread(self.pg.durability, pg.synchronous_commit, pg.wal_writer_delay_ms)
        await self.network.start()
        if self.run.mutant is not None:
            from chaos.systems.pg_store import mutants

            conn = await self._connect()
            self._restore_mutant = await mutants.install(conn, self.run.mutant)

    async def stop(self) -> None:
        await self.network.close()
        restore, self._restore_mutant = self._restore_mutant, None
        try:
            if restore is not None:  # on a connection of its own: a kill closed the install's
                await self._ensure_up()
                await restore(await self._connect())
        finally:
            admin, self._admin = self._admin, None
            if admin is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(admin.close(), READ_TIMEOUT_S)

    def worker(self, index: int, failpoints: list[str], mutant: str | None) -> WorkerProcess:
        """`python -m engine.worker --store postgres` through its own proxies."""
        module = ("chaos.mutants", mutant) if mutant else ("engine.worker",)
        return WorkerProcess(
            [*self.run.worker_args(failpoints), "--store", "postgres"],
            env={  # through the worker's own proxies (`chaos.links`)
                "EAI_DATABASE_URL": self.network.url(index, "postgres"),
                "AMQP_URL": self.network.url(index, "broker"),
            },
            log_path=self.run.run_dir / f"worker{index}.log",
            name=f"worker{index}",
            module=module,
        )

    async def _clear_earlier_runs(self) -> None:
        """Nothing: an evaluation is keyed by the run's own namespace too."""

    # --- its services ---------------------------------------------------------------------

    async def on_kill_service(self, a: acts.KillService) -> dict[str, Any]:
        svc = self.pg.service(a.name)
        self._stopped.add(a.name)
        await self._drop_admin()
        if a.graceful:
            await asyncio.to_thread(svc.terminate, SERVICE_STOP_TIMEOUT_S)
        else:
            await asyncio.to_thread(svc.kill)
        return {}

    async def on_restart_service(self, a: acts.RestartService) -> dict[str, Any]:
        await asyncio.to_thread(self.pg.service(a.name).restart)
        self._stopped.discard(a.name)  # ready again: the restart waits for it
        return {}

    async def on_pause_service(self, a: acts.PauseService) -> None:
        self._stopped.add(a.name)
        await asyncio.to_thread(self.pg.service(a.name).pause)

    async def on_resume_service(self, a: acts.ResumeService) -> bool:
        await asyncio.to_thread(self.pg.service(a.name).resume)
        self._stopped.discard(a.name)
        return False

    async def on_resume(self, a: acts.Resume) -> dict[str, Any]:
        """`engine.submit --resume`: the answer, or why it was refused (`refused`)."""
        from engine.keys import checkpoint_id
        from engine.submit import EngineClient, ResumeRefused

        chk = None if a.checkpoint is None else checkpoint_id(a.checkpoint)
        async with EngineClient(self.config()) as client:
            try:
                return await client.resume(a.attempt_id, chk)
            except ResumeRefused as exc:
                return {"refused": str(exc)}

    # --- what the store holds -------------------------------------------------------------

    async def _connect(self) -> asyncpg.Connection:
        if self._admin is None or self._admin.is_closed():
            assert self.pg.postgres is not None
            self._admin = await self.pg.postgres.admin(database=DATABASE, timeout=READ_TIMEOUT_S)
        return self._admin

    async def _drop_admin(self) -> None:
        admin, self._admin = self._admin, None
        if admin is not None:
            admin.terminate()

    async def _rows(self, sql: str, *args: Any) -> list[asyncpg.Record] | None:
        """Rows of the run's namespace; None while PostgreSQL does not answer (a fault)."""
        if "postgres" in self._stopped:
            return None
        try:
            conn = await self._connect()
            return await conn.fetch(sql, self.run.ns, *args, timeout=READ_TIMEOUT_S)
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
            await self._drop_admin()
            return None

    async def on_settled(self, a: acts.Settled) -> int:
        """Terminal, announced and out of the running index: with an outbox the final
        state's own transaction flags it announced (migration 0005), and its announcer's
        `done` (out of the index, the lease given back) follows."""
        rows = await self._rows(
            "SELECT count(*) AS n FROM eai.runs WHERE namespace = $1 AND attempt_id = ANY($2)"
            " AND state = ANY($3) AND final_published AND running_ms IS NULL"
            " AND expires_at > now()",
            list(a.attempt_ids),
            sorted(TERMINAL),
        )
        return int(rows[0]["n"]) if rows else 0

    async def on_leases(self, a: acts.Leases) -> dict[str, str] | None:
        rows = await self._rows(
            "SELECT attempt_id, owner FROM eai.runs WHERE namespace = $1"
            " AND attempt_id = ANY($2) AND owner IS NOT NULL"
            " AND lease_until_ms >= (extract(epoch FROM clock_timestamp()) * 1000)::bigint",
            list(a.attempt_ids),
        )
        return None if rows is None else {r["attempt_id"]: r["owner"] for r in rows}

    async def on_announced(self, a: acts.Announced) -> set[str]:
        rows = await self._rows(
            "SELECT attempt_id FROM eai.runs WHERE namespace = $1 AND attempt_id = ANY($2)"
            " AND final_published AND expires_at > now()",
            list(a.attempt_ids),
        )
        return {r["attempt_id"] for r in rows or []}

    async def _ensure_up(self) -> None:
        postgres = self.pg.postgres
        assert postgres is not None
        if not postgres.alive:  # the final state needs the store back
            await asyncio.to_thread(postgres.restart)
        self._stopped.discard("postgres")

    async def on_read_final(self, a: acts.ReadFinal) -> FinalState:
        """Each evaluation's row and checkpoints, and what the running and retries indexes
        (columns here) hold, named as the Redis design names them."""
        await self._ensure_up()
        conn = await self._connect()
        ids = list(self.run.attempt_ids)
        runs = await conn.fetch(
            "SELECT attempt_id, state, final_published, passes::text AS passes, running_ms"
            " FROM eai.runs WHERE namespace = $1 AND attempt_id = ANY($2)"
            " AND expires_at > now()",
            self.run.ns,
            ids,
        )
        checkpoints = await conn.fetch(
            "SELECT r.attempt_id, c.rule_id, c.result, c.status, c.retry_due_ms"
            " FROM eai.checkpoints c JOIN eai.runs r ON r.id = c.run_id"
            " WHERE r.namespace = $1 AND r.attempt_id = ANY($2) AND r.expires_at > now()",
            self.run.ns,
            ids,
        )
        by_run = {r["attempt_id"]: r for r in runs}
        evaluations = {}
        running: dict[str, float] = {}
        retries: dict[str, float] = {}
        for attempt_id in ids:
            row = by_run.get(attempt_id)
            passes = orjson.loads(row["passes"]) if row is not None else {}
            evaluations[attempt_id] = EvaluationFinal(
                attempt_id=attempt_id,
                state=row["state"] if row is not None else None,
                published=bool(row["final_published"]) if row is not None else False,
                passes={str(p): str(o) for p, o in sorted(passes.items())},
            )
            if row is not None and row["running_ms"] is not None:
                running[attempt_id] = float(row["running_ms"])
        for c in checkpoints:
            final = evaluations[c["attempt_id"]]
            if c["result"] is not None:
                final.results[c["rule_id"]] = RuleResult.from_json(c["result"])
            if c["status"] is not None:
                final.statuses[c["rule_id"]] = c["status"]
            if c["retry_due_ms"] is not None:
                retries[retry_member(c["attempt_id"], c["rule_id"])] = float(c["retry_due_ms"])
        indexes = {"engine:running": running, "engine:retries": retries}
        return FinalState(evaluations=evaluations, key_ttls={}, indexes=indexes)
