"""`pg` simulated: the same shell on PostgreSQL alone, store and job queue in one database.

What differs from `pg-store` (whose store model, timing, lost commits, service acts and final
state this design shares): the workers are `sim.pgqueue.PgSimWorker`s, whose first memory is
the job rows of `sim.pgqueue.SimJobs` in the same simulated PostgreSQL (`SimRedis` is that
server process: a kill, a pause, a restart or a cut `postgres` link acts on the queue as on
the store), with no broker; the runner publishes, cancels and broadcasts through a
`PgQueueClient` of its own; its consumer of the events reads the outbox in order of `seq`
(woken by NOTIFY, polling as the fallback), as `chaos.systems.pg.live` does, and records
each event as the RabbitMQ consumer records a delivery; at the end it takes the work jobs
left (`queues_drained`). The `SimBroker` the parent class builds stays idle: nothing
connects to it.

With `postgres.standby` the server is a `Primary` streaming to a standby, as
`chaos.systems.pg.live` runs one: the store's data and the queue's rows are one database,
so the standby lacks the same commits of both. Asynchronous, it trails by `REPLAY_LAG_S`
(`SimRedis.lag_s` and `SimJobs.lag_s`); a `cut_link` on `replication` stops it
(`SimRedis.unreplicated_since`, the queue keeping every commit since), and the primary goes
on acknowledging. Synchronous (remote_apply), a transaction that wrote waits for its reply
while the link is cut, invisible to the others, until the link is back (it commits then, in
the order they came) or the primary dies (gone, never acknowledged); one that only read is
answered at once. A kill of `postgres` is a failover: the primary dies (its kill record
counts the commits the standby lacked, `unreplicated_commits`), those commits are gone, and
`PROMOTE_S` later the promoted standby serves; the workers' connections failed with the
primary and come back to it as after a restart. The failover's record counts, as live
does, the results the history shows persisted that the promoted standby lacks
(`lost_writes`, `lost_results`). The killed primary never comes back (a restart of it does
nothing, as live), and the promoted standby has no standby of its own. Not modelled: a
synchronous commit's extra round trip to the standby while its link is up (live about 1.5x
an asynchronous one's latency on loopback), and row locks a waiting transaction holds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import orjson
import simpy

from chaos import acts
from chaos.conductor import EVENT_KEYS, RECEIVED_AS, delivered
from chaos.insim.quiet import quiet
from chaos.links import REPLICATION
from chaos.systems.pg.live import DURABLE, EVENTS_POLL_S, OUTBOX, persisted_results
from chaos.systems.pg_store.live import READ_TIMEOUT_S
from chaos.systems.pg_store.sim import PgStoreSim
from engine.core.messages import SUBMIT_REASON
from engine.core.states import EvaluationStatus
from engine.keys import result_key
from engine.shell.orchestrator import completed_event
from sim.pgqueue import EVENTS_CHANNEL, Listener, PgQueueClient, PgSimWorker, SimJobs, Tables
from sim.redis import RedisClient, SimRedis, announcing

if TYPE_CHECKING:
    from chaos.insim.run import SimRun

#: The outbox rows the reader takes at a time (`PgLive._consume_events`'s LIMIT).
EVENTS_BATCH = 500
#: How far an asynchronous standby on loopback trails its primary (seconds): a commit is
#: acknowledged before its WAL is streamed and replayed there. An assumption, not a measure:
#: live, a kill with no cut lost next to nothing (`tests/live/test_pg_standby_live.py`).
REPLAY_LAG_S = 0.001
#: From the primary's death until the promoted standby takes writes (seconds): live,
#: `PostgresPair.promote` (`pg_ctl promote --wait`) took about 0.14 s on loopback.
PROMOTE_S = 0.14

#: A request the synchronous primary holds: the operation, its arguments, its reply's path.
Held = tuple[Callable[..., Any], tuple[Any, ...], Callable[[Any, bool], None]]


class StandbyJobs(SimJobs):
    """The queue's tables on a primary with a standby: a transaction can be tried and
    undone (`Primary.serve`: whether it writes, so whether it waits), its notifications
    held back meanwhile (they go at commit)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._trying = False
        self._before: Tables | None = None  # the tables before the tried transaction wrote

    def trying(self) -> None:
        self._trying, self._before = True, None

    def tried(self) -> bool:
        """Whether the transaction tried wrote; if it did, it is undone."""
        self._trying = False
        before, self._before = self._before, None
        if before is None:
            return False
        self.jobs, self.consumers, kept = before
        del self.outbox[kept:]
        return True

    def _touch(self) -> None:
        if not self._trying:
            super()._touch()
        elif self._before is None:
            self._before = self.tables()

    def notify(self, channel: str, payload: Any) -> None:
        if not self._trying:
            super().notify(channel, payload)


class Primary(SimRedis):
    """The store's server with a streaming standby (see the module docstring): asynchronous
    through `SimRedis`'s own replica model (`lag_s`, `unreplicated_since`,
    `lose_unreplicated`); synchronous and cut off (`holding`), it holds what writes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.jobs: StandbyJobs | None = None  # the queue's tables, in the same database
        self.holding: list[Held] | None = None  # synchronous, its standby cut off: waiting
        self._released: simpy.Event | None = None  # fires when what waits is answered or gone

    def synced(self) -> None:
        """A synchronous local commit: its WAL is flushed here, which sends none of it to
        the standby (what a failover keeps is the standby's)."""

    def serve(
        self, fn: Callable[..., Any], args: tuple[Any, ...], done: Callable[[Any, bool], None]
    ) -> simpy.Event | None:
        """`SimRedis.serve`; synchronous and cut off, a transaction that wrote waits (the
        event returned fires when it is answered, or lost with the primary)."""
        if self.holding is None or self.paused:
            return super().serve(fn, args, done)
        value, wrote = self._try(fn, args)
        if not wrote:  # no xid: PostgreSQL commits it without waiting for the standby
            done(value, False)
            return None
        self.holding.append((fn, args, done))
        if self._released is None:
            self._released = self.env.event()
        return self._released

    def _try(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, bool]:
        """`fn` applied and, if it wrote, undone: (its reply, whether it wrote). A key
        dropped because its TTL had run out is no write (Redis's lazy expiry, not SQL's)."""
        jobs = self.jobs
        self._op = {}
        if jobs is not None:
            jobs.trying()
        try:
            value = fn(*args)
        finally:
            touched, self._op = self._op, None
            self._synced = False
            queue_wrote = jobs is not None and jobs.tried()
        now = self.env.now
        wrote = queue_wrote or any(
            exp is None or exp >= now or key in self.data for key, (_, exp) in touched.items()
        )
        if wrote:
            for key, (old, exp) in touched.items():
                self._restore(key, old, exp)
        return value, wrote

    def standby_cut(self) -> None:
        """The synchronous standby cut off: from now on what writes waits."""
        if self.holding is None:
            self.holding = []

    def standby_back(self) -> None:
        """The standby back: what waited commits, in the order it came, and is answered."""
        held, self.holding = self.holding or [], None
        for fn, args, done in held:
            done(self.apply(fn, args), False)
        self._let_go()

    def waiting(self) -> int:
        """How many transactions wait for the standby."""
        return len(self.holding or ())

    def _let_go(self) -> None:
        released, self._released = self._released, None
        if released is not None:
            released.succeed()

    def kill(self) -> None:
        """What waited for the standby dies with the primary, never committed there."""
        super().kill()
        if self.holding:
            self.holding = []
        self._let_go()

    def promoted(self) -> None:
        """The promoted standby: no standby of its own, nothing to wait for or to lose."""
        self.lag_s = None
        self.unreplicated_since = None
        self.holding = None


class PgSim(PgStoreSim):
    """The design's side of one simulated run (`chaos.systems.seam.SimSystem`), and the world
    of its workers (`sim.pgqueue.PgWorld`)."""

    def __init__(self, run: SimRun) -> None:
        #: "async" or "sync" (`postgres.standby`); None: no standby
        self.standby = None if run.spec.postgres.standby == "none" else run.spec.postgres.standby
        if self.standby is not None:
            self.server = Primary
        super().__init__(run)
        config = self.config
        #: (tier, bucket) -> its TTL (ms), as `engine.runtime.broker.delay_queue_names`
        self.delays_ms = {
            (tier, bucket): max(1, round(ms * config.time_scale))
            for tier, bucket, ms in config.policy.delay_queues()
        }
        tables = SimJobs if self.standby is None else StandbyJobs
        self.jobs = tables(self.env, self.net_rng, self.options.redis_latency_s, config.stale_ms)
        # The queue's transactions commit synchronously whatever the role's setting
        # (`eai.queue_apply`): a kill loses none of them (`jobs.lag_s` stays None, but for
        # what an asynchronous standby lacks)
        self._queue: PgQueueClient | None = None  # the runner's, as `EngineClient`
        self._reader: simpy.Process | None = None  # the consumer of the outbox
        #: The server streaming to the standby (None: no standby, or promoted over)
        self.primary: Primary | None = None
        self._old_primary_down = False  # killed and failed over: its restart does nothing
        if isinstance(self.redis, Primary) and isinstance(self.jobs, StandbyJobs):
            self.primary = self.redis
            self.primary.jobs = self.jobs
            if self.standby == "async":  # what a failover may lose, of both
                self.redis.lag_s = self.jobs.lag_s = REPLAY_LAG_S

    def worker(self, index: int, incarnation: int, failpoints: str) -> PgSimWorker:
        config = dataclasses.replace(self.config)  # each process parses its own, as live
        return PgSimWorker(self, index, incarnation, failpoints, self.run.agent(), config)

    def extra(self) -> dict[str, Any]:
        return {}

    def client(self, name: str) -> PgQueueClient:
        """A runner's `PgQueue`, around the proxies as the live runner's clients are."""
        return PgQueueClient(
            self.env,
            self.redis,
            self.jobs,
            self.net_rng,
            self.options.redis_latency_s,
            name,
            delays_ms=self.delays_ms,
            renew_every_s=max(self.config.heartbeat_ms, 1) / 1000,
            spawn=lambda gen: self.env.process(quiet(gen)),
            read_timeout_s=READ_TIMEOUT_S,
        )

    # --- the services -----------------------------------------------------------------------

    def on_kill_service(self, a: acts.KillService) -> dict[str, Any]:
        """PostgreSQL dies with every connection: the listeners too (none listens again).
        It held `messages` jobs (`nothing_lost_on_restart` counts them again at the restart,
        as the simulated RabbitMQ's). With a standby: a failover (`_fail_over`)."""
        if self.primary is not None and a.name == self.store_service:
            return self._fail_over()
        self.jobs.kill(crash=not a.graceful)
        return {**super().on_kill_service(a), "messages": len(self.jobs.jobs)}

    def _fail_over(self) -> dict[str, Any]:
        """The primary SIGKILLed (a clean stop too, as live) with what its standby lacked:
        asynchronous, the commits since the cut (or in the last `REPLAY_LAG_S`), which go;
        synchronous, the transactions waiting for it, never committed. The promotion follows
        (`on_await_failover`)."""
        primary, jobs = self.primary, self.jobs
        assert primary is not None
        died = self.env.now
        if self.standby == "async":
            since = primary.unreplicated_since
            cutoff = (died if since is None else min(since, died)) - REPLAY_LAG_S
            lacked = primary.lose_unreplicated(died) + jobs.lose_since(cutoff)
        else:
            lacked = primary.waiting()
        primary.kill()
        jobs.kill(crash=True)
        primary.promoted()
        jobs.lag_s = None
        self.primary = None
        self._old_primary_down = True
        return {acts.FAILS_OVER: True, "unreplicated_commits": lacked}

    def on_await_failover(
        self, a: acts.AwaitFailover
    ) -> Generator[Any, Any, bool | dict[str, Any]]:
        """The standby promoted `PROMOTE_S` after the kill; the results the history shows
        persisted that it lacks counted before any worker reaches it (as
        `PgLive._lost_results`); then it serves, and the workers' retries find it."""
        yield self.env.timeout(PROMOTE_S)
        redis = self.redis
        lost = [
            [attempt_id, rule_id]
            for attempt_id, rule_id in persisted_results(self.events)
            if redis.get(result_key(attempt_id, rule_id)) is None
        ]
        redis.restart()
        self.jobs.restart()
        return {"promoted": True, "lost_writes": len(lost), "lost_results": lost}

    def on_restart_service(self, a: acts.RestartService) -> Generator[Any, Any, dict[str, Any]]:
        """The primary failed over from stays down (the promoted standby serves), as live."""
        if self._old_primary_down and a.name == self.store_service:
            self._old_primary_down = False
            return {}
        return (yield from super().on_restart_service(a))

    def set_own_link(self, link: str, cut: bool) -> bool:
        """The standby's link to the primary (the run's replication proxy, live): cut, an
        asynchronous standby stops receiving, a synchronous one holds every commit back."""
        if link != REPLICATION:
            return False
        self._replicating(not cut)
        return True

    def heal_links(self) -> None:
        self._replicating(True)

    def _replicating(self, on: bool) -> None:
        """The standby streams (`on`) or is cut off; after a failover nothing does (the link
        led to the dead primary)."""
        primary = self.primary
        if primary is None:
            return
        if self.standby == "sync" and on:
            primary.standby_back()
        elif self.standby == "sync":
            primary.standby_cut()
        elif on:  # it catches up
            primary.unreplicated_since = None
            self.jobs.lag_s = REPLAY_LAG_S
        elif primary.unreplicated_since is None:  # every commit from now on is losable
            primary.unreplicated_since = self.env.now
            self.jobs.lag_s = math.inf

    def _store_back(self) -> dict[str, Any]:
        """The store loses its last commits without synchronous commits, the queue none
        (its own are synchronous, its table logged); the jobs it found (`messages`)."""
        back = super()._store_back()
        self.jobs.restart()
        return {**back, "messages": len(self.jobs.jobs)}

    # --- the runner's client ------------------------------------------------------------------

    def on_connect(self, a: acts.Connect) -> Generator[Any, Any, None]:
        """`EngineClient`'s probe: PostgreSQL answers (waiting for it while it does not)."""
        while True:
            try:
                yield from self.store.call(self.redis.ping)
                break
            except ConnectionError:
                yield self.env.timeout(self.options.reconnect_interval_s)
        self._queue = self.client("runner")

    def on_disconnect(self, a: acts.Disconnect) -> Generator[Any, Any, None]:
        if self._queue is not None:
            yield from self._queue.close()

    def on_submit(self, a: acts.Submit) -> Generator[Any, Any, None]:
        assert self._queue is not None
        body = {
            "type": "execute",
            "attempt_id": a.attempt_id,
            "plan": a.plan,  # the live job carries plan.to_dict(); the sim, the plan
            "reason": SUBMIT_REASON,
            "published_ms": int(self.env.now * 1000),
        }
        yield from self._queue.publish_work(body, a.attempt_id)

    def on_cancel(self, a: acts.Cancel) -> Generator[Any, Any, str]:
        """`EngineClient.cancel`, on a client of its own."""
        attempt_id = a.attempt_id
        queue = self.client("runner-cancel")
        # the cancel's evaluation.completed is a row of set_state's transaction, if it wins
        event = completed_event(attempt_id, EvaluationStatus.CANCELLED.value, {})
        cancel = announcing(self.redis, self.jobs, "set_state", self.redis.set_state, event)
        kept = yield from self.store.call(cancel, attempt_id, EvaluationStatus.CANCELLED.value)
        if kept is None:
            yield from self.store.call(self.redis.done, attempt_id, "")
            yield from queue.publish_control({"type": "cancel", "attempt_id": attempt_id})
        return kept or EvaluationStatus.CANCELLED.value

    def publish_as_runner(self, body: Any, message_id: str, name: str) -> Generator[Any, Any, None]:
        """Work published by the runner, as a job (a resume's, `PgStoreSim.on_resume`)."""
        yield from self.client(name).publish_work(body, message_id)

    # --- the harness's consumer of the events: the outbox -------------------------------------

    def on_bind_consumer(self, a: acts.BindConsumer) -> None:
        """Before the first submit: read the outbox from its start, in order, each event once
        (the cursor is the last `seq` read), through restarts of PostgreSQL."""
        for key in EVENT_KEYS:
            self.runner.record("events_consumer_bound", queue=OUTBOX, routing_key=key)
        self._reader = self.env.process(quiet(self._read_events()))

    def _read_events(self) -> Generator[Any, Any, None]:
        """`PgLive._consume_events`: a read of what follows the cursor, then a wait for a
        notification or `EVENTS_POLL_S`; a connection lost is made again, listening anew."""
        env, jobs = self.env, self.jobs
        reader = RedisClient(
            env,
            self.redis,
            self.net_rng,
            self.options.redis_latency_s,
            read_timeout_s=READ_TIMEOUT_S,
        )
        woken = env.event()

        def wake(_: Any) -> None:
            if not woken.triggered:
                woken.succeed()

        listener: Listener | None = None
        after = 0
        while True:
            if woken.triggered:  # before the read: a notification during it wakes the wait
                woken = env.event()
            rows: list[Any] = []
            try:
                if listener is None or not listener.open:
                    listener = Listener(jobs, EVENTS_CHANNEL, wake, None)
                    yield from reader.call(jobs.listen, listener)
                rows = yield from reader.call(jobs.events_after, after, EVENT_KEYS, EVENTS_BATCH)
            except ConnectionError:
                listener = None
            for seq, topic, message_id, data in rows:
                after = seq
                self._received(topic, message_id, data)
            if len(rows) < EVENTS_BATCH:
                yield woken | env.timeout(EVENTS_POLL_S)

    def _received(self, topic: str, message_id: str | None, data: Any) -> None:
        body = orjson.loads(orjson.dumps(data))  # a copy, as JSON carries it
        ev = RECEIVED_AS.get(topic, "completed_received")
        self.runner.record(ev, **delivered(body, message_id, False, DURABLE))
        if ev == "completed_received" and isinstance(body, dict):
            self.run.received.add(str(body.get("attempt_id")))

    def on_close_consumer(self, a: acts.CloseConsumer) -> None:
        """Stop reading; at the end of a run (the workers stopped), take the work jobs the
        queue still holds (`queues_drained`), while PostgreSQL answers."""
        reader, self._reader = self._reader, None
        if reader is not None and reader.is_alive:
            reader.interrupt()
        if self.redis.up and not self.redis.paused:
            left = self.jobs.apply("drain")
            self.runner.record("queues_drained", message_ids=left)
