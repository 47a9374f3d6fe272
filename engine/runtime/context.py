"""What every part of a live worker shares: its identity, its two memories and its probes."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aio_pika.abc import AbstractIncomingMessage

from engine.agent import AgentService
from engine.config import EngineConfig
from engine.failpoints import Failpoints
from engine.history import History
from engine.metrics import Metrics
from engine.runtime.broker import Broker
from engine.runtime.store import RedisStore

log = logging.getLogger("engine")


@dataclass
class Runtime:
    worker_id: str
    config: EngineConfig
    store: RedisStore
    broker: Broker
    agent: AgentService
    failpoints: Failpoints
    history: History
    metrics: Metrics


async def settle(message: AbstractIncomingMessage, *, ack: bool = True, timeout_s: float) -> bool:
    """ACK (or NACK with requeue) a delivery; False when its channel is gone.

    A channel lost with the broker takes the delivery with it: the broker requeues it and
    redelivers, and the duplicate checks downstream absorb the second copy. An ACK waits
    for its frame to be written, which a dead connection never does (its writer is gone
    and the frame queue full): the wait ends when the channel closes, or after
    `timeout_s`, and counts as a lost channel either way.
    """
    try:
        closing = message.channel.closing  # an observer of the channel's end, ours to drop
        async with asyncio.timeout(timeout_s) as bound:
            waiting = True

            def cut_short(_: object) -> None:
                if waiting and not bound.expired():
                    bound.reschedule(-1)  # at once: the frame will never be written

            closing.add_done_callback(cut_short)
            try:
                if ack:
                    await message.ack()
                else:
                    await message.nack(requeue=True)
            finally:
                waiting = False
                closing.remove_done_callback(cut_short)
                closing.cancel()
    except (Exception, asyncio.CancelledError) as exc:  # the channel closed under us
        if isinstance(exc, asyncio.CancelledError) and cancelled():
            raise
        log.warning("could not %s a delivery: %r", "ack" if ack else "nack", exc)
        return False
    return True


def cancelled() -> bool:
    """Whether this task is being cancelled. aiormq cancels the frames it had in flight
    when its connection dies, so a `CancelledError` out of an ACK or a publish may be the
    connection's, not this task's: only this task's must go on propagating."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0
