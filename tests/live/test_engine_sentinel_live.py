"""The engine's store through Redis Sentinel (`redis+sentinel://`, `engine.runtime.sentinel`),
on a private topology of real processes (`chaos.services.SentinelRedis`): it finds the
primary, finds the new one after a SIGKILL and a failover (its scripts loaded anew), and
with `wait_replicas` a write counts only once the replica holds it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from chaos.services import SentinelRedis
from engine.config import EngineConfig
from engine.core import RuleResult
from engine.runtime.autopipeline import NotReplicated
from engine.runtime.store import RedisStore

pytestmark = pytest.mark.live

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
