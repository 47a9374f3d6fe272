"""A Redis client through Sentinel: the primary the sentinels name, found again after each
failover (the URL itself is parsed by `engine.sentinel_url`, which the configuration and
the simulator read without redis-py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.sentinel_url import parse_sentinel_url

if TYPE_CHECKING:
    import redis.asyncio as aioredis


def sentinel_client(url: str, **kwargs: Any) -> aioredis.Redis:
    """A client of the primary the sentinels name, found again after each failover;
    `kwargs` are the connection settings of `redis_client` (timeouts, retry)."""
    from redis.asyncio.sentinel import Sentinel

    target = parse_sentinel_url(url)
    timeouts = {k: kwargs[k] for k in ("socket_connect_timeout", "socket_timeout") if k in kwargs}
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=timeouts)
    return sentinel.master_for(
        target.master,
        db=target.db,
        username=target.username,
        password=target.password,
        **kwargs,
    )
