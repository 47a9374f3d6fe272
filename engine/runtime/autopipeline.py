"""Group commit for Redis: the scripts called in one event-loop turn go out as one pipeline.

A worker runs many rules at once, and each rule's bookkeeping is one or two small scripts.
Sent one by one, each pays the client's whole per-command cost (a pooled connection, a
write, a read, a parse, a wake-up); gathered, a batch of ten costs about a third of that
per script, with the same number of round trips seen by any one caller. Order within a
batch is the order of the calls, and Redis runs each script atomically, so batching
changes neither what is written nor in what order.

Scripts are sent by their SHA (`EVALSHA`) without the `SCRIPT EXISTS` check redis-py's
pipelines add; after a Redis restart the cache is empty, so a `NOSCRIPT` reply loads the
scripts and sends the batch's missing calls again.

A batch is packed by hiredis (`hiredis.pack_command`, C: the same bytes as redis-py's
own packer, which cost the worker about a tenth of its CPU) and written on one pooled
connection as one write, its replies read in order; a lost connection is retried as
redis-py's pipelines retry it (the client's `Retry`, the connection dropped in between),
each try connecting once: redis-py's own connect retries again inside each try, so a
call to a Redis that stays down would give up only after (retries + 1) times the read
timeout, about twenty minutes, instead of the client's retries, about 37 s (what the
simulator's client does, `sim.redis.RedisClient`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

try:  # redis-py's internals, read by `_read_replies`; without them, its public path
    from redis._parsers.hiredis import NOT_ENOUGH_DATA, _AsyncHiredisParser
except ImportError:  # pragma: no cover - another redis-py than the one tested (8.x)
    NOT_ENOUGH_DATA = _AsyncHiredisParser = None


class NotReplicated(ConnectionError):
    """A batch's writes are on the primary but fewer replicas than asked acknowledged them
    within the WAIT timeout: a failover now could lose them, so they do not count as done
    (the caller sees a store failure, as if the connection had dropped)."""


def _refused(error: Exception) -> Exception:
    """A primary with `min-replicas-to-write` that lacks a good replica refuses the
    script's first write (`-NOREPLICAS`): nothing was written, as with a failed WAIT."""
    if isinstance(error, ResponseError) and str(error).startswith("NOREPLICAS"):
        return NotReplicated(f"the primary refused the write ({error})")
    return error


class AutoPipeline:
    """At most `max_in_flight` batches travel at once (one by default: measured best on a
    busy worker); calls made meanwhile wait for the next batch, which is what makes
    batches grow under load. With `wait_replicas` > 0 a batch ends with `WAIT`: one more
    command per batch, not per write (group commit for replication too)."""

    def __init__(
        self,
        client: aioredis.Redis,
        max_in_flight: int = 1,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        self.client = client
        self.max_in_flight = max_in_flight
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self.scripts: dict[str, str] = {}  # sha -> source
        self._queue: list[tuple[str, tuple[Any, ...], asyncio.Future[Any]]] = []
        self._flush_scheduled = False
        self._flushing: set[asyncio.Task[None]] = set()
        self._conn: Any = None  # the batches' connection, kept between batches

    def register(self, source: str) -> str:
        sha = self.client.register_script(source).sha
        self.scripts[sha] = source
        return sha

    def call(self, sha: str, keys: list[Any], args: list[Any]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._queue.append((sha, (len(keys), *keys, *args), fut))
        if not self._flush_scheduled and len(self._flushing) < self.max_in_flight:
            self._flush_scheduled = True
            loop.call_soon(self._start_flush)
        return fut

    def _start_flush(self) -> None:
        self._flush_scheduled = False
        batch, self._queue = self._queue, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._flush(batch))
            self._flushing.add(task)
            task.add_done_callback(self._flushed)

    def _flushed(self, task: asyncio.Task[None]) -> None:
        self._flushing.discard(task)
        if self._queue and not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._start_flush)

    async def _flush(self, batch: list[tuple[str, tuple[Any, ...], asyncio.Future[Any]]]) -> None:
        try:
            replies = await self._send(batch)
            missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
            if missing:
                for source in self.scripts.values():
                    await self.client.script_load(source)
                again = await self._send([batch[i] for i in missing])
                for i, reply in zip(missing, again, strict=True):
                    replies[i] = reply
        except Exception as exc:
            for _, _, fut in batch:
                if not fut.done():
                    fut.set_exception(_refused(exc))
            return
        for (_, _, fut), reply in zip(batch, replies, strict=True):
            if fut.done():
                continue
            if isinstance(reply, Exception):
                fut.set_exception(_refused(reply))
            else:
                fut.set_result(reply)

    async def _send(self, batch: list[tuple[str, tuple[Any, ...], asyncio.Future[Any]]]) -> list:
        """Each call's reply, or its error reply as an exception (`NoScriptError` among
        them); a connection that fails past the client's retries raises."""
        pack = hiredis.pack_command
        packed = b"".join([pack(("EVALSHA", sha, *args)) for sha, args, _ in batch])
        if self.wait_replicas <= 0:
            return await self._exchange(packed, len(batch))
        packed += pack(("WAIT", self.wait_replicas, self.wait_timeout_ms))
        *replies, acked = await self._exchange(packed, len(batch) + 1)
        if isinstance(acked, Exception):
            if "replica" in str(acked).lower():  # talking to a demoted primary: find the new
                await self.client.connection_pool.disconnect()
                raise NotReplicated(f"WAIT reached a replica ({acked})")
            raise acked
        if int(acked) < self.wait_replicas:
            raise NotReplicated(
                f"{acked} of {self.wait_replicas} replica(s) acknowledged within "
                f"{self.wait_timeout_ms} ms"
            )
        return replies

    async def _exchange(self, packed: bytes, n: int) -> list[Any]:
        """Write `packed` (`n` commands) on the batches' connection and read `n` replies.

        The connection is kept from one batch to the next rather than taken from the pool
        and given back each time: redis-py's pool checks a connection out with a lock, a
        read that must find nothing waiting and its counters, which cost the worker more
        than the batch's own write (an A/B: +13 % rules a second, 7 rounds). One
        that failed in any way, or whose read was cut short, is dropped and goes back to
        the pool, so that no reply of a batch is ever read as another's. Through Sentinel
        each batch still takes one from the pool, which finds the primary after a
        failover."""
        pool = self.client.connection_pool
        conn, self._conn = self._conn, None  # its own while in use (max_in_flight > 1)
        if conn is None:
            conn = await pool.get_connection()

        async def once() -> list[Any]:
            plain = _plain(conn)
            if not plain:
                await _connect_once(conn)
                await conn.send_packed_command(packed, check_health=False)
            replies: list[Any] = []
            try:
                # One timeout for the batch, not one a reply (a timer each); a read cut
                # short by it drops the connection, so none is left half read.
                async with asyncio.timeout(conn.socket_timeout):
                    if plain:
                        await _write(conn, packed)
                        return await _read_replies(conn, n)
                    for _ in range(n):
                        try:
                            replies.append(await conn.read_response(timeout=math.inf))
                        except ResponseError as exc:  # an error reply: that call's alone
                            replies.append(exc)
            except TimeoutError:
                raise RedisTimeoutError(f"Timeout reading {n} replies from Redis") from None
            return replies

        async def dropped(_: BaseException) -> None:
            await conn.disconnect()

        try:
            replies = await conn.retry.call_with_retry(once, dropped)
        except BaseException:
            await conn.disconnect(nowait=True)
            await pool.release(conn)
            raise
        if self._conn is None and _plain(conn):
            self._conn = conn
        else:  # another batch's was kept meanwhile, or Sentinel's pool picks the primary
            await pool.release(conn)
        return replies


def _plain(conn: Any) -> bool:
    """A connection whose replies `_read_replies` may read for redis-py: a plain
    `Connection` (a Sentinel-managed one turns a READONLY reply into a failover) with
    hiredis's parser and no health checks to schedule."""
    return (
        _AsyncHiredisParser is not None
        and type(conn).read_response is Connection.read_response
        and type(conn._parser) is _AsyncHiredisParser
        and hasattr(conn._parser, "_reader")
        and not conn.health_check_interval
    )


#: Whether this redis-py can connect without retrying (`retry_socket_connect`: 8.x can).
_ONE_TRY = (
    "retry_socket_connect"
    in inspect.signature(getattr(Connection, "connect_check_health", Connection.connect)).parameters
)


async def _connect_once(conn: Any) -> None:
    """Connect a dropped connection with one try: the batch's `Retry` is the only retry."""
    if conn.is_connected:
        return
    if _ONE_TRY:
        await conn.connect_check_health(retry_socket_connect=False)
    else:  # pragma: no cover - an older redis-py than the one tested (8.x)
        await conn.connect()


async def _write(conn: Any, packed: bytes) -> None:
    """What `conn.send_packed_command` does, less the task and timer its
    `asyncio.wait_for` costs each write (the caller's timeout covers this one): a
    failed or interrupted write drops the connection."""
    await _connect_once(conn)
    try:
        conn._writer.write(packed)
        await conn._writer.drain()
    except OSError as exc:
        await conn.disconnect(nowait=True)
        raise RedisConnectionError(f"Error while writing to {conn._host_error()}: {exc}") from None
    except BaseException:
        await conn.disconnect(nowait=True)
        raise


async def _read_replies(conn: Any, n: int) -> list[Any]:
    """`n` replies read straight from the connection's hiredis reader: what
    `conn.read_response()` returns or raises for each (its three coroutines, timeout checks
    and error formatting a reply, about a tenth of a script's cost to the worker), except
    that an error reply is returned as its exception (that call's alone) rather than
    raised. As redis-py does, any failure drops the connection, so none is left half read:
    a reply that is a connection error (`LOADING`...) or a lost socket raise."""
    parser = conn._parser
    gets = parser._reader.gets
    push = getattr(parser, "_hiredis_PushNotificationType", None)  # RESP3's out-of-band
    replies: list[Any] = []
    try:
        while len(replies) < n:
            if not parser._connected:
                raise RedisConnectionError("Connection closed by server.")
            reply = gets()
            if reply is NOT_ENOUGH_DATA:
                await parser.read_from_socket()
                continue
            if isinstance(reply, RedisConnectionError):
                raise reply
            if push is not None and isinstance(reply, push):  # handled, then read on
                await parser.handle_push_response(reply)
                continue
            if type(reply) is list and reply and isinstance(reply[0], RedisConnectionError):
                raise reply[0]
            replies.append(reply)
    except OSError as exc:
        await conn.disconnect(nowait=True)
        raise RedisConnectionError(
            f"Error while reading from {conn._host_error()} : {exc.args}"
        ) from None
    except BaseException:
        await conn.disconnect(nowait=True)
        raise
    return replies
