"""The `pg` design's job queue, simulated: `engine.runtime.pgqueue.PgQueue` on the rows of
`engine/runtime/migrations/0002_eai_jobs.sql`, in the same simulated PostgreSQL as the store.

Why a model of its own: with no broker, the late ACK rests on visibility leases, wake-ups
on NOTIFY, timers and polling, and forwards on a registry of consumers; each has failure
modes RabbitMQ's model (`sim.broker`) does not have, and the simulator must explore them.

`SimJobs` is the tables (`eai.jobs`, `eai.consumers`, the outbox of `eai.run_events`) with
each operation of `eai.queue_apply` as a method, atomic where its request lands, as the
SQL function runs in one transaction:
- claim: up to n jobs of the work queue and of the claimant's own queue `worker.{id}`,
  visible and unclaimed or whose claim lapsed, oldest first; each claim holds a
  visibility lease (`lease_ms` = the engine's `stale_ms`) and counts a delivery (the
  ACK's token; > 1: redelivered); also, a forward to a worker whose consumer row is stale
  is work for anyone, and a control job for one is dropped; the reply ends with when the
  next job not yet visible is due;
- ack deletes the job if this claim (worker and token) still holds it; nack makes it
  visible now; renew stamps the consumer's row and extends the claims it still holds,
  naming those it lost; deregister makes its queue unroutable;
- a delayed retry is a work job visible its tier's TTL later; a forward is a job in
  `worker.{holder}`, refused (`Unroutable`) unless the holder's row was renewed within
  the lease; control is one job per live consumer; events are outbox rows in order.
NOTIFY goes at commit to each LISTEN connection (a worker's through its proxy), with the
PostgreSQL latency; a connection that closes (a kill, a cut link, a timeout toxic) is never
listened on again, as live: then the timer at the next due job and polling wake claims.

`PgQueueClient` is one process's `PgQueue`, with the methods `sim.worker` and `sim.drive`
call on `sim.broker.BrokerClient`. Its operations ride `sim.redis.RedisClient` to the
simulated PostgreSQL (`SimRedis` is the server process: its kills, pauses, epochs), batched
as `GroupCommit` batches them, through the worker's `postgres` link, with the store's
latency and retries: a postgres fault acts on the queue as on the store. A claimed job is a
`sim.broker.Delivery`; its settle is a round trip the step waits for (`sim.drive`).
`PgSimWorker` is a `SimWorker` with this client.

With `lag_s` (PostgreSQL's `synchronous_commit: false`) each transaction keeps the tables
as they were before it for `lag_s`: a kill rolls back those of the last `lag_s`, as
`SimRedis.lose_unreplicated` rolls the store back (the `pg` design leaves it None: the
queue's transactions commit synchronously whatever the role's setting; with an asynchronous
standby it is how far the standby trails, and a failover loses what it lacks:
`chaos.systems.pg.sim`). Not modelled:
sequences rolled back with them (ids are never reused), row locks and SKIP LOCKED (every
operation is atomic, so no claim waits for or skips another), a batch as one transaction
(its operations apply one by one as they land, in order), NOTIFY's de-duplication within
a transaction, and LISTEN's own connect (its registration rides the client's retries).
"""

from __future__ import annotations

import contextlib
import random
from collections import deque
from collections.abc import Callable, Generator
from typing import Any, Protocol

import simpy

from engine.shell.effects import WAIT, Unroutable
from sim.broker import WORK_QUEUE, Connection, Delivery, Message
from sim.network import DOWN, Conn, Link, size_of
from sim.redis import RedisClient, SimRedis
from sim.worker import SimWorker
from sim.world import World

#: A worker's own queue is this and its id.
PRIVATE = "worker."
#: The longest a due job waits unseen when every notification is lost (`pgqueue.POLL_S`).
POLL_S = 1.0
#: What a claim may take under a prefetch of 0 (`pgqueue.UNLIMITED`).
UNLIMITED = 1 << 20
#: What the claims and the outbox reader listen on (`pg_notify`'s channels).
JOBS_CHANNEL = "eai_jobs"
EVENTS_CHANNEL = "eai_events"


class Row:
    """One row of `eai.jobs`: a message (`sim.broker`'s, never changed) and its claim."""

    __slots__ = (
        "claim_until_ms",
        "claimed_by",
        "deliveries",
        "kind",
        "message",
        "queue",
        "seq",
        "visible_ms",
    )

    def __init__(self, seq: int, queue: str, kind: str, message: Message, visible_ms: int) -> None:
        self.seq = seq
        self.queue = queue
        self.kind = kind  # work | control
        self.message = message
        self.visible_ms = visible_ms  # claimable from then on
        self.claimed_by: str | None = None
        self.claim_until_ms = 0  # the claim's lease runs to then
        self.deliveries = 0  # claims so far: the claim's token; > 1 redelivered

    def copy(self) -> Row:
        row = Row(self.seq, self.queue, self.kind, self.message, self.visible_ms)
        row.claimed_by, row.claim_until_ms = self.claimed_by, self.claim_until_ms
        row.deliveries = self.deliveries
        return row


#: The tables a transaction may roll back to: the jobs, the consumers, the outbox's length.
Tables = tuple[dict[int, Row], dict[str, int], int]


class Listener:
    """One LISTEN connection (asyncpg's `add_listener`): notifications come down it in
    order, through the worker's proxy; closed, it hears nothing more (`sim.network.Ends`)."""

    __slots__ = ("channel", "conn", "in_at", "jobs", "on_notify", "open")

    def __init__(
        self, jobs: SimJobs, channel: str, on_notify: Callable[[Any], None], link: Link | None
    ) -> None:
        self.jobs = jobs
        self.channel = channel
        self.on_notify = on_notify
        self.in_at = 0.0
        self.conn: Conn | None = link.open(self) if link is not None else None
        self.open = link is None or self.conn is not None  # None: the proxy refused it

    def close(self) -> None:
        self.open = False
        if self in self.jobs.listeners:
            self.jobs.listeners.remove(self)
        if self.conn is not None:
            self.conn.close("client")

    def client_lost(self, conn: Conn) -> None:
        self.close()

    def server_lost(self, conn: Conn) -> None:
        self.close()

    def silence(self, conn: Conn, stream: str, silent: bool) -> None:
        """asyncpg sends no keepalive: a silent listener just hears nothing."""


class SimJobs:
    """The queue's tables in the simulated PostgreSQL, and `eai.queue_apply`'s operations."""

    def __init__(
        self,
        env: simpy.Environment,
        rng: random.Random,
        latency_s: tuple[float, float],
        lease_ms: int,
    ) -> None:
        self.env = env
        self.rng = rng
        self.latency_s = latency_s  # one way, the server's notifications
        self.lease_ms = lease_ms
        self.jobs: dict[int, Row] = {}  # by seq (the job's id), in insertion order
        self.consumers: dict[str, int] = {}  # worker id -> seen_ms
        self.outbox: list[tuple[int, str, str | None, Any]] = []  # seq, topic, id, data
        self.listeners: list[Listener] = []
        self._job_seq = 0
        self._event_seq = 0
        self.lag_s: float | None = None  # synchronous_commit off: what a kill may lose
        self._recent: deque[tuple[float, Tables]] = deque()
        self._saved = True  # the running transaction's tables are kept already
        self.crashed = False  # killed without a clean shutdown, not restarted yet

    def now_ms(self) -> int:
        """The database's clock (`eai.now_ms()`)."""
        return int(self.env.now * 1000)

    def apply(self, op: str, *args: Any) -> Any:
        """`eai.queue_apply` of one operation: one transaction."""
        self._saved = False
        return getattr(self, op)(*args)

    def _touch(self) -> None:
        """The transaction writes: with `lag_s`, keep the tables as they were before it."""
        if self.lag_s is None or self._saved:
            return
        self._saved = True
        now = self.env.now
        self._recent.append((now, self.tables()))
        while self._recent and self._recent[0][0] < now - self.lag_s:
            self._recent.popleft()

    def tables(self) -> Tables:
        """A copy of the tables as they are, to roll back to."""
        return {s: r.copy() for s, r in self.jobs.items()}, dict(self.consumers), len(self.outbox)

    def lose_since(self, cutoff: float) -> int:
        """A kill lost the commits after `cutoff` (the WAL not flushed): the tables as they
        were before the first of them; how many transactions."""
        lost = [tables for t, tables in self._recent if t > cutoff]
        if lost:
            self.jobs, self.consumers, kept = lost[0]
            del self.outbox[kept:]
        self._recent.clear()
        return len(lost)

    def kill(self, crash: bool = True) -> None:
        """The server dies (`crash`: SIGKILL; else a clean shutdown): every LISTEN
        connection with it."""
        self.crashed = crash
        for listener in list(self.listeners):
            listener.close()

    def restart(self) -> None:
        """The server back. After a crash its recovery replays the WAL, and every table of
        the queue is logged: each committed row is back as it was (with `lag_s`,
        `lose_since` takes the commits not flushed), so there is nothing to undo here (an
        unlogged `eai.jobs` would be emptied: `chaos.insim.mutants`' `pg_jobs_unlogged`)."""
        self.crashed = False

    def _consumes(self, worker: str, now: int) -> bool:
        """`eai._consumes`: the worker's row renewed within the lease."""
        seen = self.consumers.get(worker)
        return seen is not None and seen >= now - self.lease_ms

    def _insert(self, queue: str, kind: str, body: Any, message_id: str | None, at: int) -> None:
        self._touch()
        self._job_seq += 1
        message = Message(body, message_id, queue)
        self.jobs[self._job_seq] = Row(self._job_seq, queue, kind, message, at)

    def notify(self, channel: str, payload: Any) -> None:
        """`pg_notify` at commit: to each listener of `channel`, one way down its link."""
        env, lo, hi = self.env, *self.latency_s
        for listener in self.listeners:
            if listener.channel != channel:
                continue
            at: float | None = env.now + self.rng.uniform(lo, hi)
            conn = listener.conn
            if conn is not None and not conn.link.calm:
                at = conn.pass_(DOWN, size_of(payload), at)  # type: ignore[arg-type]
            if at is None:
                continue  # lost in the proxy
            at = listener.in_at = max(at, listener.in_at)

            def hear(_: simpy.Event, listener: Listener = listener) -> None:
                if listener.open:
                    listener.on_notify(payload)

            env.timeout(at - env.now).callbacks.append(hear)

    # --- eai.queue_apply's operations ------------------------------------------------------

    def listen(self, listener: Listener) -> bool:
        """LISTEN on the listener's connection (still open)."""
        if listener.open and listener not in self.listeners:
            self.listeners.append(listener)
        return listener.open

    def publish(self, queue: str, message_id: str | None, body: Any, delay_ms: int) -> bool:
        """`eai.job_publish`: a work job, visible `delay_ms` from now."""
        visible = self.now_ms() + delay_ms
        self._insert(queue, "work", body, message_id, visible)
        self.notify(JOBS_CHANNEL, visible)
        return True

    def claim(self, me: str, n: int, n_mine: int) -> list[Any]:
        """`eai.job_claim`: [(seq, token, message, queue)..., next due ms or None]; up to
        `n` of the work queue (and dead consumers' forwards), `n_mine` of its own."""
        now, mine = self.now_ms(), PRIVATE + me
        for seq, row in list(self.jobs.items()):  # control jobs of dead consumers go
            if (
                row.kind == "control"
                and row.queue != mine
                and row.claimed_by is None
                and not self._consumes(row.queue[len(PRIVATE) :], now)
            ):
                self._touch()
                del self.jobs[seq]
        ready = sorted(
            (r for r in self.jobs.values() if self._claimable(r, me, now)),
            key=lambda r: (r.visible_ms, r.seq),
        )
        picked = [r for r in ready if r.queue != mine][:n] + [r for r in ready if r.queue == mine][
            :n_mine
        ]
        picked.sort(key=lambda r: (r.visible_ms, r.seq))
        for row in picked:
            self._touch()
            row.claimed_by, row.claim_until_ms = me, now + self.lease_ms
            row.deliveries += 1
        later = [
            r.visible_ms
            for r in self.jobs.values()
            if r.visible_ms > now and r.queue in (WORK_QUEUE, mine)
        ]
        return [(r.seq, r.deliveries, r.message, r.queue) for r in picked] + [
            min(later) if later else None
        ]

    def _claimable(self, row: Row, me: str, now: int) -> bool:
        """Visible, not held by a claim that runs, and ours to take."""
        if row.visible_ms > now or (row.claimed_by is not None and row.claim_until_ms >= now):
            return False
        return row.queue in (WORK_QUEUE, PRIVATE + me) or (
            row.kind == "work" and not self._consumes(row.queue[len(PRIVATE) :], now)
        )

    def _held(self, seq: int, me: str, token: int) -> Row | None:
        row = self.jobs.get(seq)
        return row if row is not None and row.claimed_by == me and row.deliveries == token else None

    def ack(self, seq: int, me: str, token: int) -> bool:
        """`eai.job_ack`: gone, if this claim still holds it."""
        if self._held(seq, me, token) is None:
            return False
        self._touch()
        del self.jobs[seq]
        return True

    def nack(self, seq: int, me: str, token: int) -> bool:
        """`eai.job_nack`: visible again at once, for anyone."""
        row = self._held(seq, me, token)
        if row is None:
            return False
        self._touch()
        now = self.now_ms()
        row.claimed_by = None
        row.visible_ms = now
        self.notify(JOBS_CHANNEL, now)
        return True

    def renew(self, me: str, ids: list[int]) -> list[int]:
        """`eai.job_renew`: the consumer's row stamped, the claims it holds extended; the
        ids it holds no more."""
        self._touch()
        now = self.now_ms()
        self.consumers[me] = now
        lost = []
        for seq in ids:
            row = self.jobs.get(seq)
            if row is not None and row.claimed_by == me:
                row.claim_until_ms = now + self.lease_ms
            else:
                lost.append(seq)
        return lost

    def deregister(self, me: str) -> bool:
        """`eai.job_deregister`: its queue unroutable from now on."""
        self._touch()
        self.consumers.pop(me, None)
        return True

    def forward(self, holder: str, message_id: str | None, body: Any) -> bool:
        """`eai.job_forward`: into the holder's queue, if it consumes; False: unroutable."""
        if not self._consumes(holder, self.now_ms()):
            return False
        return self.publish(PRIVATE + holder, message_id, body, 0)

    def control(self, body: Any) -> int:
        """`eai.job_control`: a job for each live consumer; how many."""
        now = self.now_ms()
        alive = [w for w in self.consumers if self._consumes(w, now)]
        for worker in alive:
            self._insert(PRIVATE + worker, "control", body, None, now)
        self.notify(JOBS_CHANNEL, now)
        return len(alive)

    def event(self, topic: str, message_id: str | None, data: Any) -> bool:
        """`eai.event_publish`: an outbox row, in order."""
        self._touch()
        self._event_seq += 1
        self.outbox.append((self._event_seq, topic, message_id, data))
        self.notify(EVENTS_CHANNEL, None)
        return True

    def events_after(
        self, after: int, topics: tuple[str, ...], limit: int
    ) -> list[tuple[int, str, str | None, Any]]:
        """The outbox after seq `after`, in order (the harness's reader)."""
        rows = [e for e in self.outbox if e[0] > after and e[1] in topics]
        return rows[:limit]

    def drain(self) -> list[str]:
        """The harness's end: the work jobs left, deleted; their message ids."""
        left = [seq for seq, row in self.jobs.items() if row.kind == "work"]
        if left:
            self._touch()
        return sorted(str(self.jobs.pop(seq).message.message_id) for seq in left)


class _Wake:
    """asyncio.Event for the one claim loop that waits on it."""

    __slots__ = ("_waiter", "env", "is_set")

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.is_set = False
        self._waiter: simpy.Event | None = None

    def set(self, _: Any = None) -> None:
        self.is_set = True
        if self._waiter is not None and not self._waiter.triggered:
            self._waiter.succeed()

    def clear(self) -> None:
        self.is_set = False

    def wait(self) -> simpy.Event:
        self._waiter = self.env.event()
        if self.is_set:
            self._waiter.succeed()
        return self._waiter


class Claimed(Delivery):
    """A claimed job as a worker sees a delivery: `tag` is the claim's token."""

    __slots__ = ("job",)

    def __init__(
        self, channel: Connection, token: int, message: Message, queue: str, job: int
    ) -> None:
        super().__init__(channel, token, message, queue)
        self.job = job
        self.redelivered = token > 1


class PgQueueClient:
    """One process's `PgQueue` (see the module docstring)."""

    #: An event with a flag is written in its flag's transaction (`sim.drive`).
    outbox = True

    def __init__(
        self,
        env: simpy.Environment,
        server: SimRedis,
        jobs: SimJobs,
        rng: random.Random,
        latency_s: tuple[float, float],
        name: str,
        *,
        delays_ms: dict[tuple[int, int], int],
        renew_every_s: float,
        spawn: Callable[[Generator], Any],
        link: Link | None = None,
        read_timeout_s: float = 30.0,
    ) -> None:
        self.env = env
        self.jobs = jobs
        self.name = name  # the worker's id: the claims are its
        self.link = link
        self.db = RedisClient(env, server, rng, latency_s, link=link, read_timeout_s=read_timeout_s)
        self.delays_ms = delays_ms  # (tier, bucket) -> its TTL, as `delay_queue_names`
        self.renew_every_s = renew_every_s
        self.poll_s = min(POLL_S, renew_every_s)
        self.read_timeout_s = read_timeout_s
        self._spawn = spawn
        self.channel = Connection(name, None)  # the consumers' identity (the window's)
        self.prefetch = 32
        self._private = ""
        self._handlers: dict[str, Callable[[Delivery], None]] = {}
        self._held: dict[int, Claimed] = {}
        self._wake = _Wake(env)
        self._consuming = False
        self._procs: list[Any] = []
        self._listener: Listener | None = None

    def _call(self, op: str, *args: Any) -> Generator[Any, Any, Any]:
        """One operation through the queue's `GroupCommit` (one batch in flight)."""
        return self.db.call(self.jobs.apply, op, *args, batched=True)

    # --- connecting --------------------------------------------------------------------------

    def connect(self) -> Generator[Any, Any, bool]:
        """Nothing to connect: the store's pool carries the queue."""
        return True
        yield  # a generator, as `BrokerClient.connect`

    def close_now(self) -> None:
        """The process died: its sockets go; what it sent still lands."""
        self.channel.open = False
        self._consuming = False
        self.db.hang_up()
        if self._listener is not None and self._listener.conn is not None:
            self._listener.conn.discard()

    def close(self) -> Generator[Any, Any, None]:
        """`PgQueue.close`: consuming stops, the loops end, the listener closes."""
        yield from self.stop_consuming()
        for proc in self._procs:
            if proc is not None and proc.is_alive and proc is not self.env.active_process:
                proc.interrupt()
        self._procs = []
        if self._listener is not None:
            self._listener.close()
        self.channel.open = False

    # --- consuming ---------------------------------------------------------------------------

    def consume_private(
        self, queue: str, prefetch: int, handler: Callable[[Delivery], None]
    ) -> Generator[Any, Any, None]:
        """Its own queue: routable from now on, while the renewals stamp its row."""
        self.prefetch = prefetch
        self._private = queue
        self._handlers["private"] = handler
        yield from self._call("renew", self.name, [])
        self._procs.append(self._spawn(self._renewing()))

    def consume(
        self, queue: str, prefetch: int, handler: Callable[[Delivery], None]
    ) -> Generator[Any, Any, None]:
        """The work queue: LISTEN, then the claim loop."""
        yield from self._listen()
        self._handlers["work"] = handler
        self._consuming = True
        self._procs.append(self._spawn(self._claiming()))

    def _notified(self, due: Any) -> None:
        wait_s = (int(due) - self.jobs.now_ms()) / 1000
        if wait_s <= 0:
            self._wake.set()
        else:
            self.env.timeout(wait_s).callbacks.append(self._wake.set)

    def stop_consuming(self) -> Generator[Any, Any, None]:
        """No more claims, the private queue unroutable; what it holds is still its own to
        settle. The deregistration waits `read_timeout_s` at most."""
        if not self._consuming:
            return
        self._consuming = False
        self._wake.set()
        proc = self._spawn(self._call("deregister", self.name))
        if proc is not None:
            yield proc | self.env.timeout(self.read_timeout_s)
            if proc.is_alive:
                proc.interrupt()

    def _free(self) -> tuple[int, int]:
        """What each queue's prefetch leaves: (work, its own); 0 is no limit."""
        mine = sum(1 for d in self._held.values() if d.queue == self._private)
        prefetch = self.prefetch or UNLIMITED
        return prefetch - (len(self._held) - mine), prefetch - mine

    def _listen(self) -> Generator[Any, Any, None]:
        """LISTEN on a connection of its own (again, once the last one is gone)."""
        listener = Listener(self.jobs, JOBS_CHANNEL, self._notified, self.link)
        if not listener.open:
            raise ConnectionError("LISTEN: the connection was refused (simulated)")
        self._listener = listener
        yield from self.db.call(self.jobs.listen, listener)

    def _claiming(self) -> Generator[Any, Any, None]:
        env = self.env
        while self._consuming:
            self._wake.clear()
            wait_s = self.poll_s
            if self._listener is None or not self._listener.open:
                with contextlib.suppress(ConnectionError):  # the polling covers its absence
                    yield from self._listen()
            free, free_mine = self._free()
            if free > 0 or free_mine > 0:
                try:
                    *jobs, due = yield from self._call("claim", self.name, free, free_mine)
                except ConnectionError:  # the database away: the next round tries again
                    jobs, due = [], None
                if not self._consuming:  # stopped meanwhile: they go back
                    for seq, token, *_ in jobs:
                        yield from self._call("nack", seq, self.name, token)
                    return
                for raw in jobs:
                    self._deliver(*raw)
                if len(jobs) == free + free_mine:
                    wait_s = 0  # there may be more
                elif due is not None:
                    wait_s = min(wait_s, max(0.0, (due - self.jobs.now_ms()) / 1000))
            if wait_s > 0:
                yield self._wake.wait() | env.timeout(wait_s)

    def _deliver(self, seq: int, token: int, message: Message, queue: str) -> None:
        held = self._held.get(seq)
        if held is not None:  # its own lapsed claim, taken again: the delivery stands
            held.tag = token
            return
        private = queue != WORK_QUEUE
        d = Claimed(self.channel, token, message, self._private if private else queue, seq)
        self._held[seq] = d
        self._handlers["private" if private else "work"](d)

    def _renewing(self) -> Generator[Any, Any, None]:
        """The consumer's heartbeat: its row, and the claims of the jobs it holds."""
        while True:
            yield self.env.timeout(self.renew_every_s)
            try:
                lost = yield from self._call("renew", self.name, list(self._held))
            except ConnectionError:
                continue
            for seq in lost:  # lapsed and claimed by another: as a channel lost
                self._held.pop(seq, None)

    def settle(self, d: Delivery, *, ack: bool = True) -> object:
        """A round trip: the step waits for it (`settle_later`)."""
        return WAIT

    def settle_later(self, d: Claimed, *, ack: bool = True) -> Generator[Any, Any, bool]:
        """ACK or NACK; False when this claim no longer holds the job."""
        was_full = len(self._held) >= self.prefetch
        try:
            done = yield from self._call("ack" if ack else "nack", d.job, self.name, d.tag)
        except ConnectionError:
            return False
        finally:
            self._held.pop(d.job, None)
            if was_full:
                self._wake.set()
        return bool(done)

    # --- publishing --------------------------------------------------------------------------

    def publish_work(self, body: Any, message_id: str | None) -> Generator[Any, Any, Any]:
        return self._call("publish", WORK_QUEUE, message_id, body, 0)

    def publish_retry(
        self, tier: int, bucket: int, body: dict[str, Any], message_id: str
    ) -> Generator[Any, Any, Any]:
        delay = self.delays_ms[(tier, bucket)]  # KeyError, as live, for one not declared
        return self._call("publish", WORK_QUEUE, message_id, body, delay)

    def forward(self, queue: str, body: Any, message_id: str | None) -> Generator[Any, Any, None]:
        """Into a worker's queue; `Unroutable` if that worker does not consume (any more)."""
        if not (yield from self._call("forward", queue.removeprefix(PRIVATE), message_id, body)):
            raise Unroutable(f"unroutable: {queue} has no consumer")

    def publish_event(
        self, routing_key: str, body: dict[str, Any], message_id: str
    ) -> Generator[Any, Any, Any]:
        return self._call("event", routing_key, message_id, body)

    def publish_control(self, body: dict[str, Any]) -> Generator[Any, Any, Any]:
        return self._call("control", body)


class PgWorld(World, Protocol):
    """A world whose first memory is PostgreSQL's job rows."""

    jobs: SimJobs
    delays_ms: dict[tuple[int, int], int]


class PgSimWorker(SimWorker):
    """A `pg` worker: `SimWorker` with the job queue for its first memory."""

    run: PgWorld

    def first_memory(self) -> PgQueueClient:  # type: ignore[override]
        run = self.run
        return PgQueueClient(
            self.env,
            run.redis,
            run.jobs,
            run.net_rng,
            run.options.redis_latency_s,
            self.worker_id,
            delays_ms=run.delays_ms,
            renew_every_s=max(self.config.heartbeat_ms, 1) / 1000,
            spawn=self.spawn,
            link=run.network.link(self.index, run.store_link),
            read_timeout_s=self.config.read_timeout_s,
        )

    def subscribe(self) -> Generator[Any, Any, None]:
        """`consume_private` (a renewal), then `consume_work` (LISTEN, the claim loop)."""
        prefetch = self.config.prefetch
        queue = self.broker
        assert isinstance(queue, PgQueueClient)
        yield from queue.consume_private(f"{PRIVATE}{self.worker_id}", prefetch, self.on_message)
        yield from queue.consume(WORK_QUEUE, prefetch, self.on_message)
