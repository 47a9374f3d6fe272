"""Each toxic on real TCP traffic through `chaos.proxy`, both streams.

No test times anything: the delay a toxic applied is read from the proxy's own record
(`LinkRecord.held`: when each wait counted from and when the toxic let go, on the proxy's
loop clock), so a busy machine can make a test slower, never wrong. GENEROUS only turns
a hang into a failure.
"""

from __future__ import annotations

import asyncio

import pytest

from chaos.proxy.toxics import Held
from tests.test_proxy import Env, Handler, aio, closed_by_peer, roundtrip

GENEROUS = 10.0  # a wait that only catches a hang


def held(env: Env, stream: str, toxic: str, proxy: str = "p") -> list[Held]:
    """What `toxic` held back on the `stream` links of `proxy`, in order: the proxy's record."""
    records = env.server.links(proxy)
    return [h for r in records if r.stream == stream for h in r.held if h.toxic == toxic]


def in_full(h: Held) -> bool:
    """The toxic let go no sooner than it owed, on the proxy's clock (the same sum the
    toxic waits for, so exact)."""
    return h.until >= h.since + h.delay


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
    """An upstream that keeps what it receives, and notes that the proxy closed on it."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = asyncio.Event()

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(65536):
                self.data += chunk
        except ConnectionResetError:
            pass
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
        await roundtrip(reader, writer, b"ping")
        chunks = held(env, stream, f"latency_{stream}")
        assert sum(h.nbytes for h in chunks) == 4  # the ping, on that stream only
        assert all(h.what == "data" and h.delay == 0.150 and in_full(h) for h in chunks)
        other = "upstream" if stream == "downstream" else "downstream"
        assert held(env, other, f"latency_{stream}") == []
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
        (down,) = [r for r in env.server.links("p") if r.stream == "downstream"]
        jitter = [value for toxic, what, value in down.draws if what == "jitter"]
        chunks = held(env, "downstream", "a")
        assert sum(h.nbytes for h in chunks) == len(payload)
        # each chunk its own draw, 40 ms +/- 35, and each waited in full
        assert [h.delay for h in chunks] == [(40 + j) / 1000 for j in jitter]
        assert all(0.005 <= h.delay <= 0.075 and in_full(h) for h in chunks)

        await env.toxic(type="latency", name="b", attributes={"latency": 100})
        await roundtrip(reader, writer, b"x")
        x_a, (x_b,) = held(env, "downstream", "a")[-1], held(env, "downstream", "b")
        assert x_a.nbytes == x_b.nbytes == 1
        assert in_full(x_a) and in_full(x_b) and x_b.delay == 0.100
        # b counts from when a made it due: the latencies add up (at least 5 + 100 ms)
        assert x_b.since == x_a.since + x_a.delay
        assert x_b.until >= x_a.since + x_a.delay + 0.100
        writer.close()


@aio
async def test_toxics_reach_live_connections_and_removal_loses_nothing() -> None:
    async with Env() as env:
        reader, writer = await asyncio.open_connection(*await env.proxy())
        await roundtrip(reader, writer, b"before")
        await env.toxic(type="latency", name="lat", attributes={"latency": 100})
        await roundtrip(reader, writer, b"added")
        [*_, added] = held(env, "downstream", "lat")
        assert (added.nbytes, added.delay) == (5, 0.100) and in_full(added)
        await env.server.update_toxic("p", "lat", {"attributes": {"latency": 200}})
        await roundtrip(reader, writer, b"updated")
        [*_, updated] = held(env, "downstream", "lat")
        assert (updated.nbytes, updated.delay) == (7, 0.200) and in_full(updated)

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
        assert held(env, "downstream", "lat")[-1] == updated  # "held" left without its latency
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
        writer.write(b"hi")
        await writer.drain()
        await asyncio.wait_for(sink.closed.wait(), GENEROUS)
        (reset,) = held(env, "upstream", "reset_peer_upstream")
        assert (reset.what, reset.delay) == ("reset", 0.200) and in_full(reset)
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
        writer.write(b"hi")
        await writer.drain()
        got = await asyncio.wait_for(reader.read(100), GENEROUS)
        assert got == b""  # no data at all, then the close
        # the close is the toxic's, 300 ms after the last data it dropped (the echoed "hi")
        (close,) = held(env, "downstream", "timeout_downstream")
        assert (close.what, close.delay) == ("close", 0.300) and in_full(close)
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
        assert held(env, "upstream", "timeout_upstream") == []  # the removal closed it
        writer.close()


# --- bandwidth -------------------------------------------------------------------------------


@aio
async def test_bandwidth_downstream_limits_throughput() -> None:
    payload = b"b" * 50_000
    async with Env() as env:
        address = await env.proxy(handler=sender(payload))
        await env.toxic(type="bandwidth", attributes={"rate": 100})  # 100 KB/s: 0.5 s
        reader, writer = await asyncio.open_connection(*address)
        got = await asyncio.wait_for(reader.readexactly(len(payload)), GENEROUS)
        assert got == payload
        chunks = held(env, "downstream", "bandwidth_downstream")
        assert sum(h.nbytes for h in chunks) == len(payload)
        assert all(h.delay == h.nbytes / 100_000 for h in chunks)  # its bytes at 100 KB/s
        # from the first byte it took to the last it let go, on the proxy's clock
        assert chunks[-1].until - chunks[0].since >= 0.500
        writer.close()


@aio
async def test_bandwidth_upstream_limits_throughput() -> None:
    async with Env() as env:
        sink = Sink()
        reader, writer = await asyncio.open_connection(*await env.proxy(handler=sink))
        await env.toxic(type="bandwidth", stream="upstream", attributes={"rate": 50})
        writer.write(b"u" * 15_000)  # 50 KB/s: 0.3 s
        await writer.drain()
        writer.close()  # the close follows the data through the toxic
        await asyncio.wait_for(sink.closed.wait(), GENEROUS)
        assert bytes(sink.data) == b"u" * 15_000
        chunks = held(env, "upstream", "bandwidth_upstream")
        assert sum(h.nbytes for h in chunks) == 15_000
        assert all(h.delay == h.nbytes / 50_000 for h in chunks)
        assert chunks[-1].until - chunks[0].since >= 0.300
        assert await closed_by_peer(reader)


# --- slow_close ------------------------------------------------------------------------------


@aio
async def test_slow_close_delays_the_close_not_the_data() -> None:
    async with Env() as env:
        address = await env.proxy(handler=sender_then_close(b"0123456789"))
        await env.toxic(type="slow_close", attributes={"delay": 300})
        reader, writer = await asyncio.open_connection(*address)
        assert await asyncio.wait_for(reader.readexactly(10), GENEROUS) == b"0123456789"
        assert await asyncio.wait_for(reader.read(100), GENEROUS) == b""
        # only the close was held (the data went on at once), and for its 300 ms in full
        (close,) = held(env, "downstream", "slow_close_downstream")
        assert (close.what, close.delay) == ("close", 0.300) and in_full(close)
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
