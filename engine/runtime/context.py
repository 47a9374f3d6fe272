"""What every part of a live worker shares: its identity, its two memories and its probes."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aio_pika.abc import AbstractIncomingMessage
from aio_pika.exceptions import MessageProcessError

from engine.agent import AgentService
from engine.config import EngineConfig, redacted
from engine.failpoints import Failpoints
from engine.history import History
from engine.metrics import Metrics
from engine.runtime.broker import Broker
from engine.runtime.pgqueue import PgQueue
from engine.runtime.pgstore import PostgresStore, pg_unavailable
from engine.runtime.store import RedisStore, redis_unavailable
from engine.runtime.wire import wire
from engine.shell.window import DeliveryWindow

log = logging.getLogger("engine")

#: The stores the shell runs on, with the same methods and replies (`config.store`).
Store = RedisStore | PostgresStore


def open_store(config: EngineConfig) -> Store:
    """The store `config.store` names (no connection yet: `probe()` makes the first)."""
    return PostgresStore(config) if config.store == "postgres" else RedisStore(config)


def open_broker(config: EngineConfig, store: Store) -> Broker | PgQueue:
    """The first memory `config.broker` names: RabbitMQ, or job rows in the store's database."""
    if config.broker == "postgres":
        assert isinstance(store, PostgresStore)
        return PgQueue(config, store)
    return Broker(config)


def store_unavailable(config: EngineConfig, exc: BaseException) -> ConnectionError:
    """What a failed call to the store means during start-up, as one `ServiceUnavailable`
    line naming the store in use."""
    if config.store == "postgres":
        return pg_unavailable(exc, config.database_url, config.connect_timeout_s)
    return redis_unavailable(exc, config.redis_url, config.connect_timeout_s)


def store_address(config: EngineConfig) -> str:
    """The store, as a ready line or an error shows it (credentials masked)."""
    if config.store == "postgres":
        return f"postgres {redacted(config.database_url)} (tenant {config.tenant_id})"
    return f"redis {redacted(config.redis_url)}"


@dataclass
class Runtime:
    worker_id: str
    config: EngineConfig
    store: Store
    broker: Broker | PgQueue
    agent: AgentService
    failpoints: Failpoints
    history: History
    metrics: Metrics
    window: DeliveryWindow | None = None  # the deliveries held unsettled (None: not watched)


async def settle(message: AbstractIncomingMessage, *, ack: bool = True, timeout_s: float) -> bool:
    """ACK (or NACK with requeue) a delivery; False when its channel is gone.

    A channel lost with the broker takes the delivery with it: the broker requeues it and
    redelivers, and the duplicate checks downstream absorb the second copy. The frame is
    written to the socket at once (`engine.runtime.wire`); a delivery settled already, or
    whose channel is closed or closing, is a lost channel too.
    """
    try:
        channel = message.channel  # ChannelInvalidStateError once it is closed
        w = wire(channel, timeout_s)
        if w is not None:
            if message.locked or message.processed:
                raise MessageProcessError("Message already processed", message)
            assert message.delivery_tag is not None
            w.settle(message.delivery_tag, ack)
            message.lock()  # settled: a second settle of it is refused above
            return True
    except Exception as exc:
        log.warning("could not %s a delivery: %r", "ack" if ack else "nack", exc)
        return False
    return await _settle_through_aiormq(message, ack, timeout_s)


async def _settle_through_aiormq(
    message: AbstractIncomingMessage, ack: bool, timeout_s: float
) -> bool:
    """`settle` on a channel `wire` does not write: through aiormq's writer, whose frame a
    dead connection never writes (its writer is gone and the frame queue full), so the
    wait ends when the channel closes, or after `timeout_s`."""
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
