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
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError


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
            task = asyncio.ensure_future(self._flush(batch))
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
        if self.wait_replicas > 0:
            return await self._send_replicated(batch)
        if len(batch) == 1:
            sha, args, _ = batch[0]
            try:
                return [await self.client.execute_command("EVALSHA", sha, *args)]
            except NoScriptError as exc:
                return [exc]
        async with self.client.pipeline(transaction=False) as pipe:
            for sha, args, _ in batch:
                pipe.execute_command("EVALSHA", sha, *args)
            return list(await pipe.execute(raise_on_error=False))

    async def _send_replicated(self, batch: list[tuple[str, tuple[Any, ...], Any]]) -> list:
        """The batch, then `WAIT`: its replies only once `wait_replicas` replicas hold it."""
        async with self.client.pipeline(transaction=False) as pipe:
            for sha, args, _ in batch:
                pipe.execute_command("EVALSHA", sha, *args)
            pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
            *replies, acked = await pipe.execute(raise_on_error=False)
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
        return list(replies)
