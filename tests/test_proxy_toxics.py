"""Each toxic measured on real TCP traffic through `chaos.proxy`, both streams.

Time is only ever bounded from below strictly (a toxic cannot be faster than it says);
upper bounds are generous, since CI runs on a busy two-core machine.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.test_proxy import Env, Handler, aio, closed_by_peer, roundtrip

SLACK = 0.005  # timer rounding: the lower bounds allow this much
GENEROUS = 10.0  # an upper bound that only catches a hang


def sender(payload: bytes) -> Handler:
    """An upstream that sends `payload` on connect, then waits for the client to go."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(payload)
        await writer.drain()
        await reader.read()
        writer.close()

    return handler


def sender_then_close(payload: bytes) -> Handler:
    """An upstream that sends `payload` and closes at once."""

    async def handler(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(payload)
        await writer.drain()
        writer.close()

    return handler


class Sink:
    """An upstream that keeps what it receives, and notes when the proxy closed on it."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = asyncio.Event()
        self.closed_at = 0.0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(65536):
                self.data += chunk
        except ConnectionResetError:
            pass
        self.closed_at = time.monotonic()
        self.closed.set()
        writer.close()


async def read_all(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while chunk := await reader.read(65536):
        out += chunk
    return bytes(out)


# --- latency ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", ["downstream", "upstream"])
@aio
async def test_latency_delays_each_way(stream: str) -> None:
    async with Env() as env:
        reader, writer = await asyncio.open_connection(*await env.proxy())
        await env.toxic(type="latency", stream=stream, attributes={"latency": 150})
        took = await roundtrip(reader, writer, b"ping")
        assert 0.150 - SLACK <= took < GENEROUS
        writer.close()


@aio
async def test_latency_keeps_order_under_jitter_and_chains_add_up() -> None:
    async with Env() as env:
        reader, writer = await asyncio.open_connection(*await env.proxy())
        await env.toxic(type="latency", name="a", attributes={"latency": 40, "jitter": 35})
        payload = b"".join(b"%03d," % i for i in range(50))
        for i in range(50):  # many small writes: many chunks, each its own jitter
            writer.write(payload[i * 4 : i * 4 + 4])
            await writer.drain()
        assert await reader.readexactly(len(payload)) == payload

        await env.toxic(type="latency", name="b", attributes={"latency": 100})
        took = await roundtrip(reader, writer, b"x")
        assert 0.100 + 0.005 - SLACK <= took < GENEROUS  # a: at least 40 - 35 ms, b: 100 ms
        writer.close()


@aio
async def test_toxics_reach_live_connections_and_removal_loses_nothing() -> None:
    async with Env() as env:
        reader, writer = await asyncio.open_connection(*await env.proxy())
        await roundtrip(reader, writer, b"before")
        await env.toxic(type="latency", name="lat", attributes={"latency": 100})
        assert await roundtrip(reader, writer, b"added") >= 0.100 - SLACK
        await env.server.update_toxic("p", "lat", {"attributes": {"latency": 200}})
        assert await roundtrip(reader, writer, b"updated") >= 0.200 - SLACK

        # a chunk held by a toxic being removed is handed on, not dropped
        changes = {"attributes": {"latency": 60_000, "jitter": 1}}
        await env.server.update_toxic("p", "lat", changes)
        writer.write(b"held")
        await writer.drain()
        (down,) = [r for r in env.server.links("p") if r.stream == "downstream"]
        while not any(what == "jitter" for _, what, _ in down.draws):
            await asyncio.sleep(0.001)  # until the toxic holds the chunk (it draws its delay)
        await env.server.remove_toxic("p", "lat")
        assert await asyncio.wait_for(reader.readexactly(4), GENEROUS) == b"held"
        writer.close()


@aio
async def test_toxicity_zero_never_applies() -> None:
    async with Env() as env:
        reader, writer = await asyncio.open_connection(*await env.proxy())
        await env.toxic(type="timeout", toxicity=0.0)
        await roundtrip(reader, writer, b"through")
        records = [r for r in env.server.links("p") if r.stream == "downstream"]
        assert records[0].decisions == {"timeout_downstream": False}
        writer.close()


# --- limit_data ------------------------------------------------------------------------------


@aio
async def test_limit_data_downstream_cuts_at_exactly_the_byte_count() -> None:
    async with Env() as env:
        address = await env.proxy(handler=sender(bytes(range(256)) * 40))
        await env.toxic(type="limit_data", attributes={"bytes": 1000})
        reader, writer = await asyncio.open_connection(*address)
        got = await asyncio.wait_for(read_all(reader), GENEROUS)
        assert got == (bytes(range(256)) * 4)[:1000]
        writer.close()


@aio
async def test_limit_data_upstream_cuts_at_exactly_the_byte_count() -> None:
    async with Env() as env:
        sink = Sink()
        address = await env.proxy(handler=sink)
        await env.toxic(type="limit_data", stream="upstream", attributes={"bytes": 777})
        reader, writer = await asyncio.open_connection(*address)
        writer.write(b"a" * 5000)
        await writer.drain()
        await asyncio.wait_for(sink.closed.wait(), GENEROUS)
        assert bytes(sink.data) == b"a" * 777
        assert await closed_by_peer(reader)
        writer.close()


# --- reset_peer ------------------------------------------------------------------------------


@aio
async def test_reset_peer_resets_the_connection() -> None:
    async with Env() as env:
        reader, writer = await asyncio.open_connection(*await env.proxy())
        await env.toxic(type="reset_peer", attributes={"timeout": 0})
        writer.write(b"hi")
        await writer.drain()
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(100), GENEROUS)
        writer.close()


@aio
async def test_reset_peer_upstream_waits_its_timeout() -> None:
    async with Env() as env:
        sink = Sink()
        reader, writer = await asyncio.open_connection(*await env.proxy(handler=sink))
        await env.toxic(type="reset_peer", stream="upstream", attributes={"timeout": 200})
        start = time.monotonic()
        writer.write(b"hi")
        await writer.drain()
        await asyncio.wait_for(sink.closed.wait(), GENEROUS)
        assert sink.closed_at - start >= 0.200 - SLACK
        assert sink.data == b""  # the data that armed it is dropped
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(100), GENEROUS)
        writer.close()


# --- timeout ---------------------------------------------------------------------------------


@aio
async def test_timeout_stalls_then_closes_after_its_timeout() -> None:
    async with Env() as env:
        reader, writer = await asyncio.open_connection(*await env.proxy())
        await env.toxic(type="timeout", attributes={"timeout": 300})
        start = time.monotonic()
        writer.write(b"hi")
        await writer.drain()
        got = await asyncio.wait_for(reader.read(100), GENEROUS)
        assert got == b""  # no data at all, then the close
        assert time.monotonic() - start >= 0.300 - SLACK
        writer.close()


@aio
async def test_timeout_zero_holds_until_removed_then_closes() -> None:
    async with Env() as env:
        sink = Sink()
        reader, writer = await asyncio.open_connection(*await env.proxy(handler=sink))
        await env.toxic(type="timeout", stream="upstream", attributes={"timeout": 0})
        writer.write(b"lost")
        await writer.drain()
        with pytest.raises(TimeoutError):  # held open, nothing through, for the window
            await asyncio.wait_for(reader.read(100), 0.4)
        assert sink.data == b"" and not sink.closed.is_set()
        await env.server.remove_toxic("p", "timeout_upstream")  # Toxiproxy closes it then
        await asyncio.wait_for(sink.closed.wait(), GENEROUS)
        assert await closed_by_peer(reader)
        assert sink.data == b""
        writer.close()


# --- bandwidth -------------------------------------------------------------------------------


@aio
async def test_bandwidth_downstream_limits_throughput() -> None:
    payload = b"b" * 50_000
    async with Env() as env:
        address = await env.proxy(handler=sender(payload))
        await env.toxic(type="bandwidth", attributes={"rate": 100})  # 100 KB/s: 0.5 s
        start = time.monotonic()
        reader, writer = await asyncio.open_connection(*address)
        got = await asyncio.wait_for(reader.readexactly(len(payload)), GENEROUS)
        assert got == payload
        assert time.monotonic() - start >= 0.500 - SLACK
        writer.close()


@aio
async def test_bandwidth_upstream_limits_throughput() -> None:
    async with Env() as env:
        sink = Sink()
        reader, writer = await asyncio.open_connection(*await env.proxy(handler=sink))
        await env.toxic(type="bandwidth", stream="upstream", attributes={"rate": 50})
        start = time.monotonic()
        writer.write(b"u" * 15_000)  # 50 KB/s: 0.3 s
        await writer.drain()
        writer.close()  # the close follows the data through the toxic
        await asyncio.wait_for(sink.closed.wait(), GENEROUS)
        assert bytes(sink.data) == b"u" * 15_000
        assert sink.closed_at - start >= 0.300 - SLACK
        assert await closed_by_peer(reader)


# --- slow_close ------------------------------------------------------------------------------


@aio
async def test_slow_close_delays_the_close_not_the_data() -> None:
    async with Env() as env:
        address = await env.proxy(handler=sender_then_close(b"0123456789"))
        await env.toxic(type="slow_close", attributes={"delay": 300})
        start = time.monotonic()
        reader, writer = await asyncio.open_connection(*address)
        assert await asyncio.wait_for(reader.readexactly(10), GENEROUS) == b"0123456789"
        assert await asyncio.wait_for(reader.read(100), GENEROUS) == b""
        assert time.monotonic() - start >= 0.300 - SLACK
        writer.close()


# --- slicer ----------------------------------------------------------------------------------


@aio
async def test_slicer_delivers_every_byte_in_pieces() -> None:
    payload = bytes(range(256)) * 20
    async with Env(seed=3) as env:
        address = await env.proxy(handler=sender(payload))
        await env.toxic(
            type="slicer", attributes={"average_size": 100, "size_variation": 40, "delay": 1000}
        )
        reader, writer = await asyncio.open_connection(*address)
        got = await asyncio.wait_for(reader.readexactly(len(payload)), GENEROUS)
        assert got == payload
        (down,) = [r for r in env.server.links("p") if r.stream == "downstream"]
        slices = [sizes for toxic, what, sizes in down.draws if what == "slices"]
        pieces = [size for sizes in slices for size in sizes]
        assert sum(pieces) == len(payload)
        assert len(pieces) >= len(payload) // 140 and max(pieces) <= 140
        writer.close()
