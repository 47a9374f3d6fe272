"""The asyncio driver of `engine.shell`: each effect carried out on Redis and RabbitMQ.

A reply goes back into the step with `send`, an error with `throw` (a cancellation too, so
the step's own `finally` blocks run and it decides what propagates).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from engine.runtime.context import Runtime
from engine.runtime.store import now_ms
from engine.shell.effects import Clock, Effect, PublishWork, Record, Stepper, Store


async def drive(step: Generator[Effect, Any, Any], rt: Runtime) -> Any:
    """Run `step` to its end; its return value is returned."""
    stepper = Stepper(step)
    while (effect := stepper.next()) is not None:
        try:
            stepper.reply(await _carry_out(effect, rt))
        except BaseException as exc:  # into the step, which decides
            stepper.fail(exc)
    return stepper.value


async def _carry_out(effect: Effect, rt: Runtime) -> Any:
    match effect:
        case Store(op=op, args=args):
            return await getattr(rt.store, op)(*args)
        case PublishWork(body=body, message_id=message_id):
            return await rt.broker.publish_work(dict(body), message_id)
        case Record(event=event, fields=fields):
            rt.history.record(event, **fields)
            return None
        case Clock():
            return now_ms()
    raise TypeError(f"not an effect: {effect!r}")
