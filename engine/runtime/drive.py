"""The asyncio driver of `engine.shell`: each effect carried out on Redis and RabbitMQ.

A reply goes back into the step with `send`, an error with `throw` (a cancellation too, so
the step's own `finally` blocks run and it decides what propagates). `LiveHost` runs the
steps that spawn tasks of their own as asyncio tasks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from engine.runtime.context import Runtime, log, settle
from engine.runtime.store import LeaseLost, now_ms
from engine.shell import effects as fx


async def drive(step: fx.Step, rt: Runtime) -> Any:
    """Run `step` to its end; its return value is returned."""
    stepper = fx.Stepper(step)
    while (effect := stepper.next()) is not None:
        try:
            stepper.reply(await _carry_out(effect, rt))
        except BaseException as exc:  # into the step, which decides
            stepper.fail(exc)
    return stepper.value


async def _carry_out(effect: fx.Effect, rt: Runtime) -> Any:
    match effect:
        case fx.Store(op=op, args=args):
            return await getattr(rt.store, op)(*args)
        case fx.Record(event=event, fields=fields):
            rt.history.record(event, **fields)
            return None
        case fx.Clock():
            return now_ms()
        case fx.Monotonic():
            return time.monotonic()
        case fx.Acquire(lock=lock):
            return await lock.acquire()
        case fx.Settle(delivery=delivery, ack=ack):
            return await settle(delivery, ack=ack)
        case fx.CallAgent(attempt_id=a, rule=rule, attempt=attempt, try_no=try_no, execution=n):
            return await rt.agent.evaluate(a, rule, attempt, try_no, execution=n)
        case fx.Failpoint(name=name, rule=rule_id, attempt_id=a):
            return await rt.failpoints.hit(name, rule_id, a)
        case fx.Count(metric=metric, amount=amount, labels=labels):
            counter = getattr(rt.metrics, metric)
            (counter.labels(**dict(labels)) if labels else counter).inc(amount)
            return None
        case fx.PublishWork(body=body, message_id=message_id):
            return await rt.broker.publish_work(dict(body), message_id)
        case fx.PublishEvent(routing_key=key, body=body, message_id=message_id):
            return await rt.broker.publish_event(key, dict(body), message_id)
        case fx.PublishRetry(tier=tier, bucket=bucket, body=body, message_id=message_id):
            return await rt.broker.publish_retry(tier, bucket, dict(body), message_id)
        case fx.Forward(holder=holder, delivery=message):
            queue = rt.config.name(f"worker.{holder}")
            return await rt.broker.forward(queue, message.body, message.message_id)
        case fx.Gauge(metric=metric, value=value):
            getattr(rt.metrics, metric).set(value)
            return None
        case fx.Sleep(seconds=seconds):
            return await asyncio.sleep(seconds)
        case fx.Join(task=task):
            return await asyncio.shield(task)
        case fx.Log(level=level, message=message, error=error):
            if isinstance(error, LeaseLost):  # fenced off: another worker owns it now
                level = "warning"
            trace = error if level == "error" else None
            log.log(logging.getLevelName(level.upper()), "%s", message, exc_info=trace)
            return None
    raise TypeError(f"not an effect: {effect!r}")


class LiveHost:
    """Steps that run tasks of their own, as asyncio tasks of this worker."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def spawn(self, step: fx.Step, on_done: Callable[[Any], None] | None = None) -> Any:
        task = asyncio.ensure_future(drive(step, self.rt))
        if on_done is not None:
            task.add_done_callback(on_done)
        return task

    def cancel(self, task: Any) -> None:
        task.cancel()

    def current(self) -> Any:
        return asyncio.current_task()

    def lock(self) -> asyncio.Lock:
        return asyncio.Lock()

    def semaphore(self, value: int) -> asyncio.Semaphore:
        return asyncio.Semaphore(value)
