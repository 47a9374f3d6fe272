"""The worker's hot AMQP frames: publishes and ACKs written straight to the socket,
publisher acks read straight from it.

Per evaluation the worker sends six confirmed publishes and one ACK. Through aiormq each
publish marshals three frames with pamqp in Python, takes the channel's lock, hops through
the connection's frame queue to its writer task and back through a drain future, and arms
a timeout of its own; an ACK makes the same hop; each publisher ack the broker sends back
is read by aiormq's connection task (three reads, a lock, pamqp), queued to the channel's
reader task and settled there. All that cost about 75 us of CPU a publish (measured
2026-12-02). Here:

- a publish is one `transport.write` of bytes built from a cached method frame and a
  header packed with one `struct` call, and an ACK one `write` of 21 bytes (the same bytes
  pamqp writes: `tests/test_wire.py` compares them);
- `ConfirmReader`, the connection's stream reader, settles a Basic.Ack of a publish as its
  bytes arrive, and passes every other byte on to aiormq's reader, in order;
- one timer per channel, at the oldest unconfirmed publish's deadline, raises
  `TimeoutError` in publishes unconfirmed after `timeout_s` (they go out in order, so the
  deadlines are too), instead of a timer per publish.

Everything else stays aiormq's: the connection, heartbeats, RPCs, consumers, and the
channel's reading of nacks and returns, which fail the futures this module puts in the
channel's `confirmations` exactly as for aiormq's own `basic_publish`: a nack raises
`DeliveryError`, a mandatory return `PublishError` (matched by message id), and a channel
that closes (its connection lost) fails every publish still waiting, with the exception
aiormq fails its own futures with. An ack that covers a mandatory publish aiormq has not
settled yet is left to aiormq too: the return the broker sent before it must win.

Why frames may bypass aiormq's writer queue: the broker numbers a channel's publishes in
the order it reads them, so every publish of a channel must take this path (the delivery
tag is aiormq's counter, advanced here), and each is one `write`, so its three frames stay
contiguous. Frames still in aiormq's queue (RPCs, heartbeats) are of other kinds, which
the broker does not order against publishes and ACKs. A channel whose close has begun
(aiormq sets its close event) takes no more frames: after its Close-Ok a frame on its
number would be a connection error. (aiormq's own orderly close of a channel sets that
event only at the end; the engine closes its channel only once it has stopped publishing.)

The transport comes from `Transports`, the connection's transport factory (aiormq keeps
its stream writer inside its writer task); `link` ties it to the aiormq connection once
the handshake is done, before channels are restored, so every channel of a linked
connection has a `Wire`.
"""

from __future__ import annotations

import asyncio
import collections
import struct
import weakref
from random import getrandbits
from typing import Any
from uuid import UUID

import aiormq
import pamqp.frame
from aiormq.abc import AbstractChannel, AbstractConnection
from aiormq.channel import Returning
from aiormq.connection import TransportFactory
from pamqp import commands as spec
from yarl import URL

FRAME_END = b"\xce"
#: A content header's frame head, class, weight, body size and property flags.
_HEADER = struct.Struct(">BHIHHQH")
#: Every engine message's delivery mode: 2, persistent (a durable queue keeps it across a
#: broker restart; a transient one is held in memory only).
DELIVERY_MODE = 2
#: The properties every engine message carries before its optional ones, encoded: content
#: type application/json, empty headers, delivery mode 2 (persistent), priority 0.
_FIXED_PROPS = b"\x10application/json" + b"\x00\x00\x00\x00" + bytes((DELIVERY_MODE,)) + b"\x00"
_FLAGS = 0x8000 | 0x2000 | 0x1000 | 0x0800 | 0x0080  # the above and message_id
_EXPIRATION = 0x0100
_BODY = struct.Struct(">BHI")
#: Basic.Ack / Basic.Nack: frame head, class, method, delivery tag, bits, frame end.
_SETTLE = struct.Struct(">BHIHHQBB")


def content(
    channel: int, body: bytes, message_id: str, expiration: str | None, max_body: int
) -> bytes:
    """The content header and body frames of one engine message."""
    flags, props = _FLAGS, _FIXED_PROPS
    if expiration is not None:
        flags |= _EXPIRATION
        props += _short(expiration)
    props += _short(message_id)
    parts = [_HEADER.pack(2, channel, 14 + len(props), 60, 0, len(body), flags), props, FRAME_END]
    for i in range(0, len(body), max_body):  # no frame at all for an empty body
        chunk = body[i : i + max_body]
        parts += (_BODY.pack(3, channel, len(chunk)), chunk, FRAME_END)
    return b"".join(parts)


def _short(text: str) -> bytes:
    raw = text.encode()
    if len(raw) > 255:
        raise ValueError(f"AMQP short string longer than 255 bytes: {text[:40]!r}...")
    return bytes((len(raw),)) + raw


def settle_frame(channel: int, delivery_tag: int, ack: bool) -> bytes:
    """Basic.Ack of one delivery, or Basic.Nack with requeue."""
    method, bits = (80, 0) if ack else (120, 2)
    return _SETTLE.pack(1, channel, 13, 60, method, delivery_tag, bits, 0xCE)


_FRAME_HEAD = struct.Struct(">BHI")
_ACK = struct.Struct(">HHQB")  # a method frame's class, method, delivery tag, bits
_HEARTBEAT = b"\x08\x00\x00\x00\x00\x00\x00\xce"


class ConfirmReader(asyncio.StreamReader):
    """The connection's stream reader: a publisher ack (Basic.Ack, 21 bytes) of a channel
    with a `Wire`, whole in one read, settles its publishes as it arrives; every other byte
    goes on to aiormq's reader unchanged and in order. Frames are tracked from the first
    byte; one split over reads is passed on. A heartbeat stands in for taken acks at most
    once a second, so aiormq, which counts the frames it reads, never thinks the link dead.
    """

    BEAT_S = 1.0  # at most one heartbeat fed in this often

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=2**16, loop=loop)
        self.wires: dict[int, Wire] = {}  # by channel number
        self._skip = 0  # bytes of the frame being passed on still to come
        self._head = b""  # the start of a frame head split over reads (passed on)
        self._taken = False  # acks taken since the last heartbeat fed
        self._beat = 0.0

    def feed_data(self, data: bytes) -> None:
        n, pos, start = len(data), 0, 0
        if self._head:
            head = self._head + data[: 7 - len(self._head)]
            if len(head) < 7:
                self._head = head
                super().feed_data(data)
                return
            pos, self._head = 7 - len(self._head), b""
            self._skip = _FRAME_HEAD.unpack(head)[2] + 1
        skip, wires = self._skip, self.wires
        while True:
            if skip:
                if skip >= n - pos:
                    skip -= n - pos
                    break
                pos += skip
                skip = 0
            if n - pos < 7:
                self._head = data[pos:]
                break
            kind, number, size = _FRAME_HEAD.unpack_from(data, pos)
            if (
                kind == 1
                and size == 13
                and n - pos >= 21
                and (w := wires.get(number)) is not None
                and data[pos + 20] == 0xCE
                and w.acked(data, pos + 7)
            ):
                if pos > start:
                    super().feed_data(data[start:pos])
                pos += 21
                start = pos
                self._taken = True
                continue
            skip = size + 8
        self._skip = skip
        if start < n:
            super().feed_data(data[start:] if start else data)
        if self._taken and not skip and not self._head:
            now = self._loop.time()
            if now - self._beat >= self.BEAT_S:
                self._beat, self._taken = now, False
                super().feed_data(_HEARTBEAT)


class Transports(TransportFactory):
    """aiormq's TCP or TLS transport, read by a `ConfirmReader`; remembers the last made."""

    def __init__(self) -> None:
        self.writer: asyncio.StreamWriter | None = None
        self.reader: ConfirmReader | None = None

    async def create(self, url: URL, **kwargs: Any) -> tuple[asyncio.StreamReader, Any]:
        provider = kwargs.pop("ssl_context_provider", None)
        ssl = None
        if url.scheme == "amqps":
            assert provider is not None
            ssl = await provider.get_context()
        loop = asyncio.get_running_loop()
        reader = ConfirmReader(loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        try:  # as asyncio.open_connection, in aiormq's TCP and TLS factories
            transport, _ = await loop.create_connection(
                lambda: protocol, url.host, url.port, ssl=ssl, **kwargs
            )
        except OSError as exc:
            raise aiormq.exceptions.AMQPConnectionError(*exc.args) from exc
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        self.reader, self.writer = reader, writer
        return reader, writer


_TRANSPORTS: weakref.WeakKeyDictionary[
    AbstractConnection, tuple[asyncio.WriteTransport, ConfirmReader]
] = weakref.WeakKeyDictionary()
_WIRES: weakref.WeakKeyDictionary[AbstractChannel, Wire] = weakref.WeakKeyDictionary()


def link(connection: AbstractConnection, transports: Transports) -> None:
    """`connection` (just opened by `transports`) writes through the last transport made."""
    assert transports.writer is not None and transports.reader is not None
    _TRANSPORTS[connection] = (transports.writer.transport, transports.reader)  # type: ignore[assignment]


def wire(channel: AbstractChannel, timeout_s: float) -> Wire | None:
    """The `Wire` of an aiormq channel; None when its connection is not linked, or when
    this aiormq keeps no close event where `Wire` looks (then aiormq's own path serves)."""
    found = _WIRES.get(channel)
    if found is None:
        connection = getattr(channel, "connection", None)
        linked = None if connection is None else _TRANSPORTS.get(connection)
        closing = getattr(channel, "_Channel__close_event", None)
        if linked is None or not isinstance(closing, asyncio.Event):
            return None
        transport, reader = linked
        found = _WIRES[channel] = Wire(channel, transport, closing, timeout_s)  # type: ignore[arg-type]
        found.reader = reader
        reader.wires[channel.number] = found
    return found


class Wire:
    """Confirmed publishes and ACKs of one aiormq channel (see the module docstring)."""

    def __init__(
        self,
        channel: aiormq.Channel,
        transport: asyncio.WriteTransport,
        close_begun: asyncio.Event,
        timeout_s: float,
    ) -> None:
        self.channel = channel
        self.transport = transport
        self.close_begun = close_begun  # set before aiormq queues a Channel.Close
        self.timeout_s = timeout_s
        self.loop = channel.loop
        self._methods: dict[tuple[str, str, bool], bytes] = {}
        self._pending: collections.deque[tuple[float, int, asyncio.Future[Any]]] = (
            collections.deque()
        )
        self._timer: asyncio.TimerHandle | None = None
        self._mandatory: collections.deque[int] = collections.deque()  # tags, in order
        self.reader: ConfirmReader | None = None
        channel.closing.add_done_callback(self._closed)

    def _check(self) -> None:
        ch = self.channel
        if ch.is_closed or self.close_begun.is_set() or self.transport.is_closing():
            raise aiormq.exceptions.ChannelInvalidStateError(f"{ch!r} closed")

    async def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        message_id: str | None,
        mandatory: bool,
        expiration: str | None = None,
    ) -> None:
        """Publish and wait for the broker's confirm (see the module docstring)."""
        self._check()
        ch = self.channel
        method = self._methods.get((exchange, routing_key, mandatory))
        if method is None:
            method = self._method(exchange, routing_key, mandatory)
        if not message_id:  # as aiormq: returns are matched by message id
            message_id = UUID(int=getrandbits(128), version=4).hex
        frames = method + content(ch.number, body, message_id, expiration, ch.max_content_size)
        ch.delivery_tag += 1
        tag = ch.delivery_tag
        confirmation = self.loop.create_future()
        ch.confirmations[tag] = confirmation
        ids = ch.message_id_delivery_tag
        if mandatory:
            ids[message_id] = tag
            self._mandatory.append(tag)
        self.transport.write(frames)
        self._track(tag, confirmation)
        try:
            await confirmation
        finally:
            if mandatory and ids.get(message_id) == tag:
                del ids[message_id]

    def settle(self, delivery_tag: int, ack: bool) -> None:
        """Write the ACK (or NACK with requeue) of a delivery of this channel."""
        self._check()
        self.transport.write(settle_frame(self.channel.number, delivery_tag, ack))

    def acked(self, data: bytes, offset: int) -> bool:
        """Settle the publishes a Basic.Ack at `offset` confirms; False leaves the frame to
        aiormq: not an ack, an unknown tag (aiormq logs it), or one that covers a mandatory
        publish aiormq has not settled yet (a return read before it must win)."""
        cls, method, tag, bits = _ACK.unpack_from(data, offset)
        if cls != 60 or method != 80:
            return False
        confirmations, mandatory = self.channel.confirmations, self._mandatory
        while mandatory and mandatory[0] not in confirmations:
            mandatory.popleft()
        if mandatory and mandatory[0] <= tag:
            return False
        if bits & 1:  # multiple: every tag up to this one
            # In tag order up to the first one above: only aiormq moves an entry (a return's
            # marker, to the end), and those of mandatory publishes up to `tag` were ruled
            # out above.
            tags = []
            for t in confirmations:
                if t > tag:
                    break
                tags.append(t)
            if not tags:
                return False
        elif tag in confirmations:
            tags = [tag]
        else:
            return False
        for t in tags:
            confirmation = confirmations.pop(t)
            if not confirmation.done():  # timed out or cancelled: ignored, as by aiormq
                confirmation.set_result(None)
        return True

    def _method(self, exchange: str, routing_key: str, mandatory: bool) -> bytes:
        if len(self._methods) > 1024:  # routing keys are few; a bound all the same
            self._methods.clear()
        frame = spec.Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=mandatory)
        raw = self._methods[(exchange, routing_key, mandatory)] = pamqp.frame.marshal(
            frame, self.channel.number
        )
        return raw

    def _track(self, tag: int, confirmation: asyncio.Future[Any]) -> None:
        pending = self._pending
        while pending and pending[0][2].done():
            pending.popleft()
        deadline = self.loop.time() + self.timeout_s
        pending.append((deadline, tag, confirmation))
        if self._timer is None:
            self._timer = self.loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        self._timer = None
        now, pending = self.loop.time(), self._pending
        while pending:
            deadline, tag, confirmation = pending[0]
            if not confirmation.done():
                if deadline > now:
                    self._timer = self.loop.call_at(deadline, self._expire)
                    return
                # A confirm that comes later is ignored, as for a returned message.
                self.channel.confirmations[tag] = Returning()
                confirmation.set_exception(
                    TimeoutError(f"no publisher confirm within {self.timeout_s:g} s")
                )
            pending.popleft()

    def _closed(self, closing: asyncio.Future[Any]) -> None:
        """The channel closed: what still waits fails as aiormq fails its own futures."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.reader is not None and self.reader.wires.get(self.channel.number) is self:
            del self.reader.wires[self.channel.number]
        exc = None if closing.cancelled() else closing.exception()
        for _, _, confirmation in self._pending:
            if confirmation.done():
                continue
            if closing.cancelled():
                confirmation.cancel()
            else:
                confirmation.set_exception(
                    exc or aiormq.exceptions.ChannelInvalidStateError("channel closed")
                )
        self._pending.clear()
