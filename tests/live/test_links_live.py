"""The workers' links (`chaos.links`): each worker's Redis and RabbitMQ through proxies of
its own, driven through the Toxiproxy API, on the machine's real services; our server in
process, or a `toxiproxy-server` found on PATH through the same client."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
import time
from pathlib import Path

import aio_pika
import pytest
import redis.asyncio as aredis

from chaos.links import Network, through, upstream_of
from chaos.proxy.model import ToxicSpec
from engine.config import DEFAULT_AMQP_URL, DEFAULT_REDIS_URL

pytestmark = [pytest.mark.live, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_a_url_through_a_proxy_keeps_its_credentials_path_and_query() -> None:
    url = "amqp://guest:secret@10.0.0.1:5673/vhost?x=1"
    assert through(url, "127.0.0.1:4000", heartbeat="2") == (
        "amqp://guest:secret@127.0.0.1:4000/vhost?x=1&heartbeat=2"
    )
    assert through("redis://127.0.0.1:6379/3", "127.0.0.1:4001") == "redis://127.0.0.1:4001/3"
    assert upstream_of("redis://h:7/0") == "h:7" and upstream_of("amqp://u:p@h/") == "h:5672"


async def _ping(url: str) -> bool:
    client = aredis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        return bool(await client.ping())
    except (OSError, aredis.ConnectionError, aredis.TimeoutError):
        return False
    finally:
        await client.aclose()


async def _exercise(net: Network) -> None:
    """Each worker's links work, one worker's can be cut and slowed alone, and reset."""
    await net.start()
    try:
        assert await _ping(net.url(0, "redis")) and await _ping(net.url(1, "redis"))
        conn = await aio_pika.connect(net.url(1, "broker"), timeout=5)
        await conn.close()
        await net.set_enabled("redis", (0,), False)
        assert not await _ping(net.url(0, "redis"))
        assert await _ping(net.url(1, "redis"))  # the other worker's link is its own
        await net.set_enabled("redis", (0,), True)
        assert await _ping(net.url(0, "redis"))
        slow = ToxicSpec.model_validate({"type": "latency", "attributes": {"latency": 300}})
        await net.add_toxic("redis", (0,), slow)
        began = time.monotonic()
        assert await _ping(net.url(0, "redis"))
        assert time.monotonic() - began >= 0.29
        await net.add_toxic("redis", (0,), slow)  # there already: changed, not refused
        await net.reset()
        assert await _ping(net.url(0, "redis"))
        assert net.client is not None
        assert await net.client.toxics(net.proxy(0, "redis")) == []
    finally:
        await net.close()


def test_each_worker_has_its_own_links_through_our_proxy() -> None:
    net = Network("t.", seed=1, workers=2, redis_url=DEFAULT_REDIS_URL, amqp_url=DEFAULT_AMQP_URL)
    asyncio.run(_exercise(net))
    assert net.kind == "chaos.proxy" and net.server is None  # closed with the run


def test_a_toxiproxy_server_on_path_is_used_through_the_same_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in named toxiproxy-server (our server behind Toxiproxy's flags) on PATH: the
    harness starts it on a free port, drives it over HTTP, and stops it."""
    shim = tmp_path / "toxiproxy-server"
    shim.write_text(
        f'#!/bin/sh\n# toxiproxy-server -host H -port P\ncd "{ROOT}"\n'
        f'exec "{sys.executable}" -m chaos proxy --host "$2" --port "$4"\n'
    )
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("TOXIPROXY_URL", raising=False)
    net = Network("t.", seed=1, workers=2, redis_url=DEFAULT_REDIS_URL, amqp_url=DEFAULT_AMQP_URL)
    asyncio.run(_exercise(net))
    assert net.kind == "toxiproxy-server" and net.process is None


def test_a_given_toxiproxy_url_is_used_and_keeps_nothing_of_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from chaos.proxy.client import ToxiproxyClient
    from chaos.proxy.server import ProxyServer

    async def main() -> None:
        server = ProxyServer(seed=0, port=0)
        await server.start()
        try:
            monkeypatch.setenv("TOXIPROXY_URL", server.url)
            net = Network("run1.", 1, 2, DEFAULT_REDIS_URL, DEFAULT_AMQP_URL)
            await _exercise(net)
            assert net.kind == "TOXIPROXY_URL"
            async with ToxiproxyClient(server.url) as client:
                assert await client.proxies() == {}  # the run's proxies went with it
        finally:
            await server.close()

    asyncio.run(main())
