"""The simpy driver of `engine.shell`: each effect carried out on the simulated stack.

The same steps as live: a store operation runs its reference in `sim.redis` (through the
worker's client: latency, retries while Redis is down), a publish goes to `SimBroker`, an
event to the worker's history, an agent call to `FakeAgent.draw` (the live agent's own
draw) and its latency on the simulated clock, a failpoint to `SimFailpoints`. Simulated
Redis has no clock of its own to read, so the operations whose live version reads the
worker's clock get the simulated one. The counters are the live worker's own
(`engine.metrics.Metrics`, left in its `worker_stopped`). Log lines go nowhere (their
level checked as `logging` checks it), except a task's failure that no live fault
explains: the simulator's own bug, recorded as an `engine_error` (with its traceback)
that fails the run, as the live driver records one (`engine.runtime.drive`): never an
exception out of the simulator.
`SimHost` runs the steps that spawn tasks as processes of the worker.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import simpy

from engine.agent import agent_error
from engine.core import ProtocolError
from engine.failpoints import InjectedFault, site
from engine.history import error_fields
from engine.shell import effects as fx
from engine.shell.replies import LeaseLost
from sim.redis import SCRIPTS, announcing
from sim.sync import Lock, Semaphore

if TYPE_CHECKING:
    from sim.worker import SimWorker

#: What a live task may fail with short of a bug in the simulator: logged, then abandoned.
TASK_ERRORS = (InjectedFault, ConnectionError, fx.Unroutable, ProtocolError, LeaseLost)

#: Store operations whose live version reads the worker's clock (`now_ms()`).
_CLOCKED = frozenset(
    {"begin", "renew", "stale_evaluations", "claim_stale", "overdue_retries", "claim_retry"}
)


def drive(step: fx.Step, w: SimWorker) -> Generator[Any, Any, Any]:
    """The live `drive`: run `step` to its end; its return value is returned. An effect
    that takes no simulated time is carried out in place, as live."""
    stepper = fx.Stepper(step)
    while (effect := stepper.advance(_NOW, w)) is not None:
        try:
            stepper.reply((yield from _LATER[type(effect)](effect, w)))
        except simpy.Interrupt:  # a cancellation: no `except Exception` may take it
            stepper.fail(fx.Cancelled())
        except BaseException as exc:  # into the step, which decides
            stepper.fail(exc)
    return stepper.value


def _record(e: fx.Record, w: SimWorker) -> None:
    w.history.record_fields(e.event, e.fields)


def _log(e: fx.Log, w: SimWorker) -> None:
    fx.log_level(e)  # what live `logging` refuses, refused here
    if isinstance(e.error, ProtocolError):
        w.run.shell_errors.append(f"{w.worker_id}: {e.error}")
    if e.error is not None and not isinstance(e.error, TASK_ERRORS):
        # no simulated fault explains it: the engine's bug (or the simulator's), judged
        # by `no_engine_error`; the step goes on, as the live worker, which logs it
        engine_error(w, e.error, e.message)


#: Engine errors after which the simulation stops: the run has failed at the first, and an
#: engine that raises at every delivery would otherwise redeliver (and format a traceback)
#: for the rest of the scenario, minutes of work that only repeat the first error.
ENGINE_ERROR_LIMIT = 100


def engine_error(w: SimWorker, exc: BaseException, during: str) -> None:
    """Record what escaped the engine's code (`engine_error`, with its traceback); at the
    `ENGINE_ERROR_LIMIT`th, stop the simulation."""
    w.history.record_fields("engine_error", error_fields(exc, during))
    w.run.engine_error_seen()


def _settle(e: fx.Settle, w: SimWorker) -> Any:
    """A settle is a frame sent (RabbitMQ's: no wait), or `WAIT` from a client whose settle
    is a round trip the step waits for (`sim.pgqueue`): then `_LATER` carries it out."""
    w.window.settled(e.delivery)
    return w.broker.settle(e.delivery, ack=e.ack)


def _store(e: fx.Store, w: SimWorker) -> Generator[Any, Any, Any]:
    clock = (w.store.now_ms(),) if e.op in _CLOCKED else ()
    op = getattr(w.redis, e.op)
    if e.event is not None:  # an outbox's event, in the operation's transaction
        op = announcing(w.redis, w.broker.jobs, e.op, op, e.event)
    return w.store.call(op, *e.args, *clock, batched=e.op in SCRIPTS)


def _call_agent(e: fx.CallAgent, w: SimWorker) -> Generator[Any, Any, Any]:
    d = w.agent.draw(e.attempt_id, e.rule.id, e.attempt, e.try_no, e.execution)
    delay = d.latency_ms * w.config.time_scale / 1000.0  # FakeAgent.evaluate's sleep
    if delay > 0:
        yield w.env.timeout(delay)
    if d.error is not None:
        raise agent_error(d.error, tokens=d.tokens)
    return d.result


def _sleep(e: fx.Sleep, w: SimWorker) -> Generator[Any, Any, None]:
    yield w.env.timeout(e.seconds)


def _join(e: fx.Join, w: SimWorker) -> Generator[Any, Any, Any]:
    outcome = yield e.task
    if isinstance(outcome, _Failed):
        raise outcome.error
    return outcome


#: Effects that take no simulated time.
_NOW: dict[type, Callable[[Any, SimWorker], Any]] = {
    fx.Record: _record,
    fx.Count: lambda e, w: w.metrics.count(e.metric, e.labels, e.amount),
    fx.Gauge: lambda e, w: getattr(w.metrics, e.metric).set(e.value),
    fx.Log: _log,
    fx.Clock: lambda e, w: w.store.now_ms(),
    fx.Monotonic: lambda e, w: w.env.now,
    fx.Settle: _settle,
    fx.Failpoint: lambda e, w: site(e.name) or (fx.WAIT if w.fp else None),
}
#: Effects that may: each handler returns the generator that carries it out.
_LATER: dict[type, Callable[[Any, SimWorker], Generator[Any, Any, Any]]] = {
    fx.Store: _store,
    fx.Acquire: lambda e, w: e.lock.acquire(),
    fx.CallAgent: _call_agent,
    fx.Failpoint: lambda e, w: w.fp.hit(e.name, e.rule, e.attempt_id),
    fx.PublishWork: lambda e, w: w.broker.publish_work(dict(e.body), e.message_id),
    fx.PublishEvent: lambda e, w: w.broker.publish_event(e.routing_key, dict(e.body), e.message_id),
    fx.PublishRetry: lambda e, w: w.broker.publish_retry(
        e.tier, e.bucket, dict(e.body), e.message_id
    ),
    fx.Forward: lambda e, w: w.broker.forward(
        f"worker.{e.holder}", e.delivery.body, e.delivery.message_id
    ),
    fx.Sleep: _sleep,
    fx.Join: _join,
    fx.Settle: lambda e, w: w.broker.settle_later(e.delivery, ack=e.ack),  # after a WAIT
}


class _Failed:
    """A spawned step's error, kept for whoever joins it (`Join`)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class SimHost:
    """Steps that run tasks of their own, as processes of the simulated worker (which a
    death interrupts, all together)."""

    recording = True  # every event goes to the run's history
    failpoints = True  # every failpoint is a hit the simulated worker sees

    def __init__(self, w: SimWorker) -> None:
        self.w = w
        self.outbox: bool = w.broker.outbox
        self._cancelled: set[simpy.Process] = set()

    def spawn(self, step: fx.Step, on_done: Callable[[Any], None] | None = None) -> Any:
        proc = self.w.spawn(self._run(step))
        if proc is not None:
            proc.callbacks.append(self._cancelled.discard)
            if on_done is not None:
                proc.callbacks.append(on_done)
        return proc

    def _run(self, step: fx.Step) -> Generator[Any, Any, Any]:
        if self.w.env.active_process in self._cancelled:  # before its first step
            step.close()
            return None
        try:
            return (yield from drive(step, self.w))
        except TASK_ERRORS as exc:  # kept for `Join` (asyncio's task keeps it too)
            return _Failed(exc)
        except Exception as exc:  # an engine bug: recorded, and kept for `Join` too
            engine_error(self.w, exc, "task")
            return _Failed(exc)

    def cancel(self, task: Any) -> None:
        if task.is_alive:
            self._cancelled.add(task)
            task.interrupt()

    def current(self) -> Any:
        return self.w.env.active_process

    def lock(self) -> Lock:
        return Lock(self.w.env)

    def semaphore(self, value: int) -> Semaphore:
        return Semaphore(self.w.env, value)
