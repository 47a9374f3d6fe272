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

Every operation is bounded: the connection by the config's connect timeout, each broker
call (declare, bind, consume, publish with its confirm) by its read timeout. The first
connection fails fast (`fail_fast`) and becomes one `ServiceUnavailable` line; later ones
are the robust connection's business (a broker restart must not kill the worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

import aio_pika
import aiormq
import orjson
from aio_pika.abc import (
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustChannel,
    AbstractRobustConnection,
)
from aio_pika.exceptions import (
    AMQPError,
    AuthenticationError,
    ChannelNotFoundEntity,
    ProbableAuthenticationError,
    PublishError,
)

from engine.config import EngineConfig, ServiceUnavailable, network_reason, scrubbed
from engine.runtime import wire as frames
from engine.runtime.wire import Transports, Wire, link, wire
from engine.shell.effects import Unroutable

log = logging.getLogger("engine.broker")

Handler = Callable[[AbstractIncomingMessage], Awaitable[None]]


_TRANSIENT = (
    TimeoutError,
    ConnectionError,
    aio_pika.exceptions.AMQPConnectionError,
    aio_pika.exceptions.ChannelClosed,
    aio_pika.exceptions.ChannelInvalidStateError,
)


#: How long a stopping worker waits for each consumer's cancel: it hands its evaluations
#: back only after, and a stop is given a few seconds before SIGKILL.
CANCEL_TIMEOUT_S = 1.0


def delay_queue_names(config: EngineConfig) -> dict[tuple[int, int], tuple[str, int]]:
    """(tier, bucket) -> its delay queue's name and TTL (ms). The TTL is in the name: a
    different time scale declares new queues instead of failing on old ones."""
    names: dict[tuple[int, int], tuple[str, int]] = {}
    for tier, bucket, ms in config.policy.delay_queues():
        ttl = max(1, round(ms * config.time_scale))
        name = config.name(f"evaluation.retry.t{tier + 1}.b{bucket}.{ttl}ms")
        names[(tier, bucket)] = (name, ttl)
    return names


class QueueInUse(RuntimeError):
    """A queue to delete still has consumers (a worker of the namespace is running)."""


def amqp_unavailable(exc: BaseException, url: str, timeout_s: float) -> ServiceUnavailable:
    """What a failed first contact with RabbitMQ means, as the one line `ServiceUnavailable`."""
    if isinstance(exc, ServiceUnavailable):
        return exc
    text = scrubbed(str(exc), url)
    if isinstance(exc, ProbableAuthenticationError | AuthenticationError) or (
        "ACCESS_REFUSED" in text
    ):
        reason = "login refused: wrong user name or password"
        return ServiceUnavailable("RabbitMQ", url, reason, "AMQP_URL", login=True)
    reason = network_reason(exc, timeout_s)
    if reason is not None:
        return ServiceUnavailable("RabbitMQ", url, reason, "AMQP_URL")
    if "Connection.Close" in text:  # refused after the login: most often an unknown vhost
        reason = "the broker closed the connection: unknown virtual host, or no access to it"
        return ServiceUnavailable("RabbitMQ", url, reason, "AMQP_URL", todo="check AMQP_URL")
    reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return ServiceUnavailable("RabbitMQ", url, reason, "AMQP_URL", todo="check AMQP_URL")


class _Drop(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextlib.contextmanager
def _quiet_first_connect() -> Iterator[None]:
    """aiormq logs a failed first connection at ERROR before raising it; the caller turns
    the exception into one line, so that log record would only be noise."""
    loggers = [logging.getLogger(n) for n in ("aiormq.connection", "aio_pika.robust_connection")]
    drop = _Drop()
    for lg in loggers:
        lg.addFilter(drop)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(drop)


async def probe_amqp(config: EngineConfig) -> None:
    """Open and close one connection; raise `ServiceUnavailable` saying why it failed."""
    timeout = config.connect_timeout_s
    try:
        with _quiet_first_connect():
            connection = await aio_pika.connect(config.amqp_url, timeout=timeout)
    except (AMQPError, OSError, ValueError) as exc:  # TimeoutError is an OSError
        raise amqp_unavailable(exc, config.amqp_url, timeout) from None
    await connection.close()


class _Connection(aio_pika.RobustConnection):
    """A robust connection whose publishes and ACKs `engine.runtime.wire` writes: its
    transports are made by a `Transports`, each linked to its aiormq connection once open,
    before the channels (and their consumers) are restored on it."""

    def __init__(self, url: Any, loop: asyncio.AbstractEventLoop | None = None, **kw: Any) -> None:
        super().__init__(url, loop=loop, **kw)
        self.transports = Transports()
        self.kwargs["transport_factory"] = self.transports

    async def _on_connected(self) -> None:
        assert self.transport is not None
        link(self.transport.connection, self.transports)
        await super()._on_connected()


class Broker:
    #: Whether events are rows of the store, written with their flag (`drive`): not here.
    outbox = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.work_queue_name = config.name("evaluation.execute")
        self.connection: AbstractRobustConnection | None = None
        self.channel: AbstractRobustChannel | None = None
        self.events: AbstractExchange | None = None
        self.control: AbstractExchange | None = None
        self.delay_queues: dict[tuple[int, int], str] = {}
        self.declared: list[str] = []  # `queue:NAME` / `exchange:NAME`, for the topology key
        self.timeout = config.read_timeout_s
        self._wire: Wire | None = None  # the current channel's
        self._consuming: list[tuple[AbstractQueue, str]] = []  # (queue, consumer tag)

    async def connect(self, prefetch: int = 32, declare: bool = True) -> None:
        """Connect, open the channel and declare the topology. Any failure on the way is a
        `ServiceUnavailable` (the broker is not usable), and leaves nothing open."""
        url, connect_s = self.config.amqp_url, self.config.connect_timeout_s
        try:
            with _quiet_first_connect():
                self.connection = await aio_pika.connect_robust(
                    url,
                    reconnect_interval=0.5,
                    fail_fast=True,
                    timeout=connect_s,
                    connection_class=_Connection,
                )
            channel = await asyncio.wait_for(
                self.connection.channel(publisher_confirms=True, on_return_raises=True),
                self.timeout,
            )
            self.channel = channel  # type: ignore[assignment]
            await channel.set_qos(prefetch_count=prefetch, timeout=self.timeout)
            if declare:
                await self.declare()
        except (AMQPError, OSError, ValueError) as exc:  # TimeoutError is an OSError
            await self.close()
            raise amqp_unavailable(exc, url, connect_s) from None

    async def declare(self) -> None:
        ch, t = self._ch(), self.timeout
        await ch.declare_queue(self.work_queue_name, durable=True, timeout=t)
        self.declared = [f"queue:{self.work_queue_name}"]
        for (tier, bucket), (name, ttl) in delay_queue_names(self.config).items():
            await ch.declare_queue(
                name,
                durable=True,
                arguments={
                    "x-message-ttl": ttl,
                    "x-dead-letter-exchange": "",
                    "x-dead-letter-routing-key": self.work_queue_name,
                },
                timeout=t,
            )
            self.delay_queues[(tier, bucket)] = name
            self.declared.append(f"queue:{name}")
        events, control = (
            self.config.name("evaluation.events"),
            self.config.name("evaluation.control"),
        )
        self.events = await ch.declare_exchange(
            events, aio_pika.ExchangeType.TOPIC, durable=True, timeout=t
        )
        self.control = await ch.declare_exchange(
            control, aio_pika.ExchangeType.FANOUT, durable=True, timeout=t
        )
        self.declared += [f"exchange:{events}", f"exchange:{control}"]

    async def close(self) -> None:
        connection, self.connection, self.channel = self.connection, None, None
        if connection is not None:
            with contextlib.suppress(AMQPError, OSError):
                await asyncio.wait_for(connection.close(), self.timeout)

    async def delete_topology(self, members: Iterable[str]) -> list[str]:
        """Delete the given `queue:NAME` / `exchange:NAME`; return what was deleted.

        Raises `QueueInUse`, deleting nothing, when a queue still has consumers: deleting
        it under a running worker would lose its messages.
        """
        assert self.connection is not None
        items = sorted(set(members))
        queues = [m.partition(":")[2] for m in items if m.startswith("queue:")]
        exchanges = [m.partition(":")[2] for m in items if m.startswith("exchange:")]
        t = self.timeout
        for name in queues:
            ch = await asyncio.wait_for(self.connection.channel(publisher_confirms=False), t)
            try:
                queue = await ch.declare_queue(name, passive=True, timeout=t)
            except ChannelNotFoundEntity:
                continue  # gone already (the failed passive declare closed the channel)
            result = queue.declaration_result
            await ch.close()
            if result.consumer_count:
                raise QueueInUse(
                    f"queue {name} has {result.consumer_count} consumer(s); "
                    "stop the workers of this namespace first"
                )
        ch = await asyncio.wait_for(self.connection.channel(publisher_confirms=False), t)
        try:
            for name in queues:
                await ch.queue_delete(name, timeout=t)
            for name in exchanges:
                await ch.exchange_delete(name, timeout=t)
        finally:
            await ch.close()
        return items

    def _ch(self) -> AbstractRobustChannel:
        if self.channel is None:
            raise RuntimeError("broker not connected")
        return self.channel

    # --- consuming ----------------------------------------------------------------------

    async def consume_work(self, handler: Handler) -> AbstractQueue:
        t = self.timeout
        queue = await self._ch().declare_queue(self.work_queue_name, durable=True, timeout=t)
        tag = await queue.consume(handler, no_ack=False, timeout=t)
        self._consuming.append((queue, tag))
        return queue

    async def consume_private(self, worker_id: str, handler: Handler) -> str:
        """The worker's own queue: forwarded messages and control broadcasts.

        Exclusive, so it goes with the worker's connection (a forward that comes back
        unroutable means the owner is dead), and not auto-delete: a channel the broker
        closes (`consumer_timeout`) cancels its consumer, and the queue must not go with
        it while the worker lives, or a forward would take the lease of a live owner.
        """
        name = self.config.name(f"worker.{worker_id}")
        t = self.timeout
        queue = await self._ch().declare_queue(name, exclusive=True, timeout=t)
        assert self.control is not None
        await queue.bind(self.control, timeout=t)
        tag = await queue.consume(handler, no_ack=False, timeout=t)
        self._consuming.append((queue, tag))
        return name

    async def stop_consuming(self) -> None:
        """Cancel this worker's consumers (basic.cancel), before it hands anything back: a
        message it requeues goes to the other workers, not back to it while it stops. The
        robust channel forgets them too (no restore after a reconnect). A broker away or
        slow to answer (`CANCEL_TIMEOUT_S`) leaves them to the connection's close."""
        consuming, self._consuming = self._consuming, []
        for queue, tag in consuming:
            with contextlib.suppress(AMQPError, OSError, RuntimeError):  # TimeoutError too
                await queue.cancel(tag, timeout=min(self.timeout, CANCEL_TIMEOUT_S))

    # --- publishing ---------------------------------------------------------------------

    async def publish_work(self, body: dict[str, Any], message_id: str) -> None:
        await self._publish(None, self.work_queue_name, body, message_id, mandatory=True)

    async def publish_work_raw(self, raw: bytes, message_id: str) -> None:
        """A message as bytes, whatever they hold: a harness's poison message."""
        await self._publish_raw(None, self.work_queue_name, raw, message_id, mandatory=True)

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
        per-message TTL, which the engine never uses (see the module docstring).

        The channel's `Wire` writes the frames (`engine.runtime.wire`: about 75 us of CPU
        less a publish than aiormq's path); aiormq's `basic_publish` only where the
        connection has no wire. Either way the message has the properties aio-pika's
        `Message` would give it (the same bytes on the wire), without building one: a
        `Message` cost about 50 us of CPU a publish, for nothing the engine uses."""
        ch = self._ch()
        name = "" if exchange is None else exchange.name
        expiration = None if expiration_ms is None else str(expiration_ms)
        delay = 0.05
        for attempt in range(60):
            try:
                if ch.is_closed:
                    raise aiormq.exceptions.ChannelInvalidStateError(f"{ch!r} closed")
                w = self._wire
                if w is None or w.channel.is_closed:  # the robust channel opens a new one
                    underlay = await ch.get_underlay_channel()
                    w = self._wire = wire(underlay, self.timeout)
                if w is not None:
                    await w.publish(name, key, raw, msg_id, mandatory, expiration)
                    return
                await underlay.basic_publish(
                    raw,
                    exchange=name,
                    routing_key=key,
                    properties=aiormq.spec.Basic.Properties(
                        content_type="application/json",
                        delivery_mode=frames.DELIVERY_MODE,  # 2: persistent
                        expiration=expiration,
                        headers={},
                        message_id=msg_id,
                        priority=0,
                    ),
                    mandatory=mandatory,
                    timeout=self.timeout,
                )
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
