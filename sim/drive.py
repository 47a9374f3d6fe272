"""The simpy driver of `engine.shell`: each effect carried out on the simulated stack.

The same steps as live: a store operation runs its reference in `sim.redis` (through the
worker's client: latency, retries while Redis is down), a publish goes to `SimBroker`, an
event to the worker's history. Simulated Redis has no clock of its own to read, so the
operations whose live version reads the worker's clock get the simulated one.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from engine.shell.effects import Clock, Effect, PublishWork, Record, Stepper, Store

if TYPE_CHECKING:
    from sim.worker import SimWorker

#: Store operations whose live version reads the worker's clock (`now_ms()`).
_CLOCKED = frozenset({"stale_evaluations", "claim_stale", "overdue_retries", "claim_retry"})


def drive(step: Generator[Effect, Any, Any], w: SimWorker) -> Generator[Any, Any, Any]:
    """The live `drive`: run `step` to its end; its return value is returned."""
    stepper = Stepper(step)
    while (effect := stepper.next()) is not None:
        try:
            stepper.reply((yield from _carry_out(effect, w)))
        except BaseException as exc:  # into the step, which decides
            stepper.fail(exc)
    return stepper.value


def _carry_out(effect: Effect, w: SimWorker) -> Generator[Any, Any, Any]:
    match effect:
        case Store(op=op, args=args):
            clock = (w.store.now_ms(),) if op in _CLOCKED else ()
            return (yield from w.store.call(getattr(w.redis, op), *args, *clock))
        case PublishWork(body=body, message_id=message_id):
            return (yield from w.broker.publish_work(dict(body), message_id))
        case Record(event=event, fields=fields):
            w.record(event, **fields)
            return None
        case Clock():
            return w.store.now_ms()
    raise TypeError(f"not an effect: {effect!r}")
