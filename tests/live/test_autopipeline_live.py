"""The group commit's own wire handling (`engine.runtime.autopipeline`), on the real Redis.

The batch is packed and read by hand (not through redis-py's pipeline), so what the
pipeline did for it is proven here: replies in call order, an error reply kept to its own
call, a script Redis does not hold loaded on its `NOSCRIPT`, a silent server timing out with the
connection dropped rather than left half read, and a Redis that stays down failing the batch
after the client's retries, one connect each (as the simulator's client gives up).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from chaos.systems.redis_rabbitmq.stack import RedisServer
from engine.config import DEFAULT_REDIS_URL
from engine.runtime.autopipeline import AutoPipeline

pytestmark = [pytest.mark.live, pytest.mark.slow]

_ECHO = "return {KEYS[1], ARGV[1]}"
_FAIL = "return redis.error_reply('no: ' .. ARGV[1])"


def test_a_batch_replies_in_call_order_and_an_error_stays_with_its_call() -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(DEFAULT_REDIS_URL, decode_responses=True)
        try:
            batch = AutoPipeline(client)
            key = f"test:autopipeline:{uuid.uuid4().hex}"
            # Scripts Redis has never seen: the first batch meets NOSCRIPT, and loads them.
            echo, fail = (batch.register(f"{src} -- {key}") for src in (_ECHO, _FAIL))
            calls = [
                batch.call(fail, [key], [i]) if i == 3 else batch.call(echo, [key], [i, "é"])
                for i in range(7)
            ]
            replies = await asyncio.gather(*calls, return_exceptions=True)
            for i, reply in enumerate(replies):
                if i == 3:
                    assert isinstance(reply, ResponseError) and "no: 3" in str(reply)
                else:
                    assert reply == [key, str(i)]
            assert await batch.call(echo, ["k"], ["x"]) == ["k", "x"]  # the connection is fine
        finally:
            await client.aclose()

    asyncio.run(main())


@contextlib.contextmanager
def _silent_server() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield server.getsockname()[1]


def test_a_silent_server_times_the_batch_out_and_drops_the_connection() -> None:
    async def main(port: int) -> None:
        client = aioredis.Redis(
            host="127.0.0.1",
            port=port,
            socket_timeout=0.3,
            retry=Retry(NoBackoff(), 0),  # the store's client retries, the batch does not care
        )
        try:
            batch = AutoPipeline(client)
            sha = batch.register(_ECHO)
            calls = [batch.call(sha, ["k"], [i]) for i in range(3)]
            replies = await asyncio.gather(*calls, return_exceptions=True)
            assert all(isinstance(r, RedisTimeoutError) for r in replies), replies
            pool = client.connection_pool
            released = pool._available_connections  # the one connection, back in the pool
            assert released and not any(c.is_connected for c in released)
        finally:
            await client.aclose()

    with _silent_server() as port:
        asyncio.run(main(port))


def test_a_redis_that_stays_down_fails_the_batch_after_the_client_s_retries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batch's connection, kept from the last batch, is lost with the server: each of
    the batch's tries connects again, once. redis-py's connect retries inside each try:
    nested, that was 6 x 6 connects here, and about twenty minutes with the store's
    settings (41 tries, each cut by the 30 s read timeout) where the simulator's client
    gives up after 37 s."""
    connects: list[int] = []
    real = Connection._connect

    async def counted(self: Connection) -> None:
        connects.append(self.port)
        await real(self)

    monkeypatch.setattr(Connection, "_connect", counted)

    async def main(server: RedisServer) -> None:
        client = aioredis.Redis.from_url(
            server.url, socket_timeout=5.0, retry=Retry(NoBackoff(), 5)
        )
        try:
            batch = AutoPipeline(client)
            sha = batch.register(_ECHO)
            assert await batch.call(sha, ["k"], [1]) == [b"k", b"1"]
            server.kill()  # SIGKILL: every connect from now on is refused
            connects.clear()
            with pytest.raises(RedisConnectionError):
                await batch.call(sha, ["k"], [2])
        finally:
            await client.aclose()

    with RedisServer() as server:
        asyncio.run(main(server))
    assert connects == [server.port] * 5  # the first try wrote on the lost connection
