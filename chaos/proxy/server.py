"""The server: Toxiproxy 2.x's HTTP API on aiohttp, and the TCP proxies it manages.

Routes, status codes and bodies follow Toxiproxy's `api.go`: errors are
`{"error": message, "status": code}`; creating a proxy answers 201, populating 201 with
`{"proxies": [...]}`, deleting and `/reset` 204, everything else 200. `POST` and `PATCH`
on a proxy or a toxic both update it. A proxy's `listen` with port 0 takes a free port,
shown in every answer; disabling a proxy closes its listener and its live connections.

`ProxyServer` runs in-process (the harness and the tests), `serve` is
`python -m chaos proxy`. Each change made through the API is one INFO line on the
`chaos.proxy` logger.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
from collections import deque
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from chaos.proxy.model import (
    STREAMS,
    TOXIC_TYPES,
    ProxySpec,
    ToxicSpec,
    default_toxic_name,
    describe_error,
    format_address,
    parse_address,
)
from chaos.proxy.toxics import Link, LinkRecord

log = logging.getLogger("chaos.proxy")

#: The Toxiproxy release whose API this server follows; `+chaos` tells them apart.
VERSION = "2.12.0+chaos"
DEFAULT_PORT = 8474
#: Link records kept per proxy (both streams of each connection), oldest dropped first.
RECORDS_KEPT = 20_000


class ApiError(Exception):
    """An API answer other than success: Toxiproxy's `ApiError`. `made` is what a
    `/populate` that failed partway had made before (Toxiproxy answers with them)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.made: list[Proxy] | None = None


def _not_found(what: str) -> ApiError:
    return ApiError(f"{what} not found", 404)


def _bad_body(detail: str) -> ApiError:
    return ApiError(f"bad request body: {detail}", 400)


# --- one proxy ------------------------------------------------------------------------------


class Connection:
    """A client accepted by a proxy, its upstream connection and its two links."""

    def __init__(
        self, proxy: Proxy, link_no: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.proxy = proxy
        self.link_no = link_no
        self.client = (reader, writer)
        self.links: dict[str, Link] = {}
        self.closed = False
        self.task = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        reader, writer = self.client
        host, port = parse_address(self.proxy.upstream)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError as exc:
            log.warning("proxy %s: cannot reach upstream %s: %s", self.proxy.name, host, exc)
            writer.transport.abort()
            self.proxy.connections.discard(self)
            return
        if self.closed:
            up_writer.transport.abort()
            return
        ends = {
            "upstream": (reader, writer, up_writer),
            "downstream": (up_reader, up_writer, writer),
        }
        for stream, (source, source_writer, dest) in ends.items():
            record = LinkRecord(self.proxy.name, self.link_no, stream)
            self.proxy.records.append(record)
            self.links[stream] = Link(
                seed=self.proxy.seed,
                record=record,
                source=source,
                dest=dest,
                source_writer=source_writer,
                toxics=self.proxy.chain(stream),
                on_done=self._link_done,
            )
        for link in self.links.values():
            link.start()

    def _link_done(self, _link: Link) -> None:
        if all(link.done for link in self.links.values()):
            self.proxy.connections.discard(self)

    def abort(self) -> None:
        """Close both sockets now (the proxy goes down)."""
        self.closed = True
        self.task.cancel()
        for link in self.links.values():
            link.abort()
        self.client[1].transport.abort()
        self.proxy.connections.discard(self)


class Proxy:
    """One proxy: its listener, its live connections and its toxics (in order added)."""

    def __init__(self, spec: ProxySpec, seed: int) -> None:
        self.name = spec.name
        self.listen = spec.listen
        self.upstream = spec.upstream
        self.enabled = False
        self.seed = seed
        self.toxics: dict[str, ToxicSpec] = {}
        self.connections: set[Connection] = set()
        self.accepted = 0  # connections numbered from 0 in accept order: the draw rule's link_no
        self.records: deque[LinkRecord] = deque(maxlen=RECORDS_KEPT)
        self._server: asyncio.Server | None = None

    def wire(self) -> dict[str, Any]:
        """The JSON Toxiproxy shows for a proxy, its toxics included."""
        return {
            "name": self.name,
            "listen": self.listen,
            "upstream": self.upstream,
            "enabled": self.enabled,
            "toxics": [t.wire() for t in _ordered(self)],
        }

    def chain(self, stream: str) -> list[ToxicSpec]:
        return [t for t in self.toxics.values() if t.stream == stream]

    async def start(self) -> None:
        """Listen (raises OSError when the address is taken); a no-op when enabled."""
        if self.enabled:
            return
        host, port = parse_address(self.listen)
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        except socket.gaierror as exc:
            raise OSError(f"listen {self.listen}: {exc.strerror}") from None
        self._server = await asyncio.start_server(
            self._accepted, infos[0][4][0], port, reuse_address=True
        )
        bound = self._server.sockets[0].getsockname()
        self.listen = format_address(bound[0], bound[1])
        self.enabled = True

    async def stop(self) -> None:
        """Close the listener and every live connection; a no-op when disabled."""
        if not self.enabled:
            return
        self.enabled = False
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for conn in list(self.connections):
            conn.abort()
        if server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 5)

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Called in accept order, synchronously: the number is the accept order.
        self.connections.add(Connection(self, self.accepted, reader, writer))
        self.accepted += 1

    def _live_links(self, stream: str) -> list[Link]:
        return [c.links[stream] for c in self.connections if stream in c.links]

    async def add_toxic(self, spec: ToxicSpec) -> None:
        self.toxics[spec.name] = spec
        await asyncio.gather(*(link.add(spec) for link in self._live_links(spec.stream)))

    async def update_toxic(self, spec: ToxicSpec) -> None:
        self.toxics[spec.name] = spec  # same key: keeps its place in the chain
        await asyncio.gather(*(link.update(spec) for link in self._live_links(spec.stream)))

    async def remove_toxic(self, name: str) -> None:
        spec = self.toxics.pop(name)
        await asyncio.gather(*(link.remove(name) for link in self._live_links(spec.stream)))


# --- the server -----------------------------------------------------------------------------


class ProxyServer:
    """Toxiproxy's API and proxies in this process: `await start()`, then `url`.

    Every API change is also a method here, raising `ApiError` as the API answers it.
    `links(proxy)` shows what each connection's links decided and drew (the draw rule
    of `chaos.proxy.model`), so determinism is checked without timing anything."""

    def __init__(self, seed: int = 0, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
        self.seed = seed
        self.host = host
        self.port = port
        self.proxies: dict[str, Proxy] = {}
        self._runner: web.AppRunner | None = None
        self._lock = asyncio.Lock()

    @property
    def url(self) -> str:
        return f"http://{format_address(self.host, self.port)}"

    async def start(self) -> None:
        """Serve the API (raises OSError when the port is taken); port 0 takes a free one."""
        runner = web.AppRunner(build_app(self), access_log=None, shutdown_timeout=2.0)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = runner.addresses[0][1]

    async def close(self) -> None:
        """Stop every proxy (listeners and connections) and the API: nothing is left."""
        for proxy in list(self.proxies.values()):
            await proxy.stop()
        self.proxies.clear()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> ProxyServer:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    def links(self, proxy: str) -> list[LinkRecord]:
        """The records of a proxy's links (live and closed), in the order they were made."""
        return list(self._get(proxy).records)

    def _get(self, name: str) -> Proxy:
        proxy = self.proxies.get(name)
        if proxy is None:
            raise _not_found("proxy")
        return proxy

    # proxies

    async def create_proxy(self, data: Any) -> Proxy:
        spec = _proxy_spec(data)
        async with self._lock:
            if spec.name in self.proxies:
                raise ApiError("proxy already exists", 409)
            proxy = Proxy(spec, self.seed)
            if spec.enabled:
                await _start(proxy)
            self.proxies[spec.name] = proxy
        log.info("proxy %s created: %s -> %s", proxy.name, proxy.listen, proxy.upstream)
        return proxy

    async def populate(self, data: Any) -> list[Proxy]:
        """Create or replace many proxies: all checked before any change; a proxy whose
        listen and upstream are unchanged is kept as it is."""
        if not isinstance(data, list):
            raise _bad_body("expected a list of proxies")
        specs: list[ProxySpec] = []
        for i, item in enumerate(data, 1):
            spec = _proxy_spec(item, where=f" at proxy {i}")
            if any(s.name == spec.name for s in specs):
                raise _bad_body(f"duplicate proxy name {spec.name!r}")
            specs.append(spec)
        out: list[Proxy] = []
        async with self._lock:
            for spec in specs:
                existing = self.proxies.get(spec.name)
                same = (spec.listen, spec.upstream)
                if existing is not None and (existing.listen, existing.upstream) == same:
                    out.append(existing)
                    continue
                if existing is not None:
                    await existing.stop()
                proxy = Proxy(spec, self.seed)
                if spec.enabled:
                    try:
                        await _start(proxy)
                    except ApiError as exc:  # the ones made so far stay, and are named
                        exc.made = out
                        raise
                self.proxies[spec.name] = proxy
                out.append(proxy)
                log.info("proxy %s populated: %s -> %s", proxy.name, proxy.listen, proxy.upstream)
        return out

    async def update_proxy(self, name: str, data: Any) -> Proxy:
        """Toxiproxy's `Proxy.Update`: a new listen or upstream restarts the proxy (its
        connections dropped), then `enabled` starts or stops it; the name never changes."""
        async with self._lock:
            proxy = self._get(name)
            if not isinstance(data, dict):
                raise _bad_body("expected a JSON object")
            current = {"name": name, "listen": proxy.listen, "upstream": proxy.upstream}
            known = {k: v for k, v in _set(data).items() if k in ("listen", "upstream", "enabled")}
            spec = _proxy_spec({**current, "enabled": proxy.enabled, **known})
            if (spec.listen, spec.upstream) != (proxy.listen, proxy.upstream):
                await proxy.stop()
                proxy.listen, proxy.upstream = spec.listen, spec.upstream
            if spec.enabled and not proxy.enabled:
                await _start(proxy)
            elif not spec.enabled and proxy.enabled:
                await proxy.stop()
        state = "enabled" if proxy.enabled else "disabled"
        log.info("proxy %s updated: %s -> %s, %s", name, proxy.listen, proxy.upstream, state)
        return proxy

    async def delete_proxy(self, name: str) -> None:
        async with self._lock:
            proxy = self._get(name)
            await proxy.stop()
            del self.proxies[name]
        log.info("proxy %s deleted", name)

    async def reset(self) -> None:
        """Enable every proxy and remove every toxic (Toxiproxy's `/reset`)."""
        async with self._lock:
            for proxy in self.proxies.values():
                await _start(proxy)
                for name in list(proxy.toxics):
                    await proxy.remove_toxic(name)
        log.info("reset: %d proxies enabled, every toxic removed", len(self.proxies))

    # toxics

    async def add_toxic(self, proxy_name: str, data: Any) -> ToxicSpec:
        async with self._lock:
            proxy = self._get(proxy_name)
            spec = _toxic_spec(data, proxy)
            await proxy.add_toxic(spec)
        log.info(
            "proxy %s: toxic %s added (%s %s, toxicity %s, %s)",
            proxy_name,
            spec.name,
            spec.type,
            spec.stream,
            spec.toxicity,
            spec.attributes,
        )
        return spec

    def get_toxic(self, proxy_name: str, name: str) -> ToxicSpec:
        spec = self._get(proxy_name).toxics.get(name)
        if spec is None:
            raise _not_found("toxic")
        return spec

    async def update_toxic(self, proxy_name: str, name: str, data: Any) -> ToxicSpec:
        async with self._lock:
            proxy = self._get(proxy_name)
            spec = self.get_toxic(proxy_name, name)
            if not isinstance(data, dict):
                raise _bad_body("expected a JSON object")
            try:
                new = spec.updated(_set(data))
            except ValidationError as exc:
                raise _bad_body(describe_error(exc, data)) from None
            await proxy.update_toxic(new)
        log.info(
            "proxy %s: toxic %s updated (toxicity %s, %s)",
            proxy_name,
            name,
            new.toxicity,
            new.attributes,
        )
        return new

    async def remove_toxic(self, proxy_name: str, name: str) -> None:
        async with self._lock:
            proxy = self._get(proxy_name)
            self.get_toxic(proxy_name, name)
            await proxy.remove_toxic(name)
        log.info("proxy %s: toxic %s removed", proxy_name, name)


async def _start(proxy: Proxy) -> None:
    """Start a proxy; a bind failure is Toxiproxy's 500 with the system's words."""
    try:
        await proxy.start()
    except OSError as exc:
        raise ApiError(f"listen tcp {proxy.listen}: {_reason(exc)}", 500) from None


def _reason(exc: OSError) -> str:
    """`address already in use`, not asyncio's sentence around it."""
    if isinstance(exc, socket.gaierror):
        return str(exc.strerror).lower()
    return os.strerror(exc.errno).lower() if exc.errno else str(exc)


def _proxy_spec(data: Any, where: str = "") -> ProxySpec:
    """A proxy from a request: unknown fields ignored, as Toxiproxy's JSON decoder does."""
    if not isinstance(data, dict):
        raise _bad_body(f"expected a JSON object{where}")
    for required in ("name", "upstream"):
        if not data.get(required):
            raise ApiError(f"missing required field: {required}{where}", 400)
    known = {k: v for k, v in data.items() if k in ProxySpec.model_fields}
    if known.get("listen") in (None, ""):
        known.pop("listen", None)
    if known.get("enabled") is None:
        known.pop("enabled", None)
    try:
        return ProxySpec.model_validate(known)
    except ValidationError as exc:
        raise _bad_body(describe_error(exc, known) + where) from None


def _toxic_spec(data: Any, proxy: Proxy) -> ToxicSpec:
    """A new toxic from a request, refused in Toxiproxy's order: stream, type, a name
    taken (409), then the attributes. The stream is read in any case, as Toxiproxy's
    `stream.ParseDirection` does (`Upstream` is upstream), and the default name keeps
    the spelling given, as Toxiproxy's does; the stream is shown in lower case."""
    if not isinstance(data, dict):
        raise _bad_body("expected a JSON object")
    known = {k: v for k, v in _set(data).items() if k in ToxicSpec.model_fields}
    stream = known.get("stream", "downstream")
    if not isinstance(stream, str) or stream.lower() not in STREAMS:
        raise ApiError("stream was invalid, can be either upstream or downstream", 400)
    if known.get("type") not in TOXIC_TYPES:
        raise ApiError("invalid toxic type", 400)
    name = known.get("name") or default_toxic_name(known["type"], stream)
    if name in proxy.toxics:
        raise ApiError("toxic already exists", 409)
    try:
        return ToxicSpec.model_validate({**known, "name": name, "stream": stream.lower()})
    except ValidationError as exc:
        raise _bad_body(describe_error(exc, known)) from None


def _set(data: Any) -> Any:
    """What a request body sets: a JSON null sets nothing, at the top or in `attributes`,
    as Go's `encoding/json` leaves a field it decodes a null into unchanged."""
    if not isinstance(data, dict):
        return data
    out = {k: v for k, v in data.items() if v is not None}
    if isinstance(out.get("attributes"), dict):
        out["attributes"] = {k: v for k, v in out["attributes"].items() if v is not None}
    return out


# --- HTTP -----------------------------------------------------------------------------------


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        text=json.dumps(data) + "\n", status=status, content_type="application/json"
    )


def _error(exc: ApiError) -> web.Response:
    return _json({"error": exc.message, "status": exc.status}, exc.status)


async def _body(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad_body(str(exc).split("\n")[0] if raw else "empty body") from None


@web.middleware
async def _api_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    if request.headers.get("User-Agent", "").startswith("Mozilla/"):  # as Toxiproxy does
        return web.Response(text="User agent not allowed\n", status=403)
    try:
        return await handler(request)
    except ApiError as exc:
        return _error(exc)


def build_app(server: ProxyServer) -> web.Application:
    """The routes of Toxiproxy's `api.go`, each a thin shell over a `ProxyServer` method."""

    async def proxy_index(_request: web.Request) -> web.Response:
        return _json({name: p.wire() for name, p in server.proxies.items()})

    async def proxy_create(request: web.Request) -> web.Response:
        proxy = await server.create_proxy(await _body(request))
        return _json(proxy.wire(), 201)

    async def populate(request: web.Request) -> web.Response:
        try:
            proxies = await server.populate(await _body(request))
        except ApiError as exc:
            made = None if exc.made is None else [p.wire() for p in exc.made]
            return _json({"error": exc.message, "status": exc.status, "proxies": made}, exc.status)
        return _json({"proxies": [p.wire() for p in proxies]}, 201)

    async def proxy_show(request: web.Request) -> web.Response:
        return _json(server._get(request.match_info["proxy"]).wire())

    async def proxy_update(request: web.Request) -> web.Response:
        name = request.match_info["proxy"]
        server._get(name)  # 404 before a bad body, as Toxiproxy checks
        proxy = await server.update_proxy(name, await _body(request))
        return _json(proxy.wire())

    async def proxy_delete(request: web.Request) -> web.Response:
        await server.delete_proxy(request.match_info["proxy"])
        return web.Response(status=204)

    async def toxic_index(request: web.Request) -> web.Response:
        proxy = server._get(request.match_info["proxy"])
        return _json([t.wire() for t in _ordered(proxy)])

    async def toxic_create(request: web.Request) -> web.Response:
        name = request.match_info["proxy"]
        server._get(name)
        spec = await server.add_toxic(name, await _body(request))
        return _json(spec.wire())

    async def toxic_show(request: web.Request) -> web.Response:
        spec = server.get_toxic(request.match_info["proxy"], request.match_info["toxic"])
        return _json(spec.wire())

    async def toxic_update(request: web.Request) -> web.Response:
        proxy, toxic = request.match_info["proxy"], request.match_info["toxic"]
        server.get_toxic(proxy, toxic)
        spec = await server.update_toxic(proxy, toxic, await _body(request))
        return _json(spec.wire())

    async def toxic_delete(request: web.Request) -> web.Response:
        await server.remove_toxic(request.match_info["proxy"], request.match_info["toxic"])
        return web.Response(status=204)

    async def reset(_request: web.Request) -> web.Response:
        await server.reset()
        return web.Response(status=204)

    async def version(_request: web.Request) -> web.Response:
        return _json({"version": VERSION})

    app = web.Application(middlewares=[_api_errors])
    app.router.add_post("/reset", reset)
    app.router.add_get("/proxies", proxy_index)
    app.router.add_post("/proxies", proxy_create)
    app.router.add_post("/populate", populate)
    app.router.add_get("/proxies/{proxy}", proxy_show)
    app.router.add_post("/proxies/{proxy}", proxy_update)
    app.router.add_patch("/proxies/{proxy}", proxy_update)
    app.router.add_delete("/proxies/{proxy}", proxy_delete)
    app.router.add_get("/proxies/{proxy}/toxics", toxic_index)
    app.router.add_post("/proxies/{proxy}/toxics", toxic_create)
    app.router.add_get("/proxies/{proxy}/toxics/{toxic}", toxic_show)
    app.router.add_post("/proxies/{proxy}/toxics/{toxic}", toxic_update)
    app.router.add_patch("/proxies/{proxy}/toxics/{toxic}", toxic_update)
    app.router.add_delete("/proxies/{proxy}/toxics/{toxic}", toxic_delete)
    app.router.add_get("/version", version)
    return app


def _ordered(proxy: Proxy) -> list[ToxicSpec]:
    """A proxy's toxics as Toxiproxy lists them: the upstream chain, then downstream."""
    return [t for s in STREAMS for t in proxy.chain(s)]


# --- python -m chaos proxy ------------------------------------------------------------------


def serve(host: str, port: int, seed: int) -> int:
    """Run the server until interrupted (`chaos.cli` turns SIGINT / SIGTERM into an
    exception that unwinds this, closing everything); 2 when the port cannot be had."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    return asyncio.run(_serve(host, port, seed))


async def _serve(host: str, port: int, seed: int) -> int:
    server = ProxyServer(seed, host, port)
    try:
        await server.start()
    except OSError as exc:
        where = format_address(host, port)
        print(f"chaos proxy: cannot listen on {where}: {_reason(exc)}", file=sys.stderr)
        return 2
    try:
        print(f"chaos proxy: listening on {server.url} (seed {seed})", flush=True)
        await asyncio.Event().wait()
    finally:
        await server.close()
    return 0  # pragma: no cover (only a signal ends the wait)
