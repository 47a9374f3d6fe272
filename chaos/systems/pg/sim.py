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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import orjson
import simpy

from chaos import acts
from chaos.conductor import EVENT_KEYS, RECEIVED_AS, delivered
from chaos.insim.quiet import quiet
from chaos.systems.pg.live import DURABLE, EVENTS_POLL_S, OUTBOX
from chaos.systems.pg_store.live import READ_TIMEOUT_S
from chaos.systems.pg_store.sim import PgStoreSim
from engine.core.messages import SUBMIT_REASON
from engine.core.states import EvaluationStatus
from sim.pgqueue import EVENTS_CHANNEL, Listener, PgQueueClient, PgSimWorker, SimJobs
from sim.redis import RedisClient

if TYPE_CHECKING:
    from chaos.insim.run import SimRun

#: The outbox rows the reader takes at a time (`PgLive._consume_events`'s LIMIT).
EVENTS_BATCH = 500


class PgSim(PgStoreSim):
    """The design's side of one simulated run (`chaos.systems.seam.SimSystem`), and the world
    of its workers (`sim.pgqueue.PgWorld`)."""

    def __init__(self, run: SimRun) -> None:
        super().__init__(run)
        config = self.config
        #: (tier, bucket) -> its TTL (ms), as `engine.runtime.broker.delay_queue_names`
        self.delays_ms = {
            (tier, bucket): max(1, round(ms * config.time_scale))
            for tier, bucket, ms in config.policy.delay_queues()
        }
        self.jobs = SimJobs(self.env, self.net_rng, self.options.redis_latency_s, config.stale_ms)
        # The queue's transactions commit synchronously whatever the role's setting
        # (`eai.queue_apply`): a kill loses none of them (`jobs.lag_s` stays None)
        self._queue: PgQueueClient | None = None  # the runner's, as `EngineClient`
        self._reader: simpy.Process | None = None  # the consumer of the outbox

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
        as the simulated RabbitMQ's)."""
        self.jobs.kill(crash=not a.graceful)
        return {**super().on_kill_service(a), "messages": len(self.jobs.jobs)}

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
        kept = yield from self.store.call(
            self.redis.set_state, attempt_id, EvaluationStatus.CANCELLED.value
        )
        if kept is None:
            body = {"attempt_id": attempt_id, "status": "cancelled", "verdicts": {}}
            yield from queue.publish_event("evaluation.completed", body, f"{attempt_id}:completed")
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
                if woken.triggered:
                    woken = env.event()
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
