"""The simpy driver of `engine.shell`: each effect carried out on the simulated stack.

The same steps as live: a store operation runs its reference in `sim.redis` (through the
worker's client: latency, retries while Redis is down), a publish goes to `SimBroker`, an
event to the worker's history, an agent call to `FakeAgent.draw` (the live agent's own
draw) and its latency on the simulated clock, a failpoint to `SimFailpoints`. Simulated
Redis has no clock of its own to read, so the operations whose live version reads the
worker's clock get the simulated one. Metrics and log lines go nowhere (no invariant reads
them), except a task's failure that no live fault explains: the simulator's own bug,
raised. `SimHost` runs the steps that spawn tasks as processes of the worker.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import simpy

from engine.agent import agent_error
from engine.core import ProtocolError
from engine.failpoints import InjectedFault
from engine.runtime.store import LeaseLost
from engine.shell import effects as fx
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
    """The live `drive`: run `step` to its end; its return value is returned."""
    stepper = fx.Stepper(step)
    while (effect := stepper.next()) is not None:
        try:
            stepper.reply((yield from _carry_out(effect, w)))
        except simpy.Interrupt:  # a cancellation: no `except Exception` may take it
            stepper.fail(fx.Cancelled())
        except BaseException as exc:  # into the step, which decides
            stepper.fail(exc)
    return stepper.value


def _carry_out(effect: fx.Effect, w: SimWorker) -> Generator[Any, Any, Any]:
    match effect:
        case fx.Store(op=op, args=args):
            clock = (w.store.now_ms(),) if op in _CLOCKED else ()
            return (yield from w.store.call(getattr(w.redis, op), *args, *clock))
        case fx.Record(event=event, fields=fields):
            w.record(event, **fields)
            return None
        case fx.Clock():
            return w.store.now_ms()
        case fx.Monotonic():
            return w.env.now
        case fx.Acquire(lock=lock):
            return (yield from lock.acquire())
        case fx.Settle(delivery=delivery, ack=ack):
            return w.broker.settle(delivery, ack=ack)
        case fx.CallAgent(attempt_id=a, rule=rule, attempt=attempt, try_no=try_no, execution=n):
            d = w.agent.draw(a, rule.id, attempt, try_no, n)  # FakeAgent.evaluate
            delay = d.latency_ms * w.config.time_scale / 1000.0
            if delay > 0:
                yield w.env.timeout(delay)
            if d.error is not None:
                raise agent_error(d.error, tokens=d.tokens)
            return d.result
        case fx.Failpoint(name=name, rule=rule_id, attempt_id=a):
            if w.fp:
                yield from w.fp.hit(name, rule_id, a)
            return None
        case fx.PublishWork(body=body, message_id=message_id):
            return (yield from w.broker.publish_work(dict(body), message_id))
        case fx.PublishEvent(routing_key=key, body=body, message_id=message_id):
            return (yield from w.broker.publish_event(key, dict(body), message_id))
        case fx.PublishRetry(tier=tier, bucket=bucket, body=body, message_id=message_id):
            return (yield from w.broker.publish_retry(tier, bucket, dict(body), message_id))
        case fx.Forward(holder=holder, delivery=d):
            return (yield from w.broker.forward(f"worker.{holder}", d.body, d.message_id))
        case fx.Count() | fx.Gauge():
            return None
        case fx.Sleep(seconds=seconds):
            yield w.env.timeout(seconds)
            return None
        case fx.Join(task=task):
            outcome = yield task
            if isinstance(outcome, _Failed):
                raise outcome.error
            return outcome
        case fx.Log(error=error):
            if isinstance(error, ProtocolError):
                w.run.shell_errors.append(f"{w.worker_id}: {error}")
            if error is not None and not isinstance(error, TASK_ERRORS):
                raise error  # no live fault explains it: the simulator's own bug
            return None
    raise TypeError(f"not an effect: {effect!r}")


class _Failed:
    """A spawned step's error, kept for whoever joins it (`Join`)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class SimHost:
    """Steps that run tasks of their own, as processes of the simulated worker (which a
    death interrupts, all together)."""

    def __init__(self, w: SimWorker) -> None:
        self.w = w
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
