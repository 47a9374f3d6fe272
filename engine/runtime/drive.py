"""The asyncio driver of `engine.shell`: each effect carried out on Redis and RabbitMQ.

A reply goes back into the step with `send`, an error with `throw` (a cancellation too, so
the step's own `finally` blocks run and it decides what propagates). `LiveHost` runs the
steps that spawn tasks of their own as asyncio tasks.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from engine.failpoints import site
from engine.history import CHECKOUT, History, error_fields
from engine.runtime.context import Runtime, cancelled, log, settle
from engine.runtime.pgqueue import Job
from engine.runtime.store import LeaseLost, now_ms
from engine.shell import effects as fx


async def drive(step: fx.Step, rt: Runtime) -> Any:
    """Run `step` to its end; its return value is returned. An effect that needs no
    waiting (a history event, a metric, the clock) is carried out in place, the others
    are awaited directly, with no coroutine of ours around them."""
    stepper = fx.Stepper(step)
    while (effect := stepper.advance(_NOW, rt)) is not None:
        try:
            stepper.reply(await _LATER[type(effect)](effect, rt))
        except BaseException as exc:  # into the step, which decides
            _fail(stepper, effect, exc)
    return stepper.value


def _fail(stepper: fx.Stepper, effect: fx.Effect, exc: BaseException) -> None:
    if isinstance(exc, asyncio.CancelledError) and not cancelled():
        # This task's cancellation goes in as it is; one that came out of the call (a
        # dying aiormq connection cancels what it had in flight) is a lost connection,
        # which the step handles like any other (it would otherwise end the task
        # silently, an evaluation left in memory half begun).
        exc = ConnectionError(f"{type(effect).__name__} cancelled")
    stepper.fail(exc)


class LoopLag:
    """How late this process's event loop has been running what was due, measured by a
    task that asks to wake every `INTERVAL_S` and notes how much later it woke. The live
    worker records the worst lag of the last `WINDOW_S` with the events a late retry is
    judged by (`LAGGED`): the checker (`retry_delays_respected`) may then allow a start
    that much later, on the process's own evidence rather than on a slack. The simulator
    has no lag and records none."""

    INTERVAL_S = 0.005
    WINDOW_S = 0.25
    #: The events that carry `loop_lag_ms`: a retry's path from its delivery to its start.
    LAGGED = frozenset({"delivered", "forwarded", "slot_granted", "rule_started"})

    def __init__(self) -> None:
        self._samples: collections.deque[tuple[float, float]] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._due = 0.0  # when the measuring task asked to wake next (the loop's clock)

    def lag_ms(self) -> float:
        """The worst lag of the last `WINDOW_S` (ms), the one under way included (the
        measuring task overdue now: a stall just before this event, which the task has not
        yet woken to note); starts the measuring task at first."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._samples.clear()  # another loop's (a test's earlier worker): not this one's
            self._due = loop.time() + self.INTERVAL_S
            self._task = loop.create_task(self._measure())
        samples = self._samples
        horizon = time.monotonic() - self.WINDOW_S
        while samples and samples[0][0] < horizon:
            samples.popleft()
        worst = max((lag for _, lag in samples), default=0.0)
        return round(max(worst, loop.time() - self._due) * 1000, 3)

    async def _measure(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._due = loop.time() + self.INTERVAL_S
            await asyncio.sleep(self.INTERVAL_S)
            late = loop.time() - self._due
            self._samples.append((time.monotonic(), max(late, 0.0)))


_lag = LoopLag()


def _record(e: fx.Record, rt: Runtime) -> None:
    history = rt.history
    if type(history) is not History:  # the default one discards: not even called
        if e.event in LoopLag.LAGGED:
            history.record(e.event, **e.fields, loop_lag_ms=_lag.lag_ms())
        else:
            history.record(e.event, **e.fields)


def _count(e: fx.Count, rt: Runtime) -> None:
    rt.metrics.count(e.metric, e.labels, e.amount)


def _gauge(e: fx.Gauge, rt: Runtime) -> None:
    getattr(rt.metrics, e.metric).set(e.value)


#: Exceptions no fault raises: one raised by the checkout's own code (not a library's, which
#: a lost connection can trip) that reaches the shell's log is the engine's own bug,
#: recorded (`engine_error`, with its traceback) for the checker's `no_engine_error`.
ENGINE_BUGS = (LookupError, TypeError, AttributeError, NameError, AssertionError, ArithmeticError)


def engine_bug(exc: BaseException | None) -> bool:
    """Whether `exc` is an `ENGINE_BUGS` kind raised in the checkout's own code."""
    if not isinstance(exc, ENGINE_BUGS):
        return False
    tb, where = exc.__traceback__, ""
    while tb is not None:
        where, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    return where.startswith(CHECKOUT) and "-packages" not in where


def _log(e: fx.Log, rt: Runtime) -> None:
    level = fx.log_level(e)
    if isinstance(e.error, LeaseLost):  # fenced off: expected
        level = logging.WARNING
    trace = e.error if level == logging.ERROR else None
    log.log(level, "%s", e.message, exc_info=trace)
    if type(rt.history) is not History and engine_bug(e.error):
        rt.history.record("engine_error", **error_fields(e.error, e.message))


def _settle(e: fx.Settle, rt: Runtime) -> Awaitable[bool]:
    if rt.window is not None:
        rt.window.settled(e.delivery)
    if type(e.delivery) is Job:  # a job row of the `pg` design
        return rt.broker.settle(e.delivery, e.ack)  # type: ignore[union-attr]
    return settle(e.delivery, ack=e.ack, timeout_s=rt.config.read_timeout_s)


def _forward(e: fx.Forward, rt: Runtime) -> Awaitable[None]:
    queue = rt.config.name(f"worker.{e.holder}")
    return rt.broker.forward(queue, e.delivery.body, e.delivery.message_id)


def _store(e: fx.Store, rt: Runtime) -> Awaitable[Any]:
    if e.event is None:
        return getattr(rt.store, e.op)(*e.args)
    # where events are rows of the store (`PostgresStore`'s `event`): in one transaction
    ev = e.event
    return getattr(rt.store, e.op)(*e.args, event=(ev.routing_key, ev.message_id, dict(ev.body)))


#: Effects carried out at once.
_NOW: dict[type, Callable[[Any, Runtime], Any]] = {
    fx.Record: _record,
    fx.Count: _count,
    fx.Gauge: _gauge,
    fx.Log: _log,
    fx.Clock: lambda e, rt: now_ms(),
    fx.Monotonic: lambda e, rt: time.monotonic(),
    fx.Failpoint: lambda e, rt: site(e.name) or (fx.WAIT if rt.failpoints.armed else None),
    fx.Acquire: lambda e, rt: None if e.lock.take() else fx.WAIT,
}


#: Effects awaited: each handler returns the awaitable of the service call itself.
_LATER: dict[type, Callable[[Any, Runtime], Awaitable[Any]]] = {
    fx.Store: _store,
    fx.Acquire: lambda e, rt: e.lock.wait(),
    fx.Settle: _settle,
    fx.CallAgent: lambda e, rt: rt.agent.evaluate(
        e.attempt_id, e.rule, e.attempt, e.try_no, execution=e.execution
    ),
    fx.PublishWork: lambda e, rt: rt.broker.publish_work(dict(e.body), e.message_id),
    fx.PublishEvent: lambda e, rt: rt.broker.publish_event(
        e.routing_key, dict(e.body), e.message_id
    ),
    fx.PublishRetry: lambda e, rt: rt.broker.publish_retry(
        e.tier, e.bucket, dict(e.body), e.message_id
    ),
    fx.Failpoint: lambda e, rt: rt.failpoints.hit(e.name, e.rule, e.attempt_id),
    fx.Forward: _forward,
    fx.Sleep: lambda e, rt: asyncio.sleep(e.seconds),
    fx.Join: lambda e, rt: asyncio.shield(e.task),
}


async def detached(step: fx.Step, rt: Runtime, running: set[asyncio.Task[Any]]) -> Any:
    """Run `step` in a task that the caller's cancellation does not reach; `running` holds
    it until it ends (the worker cancels what is left when it stops).

    For deliveries: aio-pika runs each consumer callback in a task of the channel and
    cancels it when the channel closes, which would stop the step half-way, an evaluation
    put in memory and never started. A lost channel is the step's to handle (its ACK
    fails); only the worker's end stops it, as in the simulator.
    """
    task = asyncio.get_running_loop().create_task(drive(step, rt))
    running.add(task)
    task.add_done_callback(running.discard)
    return await asyncio.shield(task)


class LiveHost:
    """Steps that run tasks of their own, as asyncio tasks of this worker."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.recording = type(rt.history) is not History  # the default one discards
        self.failpoints = rt.failpoints.armed  # armed at start or never
        self.outbox = rt.broker.outbox

    def spawn(self, step: fx.Step, on_done: Callable[[Any], None] | None = None) -> Any:
        # The loop's own create_task: what `ensure_future` ends in, without its checks in
        # Python (a task a rule).
        task = asyncio.get_running_loop().create_task(drive(step, self.rt))
        if on_done is not None:
            task.add_done_callback(on_done)
        return task

    def cancel(self, task: Any) -> None:
        task.cancel()

    def current(self) -> Any:
        return asyncio.current_task()

    def lock(self) -> Semaphore:
        return Semaphore(1)

    def semaphore(self, value: int) -> Semaphore:
        return Semaphore(value)


class Semaphore:
    """asyncio's FIFO semaphore (and, of one unit, its lock), as `sim.sync` has it: a free
    unit is taken in place (`take`, no coroutine: the driver's `Acquire` when nobody
    waits), and `release` hands the unit straight to the first waiter. A waiter cancelled
    before its turn leaves the queue; one cancelled just after it was handed the unit
    hands it on."""

    __slots__ = ("_free", "_waiters")

    def __init__(self, value: int = 1) -> None:
        self._free = value
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def locked(self) -> bool:
        """An `Acquire` now would wait."""
        return self._free <= 0 or bool(self._waiters)

    def take(self) -> bool:
        """Take a unit if one is free and nobody waits for it."""
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return True
        return False

    async def wait(self) -> None:
        """Wait for a unit (after `take` found none)."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed over just before: pass it on
                self.release()
            elif fut in self._waiters:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():  # a cancelled waiter is skipped
                fut.set_result(None)
                return
        self._free += 1
