"""The engine's store through Redis Sentinel (`redis+sentinel://`, `engine.runtime.sentinel`),
on a private topology of real processes (`chaos.systems.redis_rabbitmq.services.SentinelRedis`): it
finds the primary, finds the new one after a SIGKILL and a failover (its scripts loaded anew), and
with `wait_replicas` a write counts only once the replica holds it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from chaos.systems.redis_rabbitmq.services import SentinelRedis
from engine.config import EngineConfig
from engine.core import RuleResult
from engine.runtime.autopipeline import NotReplicated
from engine.runtime.store import RedisStore

pytestmark = [pytest.mark.live, pytest.mark.slow]

PATIENCE_S = 60.0  # a failover takes about two seconds; a busy CI machine may take longer


@pytest.fixture
def sentinel() -> Iterator[SentinelRedis]:
    topology = SentinelRedis(down_after_ms=2000).start()
    try:
        yield topology
    finally:
        topology.stop()


def result(rule: str) -> RuleResult:
    return RuleResult(rule_id=rule, attempt=1, verdict="pass", score=0.9, tokens=10)


def wait_serving(sentinel: SentinelRedis) -> bool:
    """Until a primary answers again (the event); the deadline only stops a hang."""
    deadline = time.monotonic() + PATIENCE_S
    while (promoted := sentinel.serving()) is None:
        if time.monotonic() > deadline:
            pytest.fail("no primary serves again")
        time.sleep(0.05)
    return promoted


def test_the_store_finds_the_new_primary_after_a_failover(sentinel: SentinelRedis) -> None:
    async def scenario() -> None:
        store = RedisStore(EngineConfig(redis_url=sentinel.url, namespace="sentinel."))
        try:
            existing, _, _ = await store.write_result("a1", result("compiles"))
            assert existing is None
            await asyncio.to_thread(sentinel.kill)
            assert await asyncio.to_thread(wait_serving, sentinel) is True
            # the same client, retrying through the sentinels: the new primary, which got
            # the first write by replication and has no scripts loaded yet
            kept, _, _ = await store.write_result("a1", result("compiles"))
            assert kept is not None and kept.verdict == "pass"
            existing, _, _ = await store.write_result("a1", result("tests_present"))
            assert existing is None
        finally:
            await store.close()

    asyncio.run(scenario())


def test_with_wait_replicas_a_write_counts_once_the_replica_holds_it(
    sentinel: SentinelRedis,
) -> None:
    async def scenario() -> None:
        config = EngineConfig(
            redis_url=sentinel.url, namespace="sentinel.", wait_replicas=1, wait_timeout_ms=300
        )
        store = RedisStore(config)
        try:
            existing, _, _ = await store.write_result("a1", result("compiles"))
            assert existing is None  # the replica acknowledged it
            await asyncio.to_thread(sentinel.kill)
            assert await asyncio.to_thread(wait_serving, sentinel) is True
            # the promoted replica has no replica of its own until the killed one is back
            with pytest.raises(NotReplicated):
                await store.write_result("a1", result("tests_present"))
        finally:
            await store.close()

    asyncio.run(scenario())


def test_a_primary_paused_past_the_failover_acknowledges_writes_nobody_keeps(
    sentinel: SentinelRedis,
) -> None:
    """What `sim.redis` models for pause_redis: a write sent to the frozen primary waits in
    its buffers; the replica is promoted meanwhile; the old primary wakes, acknowledges the
    write, and is made a replica: the new primary never has it."""
    import threading

    import redis

    old = sentinel.topology.primary()
    client = redis.Redis(host=old.host, port=old.port, socket_timeout=PATIENCE_S)
    client.set("before", 1)
    sentinel.pause()
    replies: list[object] = []
    sender = threading.Thread(target=lambda: replies.append(client.set("acked", 1)))
    sender.start()
    assert wait_serving(sentinel) is True  # the replica, promoted while the old one sleeps
    assert replies == []  # the write waits in the frozen server's buffers
    assert sentinel.resume() is True
    sender.join(PATIENCE_S)
    assert replies == [True]  # acknowledged by the old primary on waking...
    host, port = sentinel.topology.primary_address()
    new = redis.Redis(host=host, port=port, socket_timeout=5)
    assert new.get("before") == b"1" and new.get("acked") is None  # ...and lost
    client.close()
    new.close()


def test_with_min_replicas_a_primary_without_its_replica_refuses_writes() -> None:
    """The servers' min-replicas-to-write, the third answer to lost writes: once the replica
    is gone past the lag, the primary refuses a write (the store's `NotReplicated`), and
    nothing of it is applied; reads go on."""
    topology = SentinelRedis(down_after_ms=2000, min_replicas=(1, 1)).start()

    async def scenario() -> None:
        store = RedisStore(EngineConfig(redis_url=topology.url, namespace="sentinel."))
        try:
            existing, _, _ = await store.write_result("a1", result("compiles"))
            assert existing is None
            await asyncio.to_thread(topology.topology.replica().kill)
            deadline = time.monotonic() + PATIENCE_S
            while True:  # refused once no acknowledgement is younger than the lag
                try:
                    await store.write_result("a1", result("tests_present"))
                except NotReplicated:
                    break
                if time.monotonic() > deadline:
                    pytest.fail("the primary still takes writes without its replica")
                await store.redis.delete("attempt:a1:rule:tests_present:result")
                await asyncio.sleep(0.1)
            assert await store.redis.get("attempt:a1:rule:tests_present:result") is None
            assert await store.redis.get("attempt:a1:rule:compiles:result") is not None
        finally:
            await store.close()

    try:
        asyncio.run(scenario())
    finally:
        topology.stop()
