"""RabbitMQ, the first memory: the work queue, the delay tiers, events and control.

Topology (every name prefixed by the namespace):
- `evaluation.execute`: durable work queue. Execute and retry messages both land here,
  consumed with manual ACK.
- `evaluation.retry.t{tier}.b{bucket}.{ttl}ms`: one durable delay queue per tier and jitter
  bucket, with a queue-level `x-message-ttl`; expired messages dead-letter through the
  default exchange back to the work queue. No consumer ever reads them. The TTL is in the
  name, so a different time scale declares new queues instead of failing on old ones.
- `evaluation.events` (topic): evaluation.started, evaluation.pass_result,
  evaluation.completed.
- `evaluation.control` (fanout): cancel broadcasts, bound to each worker's private queue.
- `worker.{id}`: each worker's exclusive queue. Messages for an evaluation another live
  worker owns are forwarded there; the broker deleting it when the connection dies is how
  a worker learns that an owner is gone.

Publisher confirms are on and work messages are `mandatory`: an unroutable message raises
instead of being confirmed into the void.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import aio_pika
import orjson
from aio_pika.abc import (
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustChannel,
    AbstractRobustConnection,
)
from aio_pika.exceptions import PublishError

from engine.config import EngineConfig

log = logging.getLogger("engine.broker")

Handler = Callable[[AbstractIncomingMessage], Awaitable[None]]


_TRANSIENT = (
    TimeoutError,
    ConnectionError,
    aio_pika.exceptions.AMQPConnectionError,
    aio_pika.exceptions.ChannelClosed,
    aio_pika.exceptions.ChannelInvalidStateError,
)


class Unroutable(RuntimeError):
    """The broker returned a mandatory message: no queue was bound to its route."""


class Broker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.work_queue_name = config.name("evaluation.execute")
        self.connection: AbstractRobustConnection | None = None
        self.channel: AbstractRobustChannel | None = None
        self.events: AbstractExchange | None = None
        self.control: AbstractExchange | None = None
        self.delay_queues: dict[tuple[int, int], str] = {}

    async def connect(self, prefetch: int = 32) -> None:
        self.connection = await aio_pika.connect_robust(
            self.config.amqp_url, reconnect_interval=0.5, fail_fast=True
        )
        channel = await self.connection.channel(publisher_confirms=True, on_return_raises=True)
        self.channel = channel  # type: ignore[assignment]
        await channel.set_qos(prefetch_count=prefetch)
        await self.declare()

    async def declare(self) -> None:
        ch = self._ch()
        await ch.declare_queue(self.work_queue_name, durable=True)
        for tier, bucket, ms in self.config.policy.delay_queues():
            ttl = max(1, round(ms * self.config.time_scale))
            name = self.config.name(f"evaluation.retry.t{tier + 1}.b{bucket}.{ttl}ms")
            await ch.declare_queue(
                name,
                durable=True,
                arguments={
                    "x-message-ttl": ttl,
                    "x-dead-letter-exchange": "",
                    "x-dead-letter-routing-key": self.work_queue_name,
                },
            )
            self.delay_queues[(tier, bucket)] = name
        self.events = await ch.declare_exchange(
            self.config.name("evaluation.events"), aio_pika.ExchangeType.TOPIC, durable=True
        )
        self.control = await ch.declare_exchange(
            self.config.name("evaluation.control"), aio_pika.ExchangeType.FANOUT, durable=True
        )

    async def close(self) -> None:
        if self.connection is not None:
            await self.connection.close()
            self.connection = None

    def _ch(self) -> AbstractRobustChannel:
        if self.channel is None:
            raise RuntimeError("broker not connected")
        return self.channel

    # --- consuming ----------------------------------------------------------------------

    async def consume_work(self, handler: Handler) -> AbstractQueue:
        queue = await self._ch().declare_queue(self.work_queue_name, durable=True)
        await queue.consume(handler, no_ack=False)
        return queue

    async def consume_private(self, worker_id: str, handler: Handler) -> str:
        """The worker's own queue: forwarded messages and control broadcasts."""
        name = self.config.name(f"worker.{worker_id}")
        queue = await self._ch().declare_queue(name, exclusive=True, auto_delete=True)
        assert self.control is not None
        await queue.bind(self.control)
        await queue.consume(handler, no_ack=False)
        return name

    # --- publishing ---------------------------------------------------------------------

    async def publish_work(self, body: dict[str, Any], message_id: str) -> None:
        await self._publish(None, self.work_queue_name, body, message_id, mandatory=True)

    async def publish_retry(
        self, tier: int, bucket: int, body: dict[str, Any], message_id: str
    ) -> None:
        queue = self.delay_queues[(tier, bucket)]
        await self._publish(None, queue, body, message_id, mandatory=True)

    async def forward(self, queue_name: str, body: bytes, message_id: str | None) -> None:
        """Hand a message to a worker's private queue; `Unroutable` if that worker is gone."""
        await self._publish_raw(None, queue_name, body, message_id, mandatory=True)

    async def publish_event(self, routing_key: str, body: dict[str, Any], message_id: str) -> None:
        """Events are notifications: nobody listening is normal, so not mandatory."""
        assert self.events is not None
        await self._publish(self.events, routing_key, body, message_id, mandatory=False)

    async def publish_control(self, body: dict[str, Any]) -> None:
        assert self.control is not None
        await self._publish(self.control, "", body, None, mandatory=False)

    async def _publish(
        self,
        exchange: AbstractExchange | None,
        key: str,
        body: dict[str, Any],
        msg_id: str | None,
        mandatory: bool,
    ) -> None:
        raw = orjson.dumps(body)
        await self._publish_raw(exchange, key, raw, msg_id, mandatory)

    async def _publish_raw(
        self,
        exchange: AbstractExchange | None,
        key: str,
        raw: bytes,
        msg_id: str | None,
        mandatory: bool,
        expiration_ms: int | None = None,
    ) -> None:
        """Publish with confirms, retrying while the broker is away. `expiration_ms` is a
        per-message TTL, which the engine never uses (see the module docstring)."""
        message = aio_pika.Message(
            raw,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            content_type="application/json",
            message_id=msg_id,
            expiration=None if expiration_ms is None else timedelta(milliseconds=expiration_ms),
        )
        ch = self._ch()
        delay = 0.05
        for attempt in range(60):
            try:
                target = exchange or ch.default_exchange
                await target.publish(message, key, mandatory=mandatory)
                return
            except PublishError as exc:
                raise Unroutable(f"unroutable: routing key {key!r}") from exc
            except _TRANSIENT as exc:
                # The broker restarts: the robust connection reconnects in the background.
                if attempt == 59:
                    raise
                log.warning("publish failed (%s); retrying", type(exc).__name__)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
