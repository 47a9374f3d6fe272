"""One simulated worker process (one incarnation): `engine.worker.Worker`, on simpy.

It boots (a seeded delay for the interpreter, a Redis ping, the broker connection, its
private queue and the work queue's consumer), then runs the heartbeat and the sweeper.
Every process it starts goes through `spawn`, so that a death reaches all of them:
`die` (a SIGKILL, a `crash` failpoint) interrupts each at the point it is waiting, drops
its connection (the broker requeues what it had not acknowledged, deletes its private
queue) and leaves its leases to expire; requests already on their way to Redis still
land. `terminate` is SIGTERM: deliveries in flight and the loops stop, the consumers are
cancelled, and only then are the evaluations abandoned; the connection closed, then
`worker_stopped`, as the live `Worker.close` does. `freeze` (a `freeze` failpoint) stops
the process without killing it: every process of the worker takes its next step only
after the thaw, whatever it waited for meanwhile (replies, deliveries, its heartbeat's
timer), as the live worker's blocked event loop does.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any, NoReturn

import simpy

from engine.agent import FakeAgent
from engine.config import EngineConfig
from engine.core.messages import decode
from engine.failpoints import Failpoint, fired_fields, released_fields
from engine.metrics import Metrics
from engine.shell import heartbeat
from engine.shell.controller import EvaluationController
from engine.shell.effects import Cancelled
from engine.shell.sweeper import sweeper
from engine.shell.window import DeliveryWindow
from sim.broker import WORK_QUEUE, BrokerClient, Delivery
from sim.drive import TASK_ERRORS, SimHost, drive, engine_error
from sim.failpoints import SimFailpoints
from sim.history import Source
from sim.redis import RedisClient

if TYPE_CHECKING:
    from sim.world import World

EXIT_KILLED = -9  # what `Popen.returncode` says of a SIGKILLed process
EXIT_STOPPED = 0
EXIT_CANNOT_START = 3  # engine.worker: "cannot start" (Redis or the broker away)


class WorkerDied(BaseException):
    """Unwinds the process that killed its own worker (a `crash` failpoint)."""


class SimWorker:
    def __init__(
        self,
        run: World,
        index: int,
        incarnation: int,
        failpoints: str,
        agent: FakeAgent,
        config: EngineConfig,
    ) -> None:
        env = run.env
        self.run = run
        self.env = env
        self.index = index
        self.incarnation = incarnation
        self.worker_id = f"sim-w{index}-{incarnation}"
        self.pid = 10_000 * (index + 1) + incarnation
        self.config = config
        self.agent = agent
        self.history = Source(env, run.events, self.worker_id, self.pid)
        self.metrics = Metrics()  # the live worker's counters, left in `worker_stopped`
        self.record = self.history.record
        self.redis = run.redis
        self.store = RedisClient(
            env,
            run.redis,
            run.net_rng,
            run.options.redis_latency_s,
            link=run.network.link(index, run.store_link),
            read_timeout_s=config.read_timeout_s,
            wait_replicas=config.wait_replicas,
            wait_timeout_s=config.wait_timeout_ms / 1000,
        )
        self.broker = self.first_memory()
        self.fp = (
            SimFailpoints(
                env,
                failpoints,
                self.crash,
                self.freeze,
                self._failpoint_fired,
                history=run.events,
                on_release=self._failpoint_released,
            )
            if failpoints
            else None
        )
        self.frozen_until = 0.0  # simulated time the current freeze ends
        # else no step is watched: a `freeze` failpoint or the runner's `pause_worker`
        self._freezable = (self.fp is not None and self.fp.freezes) or run.pauses
        self.controller = EvaluationController(SimHost(self), config, self.worker_id)
        self.window = DeliveryWindow(
            self.history.record_fields, config.prefetch, config.max_evaluations
        )
        self.alive = True
        self.exit_code: int | None = None
        self.ready = env.event()
        self.exited = env.event()
        self._procs: dict[simpy.Process, None] = {}
        self._loops: list[simpy.Process] = []
        self._deliveries: set[simpy.Process] = set()  # the steps of deliveries, running
        self.stopping = False
        self.spawn(self._boot())

    @property
    def returncode(self) -> int | None:
        return self.exit_code

    def is_ready(self) -> bool:
        return self.ready.triggered

    # --- processes ----------------------------------------------------------------------

    def spawn(self, gen: Generator) -> simpy.Process | None:
        if not self.alive:
            gen.close()
            return None
        proc = self.env.process(self._guarded(gen))
        self._procs[proc] = None
        proc.callbacks.append(self._reap)
        return proc

    def _reap(self, proc: simpy.Event) -> None:
        self._procs.pop(proc, None)  # type: ignore[call-overload]

    def _guarded(self, gen: Generator) -> Generator[Any, Any, None]:
        if not self.alive:  # killed before this process took its first step
            gen.close()
            return
        try:
            if self._freezable:
                yield from self._thawed(gen)
            else:
                yield from gen
        except (simpy.Interrupt, Cancelled, WorkerDied):
            pass
        except TASK_ERRORS:
            pass  # what the live worker only logs (a failed task, a lost delivery)
        except Exception as exc:  # an engine bug ends this task, not the simulation
            engine_error(self, exc, "task")

    def freeze(self, duration_s: float) -> None:
        """Stop the whole process for `duration_s` (the caller sleeps it out itself)."""
        self.frozen_until = max(self.frozen_until, self.env.now + duration_s)

    def _thawed(self, gen: Generator) -> Generator[Any, Any, None]:
        """`yield from gen`, but no step of `gen` runs while the worker is frozen: what it
        waited for is handed to it at the thaw (an interrupt too, unless it is dead)."""
        value: Any = None
        error: BaseException | None = None
        while True:
            while self.alive and self.env.now < self.frozen_until:
                try:
                    yield self.env.timeout(self.frozen_until - self.env.now)
                except simpy.Interrupt as exc:
                    error = exc
            try:
                event = gen.send(value) if error is None else gen.throw(error)
            except StopIteration:
                return
            value, error = None, None
            try:
                value = yield event
            except GeneratorExit:
                gen.close()
                raise
            except BaseException as exc:  # an interrupt: thrown into `gen` at the thaw
                error = exc

    def on_message(self, d: Delivery) -> None:
        """A delivery, run as a process of its own (aio-pika runs each as a task); one that
        reaches a stopping worker is left unacknowledged, as live."""
        if self.stopping:
            return
        if self.alive:
            self.window.delivered(d, (d.conn, d.queue), d.queue)
        # the engine's own messages travel as objects; bytes (a harness's poison) are
        # decoded as the live worker decodes every body
        body = decode(d.body) if isinstance(d.body, bytes) else d.body
        proc = self.spawn(drive(self.controller.on_message(d, body, d.redelivered), self))
        if proc is not None:
            self._deliveries.add(proc)
            proc.callbacks.append(self._deliveries.discard)  # type: ignore[arg-type]

    def _boot(self) -> Generator[Any, Any, None]:
        run, env = self.run, self.env
        lo, hi = run.options.worker_boot_s
        yield env.timeout(run.boot_rng.uniform(lo, hi))  # the interpreter and its imports
        try:
            yield from self.store.call(self.redis.ping)
            if not (yield from self.broker.connect()):
                raise ConnectionError("connect_robust(fail_fast=True): no broker")
            yield from self.subscribe()
        except ConnectionError:  # `_serve`: "cannot start", the worker closed, exit 3
            self.record("worker_stopped", metrics=self.metrics.totals())
            self.die(EXIT_CANNOT_START)
            return
        held = self.controller.evaluations
        beating = drive(heartbeat.heartbeat(self.config, self.worker_id, held), self)
        self._loops.append(self.spawn(beating))  # type: ignore[arg-type]
        if self.config.sweeper:
            sweeping = drive(sweeper(self.config, held), self)
            self._loops.append(self.spawn(sweeping))  # type: ignore[arg-type]
        self.record("worker_started", sweeper=self.config.sweeper)
        self.ready.succeed()

    # --- the first memory (a subclass gives another: `sim.pgqueue.PgSimWorker`) ----------

    def first_memory(self) -> BrokerClient:
        """The client of the work queue, the delay queues and the events: RabbitMQ's."""
        run, config = self.run, self.config
        return BrokerClient(
            self.env,
            run.broker,
            self.worker_id,
            reconnect_interval_s=run.options.reconnect_interval_s,
            spawn=self.spawn,
            link=run.network.link(self.index, "broker"),
            connect_timeout_s=config.connect_timeout_s,
            read_timeout_s=config.read_timeout_s,
            heartbeat_s=run.options.amqp_heartbeat_s,
        )

    def subscribe(self) -> Generator[Any, Any, None]:
        """Consume the private queue and the work queue (`ConnectionError`: cannot start)."""
        prefetch = self.config.prefetch
        yield self.env.timeout(2 * self.run.broker.latency())  # declare, bind, consume
        self.broker.consume_private(f"worker.{self.worker_id}", prefetch, self.on_message)
        self.broker.consume(WORK_QUEUE, prefetch, self.on_message)

    # --- death and shutdown -------------------------------------------------------------

    def _failpoint_fired(self, fp: Failpoint, rule: str | None, attempt_id: str | None) -> None:
        """What the live worker's `Failpoints.on_fire` records."""
        self.record("failpoint_fired", **fired_fields(fp, rule, attempt_id))

    def _failpoint_released(
        self, fp: Failpoint, rule: str | None, attempt_id: str | None, came: bool
    ) -> None:
        """What the live worker's `Failpoints.on_release` records."""
        self.record("failpoint_released", **released_fields(fp, rule, attempt_id, came))

    def crash(
        self, failpoint: str, rule: str | None = None, attempt_id: str | None = None
    ) -> NoReturn:
        self.record("crash", failpoint=failpoint, rule=rule, attempt_id=attempt_id)
        self.die(EXIT_KILLED)
        raise WorkerDied

    def die(self, code: int) -> None:
        """The process is gone: every task stops where it waits, the socket closes."""
        if not self.alive:
            return
        self.alive = False
        self.history.alive = False
        self.exit_code = code
        self.broker.close_now()
        self.store.hang_up()
        active = self.env.active_process
        for proc in list(self._procs):
            if proc is not active and proc.is_alive:
                proc.interrupt()
        self._procs.clear()
        self.exited.succeed(code)

    def terminate(self, timeout_s: float) -> Generator[Any, Any, None]:
        """SIGTERM, then SIGKILL if it has not stopped within `timeout_s` (the runner's)."""
        if not self.alive:
            return
        if not self.ready.triggered:  # no signal handler yet: SIGTERM kills it
            self.die(-15)
            return
        self.spawn(self._close())
        yield self.exited | self.env.timeout(timeout_s)
        self.die(EXIT_KILLED)

    def _close(self) -> Generator[Any, Any, None]:
        if not self.stopping:
            self.record("worker_stopping")
        self.stopping = True
        for proc in [*self._loops, *self._deliveries]:
            if proc.is_alive:
                proc.interrupt()
        yield from self.broker.stop_consuming()
        yield from drive(self.controller.shutdown(), self)
        yield from self.broker.close()
        self.record("worker_stopped", metrics=self.metrics.totals())
        self.die(EXIT_STOPPED)
