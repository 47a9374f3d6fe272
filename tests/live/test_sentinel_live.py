"""A live Sentinel topology (chaos.systems.redis_rabbitmq.sentinel): failover, fail back, quorum,
pause, and the acknowledged writes an asynchronous failover loses.

Real processes and real signals; every wait is for an event (a sentinel's answer, a ROLE),
with deadlines generous enough for a busy 2-core CI machine, and no duration is asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from chaos.proxy.server import ProxyServer
from chaos.stack import free_port, marked_pids
from chaos.systems.redis_rabbitmq.sentinel import DataServer, SentinelTopology, redis_call
from chaos.systems.redis_rabbitmq.stack import find_redis_server

pytestmark = [
    pytest.mark.live,
    pytest.mark.slow,
    pytest.mark.skipif(find_redis_server() is None, reason="redis-server not installed"),
]

#: How long a test waits for something Sentinel must do (see tests/live/conftest.py).
PATIENCE_S = 120.0

Address = tuple[str, int]


def _client(address: Address) -> redis.Redis:
    return redis.Redis(host=address[0], port=address[1], socket_timeout=10, decode_responses=True)


def _wait_for(what: str, fact: Callable[[], bool], timeout: float = PATIENCE_S) -> None:
    deadline = time.monotonic() + timeout
    while not fact():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _holds(address: Address, key: str, value: str) -> bool:
    try:
        with _client(address) as client:
            return client.get(key) == value
    except redis.RedisError:
        return False


def _leftovers(services: list[Any], dirs: list[Path]) -> tuple[list[int], list[Path]]:
    """Processes still carrying one of the services' markers, and temp dirs still there."""
    return [p for s in services for p in marked_pids(s.marker)], [d for d in dirs if d.exists()]


def _parts(topology: SentinelTopology) -> tuple[list[Any], list[Path]]:
    services: list[Any] = [*topology.servers, *topology.sentinels]
    return services, [s.dir for s in services if s.dir is not None]


@pytest.fixture
def make_topology() -> Iterator[Callable[..., SentinelTopology]]:
    """Start topologies; at teardown each is stopped (also when the test failed) and must
    have left no process and no temp dir."""
    made: list[tuple[SentinelTopology, list[Any], list[Path]]] = []

    def make(**kwargs: Any) -> SentinelTopology:
        topology = SentinelTopology(**kwargs).start()
        made.append((topology, *_parts(topology)))
        return topology

    yield make
    for topology, services, dirs in made:
        for service in services:  # pytest shows this output only when the test failed
            for log in service._log_paths():
                with contextlib.suppress(OSError):
                    print(f"==== {service!r}\n{log.read_text()[-20_000:]}")
        topology.stop()
        assert _leftovers(services, dirs) == ([], [])


def test_start_replicates_and_stop_leaves_nothing(
    make_topology: Callable[..., SentinelTopology],
) -> None:
    topology = make_topology()
    primary, replica = topology.primary(), topology.replica()
    assert primary is not replica
    assert topology.primary_address() == primary.address
    ports = ",".join(f"127.0.0.1:{s.port}" for s in topology.sentinels)
    assert topology.url == f"redis+sentinel://{ports}/chaos/0"
    with _client(primary.address) as client:
        client.set("k", "v")
    _wait_for("the write on the replica", lambda: _holds(replica.address, "k", "v"))
    for sentinel in topology.sentinels:
        listed = redis_call(sentinel.address, "SENTINEL", "replicas", "chaos")
        assert [(r[r.index("ip") + 1], int(r[r.index("port") + 1])) for r in listed] == [
            replica.address
        ]
    services, dirs = _parts(topology)
    pids, left = _leftovers(services, dirs)
    assert len(pids) == 5 and len(left) == 5
    topology.stop()
    assert _leftovers(services, dirs) == ([], [])


def test_kill_primary_fails_over_and_back(make_topology: Callable[..., SentinelTopology]) -> None:
    topology = make_topology()
    first, second = topology.primary(), topology.replica()
    with _client(first.address) as client:
        client.set("before", "1")
        assert client.wait(1, 10_000) == 1  # the replica acknowledged it

    assert topology.kill_primary() is first
    assert topology.wait_failover(first.address, PATIENCE_S) == second.address
    assert topology.primary() is second
    assert _holds(second.address, "before", "1")

    topology.restart(first)  # comes back as a master from its config, and is demoted
    topology.wait_replica_of(first, second.address, PATIENCE_S)
    with _client(second.address) as client:
        client.set("between", "2")
    _wait_for("the write on the old primary", lambda: _holds(first.address, "between", "2"))

    topology.kill_primary()  # fail back
    assert topology.wait_failover(second.address, PATIENCE_S) == first.address
    assert _holds(first.address, "before", "1") and _holds(first.address, "between", "2")
    topology.restart(second)
    topology.wait_replica_of(second, first.address, PATIENCE_S)


class ThreadedProxy:
    """chaos.proxy's Toxiproxy-compatible server on its own event loop in a thread, so a
    sync test can put it on the replication link and cut it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = ProxyServer(seed=0, port=0)
        self.run(self.server.start())
        self.listen: Address | None = None

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def via(self, host: str, port: int) -> Address:
        """`replication_via`: a proxy to the primary on a free port."""
        listen = f"127.0.0.1:{free_port()}"
        spec = {"name": "replication", "listen": listen, "upstream": f"{host}:{port}"}
        proxy = self.run(self.server.create_proxy(spec))
        host_, _, port_ = proxy.listen.rpartition(":")
        self.listen = (host_, int(port_))
        return self.listen

    def stall(self) -> None:
        """Drop every byte both ways, connections held open: a silent partition."""
        for stream in ("downstream", "upstream"):
            spec = {"type": "timeout", "stream": stream, "attributes": {"timeout": 0}}
            self.run(self.server.add_toxic("replication", spec))

    def close(self) -> None:
        self.run(self.server.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def proxy() -> Iterator[ThreadedProxy]:
    server = ThreadedProxy()
    try:
        yield server
    finally:
        server.close()


def test_acknowledged_writes_are_lost_when_the_partitioned_replica_is_promoted(
    make_topology: Callable[..., SentinelTopology], proxy: ThreadedProxy
) -> None:
    topology = make_topology(replication_via=proxy.via)
    first, second = topology.primary(), topology.replica()
    assert proxy.listen is not None
    # Sentinel lists the replica at its own address, though its link comes from the proxy.
    listed = redis_call(topology.sentinels[0].address, "SENTINEL", "replicas", "chaos")
    entry = dict(zip(listed[0][::2], listed[0][1::2], strict=True))
    assert (entry["ip"], int(entry["port"])) == second.address
    assert int(entry["master-port"]) == proxy.listen[1]

    with _client(first.address) as client:
        client.set("before", "1")
    _wait_for("the write through the proxy", lambda: _holds(second.address, "before", "1"))

    # Sentinel "fixes" a replica whose master address is not the primary's, failover-timeout
    # after it first sees it: wait for that attempt and check the pin refused it, so the
    # replica still replicates through the proxy (or the cut below would cut nothing).
    _wait_for(
        "Sentinel's +fix-slave-config",
        lambda: any("+fix-slave-config" in s.log_text() for s in topology.sentinels),
    )
    with _client(second.address) as client:
        assert int(client.info("replication")["master_port"]) == proxy.listen[1]

    # The cut is a stall, not a disabled proxy: a disabled proxy closes the link, the
    # replica reports it down, and Sentinel promotes no replica whose link has been down
    # longer than 10 x down-after-milliseconds plus the time the primary has been down
    # (hard-coded in sentinelSelectSlave; Sentinel has no replica-validity-factor), which
    # would make this test depend on how fast it reaches the kill. Stalled, the link stays
    # "up" until repl-timeout (60 s) and goes down only when the primary dies.
    proxy.stall()
    with _client(first.address) as client:
        for i in range(5):
            assert client.set(f"lost:{i}", "acked") is True  # acknowledged by the primary
        assert client.wait(1, 200) == 0  # and by no replica

    assert topology.kill_primary() is first
    assert topology.wait_failover(first.address, PATIENCE_S) == second.address
    with _client(second.address) as client:
        assert client.get("before") == "1"
        assert [client.get(f"lost:{i}") for i in range(5)] == [None] * 5
        # Promoted, it is no longer pinned: Sentinel may make it a replica again later.
        assert client.execute_command("ACL", "DRYRUN", "default", "REPLICAOF", "127.0.0.1", "1")

    # The old primary had them in its AOF; demoted, it resyncs and they are gone for good.
    topology.restart(first)
    topology.wait_replica_of(first, second.address, PATIENCE_S)
    with _client(first.address) as client:
        assert client.get("before") == "1"
        assert client.exists(*[f"lost:{i}" for i in range(5)]) == 0


def test_two_sentinels_still_fail_over(make_topology: Callable[..., SentinelTopology]) -> None:
    topology = make_topology()
    first, second = topology.primary(), topology.replica()
    killed = topology.kill_sentinel(0)
    assert not killed.alive
    topology.kill_primary()
    assert topology.wait_failover(first.address, PATIENCE_S) == second.address
    for sentinel in topology.sentinels[1:]:
        addr = redis_call(sentinel.address, "SENTINEL", "get-master-addr-by-name", "chaos")
        assert (addr[0], int(addr[1])) == second.address


def test_a_paused_primary_is_replaced_then_demoted(
    make_topology: Callable[..., SentinelTopology],
) -> None:
    topology = make_topology()
    first, second = topology.primary(), topology.replica()
    assert topology.pause_primary() is first
    assert topology.wait_failover(first.address, PATIENCE_S) == second.address
    assert first.alive  # stopped, not dead
    assert topology.resume_primary() is first
    topology.wait_replica_of(first, second.address, PATIENCE_S)
    assert isinstance(topology.replica(), DataServer) and topology.replica() is first


def test_a_down_after_below_sentinels_ping_period_is_refused() -> None:
    with pytest.raises(ValueError, match="down_after_ms must be >= 1500"):
        SentinelTopology(down_after_ms=500)
