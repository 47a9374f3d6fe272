"""`chaos.proxy`: our Toxiproxy speaks the 2.x API, draws from its seed, leaves nothing.

Real TCP on 127.0.0.1 throughout: an asyncio echo server upstream, the proxy server
in-process on a free port (in a thread of its own for toxiproxy-python, which is
synchronous). Tests wait for events (a read, a line printed), never for a fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from pydantic import ValidationError
from toxiproxy import Toxiproxy
from toxiproxy.exceptions import InvalidToxic, NotFound, ProxyExists

from chaos.proxy.client import ToxiproxyClient, ToxiproxyError
from chaos.proxy.model import (
    ProxySpec,
    ToxicSpec,
    applies,
    describe_error,
    toxic_rng,
    toxicity_draw,
)
from chaos.proxy.server import ProxyServer

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")
TEST_LIMIT_S = 60  # a hung test fails instead of stalling the suite


def aio(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test in a fresh loop, failing it after TEST_LIMIT_S."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), TEST_LIMIT_S))

    return wrapper


# --- upstreams and helpers (test_proxy_toxics.py imports these) ------------------------------

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()


async def start_upstream(handler: Handler = echo) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def split(listen: str) -> tuple[str, int]:
    host, port = listen.rsplit(":", 1)
    return host, int(port)


async def roundtrip(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes
) -> None:
    """Send, read the echo back in full. Not timed: a delay is read from the proxy's own
    record (`LinkRecord.held`)."""
    writer.write(data)
    await writer.drain()
    assert await reader.readexactly(len(data)) == data


async def refused(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection(host, port)
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    """The proxy closed our side: EOF or a reset, whichever the socket saw."""
    try:
        return await reader.read(100) == b""
    except ConnectionResetError:
        return True


class Env:
    """An in-process server on a free port, an echo upstream, and an API session."""

    def __init__(self, seed: int = 0) -> None:
        self.server = ProxyServer(seed, port=0)
        self.upstreams: list[asyncio.Server] = []

    async def __aenter__(self) -> Env:
        await self.server.start()
        self.http = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.http.close()
        await self.server.close()
        for up in self.upstreams:
            up.close()

    async def proxy(self, name: str = "p", handler: Handler = echo) -> tuple[str, int]:
        """A proxy to a new upstream running `handler`; its listen address."""
        up, port = await start_upstream(handler)
        self.upstreams.append(up)
        proxy = await self.server.create_proxy({"name": name, "upstream": f"127.0.0.1:{port}"})
        return split(proxy.listen)

    async def toxic(self, proxy: str = "p", **spec: Any) -> dict[str, Any]:
        return (await self.server.add_toxic(proxy, spec)).wire()

    async def call(self, method: str, path: str, body: Any = None, raw: bytes | None = None):
        """(status, parsed JSON or None) of one API call."""
        kwargs: dict[str, Any] = {"data": raw} if raw is not None else {"json": body}
        async with self.http.request(method, self.server.url + path, **kwargs) as resp:
            text = await resp.text()
            return resp.status, json.loads(text) if text.strip() else None


# --- toxiproxy-python drives every call it has -----------------------------------------------


class ThreadedServer:
    """Our server and an echo upstream on a loop in a background thread."""

    def __init__(self, seed: int = 0) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server = ProxyServer(seed, port=0)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        self.call(self.server.start())
        self.upstream, self.upstream_port = self.call(start_upstream())
        return self

    def __exit__(self, *_exc: object) -> None:
        async def stop() -> None:
            await self.server.close()
            self.upstream.close()

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def sync_roundtrip(address: tuple[str, int], data: bytes = b"ping") -> None:
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(data)
        got = b""
        while len(got) < len(data):
            chunk = sock.recv(100)
            assert chunk, "closed before the echo came back"
            got += chunk
    assert got == data


def sync_closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def test_toxiproxy_python_drives_every_call() -> None:
    with ThreadedServer() as ts:
        tp = Toxiproxy()
        tp.update_api_consumer("127.0.0.1", ts.server.port)
        upstream = f"127.0.0.1:{ts.upstream_port}"

        assert tp.running()
        assert json.loads(tp.version())["version"].startswith("2.")

        proxy = tp.create(upstream=upstream, name="echo")  # listen 127.0.0.1:0
        address = split(proxy.listen)
        assert address[1] != 0 and proxy.enabled
        sync_roundtrip(address)
        with pytest.raises(ProxyExists):
            tp.create(upstream=upstream, name="echo")
        assert set(tp.proxies()) == {"echo"}
        assert tp.get_proxy("echo").upstream == upstream
        assert tp.get_proxy("nope") is None

        # disable: the listener goes, and so does the live connection
        live = socket.create_connection(address, timeout=10)
        live.sendall(b"hi")
        assert live.recv(10) == b"hi"
        proxy.disable()
        assert sync_closed(live)
        live.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(address, timeout=10)
        assert tp.get_proxy("echo").enabled is False
        proxy.enable()
        sync_roundtrip(address)
        with proxy.down():
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(address, timeout=10)
            assert tp.get_proxy("echo").enabled is False
        sync_roundtrip(address)

        # toxics
        proxy.add_toxic(type="latency", attributes={"latency": 100})
        toxics = proxy.toxics()
        assert set(toxics) == {"latency_downstream"}
        toxic = proxy.get_toxic("latency_downstream")
        assert (toxic.type, toxic.stream, toxic.toxicity) == ("latency", "downstream", 1.0)
        assert toxic.attributes == {"latency": 100, "jitter": 0}
        assert proxy.get_toxic("nope") is None
        sync_roundtrip(address)
        *_, down = (r for r in ts.server.links("echo") if r.stream == "downstream")
        # the echo held its 100 ms in full, on the proxy's clock
        assert [(h.toxic, h.nbytes, h.delay) for h in down.held] == [
            ("latency_downstream", 4, 0.100)
        ]
        assert all(h.until >= h.since + h.delay for h in down.held)
        with pytest.raises(InvalidToxic):
            proxy.add_toxic(type="bogus")
        with pytest.raises(InvalidToxic):
            proxy.add_toxic(type="latency", name="bad", attributes={"latency": "slow"})
        with pytest.raises(ProxyExists):
            proxy.add_toxic(type="latency")
        assert proxy.destroy_toxic("latency_downstream")
        assert proxy.toxics() == {}
        proxy.add_toxic(
            type="timeout",
            name="stall",
            stream="upstream",
            toxicity=0.0,
            attributes={"timeout": 0},
        )
        stall = proxy.get_toxic("stall")
        assert (stall.type, stall.stream, stall.toxicity) == ("timeout", "upstream", 0.0)
        assert stall.attributes == {"timeout": 0}
        sync_roundtrip(address)  # toxicity 0: it never applies, the data goes through
        assert proxy.destroy_toxic("stall")
        assert proxy.toxics() == {}
        with pytest.raises(NotFound):
            proxy.destroy_toxic("latency_downstream")

        # reset: every proxy enabled, every toxic gone
        proxy.add_toxic(type="timeout", stream="upstream", attributes={"timeout": 0})
        proxy.disable()
        assert tp.reset()
        again = tp.get_proxy("echo")
        assert again.enabled and again.toxics() == {}
        sync_roundtrip(address)

        # populate (the client's own loop over create): unchanged proxies are kept
        made = tp.populate(
            [
                {"name": "echo", "upstream": upstream, "listen": proxy.listen},
                {"name": "two", "upstream": upstream, "listen": "127.0.0.1:0"},
            ]
        )
        assert [p.name for p in made] == ["two"]
        two_listen = tp.get_proxy("two").listen
        two = split(two_listen)
        sync_roundtrip(two)
        # a new upstream replaces it (the client destroys, then creates it disabled)
        moved = {"name": "two", "upstream": "127.0.0.1:9", "listen": two_listen}
        made = tp.populate([{**moved, "enabled": False}])
        assert [(p.name, p.upstream, p.listen, p.enabled) for p in made] == [
            ("two", "127.0.0.1:9", two_listen, False)
        ]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(two, timeout=10)
        assert tp.get_proxy("two").enabled is False
        assert tp.destroy("two") is False  # not a Proxy: the client sends nothing

        assert tp.destroy(tp.get_proxy("two"))
        assert set(tp.proxies()) == {"echo"}
        tp.destroy_all()
        assert tp.proxies() == {}
        for gone in (address, two):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(gone, timeout=10)


# --- raw HTTP: what toxiproxy-python does not reach ------------------------------------------


@aio
async def test_proxy_create_show_patch_and_listen_port_zero() -> None:
    async with Env() as env:
        up, up_port = await start_upstream()
        env.upstreams.append(up)
        upstream = f"127.0.0.1:{up_port}"
        status, body = await env.call("POST", "/proxies", {"name": "a", "upstream": upstream})
        assert status == 201
        host, port = split(body["listen"])
        assert (host, body["enabled"], body["toxics"]) == ("127.0.0.1", True, [])
        assert port != 0  # the real port, not the 0 asked for
        reader, writer = await asyncio.open_connection(host, port)
        await roundtrip(reader, writer, b"x")

        assert await env.call("GET", "/proxies/a") == (200, body)
        assert await env.call("GET", "/proxies") == (200, {"a": body})

        status, patched = await env.call("PATCH", "/proxies/a", {"enabled": False})
        assert (status, patched["enabled"], patched["listen"]) == (200, False, body["listen"])
        assert await closed_by_peer(reader)
        writer.close()
        assert await refused(host, port)
        status, patched = await env.call("POST", "/proxies/a", {"enabled": True})
        assert (status, patched["enabled"]) == (200, True)

        # a new listen restarts the proxy elsewhere, dropping its connections
        reader, writer = await asyncio.open_connection(host, port)
        await roundtrip(reader, writer, b"y")
        status, moved = await env.call("PATCH", "/proxies/a", {"listen": "127.0.0.1:0"})
        assert status == 200 and moved["enabled"] and moved["listen"] != body["listen"]
        assert await closed_by_peer(reader)
        writer.close()
        assert await refused(host, port)
        reader, writer = await asyncio.open_connection(*split(moved["listen"]))
        await roundtrip(reader, writer, b"z")
        writer.close()

        assert await env.call("DELETE", "/proxies/a") == (204, None)
        assert await env.call("GET", "/proxies") == (200, {})


@aio
async def test_populate_creates_keeps_and_replaces() -> None:
    async with Env() as env:
        up, up_port = await start_upstream()
        env.upstreams.append(up)
        upstream = f"127.0.0.1:{up_port}"
        status, body = await env.call(
            "POST",
            "/populate",
            [{"name": "a", "upstream": upstream}, {"name": "b", "upstream": upstream}],
        )
        assert status == 201
        assert [p["name"] for p in body["proxies"]] == ["a", "b"]
        assert all(p["enabled"] and p["toxics"] == [] for p in body["proxies"])
        a = body["proxies"][0]

        # same listen and upstream: kept as it is (toxics too); a new upstream replaces
        await env.toxic("a", type="latency", attributes={"latency": 1})
        same = {"name": "a", "upstream": upstream, "listen": a["listen"]}
        other = {"name": "b", "upstream": "127.0.0.1:9", "enabled": False}
        status, body = await env.call("POST", "/populate", [same, other])
        assert status == 201
        kept, replaced = body["proxies"]
        assert kept["listen"] == a["listen"] and len(kept["toxics"]) == 1
        assert (replaced["upstream"], replaced["enabled"]) == ("127.0.0.1:9", False)

        # checked in full before any change
        status, body = await env.call(
            "POST", "/populate", [{"name": "c", "upstream": upstream}, {"name": "d"}]
        )
        assert status == 400
        assert body == {
            "error": "missing required field: upstream at proxy 2",
            "status": 400,
            "proxies": None,
        }
        status, body = await env.call("POST", "/populate", {"name": "c"})
        assert (status, body["status"], body["proxies"]) == (400, 400, None)
        status, _ = await env.call("GET", "/proxies/c")
        assert status == 404

        # failing partway (a listen address taken): the proxies made before it are kept,
        # and named in the answer, as Toxiproxy does
        taken = {"name": "e", "upstream": upstream, "listen": a["listen"]}
        status, body = await env.call(
            "POST", "/populate", [{"name": "c", "upstream": upstream}, taken]
        )
        assert status == 500 and "address already in use" in body["error"]
        assert [p["name"] for p in body["proxies"]] == ["c"]
        status, _ = await env.call("GET", "/proxies/c")
        assert status == 200


@aio
async def test_toxic_create_show_update_delete() -> None:
    async with Env() as env:
        await env.proxy("p")
        status, body = await env.call(
            "POST", "/proxies/p/toxics", {"type": "latency", "attributes": {"latency": 10}}
        )
        assert status == 200
        assert body == {
            "attributes": {"latency": 10, "jitter": 0},
            "name": "latency_downstream",
            "type": "latency",
            "stream": "downstream",
            "toxicity": 1.0,
        }
        status, body = await env.call(
            "POST",
            "/proxies/p/toxics",
            {"type": "slicer", "name": "cut", "stream": "upstream", "toxicity": 0.5,
             "attributes": {"average_size": 10, "size_variation": 2, "delay": 5}},
        )  # fmt: skip
        assert status == 200 and body["name"] == "cut"
        status, toxics = await env.call("GET", "/proxies/p/toxics")
        assert [t["name"] for t in toxics] == ["cut", "latency_downstream"]  # upstream first
        assert await env.call("GET", "/proxies/p/toxics/cut") == (200, body)

        # update by POST (deprecated) and PATCH: attributes merged, toxicity replaced
        status, body = await env.call(
            "POST", "/proxies/p/toxics/latency_downstream", {"attributes": {"jitter": 3}}
        )
        assert (status, body["attributes"]) == (200, {"latency": 10, "jitter": 3})
        status, body = await env.call(
            "PATCH",
            "/proxies/p/toxics/latency_downstream",
            {"toxicity": 0.25, "attributes": {"latency": 20}},
        )
        assert status == 200
        assert (body["toxicity"], body["attributes"]) == (0.25, {"latency": 20, "jitter": 3})
        assert (await env.call("GET", "/proxies/p"))[1]["toxics"][1] == body

        assert await env.call("DELETE", "/proxies/p/toxics/cut") == (204, None)
        assert await env.call("POST", "/reset") == (204, None)
        assert await env.call("GET", "/proxies/p/toxics") == (200, [])


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "error"),
    [
        ("GET", "/proxies/nope", None, 404, "proxy not found"),
        ("PATCH", "/proxies/nope", {"enabled": False}, 404, "proxy not found"),
        ("DELETE", "/proxies/nope", None, 404, "proxy not found"),
        ("GET", "/proxies/nope/toxics", None, 404, "proxy not found"),
        ("POST", "/proxies/nope/toxics", {"type": "latency"}, 404, "proxy not found"),
        ("GET", "/proxies/p/toxics/nope", None, 404, "toxic not found"),
        ("PATCH", "/proxies/p/toxics/nope", {"toxicity": 0.5}, 404, "toxic not found"),
        ("DELETE", "/proxies/p/toxics/nope", None, 404, "toxic not found"),
        ("POST", "/proxies", {"name": "p", "upstream": "127.0.0.1:9"}, 409, "proxy already exists"),
        ("POST", "/proxies/p/toxics", {"type": "latency", "name": "lat"}, 409,
         "toxic already exists"),
        ("POST", "/proxies", {"upstream": "127.0.0.1:9"}, 400, "missing required field: name"),
        ("POST", "/proxies", {"name": "q"}, 400, "missing required field: upstream"),
        ("POST", "/proxies", {"name": "q", "upstream": "nowhere"}, 400,
         "bad request body: upstream: expected host:port; got 'nowhere'"),
        ("POST", "/proxies/p/toxics", {"type": "bogus"}, 400, "invalid toxic type"),
        ("POST", "/proxies/p/toxics", {"type": "latency", "stream": "sideways"}, 400,
         "stream was invalid, can be either upstream or downstream"),
        ("POST", "/proxies/p/toxics", {"type": "latency", "toxicity": 1.5}, 400,
         "bad request body: toxicity: expected a value <= 1; got 1.5"),
        ("POST", "/proxies/p/toxics", {"type": "latency", "attributes": {"latency": "5"}}, 400,
         "bad request body: attributes.latency: expected an integer; got '5'"),
        ("POST", "/proxies/p/toxics", {"type": "latency", "attributes": {"rate": 5}}, 400,
         "bad request body: attributes.rate: unknown attribute for a latency toxic; "
         "expected one of latency, jitter"),
        ("POST", "/proxies/p/toxics", {"type": "timeout", "attributes": {"timeout": -1}}, 400,
         "bad request body: attributes.timeout: expected a value >= 0; got -1"),
        ("PATCH", "/proxies/p/toxics/lat", {"toxicity": "all"}, 400,
         "bad request body: toxicity: expected a number; got 'all'"),
    ],
)  # fmt: skip
@aio
async def test_errors_have_toxiproxys_codes_and_bodies(
    method: str, path: str, body: Any, status: int, error: str
) -> None:
    async with Env() as env:
        await env.proxy("p")
        await env.toxic("p", type="latency", name="lat")
        assert await env.call(method, path, body) == (status, {"error": error, "status": status})


@pytest.mark.parametrize("path", ["/proxies", "/populate", "/proxies/p", "/proxies/p/toxics"])
@aio
async def test_bad_json_is_400(path: str) -> None:
    async with Env() as env:
        await env.proxy("p")
        status, body = await env.call("POST", path, raw=b"{not json")
        assert status == 400 and body["status"] == 400
        assert body["error"].startswith("bad request body: ")


@aio
async def test_version_and_browsers_refused() -> None:
    async with Env() as env:
        assert await env.call("GET", "/version") == (200, {"version": "2.12.0+chaos"})
        headers = {"User-Agent": "Mozilla/5.0"}
        async with env.http.get(env.server.url + "/proxies", headers=headers) as resp:
            assert resp.status == 403


@aio
async def test_a_taken_listen_port_is_a_500_and_the_proxy_is_not_created() -> None:
    async with Env() as env:
        host, port = await env.proxy("p")
        status, body = await env.call(
            "POST", "/proxies", {"name": "q", "upstream": "127.0.0.1:9", "listen": f"{host}:{port}"}
        )
        assert status == 500 and "address already in use" in body["error"]
        assert (await env.call("GET", "/proxies/q"))[0] == 404


# --- the async client --------------------------------------------------------------------------


@aio
async def test_client_covers_the_api() -> None:
    async with Env() as env, ToxiproxyClient(env.server.url) as tp:
        up, up_port = await start_upstream()
        env.upstreams.append(up)
        upstream = f"127.0.0.1:{up_port}"
        assert (await tp.version()).startswith("2.")
        made = await tp.create_proxy("a", upstream)
        assert split(made["listen"])[1] != 0
        assert await tp.get_proxy("a") == made
        assert set(await tp.proxies()) == {"a"}
        assert (await tp.update_proxy("a", enabled=False))["enabled"] is False
        spec = ToxicSpec(type="latency", attributes={"latency": 5})
        assert await tp.add_toxic("a", spec) == spec.wire()
        assert (await tp.add_toxic("a", {"type": "timeout", "name": "t"}))["attributes"] == {
            "timeout": 0
        }
        assert [t["name"] for t in await tp.toxics("a")] == ["latency_downstream", "t"]
        assert await tp.get_toxic("a", "t") == (await tp.toxics("a"))[1]
        updated = await tp.update_toxic("a", "latency_downstream", toxicity=0.5)
        assert updated["toxicity"] == 0.5
        await tp.remove_toxic("a", "t")
        populated = await tp.populate([ProxySpec(name="b", upstream=upstream)])
        assert [p["name"] for p in populated] == ["b"]
        await tp.reset()
        assert (await tp.get_proxy("a"))["enabled"] and await tp.toxics("a") == []
        await tp.delete_proxy("b")

        with pytest.raises(ToxiproxyError) as err:
            await tp.create_proxy("a", upstream)
        assert (err.value.status, err.value.message) == (409, "proxy already exists")
        assert str(err.value) == "toxiproxy: proxy already exists (HTTP 409)"
        with pytest.raises(ToxiproxyError) as err:
            await tp.remove_toxic("a", "nope")
        assert err.value.status == 404

    free = _free_port()
    async with ToxiproxyClient(f"http://127.0.0.1:{free}") as nowhere:
        with pytest.raises(ToxiproxyError) as err:
            await nowhere.version()
        assert err.value.status == 0 and "\n" not in str(err.value)


# --- the models ------------------------------------------------------------------------------


def test_toxic_defaults_are_toxiproxys() -> None:
    spec = ToxicSpec(type="bandwidth")
    assert (spec.name, spec.stream, spec.toxicity) == ("bandwidth_downstream", "downstream", 1.0)
    assert spec.attributes == {"rate": 0}
    assert ToxicSpec(type="timeout", stream="upstream").name == "timeout_upstream"
    assert ToxicSpec(type="slicer", attributes={"average_size": 8}).attributes == {
        "average_size": 8,
        "size_variation": 0,
        "delay": 0,
    }


@pytest.mark.parametrize(
    ("data", "line"),
    [
        ({"type": "latency", "attributes": {"latency": 1.5}},
         "attributes.latency: expected an integer; got 1.5"),
        ({"type": "slicer", "attributes": {"average_size": 4, "size_variation": 4}},
         "attributes.size_variation: expected a value < average_size (4); got 4"),
        ({"type": "slicer"}, "attributes.average_size: expected a value >= 1; got 0"),
        ({"type": "limit_data", "attributes": {"bytes": True}},
         "attributes.bytes: expected an integer; got true"),
        ({"type": "latency", "colour": "red"}, "colour: unknown field"),
        ({"type": "reset_peer", "attributes": [1]}, "attributes: expected a mapping; got [1]"),
    ],
)  # fmt: skip
def test_toxic_errors_are_one_line_naming_the_field(data: dict[str, Any], line: str) -> None:
    with pytest.raises(ValidationError) as err:
        ToxicSpec.model_validate(data)
    assert describe_error(err.value, data) == line
    assert describe_error(err.value, data, prefix="faults[0].toxic").startswith("faults[0].toxic.")


# --- determinism -----------------------------------------------------------------------------


async def _draws(seed: int, *, concurrent: bool) -> list[tuple[int, bool, list[Any]]]:
    """40 connections through a 0.5-toxicity latency with jitter: each link's decision
    and draws, by link number."""
    async with Env(seed) as env:
        address = await env.proxy("p")
        await env.toxic(
            "p", type="latency", name="lat", toxicity=0.5, attributes={"latency": 5, "jitter": 4}
        )

        async def one() -> None:
            reader, writer = await asyncio.open_connection(*address)
            await roundtrip(reader, writer, b"x")  # one chunk each way: one jitter draw
            writer.close()

        if concurrent:
            await asyncio.gather(*(one() for _ in range(40)))
        else:
            for _ in range(40):
                await one()
        records = [r for r in env.server.links("p") if r.stream == "downstream"]
        return sorted((r.link_no, r.decisions["lat"], r.draws) for r in records)


@aio
async def test_same_seed_same_decisions_and_draws_whatever_the_interleaving() -> None:
    first = await _draws(7, concurrent=False)
    assert [n for n, _, _ in first] == list(range(40))
    pattern = [hit for _, hit, _ in first]
    assert 5 < sum(pattern) < 35  # a coin per connection, not one for all
    assert await _draws(7, concurrent=True) == first
    other = await _draws(8, concurrent=False)
    assert [hit for _, hit, _ in other] != pattern

    # the rule is the documented pure one, and only links it hits draw jitter
    for link_no, hit, draws in first:
        rng = toxic_rng(7, "p", "lat", "downstream", link_no)
        u = toxicity_draw(rng)
        assert hit == applies(u, 0.5)
        jitter = [rng.randrange(8) - 4] if hit else []
        assert draws == [("lat", "toxicity", u)] + [("lat", "jitter", j) for j in jitter]


def test_draw_rule_is_string_seeded() -> None:
    a = toxic_rng(1, "p", "t", "upstream", 3).random()
    assert a == toxic_rng(1, "p", "t", "upstream", 3).random()
    assert a != toxic_rng(1, "p", "t", "downstream", 3).random()
    assert a != toxic_rng(1, "p", "t", "upstream", 4).random()


# --- clean-up --------------------------------------------------------------------------------


@aio
async def test_close_leaves_no_listener_and_no_connection() -> None:
    env = Env()
    async with env:
        address = await env.proxy("p")
        await env.proxy("q")
        reader, writer = await asyncio.open_connection(*address)
        await roundtrip(reader, writer, b"x")
        api_port = env.server.port
    assert await closed_by_peer(reader)
    assert await refused(*address)
    assert await refused("127.0.0.1", api_port)
    writer.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "chaos", "proxy", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_cli_serves_until_sigterm() -> None:
    port = _free_port()
    proc = _cli("--port", str(port), "--seed", "5")
    try:
        line = proc.stdout.readline()  # the event: it prints once it listens
        assert line == f"chaos proxy: listening on http://127.0.0.1:{port} (seed 5)\n"
        tp = Toxiproxy()
        tp.update_api_consumer("127.0.0.1", port)
        assert json.loads(tp.version())["version"].startswith("2.")
        tp.create(upstream="127.0.0.1:9", name="x")
        listen = split(tp.get_proxy("x").listen)

        # the same port again: one line, exit 2, no traceback
        busy = _cli("--port", str(port))
        _, err = busy.communicate(timeout=30)
        assert busy.returncode == 2
        assert err == f"chaos proxy: cannot listen on 127.0.0.1:{port}: address already in use\n"

        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 128 + signal.SIGTERM
        assert "Traceback" not in err
        assert err.endswith(
            "chaos proxy: interrupted (SIGTERM); everything it started is stopped\n"
        )
        for gone in (("127.0.0.1", port), listen):
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(gone, timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "http"], "argument --port: expected a whole number; got 'http'"),
        (["--port", "70000"], "argument --port: expected a whole number within [0, 65535]"),
        (["--seed", "-1"], "argument --seed: expected a whole number within"),
        (["--colour"], "unrecognized arguments: --colour"),
    ],
)
def test_cli_bad_arguments_are_one_line_exit_2(args: list[str], message: str) -> None:
    proc = _cli(*args)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("chaos") and message in err
