"""Private Redis and RabbitMQ instances: SIGKILL, restart, what survives, and what is left.

The scenario runner trusts these helpers to crash a store or a broker and bring it back with
its data, and to leave nothing behind; these tests check exactly that, against real
processes, and check that the shared services on 6379/5672 were never touched.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import aio_pika
import pytest
import redis

from chaos import stack
from chaos.stack import StackError, free_port, free_ports, marked_pids, reap_orphans, stop_all
from chaos.systems.redis_rabbitmq.stack import (
    RabbitNode,
    RedisServer,
    amqp_handshake,
    find_epmd,
    find_rabbitmq_server,
    find_redis_server,
    redis_ping,
)
from tests.rabbit import dump_queue_records, wait_for_queue

pytestmark = pytest.mark.slow  # throwaway redis-server and RabbitMQ nodes

ROOT = Path(__file__).resolve().parent.parent

needs_redis = pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed")
needs_rabbit = pytest.mark.skipif(
    find_rabbitmq_server() is None or find_epmd() is None, reason="RabbitMQ/Erlang not installed"
)


def _shared_redis_up() -> bool:
    return redis_ping("127.0.0.1", 6379)


def _shared_rabbit_up() -> bool:
    try:
        amqp_handshake("127.0.0.1", 5672)
    except OSError:
        return False
    return True


#: Whether the shared services answered before any test here ran (checked again at the end).
SHARED_BEFORE = {"redis": _shared_redis_up(), "rabbit": _shared_rabbit_up()}


def _pgrep(pattern: str) -> list[int]:
    """Pids whose command line contains `pattern` (a second, psutil-free leftover check)."""
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, check=False)
    return [int(pid) for pid in out.stdout.split()]


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


# --- ports and binaries -----------------------------------------------------------------------


def test_free_ports_are_distinct_bindable_and_never_repeated() -> None:
    ports = free_ports(6)
    assert len(set(ports)) == 6
    assert free_port() not in ports
    for port in ports:
        assert port not in (6379, 5672, 4369, 25672)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_rabbitmq_server_is_the_real_script_not_the_su_wrapper() -> None:
    found = find_rabbitmq_server()
    if found is None:
        pytest.skip("RabbitMQ not installed")
    assert Path(found).resolve().name == "rabbitmq-server"
    assert b"su rabbitmq" not in Path(found).read_bytes()


# --- redis --------------------------------------------------------------------------------


@needs_redis
def test_redis_with_aof_keeps_data_across_sigkill() -> None:
    with RedisServer(persistence=True) as server:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        assert marked_pids(server.marker) == [server.pid]  # the leftover check can see it
        assert _pgrep(str(server.dir)) == [server.pid]
        client = redis.Redis.from_url(server.url)
        client.set("attempt:a1:rule:r1:status", "failed_attempt_1")
        first_pid, port, data_dir = server.pid, server.port, server.dir

        server.kill()
        assert not server.alive
        assert marked_pids(server.marker) == []
        with pytest.raises(redis.exceptions.ConnectionError):
            redis.Redis.from_url(server.url, socket_connect_timeout=1).ping()

        server.restart()
        assert (server.port, server.dir) == (port, data_dir)
        assert server.pid != first_pid
        fresh = redis.Redis.from_url(server.url)
        assert fresh.get("attempt:a1:rule:r1:status") == b"failed_attempt_1"
        fresh.close()
        client.close()
    assert data_dir is not None and not data_dir.exists()
    assert marked_pids(server.marker) == []


@needs_redis
def test_redis_paused_answers_nothing_and_a_clean_stop_keeps_its_data() -> None:
    """`pause` / `resume` (SIGSTOP, SIGCONT: pause_redis) and `terminate` (SIGTERM:
    stop_redis), as `chaos.systems.redis_rabbitmq.containers` offers them with docker pause
    and docker stop."""
    with RedisServer(persistence=True) as server:
        redis.Redis.from_url(server.url).set("k", "v")
        server.pause()
        with pytest.raises(redis.exceptions.TimeoutError):
            redis.Redis.from_url(server.url, socket_timeout=0.5).ping()
        server.resume()
        assert redis.Redis.from_url(server.url).get("k") == b"v"
        server.terminate(10)
        assert not server.alive and marked_pids(server.marker) == []
        server.restart()
        assert redis.Redis.from_url(server.url).get("k") == b"v"


@needs_redis
def test_redis_without_persistence_forgets_on_sigkill() -> None:
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        client.close()
        server.kill()
        server.restart()
        client = redis.Redis.from_url(server.url)
        assert client.get("k") is None
        client.close()


@needs_redis
def test_redis_start_failure_is_one_line_and_leaves_nothing() -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        server = RedisServer(port=blocker.getsockname()[1], start_timeout=5)
        with pytest.raises(StackError) as info:
            server.start()
    message = str(info.value)
    assert "\n" not in message
    assert "redis" in message and "log:" in message
    assert server.dir is None and not server.alive
    assert marked_pids(server.marker) == []
    assert server not in stack._registry.values()


@needs_redis
def test_stop_all_kills_and_cleans_every_instance() -> None:
    servers = [RedisServer().start(), RedisServer(persistence=True).start()]
    dirs = [s.dir for s in servers]
    assert all(marked_pids(s.marker) == [s.pid] for s in servers)
    stop_all()
    for server, data_dir in zip(servers, dirs, strict=True):
        assert not server.alive
        assert marked_pids(server.marker) == []
        assert data_dir is not None and not data_dir.exists()
        assert _port_free(server.port)


_OWNER_SCRIPT = """
import os, sys
from chaos.systems.redis_rabbitmq.stack import RedisServer
server = RedisServer(persistence=True).start()
print(server.marker, server.dir, flush=True)
if sys.argv[1] == "sigkill":
    os.kill(os.getpid(), 9)
"""


def _run_owner(mode: str) -> tuple[str, Path]:
    """Start a Redis from a child Python that then exits (`exit`) or dies (`sigkill`)."""
    out = subprocess.run(
        [sys.executable, "-c", _OWNER_SCRIPT, mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    marker, data_dir = out.stdout.split()
    return marker, Path(data_dir)


@needs_redis
def test_atexit_cleans_up_when_the_owner_exits_without_stop() -> None:
    marker, data_dir = _run_owner("exit")
    assert marked_pids(marker) == []
    assert not data_dir.exists()


@needs_redis
def test_reap_orphans_clears_what_a_sigkilled_owner_left() -> None:
    marker, data_dir = _run_owner("sigkill")
    orphans = marked_pids(marker)
    assert orphans and data_dir.exists()  # atexit cannot run on SIGKILL
    assert set(orphans) <= set(reap_orphans())
    deadline = time.monotonic() + 5
    while marked_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marked_pids(marker) == []
    assert not data_dir.exists()


# --- rabbitmq -------------------------------------------------------------------------------

DURABLE = "chaos.stack.durable"
TRANSIENT = "chaos.stack.transient"


async def _publish(url: str) -> None:
    """Publish with confirms on (aio-pika's default): the confirm means it is on disk."""
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(DURABLE, durable=True)
        await channel.declare_queue(TRANSIENT, durable=False)
        message = aio_pika.Message(b"survive", delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
        await channel.default_exchange.publish(message, routing_key=DURABLE)


async def _fetch(url: str) -> tuple[bytes | None, bool]:
    """The durable queue's message, and whether the non-durable queue still exists."""
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(DURABLE, durable=True, passive=True)
        message = await queue.get(timeout=5, fail=False)
        body = None
        if message is not None:
            body = message.body
            await message.ack()
        probe = await connection.channel()
        try:
            await probe.declare_queue(TRANSIENT, passive=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return body, False
        return body, True


@needs_rabbit
def test_rabbit_durable_queue_survives_sigkill_and_stop_leaves_nothing() -> None:
    node = RabbitNode()
    try:
        node.start()
        assert node.url == f"amqp://guest:guest@127.0.0.1:{node.port}/"
        assert node.port not in (5672,) and node.epmd_port != 4369
        data_dir = node.dir
        assert data_dir is not None
        running = marked_pids(node.marker)
        assert node.beam_pid in running and len(running) >= 3  # epmd, sh wrapper, beam, ...
        assert _pgrep(str(data_dir))  # beam's command line carries its private HOME

        asyncio.run(_publish(node.url))
        dump_queue_records(node)
        first_beam = node.beam_pid

        node.kill()
        assert not node.alive
        assert marked_pids(node.marker) == []
        with pytest.raises(OSError):  # aio-pika's AMQPConnectionError is an OSError
            asyncio.run(aio_pika.connect(node.url, timeout=3))

        node.restart()
        assert node.dir == data_dir and node.beam_pid != first_beam
        wait_for_queue(node, DURABLE, 1)
        body, transient_exists = asyncio.run(_fetch(node.url))
        assert body == b"survive"
        assert not transient_exists  # proof that the broker really restarted
    finally:
        node.stop()
    assert marked_pids(node.marker) == []
    assert _pgrep(str(data_dir)) == []
    assert _pgrep(node.node_name) == []
    assert not data_dir.exists()
    assert _port_free(node.port) and _port_free(node.epmd_port) and _port_free(node.dist_port)


# --- the shared instances ----------------------------------------------------------------


def test_shared_instances_still_answer() -> None:
    """Runs last in this file: nothing above may have stopped the shared Redis or RabbitMQ."""
    if not any(SHARED_BEFORE.values()):
        pytest.skip("no shared Redis/RabbitMQ on this machine")
    if SHARED_BEFORE["redis"]:
        assert _shared_redis_up()
    if SHARED_BEFORE["rabbit"]:
        amqp_handshake("127.0.0.1", 5672)
