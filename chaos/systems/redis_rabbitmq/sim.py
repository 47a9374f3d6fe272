"""`redis-rabbitmq` simulated: the engine's own code on a simulated Redis and RabbitMQ.

What `chaos.insim.run.SimRun` asks of this design, carried out on `sim.redis.SimRedis`,
`sim.broker.SimBroker` and, behind Sentinel, `sim.sentinel.SimSentinel`: the live
adapter's acts (`chaos.systems.redis_rabbitmq.live`) on simulated time. It is also the
world a simulated worker lives in (`sim.world.World`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import orjson

from chaos import acts
from chaos.checker import EvaluationFinal, FinalState
from chaos.conductor import COMPLETED_QUEUE, EVENT_KEYS, RECEIVED_AS, delivered
from chaos.insim.quiet import quiet
from engine.core.messages import SUBMIT_REASON
from engine.core.states import EvaluationStatus
from engine.history import error_fields
from engine.keys import eval_key
from sim.broker import WORK_QUEUE, BrokerClient, Delivery, SimBroker
from sim.redis import RedisClient, SimRedis
from sim.sentinel import SimSentinel
from sim.worker import SimWorker
from sim.world import SimOptions

if TYPE_CHECKING:
    from chaos.insim.run import SimRun

#: The runner's own publishes (submits, a cancel's announcement): `engine.submit`'s, in a
#: process of its own live, which a mutant of the worker never reaches.
RUNNER_DELIVERY_MODE = 2


class RedisRabbitSim:
    """The design's side of one simulated run (`chaos.systems.seam.SimSystem`), and the
    world of its workers (`sim.world.World`)."""

    #: What the store is called, as a service a fault names and as a worker's link.
    store_service = "redis"
    store_link = "redis"
    #: The store's server (a design may model more of its own: `chaos.systems.pg.sim`'s
    #: primary with a standby).
    server: type[SimRedis] = SimRedis

    def __init__(self, run: SimRun) -> None:
        self.run = run
        spec = run.spec
        # what a worker and the moved acts read of the run
        self.env = run.env
        self.events = run.events
        self.runner = run.runner
        self.options = self.sim_options(run.options)
        self.config = run.config
        self.net_rng = run.net_rng
        self.boot_rng = run.boot_rng
        self.network = run.network
        self.pauses = run.pauses
        self.shell_errors = run.shell_errors
        self.engine_error_seen = run.engine_error_seen
        self.plans = run.plans
        self.attempt_ids = run.attempt_ids
        self.id_prefix = run.id_prefix
        self.redis = self.server(
            self.env,
            running_index=self.config.name("engine:running"),
            retries_index=self.config.name("engine:retries"),
            ttl_s=self.config.state_ttl_s,
            lease_ms=self.config.stale_ms,
            failover_loss=self.options.redis_failover_loss,
        )
        delay_queues = {}
        for tier, bucket, ms in self.config.policy.delay_queues():
            ttl_ms = max(1, round(ms * spec.time_scale))
            name = f"evaluation.retry.t{tier + 1}.b{bucket}.{ttl_ms}ms"
            delay_queues[(tier, bucket)] = (name, ttl_ms / 1000)
        self.broker = SimBroker(
            self.env,
            self.net_rng,
            self.options.broker_latency_s,
            delay_queues,
            dead_letter_loss=self.options.dead_letter_loss,
            consumer_timeout_s=self.options.consumer_timeout_s,
            loses=self._loses if spec.broker.dead_letter_loss else None,
            on_lost=self._retry_lost,
        )
        self.sentinel = (  # the seed's deployment: a replica the sentinels promote
            SimSentinel(
                self.env,
                self.redis,
                random.Random(f"sim:{run.seed}:sentinel"),
                spec.redis.down_after_ms / 1000,
                self.options.redis_boot_s,
                (
                    float(spec.redis.min_replicas_max_lag_s)
                    if spec.redis.min_replicas_to_write
                    else None
                ),
            )
            if spec.redis.topology == "sentinel"
            else None
        )
        self.store = RedisClient(self.env, self.redis, self.net_rng, self.options.redis_latency_s)
        self._client: BrokerClient | None = None  # the runner's, as `EngineClient`
        self._events: BrokerClient | None = None  # the consumer of evaluation.completed

    @staticmethod
    def sim_options(options: SimOptions) -> SimOptions:
        """The simulated machines as this design has them."""
        return options

    def _loses(self, message_id: str | None) -> bool:
        """`broker.dead_letter_loss`: the live runner's draw, on the same id."""
        return self.run.spec.broker.loses(self.run.seed, message_id)

    def _retry_lost(self, body: dict[str, Any]) -> None:
        """A dead-lettered retry vanished (the live runner records the one it takes)."""
        self.runner.record(
            "retry_lost",
            attempt_id=body.get("attempt_id"),
            rule_id=body.get("rule_id"),
            attempt=body.get("attempt"),
        )

    def worker(self, index: int, incarnation: int, failpoints: str) -> SimWorker:
        config = dataclasses.replace(self.config)  # each process parses its own, as live
        return SimWorker(self, index, incarnation, failpoints, self.run.agent(), config)

    def extra(self) -> dict[str, Any]:
        return {"dead_letters_lost": self.broker.dead_letters_lost}

    # --- the acts of `chaos.conductor` that are this design's --------------------------

    def on_kill_service(self, a: acts.KillService) -> dict[str, Any]:
        """The broker says how many messages it held (the model counts them)."""
        # a clean stop (`a.graceful`) is a kill here: the engine sees its connections go
        # either way, and neither an fsync-always Redis nor durable queues lose anything
        # (persistent messages: a transient one is lost either way)
        if a.name == self.store_service and self.sentinel is not None:
            self.sentinel.kill_primary()
            return {acts.FAILS_OVER: True}
        if a.name == self.store_service:
            self.redis.kill()
            return {}
        return {"messages": self.broker.kill()}

    def on_restart_service(self, a: acts.RestartService) -> Generator[Any, Any, dict[str, Any]]:
        o = self.options
        store = a.name == self.store_service
        if store and self.sentinel is not None:
            yield from self.sentinel.restart_killed()
            return {}
        yield self.env.timeout(o.redis_boot_s if store else o.broker_boot_s)
        if store:
            return self._store_back()
        return {"messages": self.broker.restart()}  # what the node found on disk

    def _store_back(self) -> dict[str, Any]:
        """The store restarted: what it lost, when the scenario counts it."""
        lost = self.redis.restart()
        return {"lost_writes": lost} if self.run.spec.redis.lose_last_writes else {}

    def on_pause_service(self, a: acts.PauseService) -> None:
        assert a.name == self.store_service, "only the store is paused"
        if self.sentinel is not None:
            self.sentinel.pause_primary()
        else:
            self.redis.pause()

    def on_resume_service(self, a: acts.ResumeService) -> bool:
        if self.sentinel is not None:
            return self.sentinel.resume_primary()
        return self.redis.resume()

    def on_kill_sentinel(self, a: acts.KillSentinel) -> None:
        assert self.sentinel is not None, "a sentinel without Sentinel"
        self.sentinel.kill_sentinel()

    def on_restart_sentinel(self, a: acts.RestartSentinel) -> None:
        assert self.sentinel is not None, "a sentinel without Sentinel"
        self.sentinel.restart_sentinel()

    def on_await_failover(
        self, a: acts.AwaitFailover
    ) -> Generator[Any, Any, bool | dict[str, Any]]:
        assert self.sentinel is not None, "a failover without Sentinel"
        return (yield from self.sentinel.wait_back())

    def set_own_link(self, link: str, cut: bool) -> bool:
        """A link that is the design's, not a worker's: the replica's link to the primary
        (one, not per worker). True: `link` was that one."""
        if link != "replication":
            return False
        assert self.sentinel is not None, "a replication link without Sentinel"
        self.sentinel.partition(cut)
        return True

    def heal_links(self) -> None:
        if self.sentinel is not None:
            self.sentinel.partition(False)

    def on_connect(self, a: acts.Connect) -> Generator[Any, Any, None]:
        client = BrokerClient(self.env, self.broker, "runner", delivery_mode=RUNNER_DELIVERY_MODE)
        while not (yield from client.connect()):  # connect_robust waits for the node
            yield self.env.timeout(self.options.reconnect_interval_s)
        self._client = client

    def on_disconnect(self, a: acts.Disconnect) -> Generator[Any, Any, None]:
        if self._client is not None:
            yield from self._client.close()

    def on_submit(self, a: acts.Submit) -> Generator[Any, Any, None]:
        assert self._client is not None
        body = {
            "type": "execute",
            "attempt_id": a.attempt_id,
            "plan": a.plan,  # the live message carries plan.to_dict(); the sim, the plan
            "reason": SUBMIT_REASON,
            "published_ms": int(self.env.now * 1000),
        }
        yield from self._client.publish_work(body, a.attempt_id)

    def on_cancel(self, a: acts.Cancel) -> Generator[Any, Any, str]:
        """`EngineClient.cancel`, on a connection of its own."""
        attempt_id = a.attempt_id
        client = BrokerClient(
            self.env, self.broker, "runner-cancel", delivery_mode=RUNNER_DELIVERY_MODE
        )
        while not (yield from client.connect()):  # connect_robust waits for the node
            yield self.env.timeout(self.options.reconnect_interval_s)
        kept = yield from self.store.call(
            self.redis.set_state, attempt_id, EvaluationStatus.CANCELLED.value
        )
        if kept is None:
            body = {"attempt_id": attempt_id, "status": "cancelled", "verdicts": {}}
            yield from client.publish_event("evaluation.completed", body, f"{attempt_id}:completed")
            yield from self.store.call(self.redis.done, attempt_id, "")
            yield from client.publish_control({"type": "cancel", "attempt_id": attempt_id})
        yield from client.close()
        return kept or EvaluationStatus.CANCELLED.value

    def on_resume(self, a: acts.Resume) -> Any:
        """Never asked: a resume from a checkpoint is refused on this design before the run
        (`chaos.systems.refusal`)."""
        raise NotImplementedError("redis-rabbitmq has no resume from a checkpoint")

    def on_publish_raw(self, a: acts.PublishRaw) -> Generator[Any, Any, None]:
        """On a connection of its own, as `on_cancel`."""
        yield from self.publish_as_runner(a.body, a.message_id, "runner-poison")

    def publish_as_runner(self, body: Any, message_id: str, name: str) -> Generator[Any, Any, None]:
        """Work published by the runner's client `name`, on a connection of its own."""
        client = BrokerClient(self.env, self.broker, name, delivery_mode=RUNNER_DELIVERY_MODE)
        while not (yield from client.connect()):
            yield self.env.timeout(self.options.reconnect_interval_s)
        yield from client.publish_work(body, message_id)
        yield from client.close()

    def on_settled(self, a: acts.Settled) -> int:
        return len(self.redis.settled(a.attempt_ids)) if self.redis.up else 0

    def on_leases(self, a: acts.Leases) -> dict[str, str] | None:
        if not self.redis.up:
            return None
        holders = {i: self.redis.holder(i) for i in a.attempt_ids}
        return {i: h for i, h in holders.items() if h is not None}

    def on_announced(self, a: acts.Announced) -> set[str]:
        redis = self.redis
        return {i for i in a.attempt_ids if redis.up and redis.record(i)[2]}

    def on_read_final(self, a: acts.ReadFinal) -> FinalState:
        if not self.redis.up:  # the final state needs the store back
            self._store_back()
        return self._final_state()

    def _final_state(self) -> FinalState:
        """`ScenarioRun.on_read_final`: each evaluation's keys, every key's TTL (the engine's
        own `engine:*` keys too) and the members of its indexes."""
        redis = self.redis
        evaluations: dict[str, EvaluationFinal] = {}
        for attempt_id in self.attempt_ids:
            snap = redis.snapshot(attempt_id, self.plans[attempt_id].order)
            state, _, published = redis.record(attempt_id)
            passes = redis.get(eval_key(attempt_id, "passes")) or {}
            evaluations[attempt_id] = EvaluationFinal(
                attempt_id=attempt_id,
                state=state,
                results=dict(snap.results),
                statuses=dict(snap.statuses),
                published=published,
                passes={str(p): str(o) for p, o in sorted(passes.items())},
            )
        ns = self.config.name("")
        ttls = redis.ttls(f"attempt:{self.id_prefix}")
        ttls.update(
            {k.removeprefix(ns): t for k, t in redis.ttls(self.config.name("engine:")).items()}
        )
        indexes = {
            key.removeprefix(ns): {
                str(m): float(v) for m, v in sorted((redis.get(key) or {}).items())
            }
            for key in (redis.running_index, redis.retries_index)
        }
        return FinalState(evaluations=evaluations, key_ttls=ttls, indexes=indexes)

    # --- the harness's consumer of evaluation.completed -----------------------------------

    def on_bind_consumer(self, a: acts.BindConsumer) -> Generator[Any, Any, None]:
        """`acts.BindConsumer`, on a robust connection of its own."""
        env = self.env
        events = BrokerClient(
            env,
            self.broker,
            "runner-events",
            reconnect_interval_s=self.options.reconnect_interval_s,
            spawn=lambda gen: env.process(quiet(gen)),
        )
        while not (yield from events.connect()):
            yield env.timeout(self.options.reconnect_interval_s)
        queue = self.config.name(COMPLETED_QUEUE)
        for key in EVENT_KEYS:
            self.broker.bind_events(queue, key)

        def received(d: Delivery) -> None:
            body = orjson.loads(orjson.dumps(d.body))  # a copy, as JSON carries it
            fields = delivered(body, d.message_id, d.redelivered, d.delivery_mode)
            ev = RECEIVED_AS.get(d.routing_key, "completed_received")
            self.runner.record(ev, **fields)
            if ev == "completed_received" and isinstance(body, dict):
                self.run.received.add(str(body.get("attempt_id")))
            events.settle(d)

        events.consume(queue, 64, received)
        self._events = events
        for key in EVENT_KEYS:
            self.runner.record("events_consumer_bound", queue=queue, routing_key=key)

    def on_close_consumer(self, a: acts.CloseConsumer) -> Generator[Any, Any, None]:
        """The live runner's: first what is left in the work and delay queues
        (`queues_drained`), then the consumer closed."""
        if self.broker.up:
            left = [
                str(m.message_id)
                for q in self.broker.queues.values()
                if q.owner is None and (q.delay or q.name == WORK_QUEUE)
                for m in q.messages
            ]
            for q in self.broker.queues.values():
                if q.owner is None and (q.delay or q.name == WORK_QUEUE):
                    q.messages.clear()
            self.runner.record("queues_drained", message_ids=sorted(left))
        if self._events is not None:
            yield from self._events.close()

    def read_final_or_nothing(self) -> FinalState:
        """The store as the run left it; a store a broken engine left unreadable (a key or
        an index member of the wrong type) is an engine error, judged with nothing read."""
        try:
            return self.on_read_final(acts.ReadFinal())
        except Exception as exc:
            self.runner.record_fields("engine_error", error_fields(exc, "reading the final state"))
            return FinalState()
