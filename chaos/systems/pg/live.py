"""`pg` live: the same shell on PostgreSQL alone, store and queue in one database.

What differs from `pg-store` (whose reads of the tables, service acts and final state this
design shares): the workers start with `--system pg` and reach nothing but PostgreSQL (one
proxy each, the link `postgres`); the runner's client publishes jobs (`engine.submit` with
the `pg` config); its consumer of the events reads the outbox (`eai.run_events` in order of
`seq`, woken by `NOTIFY eai_events`, polling as the fallback) and records each event as the
RabbitMQ consumer records a delivery; and at the end it takes what the work queue still
holds (`queues_drained`: jobs nobody settled).

With `postgres.standby` the run has a PostgreSQL of its own: a primary and a streaming
standby (`chaos.systems.pg.standby.PostgresPair`), the schema migrated on the primary. A
kill of `postgres` is then a failover, as Sentinel's is for Redis: the primary is killed,
the standby promoted (`pg_ctl promote`) and the workers' proxies moved to it, and the kill
records how much WAL the standby had not replayed (`unreplicated_wal_bytes`). The failover's
record counts what the promotion lost that the engine had been told was written
(`lost_writes`, and which: `lost_results`): the results the history shows persisted before
it that the promoted standby lacks, read before any worker reaches it. On loopback a standby
keeps up; a `cut_link` on the link `replication` cuts it off first, as Sentinel's scenarios
cut the replica's: the standby then streams through the run's proxy (`replicate_through`),
and while the proxy is down an asynchronous primary acknowledges commits the promotion loses,
a synchronous one none (they wait). The killed primary is not brought back (it would need a
rewind to follow the new primary).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import asyncpg
import orjson

from chaos import acts
from chaos.conductor import EVENT_KEYS, RECEIVED_AS, delivered
from chaos.links import REPLICATION, Network
from chaos.scenario import LoadedScenario
from chaos.systems.pg.services import PgAloneServices
from chaos.systems.pg_store.live import READ_TIMEOUT_S, PgStoreLive
from chaos.systems.pg_store.live import refusal as store_refusal
from chaos.systems.pg_store.services import DATABASE, engine_database
from chaos.workers import WorkerProcess
from engine.config import EngineConfig

if TYPE_CHECKING:
    from chaos.runner import ScenarioRun

#: How often the events consumer reads the outbox when no notification came (seconds).
EVENTS_POLL_S = 0.2
#: The runner's events consumer as the history names its "queue".
OUTBOX = "eai.run_events"
#: What the outbox's events stand for on RabbitMQ: persistent messages (delivery mode 2),
#: since a row is durable once committed.
DURABLE = 2


def persisted_results(history: Iterable[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """The results the history shows persisted (the engine was told they were written) and
    no resume deleted since, (attempt_id, rule_id) each in the order first written: what a
    failover must not lose (live and in sim, the same count)."""
    persisted: dict[tuple[str, str], None] = {}
    for e in history:
        key = (str(e.get("attempt_id")), str(e.get("rule_id")))
        if e.get("ev") == "result_persisted":
            persisted.setdefault(key, None)
        elif e.get("ev") == "resume_written":  # results deleted on purpose
            for rule in e.get("discarded") or ():
                persisted.pop((key[0], str(rule)), None)
    return list(persisted)


def refusal(loaded: LoadedScenario, killable: set[str]) -> str | None:
    """As `pg-store`'s (only postgres to kill, and it is the run's own), with a standby."""
    return store_refusal(loaded, killable, standby=True)


class PgLive(PgStoreLive):
    """The design's side of one live run (`chaos.systems.seam.LiveSystem`)."""

    def __init__(self, run: ScenarioRun, services: PgAloneServices) -> None:
        super().__init__(run, services)
        self.network = Network(
            run.ns,
            run.seed,
            run.spec.workers,
            None,
            None,
            upstreams={"postgres": services.database_url},
        )
        self.refused = refusal(run.loaded, services.killable)
        self._events_task: asyncio.Task[None] | None = None
        self._events_wake = asyncio.Event()
        self.pair: Any = None  # PostgresPair, with postgres.standby
        self._standby_url = ""
        self._failed_over = False

    async def start(self) -> None:
        """With a standby: the run's own pair, its schema, and the proxies in front of the
        primary; then as `pg-store`."""
        if self.spec.postgres.standby != "none":
            await asyncio.to_thread(self._start_pair)
        await super().start()
        if self.pair is not None and self._cuts_replication:
            await self._stream_through_proxy()

    def _start_pair(self) -> None:
        from chaos.systems.pg.services import PgAloneServices
        from chaos.systems.pg.standby import PostgresPair

        pair = PostgresPair(synchronous=self.spec.postgres.standby == "sync")
        self.pair = pair.start()
        url = engine_database(pair.primary)
        self._standby_url = url.replace(f":{pair.primary_port}/", f":{pair.standby_port}/")
        self.pg = self.services = PgAloneServices(  # type: ignore[assignment]
            database_url=url, amqp_url="", postgres=pair.primary
        )
        # the same Network (the runner holds it), its proxies not made yet: to the pair
        self.network.upstreams["postgres"] = url
        if self._cuts_replication:
            self.network.replication_upstream = f"{pair.primary.host}:{pair.primary_port}"

    @property
    def _cuts_replication(self) -> bool:
        """Whether a fault cuts the standby's link (it streams through a proxy then)."""
        return any(getattr(f, "link", None) == REPLICATION for f in self.spec.faults)

    async def _stream_through_proxy(self) -> None:
        """The standby streams through the run's replication proxy from now on."""
        host, _, port = self.network.replication_listen.rpartition(":")
        await asyncio.to_thread(self.pair.replicate_through, host or "127.0.0.1", int(port))

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            pair, self.pair = self.pair, None
            if pair is not None:
                await asyncio.to_thread(pair.stop, False)

    async def on_kill_service(self, a: acts.KillService) -> dict[str, Any]:
        if self.pair is None or a.name != "postgres" or self._failed_over:
            return await super().on_kill_service(a)
        self._stopped.add("postgres")
        await self._drop_admin()
        # WAL the standby has not replayed, just before the kill: what a promotion loses,
        # commits acknowledged or not (None: not known)
        behind = await asyncio.to_thread(self.pair.lag_bytes)
        await asyncio.to_thread(self.pair.kill_primary)
        self._failed_over = True
        return {acts.FAILS_OVER: True, "unreplicated_wal_bytes": behind}

    async def on_await_failover(self, a: acts.AwaitFailover) -> dict[str, Any]:
        """The standby promoted, what it lost counted, and the workers' proxies moved to it."""
        await asyncio.to_thread(self.pair.promote)
        lost = await asyncio.to_thread(self._lost_results)
        await self.network.repoint("postgres", self._standby_url)
        self.pg.postgres = self.pair.standby
        self.pg.database_url = self._standby_url
        self._stopped.discard("postgres")
        found: dict[str, Any] = {"promoted": True}
        if lost is not None:
            found.update(lost_writes=len(lost), lost_results=lost)
        return found

    def _lost_results(self) -> list[list[str]] | None:
        """The results the history shows persisted (`persisted_results`) that the promoted
        standby lacks, [attempt_id, rule_id] each in the order written; None when the
        standby does not answer. Read before any worker reaches it."""
        persisted = persisted_results(self.run.on_tail(acts.Tail(None))[0])
        try:
            rows = self.pair.standby.fetch(
                "SELECT r.attempt_id, c.rule_id FROM eai.checkpoints c"
                " JOIN eai.runs r ON r.id = c.run_id"
                " WHERE r.namespace = $1 AND c.result IS NOT NULL",
                self.run.ns,
                database=DATABASE,
            )
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            return None
        kept = {(r["attempt_id"], r["rule_id"]) for r in rows}
        return [[a, r] for a, r in persisted if (a, r) not in kept]

    async def on_restart_service(self, a: acts.RestartService) -> dict[str, Any]:
        if self._failed_over and a.name == "postgres":
            return {}  # the promoted standby serves; the old primary stays down
        return await super().on_restart_service(a)

    def config(self) -> EngineConfig:
        return self.spec.engine_config(
            namespace=self.run.ns,
            policy=self.spec.retry.policy(self.run.seed),
            store="postgres",
            broker="postgres",
            database_url=self.pg.database_url,
        )

    def worker(self, index: int, failpoints: list[str], mutant: str | None) -> WorkerProcess:
        """`python -m engine.worker --system pg` through its own proxy."""
        module = ("chaos.mutants", mutant) if mutant else ("engine.worker",)
        return WorkerProcess(
            [*self.run.worker_args(failpoints), "--system", "pg"],
            env={"EAI_DATABASE_URL": self.network.url(index, "postgres")},
            log_path=self.run.run_dir / f"worker{index}.log",
            name=f"worker{index}",
            module=module,
        )

    # --- the events consumer ----------------------------------------------------------------

    async def on_bind_consumer(self, a: acts.BindConsumer) -> None:
        """Before the first submit: read the outbox from its start, in order, each event once
        (the cursor is the last `seq` read), through restarts of PostgreSQL."""
        for key in EVENT_KEYS:
            self.run.history.record("events_consumer_bound", queue=OUTBOX, routing_key=key)
        self._events_task = asyncio.get_running_loop().create_task(self._consume_events())

    async def _consume_events(self) -> None:
        after = 0
        conn: asyncpg.Connection | None = None
        while True:
            # Cleared before the read, not after: a NOTIFY that comes during it wakes the
            # next wait at once (else it waits for the poll, a read late)
            self._events_wake.clear()
            try:
                if conn is None or conn.is_closed():
                    conn = await self._events_connection()
                rows = await conn.fetch(
                    "SELECT seq, topic, message_id, data::text AS data FROM eai.run_events"
                    " WHERE namespace = $1 AND topic = ANY($2) AND seq > $3 ORDER BY seq"
                    " LIMIT 500",
                    self.run.ns,
                    list(EVENT_KEYS),
                    after,
                    timeout=READ_TIMEOUT_S,
                )
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
                if conn is not None:
                    conn.terminate()
                conn = None
                rows = []
            for row in rows:
                after = row["seq"]
                self._received(row["topic"], row["message_id"], orjson.loads(row["data"]))
            if len(rows) < 500:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._events_wake.wait(), EVENTS_POLL_S)

    async def _events_connection(self) -> asyncpg.Connection:
        assert self.pg.postgres is not None
        conn = await self.pg.postgres.admin(database=DATABASE, timeout=READ_TIMEOUT_S)
        await conn.add_listener("eai_events", lambda *_: self._events_wake.set())
        return conn

    def _received(self, topic: str, message_id: str | None, body: Any) -> None:
        fields = delivered(body, message_id, False, DURABLE)
        ev = RECEIVED_AS.get(topic, "completed_received")
        self.run.history.record(ev, **fields)
        if ev == "completed_received" and isinstance(body, dict):
            self.run.received.add(str(body.get("attempt_id")))

    async def on_close_consumer(self, a: acts.CloseConsumer | None = None) -> None:
        """Stop reading; at the end of a run (the workers stopped), take the jobs the queue
        still holds (`queues_drained`, their message ids)."""
        task, self._events_task = self._events_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if a is not None:
            rows = await self._rows(
                "DELETE FROM eai.jobs WHERE namespace = $1 AND kind = 'work' RETURNING message_id"
            )
            if rows is not None:
                left = sorted(str(r["message_id"]) for r in rows)
                self.run.history.record("queues_drained", message_ids=left)
