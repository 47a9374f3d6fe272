"""`python -m engine.worker`: one worker process of the live engine.

Flags beat environment (`REDIS_URL`, `AMQP_URL`, `ENGINE_*`), which beat defaults that work
on a machine with Redis and RabbitMQ on their usual loopback ports. `--store postgres` keeps
the store in PostgreSQL instead of Redis (`engine.runtime.pgstore`): its URL comes from
`EAI_DATABASE_URL` only (credentials never go on a command line), its tenant from
`EAI_TENANT_ID`. `--system pg` keeps the work queue, delayed retries, forwards and events in
the same PostgreSQL too (`engine.runtime.pgqueue`: no broker). SIGTERM and Ctrl-C stop
it cleanly: consuming stops, in-memory evaluations are handed back (their deliveries are
requeued, their leases released) and connections close.

Once connected it prints one line, `engine.worker ID ready: ...` (services with their
passwords masked, namespace, queues), to stderr. Exit codes: 0 stopped by a signal, 2 bad
input (one line), 3 the store (Redis or PostgreSQL) or RabbitMQ unreachable, refusing the
credentials or lost during start-up, or a PostgreSQL the store cannot use (no schema, one
newer or older than this engine's, a superuser or BYPASSRLS role that row-level security
would not hold): one line naming the service, its address and what to do, within the
connect timeout (`ENGINE_CONNECT_TIMEOUT_S`, default 5 s); once running, outages are ridden
out.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import asyncpg
from aio_pika.abc import AbstractIncomingMessage
from aio_pika.exceptions import AMQPError
from redis.exceptions import RedisError

from engine.agent import AgentProfile, AgentProfileError, AgentService, FakeAgent
from engine.config import (
    STORES,
    SYSTEMS,
    EngineConfig,
    OneLineParser,
    ServiceUnavailable,
    env_config,
    of_system,
    policy_from,
    redacted,
)
from engine.core import RuleResult
from engine.core.messages import decode
from engine.failpoints import (
    FailpointError,
    Failpoints,
    fired_fields,
    parse_specs,
    released_fields,
)
from engine.history import History, open_history
from engine.metrics import Metrics
from engine.plan import Rule
from engine.runtime.broker import amqp_unavailable
from engine.runtime.context import (
    Runtime,
    open_broker,
    open_store,
    store_address,
    store_unavailable,
)
from engine.runtime.drive import LiveHost, detached, drive
from engine.runtime.pgstore import PostgresStore
from engine.shell import heartbeat
from engine.shell.controller import EvaluationController
from engine.shell.sweeper import sweeper
from engine.shell.window import DeliveryWindow

log = logging.getLogger("engine.worker")


class UnscopedAgent:
    """The agent, shown attemptIds without a run's prefix.

    A chaos run on shared services prefixes its attemptIds with its own run id so that two
    runs of one seed never touch each other's keys; the fake agent draws from (seed,
    attemptId, ruleId), so it must see the seed's id to draw what every other run of the
    seed draws (the checker judges that run with the prefix removed too).
    """

    def __init__(self, agent: AgentService, prefix: str) -> None:
        self.agent = agent
        self.prefix = prefix

    def unscoped(self, attempt_id: str) -> str:
        return attempt_id.removeprefix(self.prefix)

    async def evaluate(
        self, attempt_id: str, rule: Rule, attempt: int, try_no: int, *, execution: int = 1
    ) -> RuleResult:
        return await self.agent.evaluate(
            self.unscoped(attempt_id), rule, attempt, try_no, execution=execution
        )


class Worker:
    """Wires one runtime together; `run()` until `stop()`."""

    def __init__(
        self,
        config: EngineConfig,
        agent: AgentService,
        failpoints: Failpoints | None = None,
        history_path: str | None = None,
        worker_id: str | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.worker_id = worker_id or f"w{os.getpid()}-{uuid.uuid4().hex[:6]}"
        history = open_history(history_path, self.worker_id)
        fps = failpoints or Failpoints()
        fps.on_crash = lambda name, rule, attempt_id: history.record(
            "crash", failpoint=name, rule=rule, attempt_id=attempt_id
        )
        fps.on_fire = lambda fp, rule, attempt_id: history.record(
            "failpoint_fired", **fired_fields(fp, rule, attempt_id)
        )
        fps.on_release = lambda fp, rule, attempt_id, came: history.record(
            "failpoint_released", **released_fields(fp, rule, attempt_id, came)
        )
        fps.history_path = history_path
        store = open_store(config)
        self.rt = Runtime(
            worker_id=self.worker_id,
            config=config,
            store=store,
            broker=open_broker(config, store),
            agent=agent,
            failpoints=fps,
            history=history,
            metrics=Metrics(),
        )
        if type(history) is not History:  # the deliveries held unsettled, when recorded
            self.rt.window = DeliveryWindow(
                lambda ev, fields: history.record(ev, **fields),
                config.prefetch,
                config.max_evaluations,
            )
        self.metrics_port = metrics_port
        self.controller = EvaluationController(LiveHost(self.rt), config, self.worker_id)
        self.private_queue = ""
        self._stop = asyncio.Event()
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self._deliveries: set[asyncio.Task[Any]] = set()

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        """A delivery, decoded for the controller; its step runs `detached` from aio-pika's
        task, which a closing channel cancels. One that reaches a stopping worker (sent
        before its consumers were cancelled) is left unacknowledged: the broker requeues it
        for another worker when the connection closes."""
        if self._stopping:
            return
        body = decode(message.body)  # None: not JSON, the controller drops it with one line
        window = self.rt.window
        if window is not None:  # per consumer: a restored channel is a new one
            try:
                channel: Any = message.channel
            except Exception:  # closed already: its deliveries went back with it
                channel = id(message)
            window.delivered(message, (channel, message.consumer_tag), message.routing_key or "")
        step = self.controller.on_message(message, body, message.redelivered)
        await detached(step, self.rt, self._deliveries)

    async def start(self) -> None:
        """Connect, declare and consume. Raises `ServiceUnavailable` (one line) when Redis or
        RabbitMQ is unreachable, refuses the credentials or fails on the way: the first
        contacts make no retries, so that takes the connect timeout, not minutes."""
        rt, cfg = self.rt, self.rt.config
        if self.metrics_port is not None:
            rt.metrics.serve(self.metrics_port)  # OSError when the port is taken
        await rt.store.probe()
        await rt.broker.connect(prefetch=cfg.prefetch)
        try:
            await rt.store.remember_topology(rt.broker.declared)
        except (RedisError, OSError, TimeoutError, asyncpg.PostgresError) as exc:
            raise store_unavailable(cfg, exc) from None
        try:
            self.private_queue = await rt.broker.consume_private(self.worker_id, self.on_message)
            await rt.broker.consume_work(self.on_message)
        except (AMQPError, OSError) as exc:
            raise amqp_unavailable(exc, cfg.amqp_url, cfg.connect_timeout_s) from None
        held = self.controller.evaluations
        beating = heartbeat.heartbeat(cfg, self.worker_id, held, self.controller.host.recording)
        self._tasks.append(asyncio.create_task(drive(beating, rt)))
        if cfg.sweeper:
            self._tasks.append(asyncio.create_task(drive(sweeper(cfg, held), rt)))
        if isinstance(rt.store, PostgresStore):
            self._tasks.append(asyncio.create_task(_retention(rt.store)))
        rt.history.record("worker_started", sweeper=cfg.sweeper)

    def ready_line(self) -> str:
        """What the worker says once it consumes (the chaos runner waits for "ready")."""
        cfg, broker = self.rt.config, self.rt.broker
        delay = len(broker.delay_queues)
        postgres = cfg.broker == "postgres"
        first = "jobs in the same database" if postgres else f"amqp {redacted(cfg.amqp_url)}"
        return (
            f"engine.worker {self.worker_id} ready: {store_address(cfg)}, "
            f"{first}, namespace {cfg.namespace!r}, queues "
            f"{broker.work_queue_name}, {self.private_queue} and {delay} delay "
            f"queues {cfg.name('evaluation.retry.*')}"
        )

    async def run(self) -> None:
        await self.start()
        print(self.ready_line(), file=sys.stderr, flush=True)
        await self._stop.wait()
        await self.close()

    def stop(self) -> None:
        self._stop.set()

    async def close(self) -> None:
        """Stop: deliveries in flight and the loops end, consuming stops, and only then are
        the evaluations in memory handed back (their retries requeued, their leases
        released), so that nothing handed back is delivered to this process again (begun
        anew, its rules started and dropped once more); then the connections close."""
        if self.private_queue and not self._stopping:
            self.rt.history.record("worker_stopping")
        self._stopping = True
        tasks = [*self._tasks, *self._deliveries]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.rt.broker.stop_consuming()
        await drive(self.controller.shutdown(), self.rt)
        await self.rt.broker.close()
        await self.rt.store.close()
        self.rt.history.record("worker_stopped", metrics=self.rt.metrics.totals())
        self.rt.history.close()


#: How often a worker on PostgreSQL deletes what is past its retention (Redis expires keys
#: on its own; lookups treat an expired run as gone meanwhile).
RETENTION_EVERY_S = 600.0


async def _retention(store: PostgresStore) -> None:
    """Delete the evaluations past their 7 days, at start and every `RETENTION_EVERY_S`."""
    while True:
        try:
            while await store.purge_expired() > 0:  # by the thousand, until none is left
                pass
        except Exception as exc:  # the database away: the next round tries again
            log.warning("retention: %r", exc)
        await asyncio.sleep(RETENTION_EVERY_S)


def _agent_profile(raw: str | None) -> AgentProfile:
    """A JSON object, or a path to a JSON/YAML file; empty means the default profile."""
    if not raw:
        return AgentProfile()
    text = raw
    if not raw.lstrip().startswith("{"):
        text = Path(raw).read_text(encoding="utf-8")
    import yaml

    return AgentProfile.from_dict(yaml.safe_load(text))


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m engine.worker", description=OneLineParser.summary(__doc__))
    p.add_argument(
        "--store",
        choices=STORES,
        help="where results, statuses and leases live (default $ENGINE_STORE or redis); "
        "postgres reads $EAI_DATABASE_URL and $EAI_TENANT_ID",
    )
    p.add_argument(
        "--system",
        choices=list(SYSTEMS),
        help="the design, its store and broker: redis-rabbitmq (the default), pg-store "
        "(--store postgres) or pg (PostgreSQL alone: jobs in the store's database)",
    )
    p.add_argument("--redis-url", help="default: $REDIS_URL or redis://127.0.0.1:6379/0")
    p.add_argument("--amqp-url", help="default: $AMQP_URL or amqp://guest:***@127.0.0.1:5672/")
    p.add_argument("--namespace", help="prefix of queues, exchanges and index keys")
    p.add_argument("--time-scale", type=float, help="multiply retry delays (0.001: 30 s -> 30 ms)")
    p.add_argument("--max-evaluations", type=int, help="evaluations in memory at once")
    p.add_argument("--max-parallel", type=int, help="rules of one evaluation in flight at once")
    p.add_argument("--heartbeat-ms", type=int, help="how often a lease is renewed")
    p.add_argument("--stale-ms", type=int, help="a heartbeat older than this is a dead owner")
    p.add_argument("--sweep-ms", type=int, help="how often the sweeper looks for stale work")
    p.add_argument(
        "--retry-grace-ms", type=int, help="a retry overdue by more is lost: re-published"
    )
    p.add_argument("--connect-timeout-s", type=float, help="per connection (default 5)")
    p.add_argument("--read-timeout-s", type=float, help="per command or broker call (default 30)")
    p.add_argument(
        "--wait-replicas",
        type=int,
        help="replicas that must hold each batch of writes before it counts (Redis WAIT; 0)",
    )
    p.add_argument("--wait-timeout-ms", type=int, help="how long WAIT waits (default 1000)")
    p.add_argument("--no-sweeper", action="store_true", help="leave the hole after the ACK open")
    p.add_argument("--immediate-retries", type=int, help="level 1 (default 2)")
    p.add_argument("--max-attempts", type=int, help="level 2 attempts before level 3 (default 3)")
    p.add_argument("--tiers-ms", help="comma-separated delay tiers (default 30000,120000,600000)")
    p.add_argument("--jitter", type=float, help="positive jitter fraction of a tier (default 0.1)")
    p.add_argument(
        "--jitter-buckets", type=int, help="delay queues per tier, the jitter's steps (default 4)"
    )
    p.add_argument("--seed", type=int, default=None, help="seed of the jitter")
    p.add_argument(
        "--agent", help="fake agent profile: JSON object or file (default $ENGINE_AGENT)"
    )
    p.add_argument(
        "--agent-id-prefix",
        default="",
        help="the fake agent draws from the attemptId without this prefix (a run's own ids)",
    )
    p.add_argument("--failpoint", action="append", default=[], help="NAME=ACTION[,hit=N]...")
    p.add_argument("--history", help="append the event history (JSON lines) to this file")
    p.add_argument("--worker-id", help="this worker's name in the history and leases")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1")
    p.add_argument(
        "--log-level",
        default=os.environ.get("ENGINE_LOG_LEVEL", "WARNING"),
        help="DEBUG, INFO, WARNING (default, or $ENGINE_LOG_LEVEL), ERROR",
    )
    p.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        help="uvloop (the default, when installed) or asyncio's own ($ENGINE_EVENT_LOOP)",
    )
    return p


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    tiers = None
    if args.tiers_ms:
        tiers = tuple(int(t) for t in args.tiers_ms.split(","))
    policy = policy_from(
        immediate_retries=args.immediate_retries,
        max_attempts=args.max_attempts,
        tiers_ms=tiers,
        jitter=args.jitter,
        jitter_buckets=args.jitter_buckets,
        seed=args.seed,
    )
    store, broker = of_system(args.system, args.store)
    return env_config(
        store=store,
        broker=broker,
        redis_url=args.redis_url,
        amqp_url=args.amqp_url,
        namespace=args.namespace,
        time_scale=args.time_scale,
        max_evaluations=args.max_evaluations,
        max_parallel=args.max_parallel,
        heartbeat_ms=args.heartbeat_ms,
        stale_ms=args.stale_ms,
        sweep_ms=args.sweep_ms,
        retry_grace_ms=args.retry_grace_ms,
        connect_timeout_s=args.connect_timeout_s,
        read_timeout_s=args.read_timeout_s,
        wait_replicas=args.wait_replicas,
        wait_timeout_ms=args.wait_timeout_ms,
        sweeper=False if args.no_sweeper else None,
        policy=policy,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args)
        specs = ";".join([os.environ.get("ENGINE_FAILPOINTS", ""), *args.failpoint])
        failpoints = Failpoints(parse_specs(specs))
        profile = _agent_profile(args.agent or os.environ.get("ENGINE_AGENT"))
        loop = args.event_loop or os.environ.get("ENGINE_EVENT_LOOP") or "uvloop"
        if loop not in EVENT_LOOPS:
            raise ValueError(f"ENGINE_EVENT_LOOP: expected one of {', '.join(EVENT_LOOPS)}")
    except (ValueError, FailpointError, AgentProfileError, OSError) as exc:
        print(f"engine.worker: {exc}", file=sys.stderr)
        return 2
    agent: AgentService = FakeAgent(
        profile,
        time_scale=config.time_scale,
        immediate_retries=config.policy.immediate_retries,  # numbers calls for fail_rules
    )
    if args.agent_id_prefix:
        agent = UnscopedAgent(agent, args.agent_id_prefix)
    # Long-lived imports and config go to the permanent generation, and young collections
    # run less often: a worker allocates many short-lived futures and few cycles.
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)
    return _run(_serve(config, agent, failpoints, args), loop)


#: The worker's event loops: uvloop is the default, though asyncio's own measured no
#: different for a worker's rules (`bench/rules_per_second.py --worker-arg`).
EVENT_LOOPS = ("uvloop", "asyncio")


def _run(main: Coroutine[Any, Any, int], loop: str = "uvloop") -> int:
    """uvloop when installed, asyncio's own loop otherwise or when asked."""
    if loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)


async def _serve(
    config: EngineConfig, agent: AgentService, failpoints: Failpoints, args: argparse.Namespace
) -> int:
    worker = Worker(config, agent, failpoints, args.history, args.worker_id, args.metrics_port)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    try:
        await worker.run()
    except ServiceUnavailable as exc:
        print(f"engine.worker: {exc}", file=sys.stderr)
        await worker.close()
        return 3
    except OSError as exc:  # the metrics port is taken
        print(f"engine.worker: cannot start: {type(exc).__name__}: {exc}", file=sys.stderr)
        await worker.close()
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
