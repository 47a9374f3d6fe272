"""The toxics on a byte stream, and the link that chains them (asyncio).

Toxiproxy's design (`link.go`, `toxics/toxic.go`), kept: a link is one direction of one
connection, `reader -> [noop] -> [toxic] -> ... -> writer`; each stage is a task between
two queues, running its toxic's `pipe` on a `Stub` that holds the stage's queues, its
per-link state and its random stream. Toxics chain in the order they were added. Adding,
updating or removing a toxic reaches the links already open: the stage concerned and its
neighbour are interrupted (cancelled; a toxic hands on any chunk it holds, so no data is
lost or reordered), rewired and restarted, as Toxiproxy's `InterruptToxic` does.

A chunk carries the time it became due (Go's `Timestamp`), so latency counts from the
moment the data was read, and chained latencies add up. A `None` on a queue is the end
of the stream; a stub that has seen it keeps seeing it, like a closed Go channel.

Whether a toxic applies to a link, and its jitter and slice sizes, come from the link's
own seeded stream (`model.toxic_rng`); every decision and draw is kept in the link's
`LinkRecord`, which tests and the simulator compare without timing anything.

What a toxic holds back (latency, bandwidth: data; slow_close, timeout: the close;
reset_peer: the reset) is kept there too, as `Held` (the latest HELD_KEPT a link): when
the wait counted from and when the toxic let go, on the loop's clock. A toxic never lets
go before its time on that clock (an asyncio timer may fire up to a clock tick early: the
waits here check the clock and wait again), so a test checks the delay a toxic applied
from the proxy's own record, whatever the load on the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from chaos.proxy.model import (
    ToxicSpec,
    applies,
    latency_ms,
    slice_offsets,
    toxic_rng,
    toxicity_draw,
)

READ_SIZE = 32 * 1024
#: Bytes a link may hold between its reader and its writer before it stops reading: the
#: sender then feels the toxics through TCP flow control, as with Toxiproxy's channels.
HIGH_WATER = 256 * 1024
#: Holds a link keeps (`LinkRecord.held`): at least the latest HELD_KEPT // 2, at most this.
HELD_KEPT = 256


@dataclass
class Chunk:
    data: bytes
    due: float  # loop time it was read, plus the latency it has been given so far


@dataclass(frozen=True, slots=True)
class Held:
    """Something a toxic held back on a link, times on the loop's clock (`loop.time()`).

    `what`: "data" (a chunk; bandwidth: all its pieces), "close" (the end of the stream:
    slow_close, and the close a timeout makes) or "reset" (reset_peer). The toxic owed it
    `delay` seconds from `since` and let it go at `until`. Latency, slow_close, timeout
    and reset_peer wait the whole of it: `until >= since + delay`, exactly. Bandwidth
    carries what a wait overshot over to the next chunk (Toxiproxy's): over a run of
    chunks, the last `until` minus the first `since` is at least the sum of the delays."""

    toxic: str
    what: str
    nbytes: int
    since: float  # latency: the time the chunk was due on arrival (read, plus earlier latency)
    delay: float
    until: float


@dataclass
class LinkRecord:
    """What one link decided and drew, in order: the evidence for determinism; and what
    its toxics held back, and for how long (`held`, the latest)."""

    proxy: str
    link_no: int
    stream: str
    decisions: dict[str, bool] = field(default_factory=dict)  # toxic -> applies (latest)
    draws: list[tuple[str, str, Any]] = field(default_factory=list)  # (toxic, what, value)
    held: list[Held] = field(default_factory=list)

    def hold(self, held: Held) -> None:
        if len(self.held) >= HELD_KEPT:
            del self.held[: HELD_KEPT // 2]  # bounded on a long run, at O(1) a hold
        self.held.append(held)


class Stub:
    """One toxic's place on one link (Toxiproxy's `ToxicStub`)."""

    def __init__(self, link: Link, spec: ToxicSpec | None, output: asyncio.Queue[Any]) -> None:
        self.link = link
        self.spec = spec  # None: the hidden noop at the head of every chain
        self.input: asyncio.Queue[Chunk | None] = asyncio.Queue()
        self.output = output
        self.state: dict[str, Any] = {}  # kept across updates, like Go's stub.State
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self.eof = False
        self.u = 1.0
        self.rng = None
        if spec is not None:
            r = link.record
            self.rng = toxic_rng(link.seed, r.proxy, spec.name, r.stream, r.link_no)
            self.u = toxicity_draw(self.rng)
            link.record.draws.append((spec.name, "toxicity", self.u))

    @property
    def applies(self) -> bool:
        return self.spec is not None and applies(self.u, self.spec.toxicity)

    async def recv(self) -> Chunk | None:
        if self.eof:
            return None
        chunk = await self.input.get()
        if chunk is None:
            self.eof = True
        return chunk

    def emit(self, chunk: Chunk) -> None:
        if chunk.data:
            self.output.put_nowait(chunk)

    def drop(self, nbytes: int) -> None:
        """Bytes a toxic swallows: they no longer count against the link's buffer."""
        self.link.settled(nbytes)

    def close(self) -> None:
        """End the stream after what this stage has emitted (Toxiproxy's `stub.Close`)."""
        if not self.closed:
            self.closed = True
            self.output.put_nowait(None)

    def draw(self, what: str, value: Any) -> None:
        assert self.spec is not None
        self.link.record.draws.append((self.spec.name, what, value))

    def held(self, what: str, nbytes: int, since: float, delay: float) -> None:
        """Note that this toxic lets go, now, of what it held since `since`."""
        assert self.spec is not None
        self.link.record.hold(Held(self.spec.name, what, nbytes, since, delay, _now()))

    def start(self) -> None:
        if self.closed:
            return
        if self.spec is not None:
            self.link.record.decisions[self.spec.name] = self.applies
        pipe = PIPES[self.spec.type] if self.applies and self.spec is not None else noop
        self.task = asyncio.get_running_loop().create_task(pipe(self))

    async def interrupt(self) -> bool:
        """Stop the running toxic, which hands on what it holds; False once closed."""
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        return not self.closed


# --- the toxics: one coroutine each, registered under their wire name --------------------------
#
# Each reads from `stub.recv()` and writes with `stub.emit()`. Cancelled (interrupted), it
# emits whatever it holds and stops; the link restarts it, or another toxic, in its place.


def _now() -> float:
    return asyncio.get_running_loop().time()


async def _sleep_until(when: float) -> None:
    """Return once the loop's clock reads `when` or later (an asyncio timer may fire up
    to a clock tick early: then wait again). Yields to the loop at least once."""
    await asyncio.sleep(max(0.0, when - _now()))
    while (left := when - _now()) > 0:
        await asyncio.sleep(left)


async def noop(stub: Stub) -> None:
    while (chunk := await stub.recv()) is not None:
        stub.emit(chunk)
    stub.close()


async def latency(stub: Stub) -> None:
    """Each chunk leaves `latency +/- jitter` ms after it was read, in order."""
    assert stub.spec is not None and stub.rng is not None
    attrs = stub.spec.attributes
    while (chunk := await stub.recv()) is not None:
        delay = latency_ms(stub.rng, attrs["latency"], attrs["jitter"])
        if attrs["jitter"]:
            stub.draw("jitter", delay - attrs["latency"])
        due = chunk.due + delay / 1000
        try:
            await _sleep_until(due)
        except asyncio.CancelledError:
            stub.emit(chunk)  # leave fast, without the latency; drop nothing
            raise
        stub.held("data", len(chunk.data), chunk.due, delay / 1000)
        stub.emit(Chunk(chunk.data, max(due, chunk.due)))
    stub.close()


async def bandwidth(stub: Stub) -> None:
    """At most `rate` KB/s: large chunks go out in 100 ms pieces, and the time a chunk
    is owed is carried over (Toxiproxy's `sleep -= time.Since(start)`)."""
    assert stub.spec is not None
    rate = stub.spec.attributes["rate"]
    owed = 0.0
    while (chunk := await stub.recv()) is not None:
        data = chunk.data
        since = _now()
        delay = len(data) / (rate * 1000) if rate > 0 else 0.0
        try:
            if rate <= 0:  # Toxiproxy sends empty pieces forever: nothing gets through
                await asyncio.Event().wait()
            owed += delay
            piece = rate * 100
            while len(data) > piece:
                await _sleep_until(_now() + 0.1)
                stub.emit(Chunk(data[:piece], chunk.due))
                data = data[piece:]
                owed -= 0.1
            start = _now()
            await _sleep_until(start + owed)
            owed -= _now() - start
        except asyncio.CancelledError:
            stub.emit(Chunk(data, chunk.due))
            raise
        stub.held("data", len(chunk.data), since, delay)
        stub.emit(Chunk(data, chunk.due))
    stub.close()


async def slow_close(stub: Stub) -> None:
    """Data passes; the end of the stream waits `delay` ms."""
    assert stub.spec is not None
    while (chunk := await stub.recv()) is not None:
        stub.emit(chunk)
    since, delay = _now(), stub.spec.attributes["delay"] / 1000
    await _sleep_until(since + delay)
    stub.held("close", 0, since, delay)
    stub.close()


async def timeout(stub: Stub) -> None:
    """Drop everything; close once `timeout` ms pass without data (Go restarts its timer
    on each chunk); 0 holds the link open until the toxic goes."""
    assert stub.spec is not None
    limit = stub.spec.attributes["timeout"] / 1000
    since = _now()
    while True:
        try:
            async with asyncio.timeout_at(since + limit if limit > 0 else None):
                chunk = await stub.recv()
        except TimeoutError:
            if _now() < since + limit:  # the timer fired a clock tick early
                continue
            stub.held("close", 0, since, limit)
            break
        if chunk is None:
            break
        stub.drop(len(chunk.data))
        since = _now()
    stub.close()


async def reset_peer(stub: Stub) -> None:
    """On the first data (or the end), wait `timeout` ms, then reset the connection (RST:
    SO_LINGER 0). Once armed the reset happens even if the toxic is removed meanwhile: in
    Toxiproxy the wait cannot be interrupted."""
    assert stub.spec is not None
    if "armed" not in stub.state:
        chunk = await stub.recv()
        if chunk is not None:
            stub.drop(len(chunk.data))
        since, delay = _now(), stub.spec.attributes["timeout"] / 1000
        _arm(stub, since, delay)
    while (chunk := await stub.recv()) is not None:  # armed: nothing more gets through
        stub.drop(len(chunk.data))


def _arm(stub: Stub, since: float, delay: float) -> None:
    """Reset the link at `since + delay` on the loop's clock, not a clock tick before."""

    def fire() -> None:
        if _now() < since + delay:
            _arm(stub, since, delay)
        else:
            stub.held("reset", 0, since, delay)
            stub.link.reset(stub)

    stub.state["armed"] = asyncio.get_running_loop().call_at(since + delay, fire)


async def slicer(stub: Stub) -> None:
    """Each chunk as pieces of `average_size +/- size_variation` bytes, `delay` us apart."""
    assert stub.spec is not None and stub.rng is not None
    attrs = stub.spec.attributes
    while (chunk := await stub.recv()) is not None:
        data = chunk.data
        cuts = slice_offsets(stub.rng, len(data), attrs["average_size"], attrs["size_variation"])
        stub.draw("slices", [b - a for a, b in itertools.pairwise(cuts)])
        for start, end in itertools.pairwise(cuts):
            stub.emit(Chunk(data[start:end], chunk.due))
            try:
                await asyncio.sleep(attrs["delay"] / 1_000_000)
            except asyncio.CancelledError:
                stub.emit(Chunk(data[end:], chunk.due))
                raise
    stub.close()


async def limit_data(stub: Stub) -> None:
    """Pass `bytes` bytes in all, then close (the count survives updates)."""
    assert stub.spec is not None
    limit = stub.spec.attributes["bytes"]
    stub.state.setdefault("sent", 0)
    while (chunk := await stub.recv()) is not None:
        room = max(0, limit - stub.state["sent"])
        data = chunk.data[:room]
        stub.drop(len(chunk.data) - len(data))
        stub.emit(Chunk(data, chunk.due))
        stub.state["sent"] += len(data)
        if stub.state["sent"] >= limit:
            break
    stub.close()


Pipe = Callable[[Stub], Awaitable[None]]

#: The toxics by wire name (`model.ATTRIBUTES` holds their attributes).
PIPES: dict[str, Pipe] = {
    "latency": latency,
    "bandwidth": bandwidth,
    "slow_close": slow_close,
    "timeout": timeout,
    "reset_peer": reset_peer,
    "slicer": slicer,
    "limit_data": limit_data,
}

#: Toxics whose removal closes the links they act on (Toxiproxy's `CleanupToxic`): a
#: timeout has dropped data, so the stream it leaves behind is broken.
CLOSE_ON_REMOVE = frozenset({"timeout"})


# --- the link ---------------------------------------------------------------------------------


def set_reset_on_close(writer: asyncio.StreamWriter) -> None:
    """SO_LINGER 0: closing the socket sends a RST instead of a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class Link:
    """One direction of one connection: reader -> stages -> writer."""

    def __init__(
        self,
        *,
        seed: int,
        record: LinkRecord,
        source: asyncio.StreamReader,
        dest: asyncio.StreamWriter,
        source_writer: asyncio.StreamWriter,
        toxics: list[ToxicSpec],
        on_done: Callable[[Link], None],
    ) -> None:
        self.seed = seed
        self.record = record
        self.source = source
        self.dest = dest
        self.source_writer = source_writer  # the source's socket, for SO_LINGER on reset
        self.on_done = on_done
        self.final: asyncio.Queue[Chunk | None] = asyncio.Queue()
        self.stubs = [Stub(self, None, self.final)]
        for spec in toxics:
            self._append(spec)
        self.pending = 0  # bytes read and not yet written or dropped
        self._room = asyncio.Event()
        self._room.set()
        self._tasks: list[asyncio.Task[None]] = []
        self._lock = asyncio.Lock()
        self.done = False
        self.resetting = False
        self.bytes_out = 0
        self.chunks_out = 0

    def _append(self, spec: ToxicSpec) -> Stub:
        last = self.stubs[-1]
        stub = Stub(self, spec, self.final)
        last.output = stub.input
        self.stubs.append(stub)
        return stub

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._write())]
        for stub in self.stubs:
            stub.start()

    # toxics changing under a live link

    async def add(self, spec: ToxicSpec) -> None:
        async with self._lock:
            if self.done:
                return
            last = self.stubs[-1]
            running = await last.interrupt()
            stub = self._append(spec)
            if running:
                last.start()
                stub.start()
            else:  # the chain already ended: keep the new stage consistent, closed
                stub.closed = True

    async def update(self, spec: ToxicSpec) -> None:
        async with self._lock:
            stub = self._find(spec.name)
            if self.done or stub is None:
                return
            if await stub.interrupt():
                stub.spec = spec
                stub.start()
            else:
                stub.spec = spec

    async def remove(self, name: str) -> None:
        async with self._lock:
            stub = self._find(name)
            if self.done or stub is None:
                return
            i = self.stubs.index(stub)
            was_applying = stub.applies
            if not await stub.interrupt():
                self.stubs.pop(i)  # closed: the stream has ended past it anyway
                return
            assert stub.spec is not None
            if was_applying and stub.spec.type in CLOSE_ON_REMOVE:
                stub.close()
                self.stubs.pop(i)
                return
            prev = self.stubs[i - 1]
            prev_running = await prev.interrupt()
            while not stub.input.empty():  # what it had not read yet follows what it sent
                stub.output.put_nowait(stub.input.get_nowait())
            if stub.eof:  # it had seen the end and was holding it (slow_close)
                stub.output.put_nowait(None)
            prev.output = stub.output
            self.stubs.pop(i)
            if prev_running:
                prev.start()

    def _find(self, name: str) -> Stub | None:
        return next((s for s in self.stubs[1:] if s.spec and s.spec.name == name), None)

    # the two ends

    def settled(self, nbytes: int) -> None:
        self.pending -= nbytes
        if self.pending < HIGH_WATER:
            self._room.set()

    def reset(self, stub: Stub) -> None:
        """A reset_peer fired: end the stream here, closing with RST."""
        self.resetting = True
        set_reset_on_close(self.dest)
        set_reset_on_close(self.source_writer)
        stub.close()

    async def _read(self) -> None:
        try:
            while True:
                await self._room.wait()
                data = await self.source.read(READ_SIZE)
                if not data:
                    break
                self.pending += len(data)
                if self.pending >= HIGH_WATER:
                    self._room.clear()
                self.stubs[0].input.put_nowait(Chunk(data, _now()))
        except (ConnectionError, OSError):
            pass
        self.stubs[0].input.put_nowait(None)

    async def _write(self) -> None:
        try:
            while (chunk := await self.final.get()) is not None:
                self.dest.write(chunk.data)
                self.bytes_out += len(chunk.data)
                self.chunks_out += 1
                await self.dest.drain()
                self.settled(len(chunk.data))
        except (ConnectionError, OSError):
            pass
        finally:
            self.finish()

    def finish(self, *, abort: bool = False) -> None:
        """The stream is over: close the destination (a RST if a reset_peer fired) and
        stop this link's tasks; the other link ends when it reads that close."""
        if self.done:
            return
        self.done = True
        if abort or self.resetting:
            self.dest.transport.abort()
        else:
            self.dest.close()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        for stub in self.stubs:
            if stub.task is not None:
                stub.task.cancel()
            armed = stub.state.get("armed")
            if armed is not None:
                armed.cancel()
        self.on_done(self)

    def abort(self) -> None:
        """Close now, whatever is in flight (the proxy is disabled or deleted)."""
        self.finish(abort=True)
