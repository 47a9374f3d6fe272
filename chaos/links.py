"""The workers' network, live: each worker reaches each service of its system (Redis,
RabbitMQ, PostgreSQL) through proxies of its own, driven through Toxiproxy's HTTP API, so
that a scenario can slow, poison or cut one worker's link and leave the others' (and the
runner's own clients) alone.

The server is the project's own (`chaos.proxy`), in the runner's event loop and seeded by
the run, so a run's toxicity and jitter draws replay. With `TOXIPROXY_URL` set, or
`toxiproxy-server` on PATH, a real Toxiproxy is used instead, through the same client;
its draws are its own (Toxiproxy ignores seeds).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import time
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from chaos.proxy.client import ToxiproxyClient, ToxiproxyError

if TYPE_CHECKING:
    from chaos.proxy.model import ToxicSpec
    from chaos.proxy.server import ProxyServer

#: How long a real toxiproxy-server gets to answer `/version` once started.
SERVER_START_S = 10.0


def upstream_of(url: str) -> str:
    """`host:port` of a service URL (Toxiproxy's `upstream`)."""
    parts = urlsplit(url)
    scheme = parts.scheme
    default = (
        6379 if scheme.startswith("redis") else 5432 if scheme.startswith("postgres") else 5672
    )
    return f"{parts.hostname or '127.0.0.1'}:{parts.port or default}"


def through(url: str, listen: str, **query: str) -> str:
    """`url` with its host and port replaced by a proxy's `listen` (credentials, path and
    query kept; `query` added)."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{listen}" if userinfo else listen
    pairs = [(k, v) for k, v in parse_qsl(parts.query) if k not in query] + list(query.items())
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(pairs)))


#: The link between Redis's primary and its replica (behind Sentinel): one for the run, not
#: one per worker.
REPLICATION = "replication"


class Network:
    """One run's proxies: `{ns}w{i}.{link}` for each worker `i` and each link of its system
    (`redis`, `broker`, `postgres`), and behind Sentinel `{ns}replication`, the replica's
    link to the primary."""

    def __init__(
        self,
        namespace: str,
        seed: int,
        workers: int,
        redis_url: str | None,
        amqp_url: str | None,
        amqp_heartbeat_s: int | None = None,
        replication_upstream: str | None = None,
        *,
        upstreams: dict[str, str] | None = None,
    ) -> None:
        """`redis_url`, `amqp_url`: the services behind the links `redis` and `broker`;
        `upstreams`: more links, by name (a design's own services)."""
        self.namespace = namespace
        self.replication_upstream = replication_upstream  # the primary's host:port
        self.replication_listen = ""  # where the replica replicates from, once started
        self.seed = seed
        self.workers = workers
        # None: that service is not proxied (Redis behind Sentinel: the workers are told
        # where the primary is, and a proxy in front of the sentinels would not be in the way)
        ups = {"redis": redis_url, "broker": amqp_url, **(upstreams or {})}
        self.upstreams = {k: v for k, v in ups.items() if v is not None}
        self.amqp_heartbeat_s = amqp_heartbeat_s
        self.server: ProxyServer | None = None  # ours, in this event loop
        self.process: subprocess.Popen[bytes] | None = None  # a real toxiproxy-server
        self.client: ToxiproxyClient | None = None
        self.kind = ""  # "chaos.proxy", "toxiproxy-server" or "TOXIPROXY_URL"
        self.urls: dict[tuple[int, str], str] = {}  # (worker, link) -> the URL it uses

    def proxy(self, worker: int, link: str) -> str:
        if link == REPLICATION:
            return f"{self.namespace}{REPLICATION}"
        return f"{self.namespace}w{worker}.{link}"

    def _names(self, link: str, workers: tuple[int, ...]) -> list[str]:
        """The proxies of `link` for these workers (the replication link's, once)."""
        return list(dict.fromkeys(self.proxy(w, link) for w in workers))

    def _all(self) -> list[str]:
        names = [self.proxy(w, link) for w in range(self.workers) for link in self.upstreams]
        return names + ([self.proxy(0, REPLICATION)] if self.replication_listen else [])

    async def start(self) -> None:
        """Start (or reach) the server and create every worker's proxies."""
        try:
            url = await self._server()
            self.client = ToxiproxyClient(url)
            for w in range(self.workers):
                for link, service_url in self.upstreams.items():
                    made = await self.client.create_proxy(
                        self.proxy(w, link), upstream=upstream_of(service_url)
                    )
                    query = {}
                    if link == "broker" and self.amqp_heartbeat_s is not None:
                        query["heartbeat"] = str(self.amqp_heartbeat_s)
                    self.urls[(w, link)] = through(service_url, made["listen"], **query)
            if self.replication_upstream is not None:
                made = await self.client.create_proxy(
                    self.proxy(0, REPLICATION), upstream=self.replication_upstream
                )
                self.replication_listen = made["listen"]
        except BaseException:
            await self.close()
            raise

    async def _server(self) -> str:
        given = os.environ.get("TOXIPROXY_URL")
        if given:
            self.kind = "TOXIPROXY_URL"
            return given.rstrip("/")
        binary = shutil.which("toxiproxy-server")
        if binary is not None:
            self.kind = "toxiproxy-server"
            return await self._spawn(binary)
        from chaos.proxy.server import ProxyServer

        self.kind = "chaos.proxy"
        self.server = ProxyServer(seed=self.seed, port=0)
        await self.server.start()
        return self.server.url

    async def _spawn(self, binary: str) -> str:
        """A real toxiproxy-server on a free loopback port, marked for `chaos clean`."""
        from chaos.stack import MARKER_ENV, OWNER_ENV, free_port, owner_token

        port = free_port()
        env = {**os.environ, MARKER_ENV: f"toxiproxy-{self.namespace}", OWNER_ENV: owner_token()}
        self.process = subprocess.Popen(
            [binary, "-host", "127.0.0.1", "-port", str(port)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + SERVER_START_S
        async with ToxiproxyClient(url) as probe:
            while True:
                try:
                    await probe.version()
                    return url
                except (TimeoutError, OSError, ToxiproxyError):
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"{binary} did not answer on 127.0.0.1:{port} "
                            f"within {SERVER_START_S:g} s"
                        ) from None
                    await asyncio.sleep(0.05)

    def url(self, worker: int, link: str) -> str:
        return self.urls[(worker, link)]

    # --- the acts -----------------------------------------------------------------------

    def _c(self) -> ToxiproxyClient:
        assert self.client is not None, "the network is not started"
        return self.client

    async def add_toxic(self, link: str, workers: tuple[int, ...], toxic: ToxicSpec) -> None:
        """Add it; a toxic of that name already there is changed instead."""
        for name in self._names(link, workers):
            try:
                await self._c().add_toxic(name, toxic)
            except ToxiproxyError as exc:
                if exc.status != 409:
                    raise
                await self._update(name, toxic)

    async def update_toxic(self, link: str, workers: tuple[int, ...], toxic: ToxicSpec) -> None:
        for name in self._names(link, workers):
            await self._update(name, toxic)

    async def _update(self, proxy: str, toxic: ToxicSpec) -> None:
        fields = toxic.wire()
        with _absent_ok():
            await self._c().update_toxic(
                proxy, toxic.name, toxicity=fields["toxicity"], attributes=fields["attributes"]
            )

    async def remove_toxic(self, link: str, workers: tuple[int, ...], name: str) -> None:
        for proxy in self._names(link, workers):
            with _absent_ok():
                await self._c().remove_toxic(proxy, name)

    async def repoint(self, link: str, url: str) -> None:
        """Every worker's proxy of `link` to the service at `url` from now on (a virtual
        address moved to a promoted standby): their connections drop and come back there."""
        self.upstreams[link] = url
        for w in range(self.workers):
            await self._c().update_proxy(self.proxy(w, link), upstream=upstream_of(url))

    async def set_enabled(self, link: str, workers: tuple[int, ...], enabled: bool) -> None:
        for proxy in self._names(link, workers):
            await self._c().update_proxy(proxy, enabled=enabled)

    async def reset(self) -> None:
        """Every proxy of this run enabled, its toxics gone (not `/reset`: a shared
        Toxiproxy may hold other runs' proxies)."""
        client = self._c()
        for name in self._all():
            for toxic in await client.toxics(name):
                with _absent_ok():
                    await client.remove_toxic(name, toxic["name"])
            await client.update_proxy(name, enabled=True)

    async def close(self) -> None:
        """Delete the run's proxies and stop the server this run started."""
        client, self.client = self.client, None
        if client is not None:
            if self.server is None:  # a server that outlives the run keeps nothing of it
                for name in self._all():
                    with contextlib.suppress(Exception):
                        await client.delete_proxy(name)
            await client.close()
        server, self.server = self.server, None
        if server is not None:
            await server.close()
        proc, self.process = self.process, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            await asyncio.to_thread(proc.wait)


@contextlib.contextmanager
def _absent_ok():  # type: ignore[no-untyped-def]
    """A toxic or proxy that is not there (404) has nothing to undo."""
    try:
        yield
    except ToxiproxyError as exc:
        if exc.status != 404:
            raise
