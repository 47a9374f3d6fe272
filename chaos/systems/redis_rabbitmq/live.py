"""`redis-rabbitmq` live: the first document's engine on a private Redis and RabbitMQ.

What the runner (`chaos.runner`) asks of this design and carries out here: its services
killed, stopped, paused and brought back (Redis behind Sentinel too, its AOF cut for
`redis.lose_last_writes`); the runner's client of the engine (`engine.submit.EngineClient`);
the Redis reads behind "settled", "leases" and "announced"; a consumer of
`evaluation.completed`, bound before the first submit, recording what a downstream service
would receive; the loss of dead-lettered retries (`broker.dead_letter_loss`); and, once
everything has stopped, the final Redis state (its keys, TTLs and the engine's indexes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)
from aio_pika.exceptions import AMQPError, ChannelInvalidStateError, ChannelNotFoundEntity

from chaos import acts
from chaos.checker import EvaluationFinal, FinalState
from chaos.conductor import COMPLETED_QUEUE, EVENT_KEYS, RECEIVED_AS, delivered
from chaos.errors import HarnessError
from chaos.links import REPLICATION, Network
from chaos.scenario import LoadedScenario
from chaos.scenario.schema import service_action
from chaos.systems.redis_rabbitmq.services import SentinelRedis, Services
from chaos.workers import WorkerProcess
from engine.config import EngineConfig
from engine.core.states import TERMINAL_EVALUATION_STATUSES
from engine.runtime.broker import delay_queue_names
from engine.runtime.store import RedisStore, eval_key, glob_escape
from engine.submit import EngineClient

if TYPE_CHECKING:
    from chaos.runner import ScenarioRun

TERMINAL = {s.value for s in TERMINAL_EVALUATION_STATUSES}
#: How long a clean stop of a service (`stop_redis`, `stop_broker`) may take before SIGKILL.
SERVICE_STOP_TIMEOUT_S = 30.0
#: How often the end of a Redis failover is looked for (Sentinel tells no one).
FAILOVER_POLL_S = 0.05
#: The loss injector (`broker.dead_letter_loss`) rides out the broker faults it runs beside:
#: while the broker is down it waits; once it runs, a take that keeps failing is tried this
#: many times, `INJECTOR_RETRY_S` apart, on a new connection each, before the scenario ends
#: in a `HarnessError`.
INJECTOR_TRIES = 40
INJECTOR_RETRY_S = 0.25
#: What a broker that went away (killed, restarting, paused) makes an AMQP client raise.
_BROKER_AWAY = (AMQPError, OSError, ChannelInvalidStateError)  # TimeoutError is an OSError


def run_prefix(namespace: str, *, shared_redis: bool) -> str:
    """What a run puts before the seed's attemptIds: its unique namespace on a shared Redis
    (another run of the same seed may be using it), nothing on its own."""
    return namespace if shared_redis else ""


def refusal(loaded: LoadedScenario, killable: set[str]) -> str | None:
    """Why the scenario cannot run against these services, in one line (None: it can)."""
    spec = loaded.spec
    needed = {on[0] for f in spec.faults if (on := service_action(f)) is not None}
    missing = needed - killable
    if missing:
        names = " and ".join(sorted(missing))
        return (
            f"{loaded.path}: faults: kills {names}, but this run uses a shared service "
            "(REDIS_URL/AMQP_URL); unset them to let the run start its own"
        )
    # settings only the run's own instances take: a node's consumer_timeout, an AOF to cut
    owned = [
        ("broker.consumer_timeout_s", "broker", "AMQP_URL", spec.broker.consumer_timeout_s),
        ("redis.lose_last_writes", "redis", "REDIS_URL", spec.redis.lose_last_writes or None),
    ]
    for field_name, service, variable, value in owned:
        if value is not None and service not in killable:
            return (
                f"{loaded.path}: {field_name}: needs the run's own {service}, but this run "
                f"uses a shared one ({variable}); unset it to let the run start its own"
            )
    return None


class RedisRabbitLive:
    """The design's side of one live run (`chaos.systems.seam.LiveSystem`)."""

    def __init__(self, run: ScenarioRun, services: Services) -> None:
        self.run = run
        self.spec = spec = run.spec
        self.services = services
        # Behind Sentinel the run has a topology of its own, whatever REDIS_URL says;
        # a replication link to fault goes through the run's proxies (`chaos.links`)
        replication = any(getattr(f, "link", None) == REPLICATION for f in spec.faults)
        self.sentinel = (
            SentinelRedis(
                spec.redis.down_after_ms,
                replication_via=self._replication_via if replication else None,
                min_replicas=(
                    (spec.redis.min_replicas_to_write, spec.redis.min_replicas_max_lag_s)
                    if spec.redis.min_replicas_to_write
                    else None
                ),
            )
            if spec.redis.topology == "sentinel"
            else None
        )
        # Queues and index keys are the run's own (`ns`). On the run's own Redis the
        # attemptIds are the seed's (as the simulator's are), and leftovers of an earlier run
        # of the same ids are cleared first; on a shared one (REDIS_URL) they carry `ns` too,
        # so two runs of one seed never read, overwrite or delete each other's keys.
        own_redis = services.redis is not None or self.sentinel is not None
        self.run_prefix = run_prefix(run.ns, shared_redis=not own_redis)
        self._client: EngineClient | None = None  # the runner's, between Connect and Disconnect
        self._events_conn: AbstractRobustConnection | None = None  # the consumer's
        self._events_queue: AbstractQueue | None = None
        self._stopped: set[str] = set()  # services killed, stopped or paused, until back
        self.network = Network(  # behind Sentinel the workers reach the primary directly
            run.ns,
            run.seed,
            spec.workers,
            None if self.sentinel is not None else services.redis_url,
            services.amqp_url,
            spec.engine.amqp_heartbeat_s,
            replication_upstream=(
                f"127.0.0.1:{self.sentinel.primary_port}"
                if self.sentinel is not None and replication
                else None
            ),
        )
        killable = services.killable | ({"redis"} if self.sentinel is not None else set())
        self.refused = refusal(run.loaded, killable)

    # --- set-up -------------------------------------------------------------------------

    @property
    def redis_url(self) -> str:
        """The workers' and the runner's Redis: the topology's sentinels, or the service."""
        return self.sentinel.url if self.sentinel is not None else self.services.redis_url

    def _replication_via(self, host: str, port: int) -> tuple[str, int]:
        """Where the replica replicates from: the run's replication proxy."""
        listen_host, _, listen_port = self.network.replication_listen.rpartition(":")
        return listen_host or host, int(listen_port)

    def _worker_redis_url(self, index: int) -> str:
        """Through the worker's own proxy; behind Sentinel, the sentinels themselves."""
        return self.redis_url if self.sentinel is not None else self.network.url(index, "redis")

    def config(self) -> EngineConfig:
        return self.spec.engine_config(
            redis_url=self.redis_url,
            amqp_url=self.services.amqp_url,
            namespace=self.run.ns,
            policy=self.spec.retry.policy(self.run.seed),
        )

    async def start(self) -> None:
        """The services as the scenario sets them, the proxies, Sentinel, and no leftover of
        an earlier run of the same seed."""
        await asyncio.to_thread(self.services.configure, self.spec.broker.consumer_timeout_s)
        await self.network.start()  # first: the replica may replicate through it
        if self.sentinel is not None:
            await asyncio.to_thread(self.sentinel.start)
        await self._clear_earlier_runs()

    async def stop(self) -> None:
        """What the run started of this design (its services are the caller's)."""
        await self.network.close()
        if self.sentinel is not None:
            await asyncio.to_thread(self.sentinel.stop)

    def worker(self, index: int, failpoints: list[str], mutant: str | None) -> WorkerProcess:
        """`python -m engine.worker` (or the mutant's module) through its own proxies."""
        module = ("chaos.mutants", mutant) if mutant else ("engine.worker",)
        return WorkerProcess(
            self.run.worker_args(failpoints),
            env={  # through the worker's own proxies (`chaos.links`)
                "REDIS_URL": self._worker_redis_url(index),
                "AMQP_URL": self.network.url(index, "broker"),
            },
            log_path=self.run.run_dir / f"worker{index}.log",
            name=f"worker{index}",
            module=module,
        )

    # --- the acts of `chaos.conductor` that are this design's --------------------------

    async def on_kill_service(self, a: acts.KillService) -> dict[str, Any]:
        if a.name == "redis" and self.sentinel is not None:
            await asyncio.to_thread(self.sentinel.kill)
            return {acts.FAILS_OVER: True}
        svc = self.services.service(a.name)
        self._stopped.add(a.name)
        if a.graceful:
            await asyncio.to_thread(svc.terminate, SERVICE_STOP_TIMEOUT_S)
        else:
            await asyncio.to_thread(svc.kill)
        return {}

    async def on_restart_service(self, a: acts.RestartService) -> dict[str, Any]:
        if a.name == "redis" and self.sentinel is not None:
            await asyncio.to_thread(self.sentinel.restart)
            return {}
        found: dict[str, Any] = {}
        if a.name == "redis" and self.spec.redis.lose_last_writes:
            found["lost_writes"] = await self._lose_redis_writes()
        await asyncio.to_thread(self.services.service(a.name).restart)
        self._stopped.discard(a.name)  # ready again: the restart waits for it
        return found

    async def on_pause_service(self, a: acts.PauseService) -> None:
        if a.name == "redis" and self.sentinel is not None:
            await asyncio.to_thread(self.sentinel.pause)
            return
        self._stopped.add(a.name)
        await asyncio.to_thread(self.services.service(a.name).pause)

    async def on_resume_service(self, a: acts.ResumeService) -> bool:
        if a.name == "redis" and self.sentinel is not None:
            return await asyncio.to_thread(self.sentinel.resume)
        await asyncio.to_thread(self.services.service(a.name).resume)
        self._stopped.discard(a.name)
        return False

    async def on_kill_sentinel(self, a: acts.KillSentinel) -> None:
        assert self.sentinel is not None, "a sentinel without Sentinel"
        await asyncio.to_thread(self.sentinel.kill_sentinel, a.index)

    async def on_restart_sentinel(self, a: acts.RestartSentinel) -> None:
        assert self.sentinel is not None, "a sentinel without Sentinel"
        await asyncio.to_thread(self.sentinel.restart_sentinel, a.index)

    async def on_await_failover(self, a: acts.AwaitFailover) -> bool:
        """Until the sentinels name a primary that answers as one (polled: Sentinel tells
        nobody); whether it is the promoted replica."""
        assert self.sentinel is not None, "a failover without Sentinel"
        while (promoted := await asyncio.to_thread(self.sentinel.serving)) is None:
            await asyncio.sleep(FAILOVER_POLL_S)
        return promoted

    async def _lose_redis_writes(self) -> int:
        """`redis.lose_last_writes`: the stopped server's append-only file loses its last
        writes before it comes back (`chaos.systems.redis_rabbitmq.aof`), as after a failover
        to a lagging replica."""
        return await asyncio.to_thread(
            self.services.lose_redis_writes, self.spec.redis.lose_last_writes
        )

    async def on_connect(self, a: acts.Connect) -> None:
        client = EngineClient(self.config())
        await client.__aenter__()
        self._client = client
        if self.spec.broker.dead_letter_loss:  # the simulated broker draws its own
            self.run.spawn(self._lose_retries(client))

    async def on_disconnect(self, a: acts.Disconnect | None = None) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.__aexit__(None, None, None)

    async def on_submit(self, a: acts.Submit) -> None:
        assert self._client is not None
        await self._client.submit(a.plan, a.attempt_id)

    async def on_cancel(self, a: acts.Cancel) -> str:
        async with EngineClient(self.config()) as client:
            return await client.cancel(a.attempt_id)

    async def on_resume(self, a: acts.Resume) -> dict[str, Any]:
        """Never asked: a resume from a checkpoint is refused on this design before the run
        (`chaos.systems.refusal`)."""
        raise NotImplementedError("redis-rabbitmq has no resume from a checkpoint")

    async def on_publish_raw(self, a: acts.PublishRaw) -> None:
        async with EngineClient(self.config()) as client:
            await client.broker.publish_work_raw(a.body, a.message_id)

    async def on_settled(self, a: acts.Settled) -> int:
        assert self._client is not None
        keys = [eval_key(i, k) for i in a.attempt_ids for k in ("state", "final_published")]
        try:
            values = await self._client.store.redis.mget(keys)
        except Exception:  # Redis is down (a fault): none counts
            return 0
        pairs = zip(values[::2], values[1::2], strict=True)
        return sum(1 for state, published in pairs if state in TERMINAL and published)

    async def on_leases(self, a: acts.Leases) -> dict[str, str] | None:
        assert self._client is not None
        try:
            owners = await self._client.store.redis.mget(
                [eval_key(i, "owner") for i in a.attempt_ids]
            )
        except Exception:  # Redis is down (a fault): nothing to say
            return None
        return {i: o for i, o in zip(a.attempt_ids, owners, strict=True) if o is not None}

    async def on_announced(self, a: acts.Announced) -> set[str]:
        assert self._client is not None
        keys = [eval_key(i, "final_published") for i in a.attempt_ids]
        try:
            flags = await self._client.store.redis.mget(keys)
        except Exception:  # Redis is down (a fault): none counts
            return set()
        return {i for i, flag in zip(a.attempt_ids, flags, strict=True) if flag}

    async def _lose_retries(self, client: EngineClient) -> None:
        """`broker.dead_letter_loss`: each delayed retry the workers publish is lost or not,
        by the draw the simulator makes on the same id (`BrokerSpec.loses`); a lost one is
        taken off its delay queue and acknowledged before its TTL sends it on. The injector
        has a connection of its own, opened again after the broker went away (`_Taker`);
        any failure of its own ends the scenario in a `HarnessError` line."""
        broker = self.spec.broker
        if not broker.dead_letter_loss or client.broker.connection is None:
            return
        taker = _Taker(client.broker.config, self._broker_up)
        try:
            async for ev in self.run.history_events():
                if ev.get("ev") != "retry_published":
                    continue
                a, rule, n = ev.get("attempt_id"), ev.get("rule_id"), ev.get("attempt")
                seed_id = f"{str(a).removeprefix(self.run_prefix)}:{rule}:{n}"
                if broker.loses(self.run.seed, seed_id):
                    queue = client.broker.delay_queues.get((int(ev["tier"]) - 1, ev["bucket"]))
                    taken = queue is not None and await taker.take(queue, f"{a}:{rule}:{n}")
                    self.run.history.record(
                        "retry_lost" if taken else "retry_loss_missed",
                        attempt_id=a,
                        rule_id=rule,
                        attempt=n,
                    )
        except HarnessError:
            raise
        except Exception as exc:  # the injector's own bug: one line, not a traceback
            raise HarnessError(
                f"broker.dead_letter_loss: the loss injector failed: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            await taker.close()

    def _broker_up(self) -> bool:
        """Whether the scenario's broker runs and answers: not killed, stopped or paused by
        the run since its last restart or resume came back ready (a broker given by
        AMQP_URL is never stopped by the run)."""
        node = self.services.broker
        return "broker" not in self._stopped and (node is None or node.alive)

    async def _clear_earlier_runs(self) -> None:
        """Leftovers of an earlier run of the same seed on the run's own Redis. On a shared
        one there are none to clear: the ids carry this run's own prefix."""
        if self.run_prefix:
            return
        store = RedisStore(self.config())
        try:
            pattern = f"attempt:{self.run.id_prefix}*"
            keys = [k async for k in store.redis.scan_iter(match=pattern, count=1000)]
            for i in range(0, len(keys), 1000):
                await store.redis.delete(*keys[i : i + 1000])
            if self.spec.redis.lose_last_writes and keys:
                await _rewrite_aof(store.redis)
        finally:
            await store.close()

    async def on_bind_consumer(self, a: acts.BindConsumer) -> None:
        """Before the first submit: a durable queue (a broker kill keeps what it holds and
        what was confirmed into it) bound to the events exchange for `evaluation.completed`
        and `evaluation.started`, consumed on a robust connection of its own. Every
        delivery is recorded (`RECEIVED_AS`), then acknowledged.
        `x-expires` removes the queue should the runner die before deleting it."""
        config = self.config()
        url = self.services.amqp_url
        self._events_conn = await aio_pika.connect_robust(url, reconnect_interval=0.5)
        channel = await self._events_conn.channel()
        await channel.set_qos(prefetch_count=64)
        exchange = await channel.declare_exchange(
            config.name("evaluation.events"), aio_pika.ExchangeType.TOPIC, durable=True
        )
        name = config.name(COMPLETED_QUEUE)
        queue = await channel.declare_queue(name, durable=True, arguments={"x-expires": 600_000})
        for key in EVENT_KEYS:
            await queue.bind(exchange, routing_key=key)
        await queue.consume(self._on_completed, no_ack=False)
        self._events_queue = queue
        for key in EVENT_KEYS:
            self.run.history.record("events_consumer_bound", queue=name, routing_key=key)

    async def _on_completed(self, message: AbstractIncomingMessage) -> None:
        try:
            body: Any = json.loads(message.body)
        except ValueError:
            body = message.body.decode("utf-8", "replace")
        fields = delivered(body, message.message_id, message.redelivered, message.delivery_mode)
        ev = RECEIVED_AS.get(message.routing_key or "", "completed_received")
        self.run.history.record(ev, **fields)
        if ev == "completed_received" and isinstance(body, dict):
            self.run.received.add(str(body.get("attempt_id")))
        with contextlib.suppress(Exception):  # the channel went with the broker: redelivered
            await message.ack()

    async def on_close_consumer(self, a: acts.CloseConsumer | None = None) -> None:
        """Delete the queue (a shared broker keeps nothing of the run) and disconnect. At
        the end of a run (the workers stopped: nothing is held unacknowledged), first take
        what is left in the work and delay queues (`queues_drained`, their message ids):
        the messages a broker restart kept that nobody consumed (`nothing_lost_on_restart`)."""
        if a is not None and self._events_conn is not None:
            left = await self._drain_queues(self._events_conn)
            if left is not None:
                self.run.history.record("queues_drained", message_ids=left)
        queue, conn = self._events_queue, self._events_conn
        self._events_queue = self._events_conn = None
        if queue is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(queue.delete(if_unused=False, if_empty=False), 5.0)
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 5.0)

    async def _drain_queues(self, conn: AbstractRobustConnection) -> list[str] | None:
        """The message ids left in the run's work and delay queues, taken off them (None:
        the broker could not be asked)."""
        config = self.config()
        names = [config.name("evaluation.execute")]
        names += [name for name, _ in delay_queue_names(config).values()]
        names.append(config.name("evaluation.retry.shared"))  # the per_message_ttl mutant's
        left: list[str] = []
        try:
            for name in names:
                channel = await asyncio.wait_for(conn.channel(), 5.0)
                try:
                    queue = await channel.declare_queue(name, passive=True, timeout=5.0)
                except ChannelNotFoundEntity:
                    continue  # never declared (the failed declare closed the channel)
                while (m := await queue.get(no_ack=True, fail=False, timeout=5.0)) is not None:
                    left.append(str(m.message_id))
                await channel.close()
        except Exception:  # the broker is down at the end: nothing to say
            return None
        return sorted(left)

    async def on_read_final(self, a: acts.ReadFinal) -> FinalState:
        redis = self.services.redis if self.sentinel is None else None
        if self.sentinel is not None and await asyncio.to_thread(self.sentinel.serving) is None:
            await asyncio.to_thread(self.sentinel.restart)  # no failover: the primary back
        if redis is not None and not redis.alive:  # the final state needs Redis up
            if self.spec.redis.lose_last_writes:
                await self._lose_redis_writes()
            await asyncio.to_thread(redis.restart)
        store = RedisStore(self.config())
        try:
            evaluations: dict[str, EvaluationFinal] = {}
            for attempt_id in self.run.attempt_ids:
                plan = self.run.plans[attempt_id]
                snap = await store.snapshot(attempt_id, plan.order)
                record = await store.record(attempt_id)
                passes = await store.redis.hgetall(eval_key(attempt_id, "passes"))
                evaluations[attempt_id] = EvaluationFinal(
                    attempt_id=attempt_id,
                    state=record.state,
                    results=dict(snap.results),
                    statuses=dict(snap.statuses),
                    published=record.final_published,
                    passes=dict(sorted(passes.items())),
                )
            # Every key the engine wrote: the evaluations' and its own (`{ns}engine:*`, named
            # without the namespace, as the simulator names them), with their TTLs.
            ttls: dict[str, int] = {}
            keys: list[str] = []
            for pattern in (f"attempt:{self.run.id_prefix}*", f"{glob_escape(self.run.ns)}*"):
                keys += [k async for k in store.redis.scan_iter(match=pattern, count=1000)]
            if keys:
                async with store.redis.pipeline(transaction=False) as pipe:
                    for k in keys:
                        pipe.ttl(k)
                    for k, ttl in zip(keys, await pipe.execute(), strict=True):
                        ttls[k.removeprefix(self.run.ns)] = int(ttl)
            indexes: dict[str, dict[str, float]] = {}
            for key in (store.running_index, store.retries_index):
                members = await store.redis.zrange(key, 0, -1, withscores=True)
                indexes[key.removeprefix(self.run.ns)] = {str(m): float(v) for m, v in members}
            return FinalState(evaluations=evaluations, key_ttls=ttls, indexes=indexes)
        finally:
            await store.close()

    def seed_final(self, final: FinalState) -> FinalState:
        """The final state as the seed's ids name it (`ScenarioRun.as_seed_run`)."""
        prefix = self.run_prefix
        if not prefix:
            return final

        def bare(value: Any) -> Any:
            return value.removeprefix(prefix) if isinstance(value, str) else value

        evaluations = {
            a.removeprefix(prefix): dataclasses.replace(f, attempt_id=a.removeprefix(prefix))
            for a, f in final.evaluations.items()
        }
        key_ttls = {
            k.replace(f"attempt:{prefix}", "attempt:", 1): ttl for k, ttl in final.key_ttls.items()
        }
        indexes = None
        if final.indexes is not None:
            indexes = {
                key: {bare(m): score for m, score in members.items()}
                for key, members in final.indexes.items()
            }
        return dataclasses.replace(
            final, evaluations=evaluations, key_ttls=key_ttls, indexes=indexes
        )


class _Taker:
    """The loss injector's own connection to the broker, opened when a take needs it and
    opened again after the broker went away, so that the injector survives a broker kill
    or restart beside it: while the broker is down, a take waits for it; once it runs, a
    take is tried `INJECTOR_TRIES` times before it fails the scenario (`HarnessError`)."""

    def __init__(self, config: EngineConfig, broker_up: Callable[[], bool]) -> None:
        self.url = config.amqp_url
        self.timeout_s = config.connect_timeout_s
        self.broker_up = broker_up
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._channel: AbstractChannel | None = None

    async def take(self, queue: str, message_id: str) -> bool:
        """`_take` on a live channel; False when the message had left its queue."""
        tries = 0
        while True:
            try:
                return await _take(await self._open(), queue, message_id)
            except _BROKER_AWAY as exc:
                await self.close()
                if self.broker_up():
                    tries += 1
                    if tries >= INJECTOR_TRIES:
                        raise HarnessError(
                            f"broker.dead_letter_loss: the loss injector could not take "
                            f"{message_id} off {queue} in {tries} tries with the broker "
                            f"running ({type(exc).__name__}: {exc})"
                        ) from exc
                await asyncio.sleep(INJECTOR_RETRY_S)

    async def _open(self) -> AbstractChannel:
        if self._channel is None or self._channel.is_closed:
            await self.close()
            self._connection = await aio_pika.connect(self.url, timeout=self.timeout_s)
            self._channel = await asyncio.wait_for(self._connection.channel(), self.timeout_s)
        return self._channel

    async def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), self.timeout_s)


async def _take(channel: AbstractChannel, queue_name: str, message_id: str) -> bool:
    """Take the message `message_id` off a queue for good (get, then ACK), handing back the
    ones got before it (NACK with requeue: they keep their place and their TTL)."""
    queue = await channel.get_queue(queue_name, ensure=False)
    others: list[AbstractIncomingMessage] = []
    found = False
    try:
        while True:
            message = await queue.get(no_ack=False, fail=False, timeout=5.0)
            if message is None:
                break
            if message.message_id == message_id:
                await message.ack()
                found = True
                break
            others.append(message)
    finally:
        for message in others:
            await message.nack(requeue=True)
    return found


#: How long the AOF rewrite before a lossy run may take (an empty-ish Redis: milliseconds).
AOF_REWRITE_TIMEOUT_S = 30.0


async def _rewrite_aof(redis: Any) -> None:
    """Fold the AOF into its base file, so that `redis.lose_last_writes` (which cuts the
    last incremental file, `chaos.systems.redis_rabbitmq.aof`) loses this run's writes only: an
    earlier scenario's leftovers deleted just before would otherwise come back with the cut (a lease
    of a worker long gone, seen in the gate after another seed-2 scenario)."""
    await redis.bgrewriteaof()
    deadline = time.monotonic() + AOF_REWRITE_TIMEOUT_S
    while time.monotonic() < deadline:
        info = await redis.info("persistence")
        if not info.get("aof_rewrite_in_progress") and not info.get("aof_rewrite_scheduled"):
            return
        await asyncio.sleep(0.02)
    raise HarnessError(f"the AOF rewrite did not end within {AOF_REWRITE_TIMEOUT_S:.0f} s")
