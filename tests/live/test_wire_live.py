"""Publishes and ACKs written by `engine.runtime.wire`, against the machine's RabbitMQ: each
publish awaits its confirm, a mandatory one nobody can route raises, a confirm that never
comes times out, a lost connection fails what waits, a blocked broker holds publishes until
it unblocks, and a delivery is settled once."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import aiormq
import orjson
import pytest
from aio_pika.abc import AbstractIncomingMessage

from chaos.systems.redis_rabbitmq.stack import RabbitNode, find_epmd, find_rabbitmq_server
from engine.config import EngineConfig
from engine.runtime.broker import Broker
from engine.runtime.context import settle
from engine.runtime.wire import Wire, wire
from engine.shell.effects import Unroutable

pytestmark = [pytest.mark.live, pytest.mark.slow]


def run(test: Callable[[Broker], Coroutine[Any, Any, None]], **config: Any) -> None:
    """`test` with a connected broker of its own namespace, deleted afterwards."""

    async def go() -> None:
        broker = Broker(EngineConfig(namespace=f"wire{uuid.uuid4().hex[:6]}.", **config))
        await broker.connect()
        try:
            await test(broker)
        finally:
            await _delete(broker)

    asyncio.run(go())


async def _delete(broker: Broker) -> None:
    """What the broker declared, consumers or not (they are this test's own)."""
    assert broker.connection is not None
    ch = await broker.connection.channel(publisher_confirms=False)
    for member in broker.declared:
        kind, _, name = member.partition(":")
        if kind == "queue":
            await ch.queue_delete(name)
        else:
            await ch.exchange_delete(name)
    await broker.close()


async def _wire(broker: Broker) -> Wire:
    assert broker.channel is not None
    found = wire(await broker.channel.get_underlay_channel(), broker.timeout)
    assert found is not None, "the broker's channel is written by engine.runtime.wire"
    return found


async def _deliveries(broker: Broker, n: int) -> AsyncIterator[AbstractIncomingMessage]:
    got: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()

    async def on_message(message: AbstractIncomingMessage) -> None:
        await got.put(message)

    await broker.consume_work(on_message)
    for _ in range(n):
        yield await asyncio.wait_for(got.get(), 10)


def test_confirmed_publishes_arrive_whole_and_acks_remove_them() -> None:
    async def test(broker: Broker) -> None:
        bodies = [{"i": i, "pad": "x" * (i * 997 % 5000)} for i in range(200)]
        await asyncio.gather(*(broker.publish_work(b, f"m{b['i']}") for b in bodies))
        seen = {}
        async for message in _deliveries(broker, len(bodies)):
            seen[message.message_id] = orjson.loads(message.body)
            assert message.content_type == "application/json" and message.delivery_mode == 2
            assert await settle(message, timeout_s=5)
        assert seen == {f"m{b['i']}": b for b in bodies}
        assert broker.connection is not None
        await broker.channel.close()  # unacknowledged deliveries would go back to the queue
        ch = await broker.connection.channel()
        queue = await ch.declare_queue(broker.work_queue_name, passive=True)
        assert queue.declaration_result.message_count == 0

    run(test)


def test_a_mandatory_publish_nobody_routes_raises_unroutable() -> None:
    async def test(broker: Broker) -> None:
        for _ in range(3):  # the channel stays usable after a return
            with pytest.raises(Unroutable):
                await broker.forward(broker.config.name("worker.gone"), b"{}", "fwd-1")
        await broker.publish_work({"after": "returns"}, "m-after")

    run(test)


def test_returns_win_over_acks_read_with_them() -> None:
    """Events (acks taken by the reader) and mandatory publishes, some unroutable (acks left
    to aiormq, after the return), interleaved on one channel."""

    async def test(broker: Broker) -> None:
        async def one(i: int) -> str:
            try:
                if i % 3 == 0:
                    await broker.forward(broker.config.name("worker.gone"), b"{}", f"f{i}")
                elif i % 3 == 1:
                    await broker.publish_work({"i": i}, f"w{i}")
                else:
                    await broker.publish_event("evaluation.started", {"i": i}, f"e{i}")
            except Unroutable:
                return "unroutable"
            return "confirmed"

        for _ in range(3):
            got = await asyncio.gather(*(one(i) for i in range(300)))
            want = ["unroutable" if i % 3 == 0 else "confirmed" for i in range(300)]
            assert got == want

    run(test)


def test_a_nack_requeues_and_a_delivery_is_settled_once() -> None:
    async def test(broker: Broker) -> None:
        await broker.publish_work({"n": 1}, "m1")
        got: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()

        async def on_message(message: AbstractIncomingMessage) -> None:
            await got.put(message)

        await broker.consume_work(on_message)
        first = await asyncio.wait_for(got.get(), 10)
        assert not first.redelivered
        assert await settle(first, ack=False, timeout_s=5)
        assert not await settle(first, timeout_s=5)  # refused, not sent: the channel lives
        again = await asyncio.wait_for(got.get(), 10)
        assert again.redelivered and again.message_id == "m1"
        assert await settle(again, timeout_s=5)
        await broker.publish_work({"n": 2}, "m2")  # the channel survived both
        assert (await asyncio.wait_for(got.get(), 10)).message_id == "m2"

    run(test)


class _Swallowed:
    """A transport that drops what is written to it: a publish whose confirm never comes."""

    def __init__(self, real: asyncio.WriteTransport) -> None:
        self.real = real

    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return self.real.is_closing()


def test_a_publish_never_confirmed_times_out() -> None:
    async def test(broker: Broker) -> None:
        w = await _wire(broker)
        w.timeout_s = 0.3
        w.transport = _Swallowed(w.transport)  # type: ignore[assignment]
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(w.publish("", broker.work_queue_name, b"{}", f"m{i}", True) for i in range(5)),
            return_exceptions=True,
        )
        assert all(isinstance(r, TimeoutError) for r in results), results
        assert time.monotonic() - t0 < 2
        assert not w._pending or all(c.done() for _, _, c in w._pending)

    run(test)


def test_a_lost_connection_fails_the_publishes_waiting_for_their_confirm() -> None:
    async def test(broker: Broker) -> None:
        w = await _wire(broker)
        real = w.transport
        w.transport = _Swallowed(real)  # type: ignore[assignment]
        waiting = [
            asyncio.ensure_future(w.publish("", broker.work_queue_name, b"{}", f"m{i}", True))
            for i in range(5)
        ]
        await asyncio.sleep(0.1)
        assert not any(p.done() for p in waiting)
        t0 = time.monotonic()
        real.abort()  # the socket dies under the connection
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(r, BaseException) for r in results), results
        assert time.monotonic() - t0 < 5  # well before the 30 s confirm timeout
        with pytest.raises(aiormq.exceptions.ChannelInvalidStateError):
            await w.publish("", broker.work_queue_name, b"{}", "late", True)
        # The broker itself rides it out: the robust connection comes back, with a wire.
        await asyncio.wait_for(broker.publish_work({"after": "reconnect"}, "m-after"), 20)
        again = await _wire(broker)
        assert again is not w and again.transport is not real and broker._wire is again

    run(test)


@pytest.mark.skipif(
    find_rabbitmq_server() is None or find_epmd() is None, reason="RabbitMQ/Erlang not installed"
)
def test_a_blocked_broker_holds_publishes_until_it_unblocks() -> None:
    """A memory alarm (a private node's watermark at 0): the broker sends connection.blocked
    and stops reading; publishes time out and are retried, and are confirmed once it
    unblocks. The shared broker is left alone: the alarm would block every client."""
    node = RabbitNode()
    try:
        node.start()

        async def test(broker: Broker) -> None:
            await broker.publish_work({"before": "alarm"}, "m0")
            node.ctl("set_vm_memory_high_watermark", "0")
            publishing = asyncio.ensure_future(broker.publish_work({"in": "alarm"}, "m1"))
            await asyncio.sleep(3)  # three confirm timeouts: retried, never failed
            assert not publishing.done()
            node.ctl("set_vm_memory_high_watermark", "0.4")
            await asyncio.wait_for(publishing, 30)
            ids = set()
            async for message in _deliveries(broker, 2):
                ids.add(message.message_id)
                assert await settle(message, timeout_s=5)
            assert ids == {"m0", "m1"}  # a retried copy of m1 may follow: at least once

        run(test, amqp_url=node.url, read_timeout_s=1.0)
    finally:
        node.stop()
