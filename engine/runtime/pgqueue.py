"""PostgreSQL as the first memory too (the `pg` design, no broker): the work queue, the
delay tiers, the workers' private queues, the control fanout and the events, as rows
(`migrations/0002_eai_jobs.sql`), behind `Broker`'s methods, so that the shell runs as it
ships.

The late ACK keeps its meaning: a claim holds a job with a visibility lease that this
consumer renews while it lives (`renew_every_s`); ACK deletes the job, NACK makes it visible
again; a worker that dies before settling lets the job come back when its lease lapses,
counted as a redelivery (one that was only cut off, its lease lapsed meanwhile, claims its
own job again: it keeps the delivery it holds, with the new claim's token). The work queue
and the worker's own queue have a prefetch each, as two RabbitMQ consumers have their own
credit: a window full of work never keeps a forward or a cancel waiting. A delayed retry
is a job visible later (its tier's TTL, with the same jitter buckets as the delay queues).
Consumers are woken by `NOTIFY eai_jobs` at each commit that makes a job due, by a timer
at the next due job the last claim saw, and by polling every `poll_s` as the fallback (a
lost notification or listener, listened on again by the next claim): no job waits unseen
longer than that once due. Events go to `eai.run_events` (an outbox read in order of
`seq`, at least once, each with its stable message id; `NOTIFY eai_events` wakes readers);
each event is written by the transaction of the store operation whose change it
announces (`Store.event`): `evaluation.started` by `begin`, `evaluation.completed` by the
final state (`finish`, a cancel's `set_state`) with its flag, a pass result by its flag.
Jobs and events are committed synchronously whatever the role's `synchronous_commit`.

The queue's operations travel as the store's do (`GroupCommit`: one `eai.queue_apply` a
batch) on the store's pool, tried again on a lost connection (`PostgresStore.fetch_json`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
import orjson

from engine.config import EngineConfig
from engine.runtime.broker import delay_queue_names
from engine.runtime.pgstore import GroupCommit, PostgresStore, pg_unavailable
from engine.runtime.store import now_ms
from engine.shell.effects import Unroutable

log = logging.getLogger("engine.pgqueue")

_QUEUE_APPLY = "SELECT eai.queue_apply($1, $2, $3, $4::jsonb, $5)"
#: The longest a due job may wait unseen when every notification is lost (seconds).
POLL_S = 1.0
#: What a claim may take under a prefetch of 0 (RabbitMQ's "no limit").
UNLIMITED = 1 << 20


@dataclass(eq=False)
class Job:
    """A claimed job: what the worker and the shell read of a delivery."""

    id: str
    token: int  # the claim's count of deliveries: its ACK must carry it
    body: bytes
    message_id: str | None
    routing_key: str
    consumer_tag: str
    channel: Any  # the queue it came through (the delivery window keys by it)

    @property
    def redelivered(self) -> bool:
        return self.token > 1


Handler = Callable[[Job], Awaitable[None]]


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


class PgQueue:
    """`Broker`'s methods on PostgreSQL (`store`'s database and pool)."""

    #: Events are rows of the store's database: each rides the store operation whose change
    #: it announces (`engine.shell.effects.Store.event`, migrations 0004 and 0005).
    outbox = True

    def __init__(self, config: EngineConfig, store: PostgresStore) -> None:
        self.config = config
        self.store = store
        self.work_queue_name = config.name("evaluation.execute")
        names = delay_queue_names(config)
        self.delay_queues = {key: name for key, (name, _) in names.items()}
        self._delay_ms = {key: ttl for key, (_, ttl) in names.items()}
        self.declared: list[str] = []  # no topology: rows of the namespace
        self.lease_ms = config.stale_ms
        self.renew_every_s = max(config.heartbeat_ms, 1) / 1000
        self.poll_s = min(POLL_S, self.renew_every_s)
        self.prefetch = 32
        self.worker_id: str | None = None
        self.batch = GroupCommit(self._apply)
        self._private = ""
        self._handlers: dict[str, Handler] = {}
        self._held: dict[str, Job] = {}
        self._wake = asyncio.Event()
        self._consuming = False
        self._tasks: list[asyncio.Task[Any]] = []
        self._handling: set[asyncio.Task[Any]] = set()
        self._listener: asyncpg.Connection | None = None

    async def _apply(self, ops: list[list[Any]]) -> list[Any]:
        payload = orjson.dumps(ops).decode()
        store, ns, lease = self.store, self.store.namespace, self.lease_ms
        return await store.fetch_json(
            _QUEUE_APPLY, lambda now: (store.tenant_id, ns, lease, payload, now)
        )

    # --- connecting ---------------------------------------------------------------------

    async def connect(self, prefetch: int = 32, declare: bool = True) -> None:
        """Nothing to connect or declare: the store's pool carries the queue (its probe
        checked the database); a consumer listens too (`consume_work`)."""
        self.prefetch = prefetch

    async def _listen(self) -> None:
        url, timeout = self.store.url, self.config.connect_timeout_s
        old, self._listener = self._listener, None
        if old is not None:
            old.terminate()
        conn = None
        try:
            conn = await asyncpg.connect(url, timeout=timeout)
            await conn.add_listener("eai_jobs", self._notified)
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            if conn is not None:
                conn.terminate()
            raise pg_unavailable(exc, url, timeout) from None
        self._listener = conn

    def _notified(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        ns, _, due = payload.rpartition(" ")
        if ns != self.store.namespace:
            return
        wait_s = (int(due) - now_ms()) / 1000 if due.lstrip("-").isdigit() else 0
        if wait_s <= 0:
            self._wake.set()
        else:
            asyncio.get_running_loop().call_later(wait_s, self._wake.set)

    async def close(self) -> None:
        await self.stop_consuming()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(listener.close(), self.config.connect_timeout_s)

    async def delete_topology(self, members: Any) -> list[str]:
        return []  # nothing declared: the namespace's jobs go with `purge`

    async def purge(self) -> None:
        """Delete the namespace's jobs and consumers (`engine.submit --purge`)."""
        await self._apply([["purge_jobs"]])

    # --- consuming ----------------------------------------------------------------------

    async def consume_private(self, worker_id: str, handler: Handler) -> str:
        """This worker's own queue (forwards, control): routable from now on, while the
        consumer's row is renewed."""
        self.worker_id = worker_id
        self._private = self.config.name(f"worker.{worker_id}")
        self._handlers["private"] = handler
        await self.batch.call(["renew", worker_id, []])
        self._tasks.append(asyncio.get_running_loop().create_task(self._renewing()))
        return self._private

    async def consume_work(self, handler: Handler) -> str:
        assert self.worker_id is not None, "consume_private first: the claims are its"
        await self._listen()
        self._handlers["work"] = handler
        self._consuming = True
        self._tasks.append(asyncio.get_running_loop().create_task(self._claiming()))
        return self.work_queue_name

    async def stop_consuming(self) -> None:
        """No more claims, and the private queue unroutable (a forward goes elsewhere); the
        jobs held are still this worker's to settle (their claims renewed until `close`)."""
        if not self._consuming:
            return
        self._consuming = False
        self._wake.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                self.batch.call(["deregister", self.worker_id]), self.config.read_timeout_s
            )

    def _free(self) -> tuple[int, int]:
        """What each queue's prefetch leaves: (work, the worker's own); a prefetch of 0 is
        no limit, as RabbitMQ's `basic.qos`."""
        mine = sum(1 for j in self._held.values() if j.consumer_tag == "private")
        prefetch = self.prefetch or UNLIMITED
        return prefetch - (len(self._held) - mine), prefetch - mine

    async def _claiming(self) -> None:
        while self._consuming:
            self._wake.clear()
            wait_s = self.poll_s
            if self._listener is None or self._listener.is_closed():
                with contextlib.suppress(Exception):  # the polling covers its absence
                    await self._listen()
            free, free_mine = self._free()
            if free > 0 or free_mine > 0:
                try:
                    *jobs, due = await self.batch.call(
                        ["claim", self.worker_id, self.work_queue_name, free, free_mine]
                    )
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the database away: the next round tries again
                    log.warning("claiming jobs: %r", exc)
                    jobs, due = [], None
                if not self._consuming:  # stopped meanwhile: they go back
                    for raw in jobs:
                        await self.batch.call(["nack", raw[0], self.worker_id, raw[1]])
                    return
                for raw in jobs:
                    self._deliver(raw)
                if len(jobs) == free + free_mine:
                    wait_s = 0  # there may be more
                elif due is not None:
                    wait_s = min(wait_s, max(0.0, (int(due) - now_ms()) / 1000))
            if wait_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait_s)

    def _deliver(self, raw: list[Any]) -> None:
        job_id, token, message_id, body, queue = raw
        held = self._held.get(job_id)
        if held is not None:  # its own lapsed claim, taken again: the delivery stands
            held.token = int(token)
            return
        private = queue != self.work_queue_name
        job = Job(
            id=job_id,
            token=int(token),
            body=base64.b64decode(body),
            message_id=message_id,
            routing_key=self._private if private else self.work_queue_name,
            consumer_tag="private" if private else "work",
            channel=self,
        )
        self._held[job.id] = job
        task = asyncio.get_running_loop().create_task(self._handlers[job.consumer_tag](job))
        self._handling.add(task)
        task.add_done_callback(self._handling.discard)

    async def _renewing(self) -> None:
        """The consumer's heartbeat: its row, and the claims of the jobs it holds."""
        while True:
            await asyncio.sleep(self.renew_every_s)
            try:
                lost = await self.batch.call(["renew", self.worker_id, list(self._held)])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("renewing claims: %r", exc)
                continue
            for job_id in lost:  # lapsed and claimed by another: as a channel lost
                self._held.pop(job_id, None)

    async def settle(self, job: Job, ack: bool = True) -> bool:
        """ACK or NACK (requeue) a job; False when this claim no longer holds it (its lease
        lapsed and another consumer took it, as a channel lost takes its deliveries)."""
        was_full = len(self._held) >= self.prefetch
        try:
            done = await self.batch.call(
                ["ack" if ack else "nack", job.id, self.worker_id, job.token]
            )
        except Exception as exc:
            log.warning("could not %s a job: %r", "ack" if ack else "nack", exc)
            return False
        finally:
            self._held.pop(job.id, None)
            if was_full:
                self._wake.set()
        return bool(done)

    # --- publishing ---------------------------------------------------------------------

    async def publish_work(self, body: dict[str, Any], message_id: str) -> None:
        await self.publish_work_raw(orjson.dumps(body), message_id)

    async def publish_work_raw(self, raw: bytes, message_id: str | None) -> None:
        await self.batch.call(["publish", self.work_queue_name, message_id, _b64(raw), 0])

    async def publish_retry(
        self, tier: int, bucket: int, body: dict[str, Any], message_id: str
    ) -> None:
        delay = self._delay_ms[(tier, bucket)]
        raw = _b64(orjson.dumps(body))
        await self.batch.call(["publish", self.work_queue_name, message_id, raw, delay])

    async def forward(self, queue_name: str, body: bytes, message_id: str | None) -> None:
        """Hand a message to a worker's private queue; `Unroutable` if that worker does not
        consume (any more)."""
        holder = queue_name.removeprefix(self.config.name("worker."))
        if not await self.batch.call(["forward", holder, message_id, _b64(body)]):
            raise Unroutable(f"unroutable: {queue_name} has no consumer")

    async def publish_event(self, routing_key: str, body: dict[str, Any], message_id: str) -> None:
        await self.batch.call(["event", routing_key, message_id, body])

    async def publish_control(self, body: dict[str, Any]) -> None:
        await self.batch.call(["control", _b64(orjson.dumps(body))])


__all__ = ["POLL_S", "UNLIMITED", "Job", "PgQueue"]
