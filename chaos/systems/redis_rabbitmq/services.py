"""The services a live chaos run talks to: its own killable Redis and RabbitMQ, or given ones.

By default a run starts a throwaway `redis-server` (append-only file, fsync always: a Redis
restart must not lose acknowledged writes, as the seed's Redis Sentinel would not) and a
private RabbitMQ node on free loopback ports, never the machine's shared instances, since
scenarios kill them. With `REDIS_URL` / `AMQP_URL` set, those services are used as they
are, and any fault that would kill one is refused before the run starts. Given services are
probed first, before anything is started or written: one that is unreachable, refuses the
credentials or does not answer within the connect timeout stops the run in one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from chaos.stack import StackError
from chaos.systems.redis_rabbitmq.stack import (
    RabbitNode,
    RedisServer,
    find_rabbitmq_server,
    find_redis_server,
)
from engine.config import ServiceUnavailable, env_config

INSTALL_HINT = (
    "needs redis-server and rabbitmq-server on this machine "
    "(Debian: apt-get install redis-server rabbitmq-server), "
    "or REDIS_URL and AMQP_URL pointing at running services"
)


class ServicesUnavailable(RuntimeError):
    """The run cannot get the services it needs; one line for a human."""


def probe_given(redis_url: str | None, amqp_url: str | None) -> None:
    """Check the services named by the environment, Redis first; `ServicesUnavailable`
    (one line: which service, where, why, what to do) when one cannot be used."""
    if redis_url is None and amqp_url is None:
        return
    from engine.runtime.broker import probe_amqp  # the clients, only for a live run
    from engine.runtime.store import probe_redis

    try:
        config = env_config()  # the URLs, and ENGINE_CONNECT_TIMEOUT_S when set
    except ValueError as exc:
        raise ServicesUnavailable(str(exc)) from None
    try:
        if redis_url is not None:
            asyncio.run(probe_redis(config))
        if amqp_url is not None:
            asyncio.run(probe_amqp(config))
    except ServiceUnavailable as exc:
        raise ServicesUnavailable(str(exc)) from None


_S = TypeVar("_S", bound=Any)


@contextlib.contextmanager
def starting() -> Iterator[Callable[[_S], _S]]:
    """Start services one after the other (`started(service)` starts one and returns it);
    should one fail, those already up are stopped, and a stack's failure is one line
    (`ServicesUnavailable`)."""
    up: list[Any] = []

    def started(service: _S) -> _S:
        service.start()
        up.append(service)
        return service

    try:
        yield started
    except BaseException as exc:
        for service in reversed(up):
            service.stop(graceful=False)
        if isinstance(exc, StackError):
            raise ServicesUnavailable(str(exc)) from None
        raise


def own_broker(
    amqp_url: str | None, started: Callable[[RabbitNode], RabbitNode], hint: str
) -> tuple[RabbitNode | None, str]:
    """The run's own RabbitMQ node, unless `amqp_url` (AMQP_URL) names one; its URL."""
    if amqp_url is not None:
        return None, amqp_url
    if find_rabbitmq_server() is None:
        raise ServicesUnavailable(hint)
    broker = started(RabbitNode())
    return broker, broker.url


def configure_broker(broker: RabbitNode | None, consumer_timeout_s: float | None) -> None:
    """Set the run's own broker as a scenario wants it (`broker.consumer_timeout_s`; None:
    RabbitMQ's default); a change costs about a second, no change nothing. A shared broker
    (None here) cannot be set."""
    if broker is None:
        if consumer_timeout_s is not None:
            raise ServicesUnavailable("cannot set consumer_timeout: AMQP_URL is shared")
        return
    ms = None if consumer_timeout_s is None else round(consumer_timeout_s * 1000)
    broker.set_consumer_timeout(ms)


@dataclass
class Services:
    redis_url: str
    amqp_url: str
    redis: RedisServer | None = None
    broker: RabbitNode | None = None

    @property
    def killable(self) -> set[str]:
        out = set()
        if self.redis is not None:
            out.add("redis")
        if self.broker is not None:
            out.add("broker")
        return out

    @staticmethod
    def own(containers: bool = False) -> set[str]:
        """The services a run starts itself here (the others: REDIS_URL, AMQP_URL)."""
        pairs = (("redis", "REDIS_URL"), ("broker", "AMQP_URL"))
        return {n for n, var in pairs if containers or var not in os.environ}

    @classmethod
    def available(cls) -> str | None:
        """None when a live run can start here, else what is missing (one line)."""
        redis_ok = "REDIS_URL" in os.environ or find_redis_server() is not None
        amqp_ok = "AMQP_URL" in os.environ or find_rabbitmq_server() is not None
        return None if redis_ok and amqp_ok else INSTALL_HINT

    @classmethod
    def start(cls, containers: bool = False) -> Services:
        """The run's services; `containers`: its own Redis and RabbitMQ in containers
        (`chaos.systems.redis_rabbitmq.containers`), whatever REDIS_URL and AMQP_URL say."""
        if containers:
            return cls._in_containers()
        redis_url = os.environ.get("REDIS_URL")
        amqp_url = os.environ.get("AMQP_URL")
        probe_given(redis_url, amqp_url)  # before starting anything of our own
        redis = broker = None
        with starting() as started:
            if redis_url is None:
                if find_redis_server() is None:
                    raise ServicesUnavailable(INSTALL_HINT)
                redis = started(RedisServer(persistence=True))
                redis_url = redis.url
            broker, amqp_url = own_broker(amqp_url, started, INSTALL_HINT)
        return cls(redis_url=redis_url, amqp_url=amqp_url, redis=redis, broker=broker)

    @classmethod
    def _in_containers(cls) -> Services:
        from chaos.systems.redis_rabbitmq.containers import RabbitContainer, RedisContainer

        with starting() as started:
            redis = started(RedisContainer(persistence=True))
            broker = started(RabbitContainer())
        return cls(redis_url=redis.url, amqp_url=broker.url, redis=redis, broker=broker)

    def service(self, name: str) -> RedisServer | RabbitNode:
        svc = self.redis if name == "redis" else self.broker
        if svc is None:
            raise ServicesUnavailable(f"cannot kill {name}: it is not this run's own instance")
        return svc

    def configure(self, consumer_timeout_s: float | None) -> None:
        """Set the run's own broker as a scenario wants it (`broker.consumer_timeout_s`;
        None: RabbitMQ's default); a change costs about a second, no change nothing. A
        shared broker cannot be set: `chaos.runner.refusal` refuses such a scenario."""
        configure_broker(self.broker, consumer_timeout_s)

    def lose_redis_writes(self, count: int) -> int:
        """Cut the last `count` writes off the run's own (stopped) Redis; how many went."""
        if count <= 0 or self.redis is None or self.redis.dir is None:
            return 0
        from chaos.systems.redis_rabbitmq.aof import drop_last_writes

        return drop_last_writes(self.redis.dir, count)

    def stop(self) -> None:
        for svc in (self.redis, self.broker):
            if svc is not None:
                svc.stop(graceful=False)
        self.redis = self.broker = None


#: How long past down-after a restart waits for the failover under way before it restarts
#: the killed server anyway (there may be no replica left to promote).
FAILOVER_PATIENCE_S = 15.0


class SentinelRedis:
    """A scenario's Redis as the seed deploys it (`redis: {topology: sentinel}`): a primary,
    a replica and three sentinels of its own (`chaos.systems.redis_rabbitmq.sentinel`), whatever
    REDIS_URL says. `kill` kills whichever server is the primary now; `restart` brings the killed
    one back (Sentinel makes it a replica of the new primary, or, nobody promoted yet, it serves
    again); `serving` says whether a primary answers again, and whether it is another."""

    def __init__(
        self,
        down_after_ms: int,
        replication_via: Callable[[str, int], tuple[str, int]] | None = None,
        min_replicas: tuple[int, int] | None = None,
    ) -> None:
        from chaos.systems.redis_rabbitmq.sentinel import SentinelTopology

        self.topology = SentinelTopology(
            down_after_ms=down_after_ms,
            replication_via=replication_via,
            min_replicas=min_replicas,
        )
        self.down_after_s = down_after_ms / 1000
        self.killed: object | None = None  # the server `kill` stopped, until restarted
        self._killed_at: tuple[str, int] | None = None
        self._killed_when = 0.0  # time.monotonic() of the kill

    @property
    def url(self) -> str:
        return self.topology.url

    @property
    def primary_port(self) -> int:
        """The first primary's port, known before `start` (a proxy can be put in front)."""
        return self.topology.servers[0].port

    def start(self) -> SentinelRedis:
        try:
            self.topology.start()
        except StackError as exc:
            raise ServicesUnavailable(f"Redis Sentinel: {exc}") from None
        return self

    def stop(self) -> None:
        self.topology.stop()

    def kill(self) -> None:
        server = self.topology.kill_primary()
        self.killed, self._killed_at = server, server.address
        self._killed_when = time.monotonic()

    def restart(self) -> None:
        """The killed server back on its port and data. A replica was promoted meanwhile:
        it is restarted as a replica of the new primary, as an operator (or a Kubernetes
        operator) would, rather than left to the sentinels' next look, up to 10 s away."""
        from chaos.systems.redis_rabbitmq.sentinel import redis_call

        server, self.killed = self.killed, None
        if server is None:
            return
        promoted = self.serving()
        if promoted is None and time.monotonic() - self._killed_when >= self.down_after_s:
            # the sentinels have declared it down: a failover is under way, and a server
            # back now would be a second primary until they demote it; it waits for it
            promoted = self._wait_serving(self.down_after_s + FAILOVER_PATIENCE_S)
        self.topology.restart(server)  # type: ignore[arg-type]
        if promoted:
            host, port = self.topology.primary_address()
            redis_call(server.address, "REPLICAOF", host, str(port))  # type: ignore[attr-defined]

    def pause(self) -> None:
        server = self.topology.pause_primary()
        self._killed_at = server.address
        self._killed_when = time.monotonic()

    def resume(self) -> bool:
        """SIGCONT the paused server: it answers what waited in its buffers at once. If the
        replica was promoted meanwhile, it is then made a replica of the new primary (as
        after a kill, rather than left to the sentinels); whether that happened."""
        from chaos.systems.redis_rabbitmq.sentinel import RedisReplyError, redis_call

        server = self.topology.resume_primary()
        promoted = bool(self.serving())
        if promoted:
            host, port = self.topology.primary_address()
            with contextlib.suppress(OSError, RedisReplyError):  # the sentinels got there first
                redis_call(server.address, "REPLICAOF", host, str(port))
        self._killed_at = None
        return promoted

    def kill_sentinel(self, index: int) -> None:
        self.topology.kill_sentinel(index)

    def restart_sentinel(self, index: int) -> None:
        self.topology.restart(self.topology.sentinels[index])

    def _wait_serving(self, timeout_s: float) -> bool | None:
        """Until a primary answers, or `timeout_s` (None: none did: no replica to promote)."""
        deadline = time.monotonic() + timeout_s
        while (promoted := self.serving()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return promoted

    def serving(self) -> bool | None:
        """None while no primary answers; else whether it is another than the one killed."""
        from chaos.systems.redis_rabbitmq.sentinel import RedisReplyError, redis_call

        try:
            address = self.topology.primary_address()
            role = redis_call(address, "ROLE")
        except (OSError, StackError, RedisReplyError):
            return None
        if not role or role[0] != "master":
            return None
        return address != self._killed_at
