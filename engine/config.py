"""Worker settings: flags beat environment, environment beats defaults that work here.

Credentials live in the URLs, which come from the environment (`REDIS_URL`, `AMQP_URL`, and
`EAI_DATABASE_URL` for the PostgreSQL store, which no flag takes) and are never printed:
`redacted()` is what logs and errors show.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import NoReturn
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from engine.policy import DEFAULT_TIERS_MS, RetryPolicy, check_engine_settings
from engine.sentinel_url import (
    is_sentinel_url,
    parse_sentinel_url,
    redacted_sentinel_url,
    sentinel_secrets,
)

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
#: The PostgreSQL store (`store="postgres"`): the durable design's variable, its tenant.
DEFAULT_DATABASE_URL = "postgresql://eai_engine@127.0.0.1:5432/eai"
DEFAULT_TENANT_ID = "00000000-0000-0000-0000-000000000001"
#: The engine's stores: Redis (the first design), PostgreSQL (`engine.runtime.pgstore`).
STORES = ("redis", "postgres")
#: Its first memories: RabbitMQ, or PostgreSQL's job rows (`engine.runtime.pgqueue`, with
#: the PostgreSQL store only: the `pg` design).
BROKERS = ("rabbitmq", "postgres")
#: The designs a worker can be (`--system`): its store and its broker.
SYSTEMS = {
    "redis-rabbitmq": ("redis", "rabbitmq"),
    "pg-store": ("postgres", "rabbitmq"),
    "pg": ("postgres", "postgres"),
}


def of_system(system: str | None, store: str | None) -> tuple[str | None, str | None]:
    """(store, broker) of `--system` and `--store` together (None: not set); ValueError,
    one line, when they contradict each other."""
    if system is None:
        return store, None
    own, broker = SYSTEMS[system]
    if store is not None and store != own:
        raise ValueError(f"--store {store}: system {system} keeps its store in {own}")
    return own, broker


#: Seven days, as the seed says: state keys expire on their own.
STATE_TTL_SECONDS = 7 * 24 * 3600


@dataclass(frozen=True)
class EngineConfig:
    redis_url: str = DEFAULT_REDIS_URL
    amqp_url: str = DEFAULT_AMQP_URL
    namespace: str = ""  # prefixes queues, exchanges and the engine's own index keys
    time_scale: float = 1.0  # 0.001 turns the 30 s tier into 30 ms
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    max_evaluations: int = 8  # evaluations one worker runs at once
    max_parallel: int = 4  # rules of one evaluation in flight at once
    heartbeat_ms: int = 1000
    stale_ms: int = 5000  # a heartbeat older than this means the owner is gone
    sweeper: bool = True
    sweep_ms: int = 1000
    retry_grace_ms: int | None = None  # a retry overdue by this much was lost (default stale_ms)
    state_ttl_s: int = STATE_TTL_SECONDS
    # Every network call is bounded, so a dead or wrong service is an error, not a hang: a
    # connection gets `connect_timeout_s`, a command or broker operation `read_timeout_s`
    # (generous: a false timeout makes a retry, and CI runs on a busy machine).
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    # Redis behind Sentinel replicates asynchronously: a primary that dies loses the writes
    # its replica had not received, acknowledged or not. With `wait_replicas` > 0 each batch
    # of the store's scripts ends with `WAIT wait_replicas wait_timeout_ms`, and a write is
    # taken as done only once that many replicas hold it (`NotReplicated` otherwise).
    wait_replicas: int = 0
    wait_timeout_ms: int = 1000
    # Which store keeps results, statuses, leases and indexes: "redis" or "postgres" (then
    # `database_url`, from EAI_DATABASE_URL, and the rows of tenant `tenant_id`).
    store: str = "redis"
    # Which first memory carries work, retries, forwards and events: "rabbitmq" or
    # "postgres" (job rows in the store's database; `store` must be "postgres").
    broker: str = "rabbitmq"
    database_url: str = DEFAULT_DATABASE_URL
    tenant_id: str = DEFAULT_TENANT_ID

    def scaled(self, ms: int) -> float:
        """Policy milliseconds to real seconds."""
        return ms * self.time_scale / 1000.0

    @property
    def prefetch(self) -> int:
        """The consumers' prefetch: the deliveries a worker holds unacknowledged at most. A
        delivery waits for a free slot with its ACK pending, so a worker takes no more than
        it can soon begin (4 x max_evaluations, a 16-bit count for RabbitMQ)."""
        return self.max_evaluations * 4

    @property
    def grace_ms(self) -> int:
        return self.retry_grace_ms if self.retry_grace_ms is not None else self.stale_ms

    def name(self, base: str) -> str:
        return f"{self.namespace}{base}"


class OneLineParser(argparse.ArgumentParser):
    """Bad input is one line on stderr and exit 2 (argparse would add the usage)."""

    @staticmethod
    def summary(doc: str | None) -> str:
        """A module docstring's first paragraph on one line: `--help`'s description, whole
        (its first line alone may stop mid-sentence)."""
        return " ".join((doc or "").strip().split("\n\n", 1)[0].split())

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog.removeprefix('python -m ')}: {message}\n")


def env_config(**overrides: object) -> EngineConfig:
    """Defaults, then `ENGINE_*` / `REDIS_URL` / `AMQP_URL` / `EAI_DATABASE_URL` /
    `EAI_TENANT_ID` from the environment, then overrides."""
    env = os.environ
    values: dict[str, object] = {}
    for var, key in (
        ("REDIS_URL", "redis_url"),
        ("AMQP_URL", "amqp_url"),
        ("EAI_DATABASE_URL", "database_url"),
        ("EAI_TENANT_ID", "tenant_id"),
        ("ENGINE_STORE", "store"),
    ):
        if var in env:
            values[key] = env[var]
    for key, cast in (
        ("namespace", str),
        ("time_scale", float),
        ("max_evaluations", int),
        ("max_parallel", int),
        ("heartbeat_ms", int),
        ("stale_ms", int),
        ("sweep_ms", int),
        ("retry_grace_ms", int),
        ("connect_timeout_s", float),
        ("read_timeout_s", float),
        ("wait_replicas", int),
        ("wait_timeout_ms", int),
    ):
        raw = env.get(f"ENGINE_{key.upper()}")
        if raw is not None:
            values[key] = cast(raw)
    stale_s = env.get("EAI_HEARTBEAT_STALE_SECONDS")  # the durable design's name for the lease
    if stale_s is not None and "ENGINE_STALE_MS" not in env:
        try:
            values["stale_ms"] = round(float(stale_s) * 1000)
        except ValueError:
            raise ValueError(
                f"EAI_HEARTBEAT_STALE_SECONDS: expected seconds; got {stale_s!r}"
            ) from None
    if "ENGINE_SWEEPER" in env:
        values["sweeper"] = env["ENGINE_SWEEPER"].lower() not in ("0", "false", "no", "off")
    values.update({k: v for k, v in overrides.items() if v is not None})
    config = EngineConfig(**values)  # type: ignore[arg-type]
    check_urls(config)
    check_engine_settings(config)
    return config


def check_urls(config: EngineConfig) -> None:
    """A URL of the wrong kind is bad input (a ValueError, one line), not an outage."""
    for name, url, schemes in (
        ("REDIS_URL", config.redis_url, ("redis", "rediss", "unix", "redis+sentinel")),
        ("AMQP_URL", config.amqp_url, ("amqp", "amqps")),
    ):
        scheme = url.partition("://")[0] if "://" in url else ""
        if scheme not in schemes:
            expected = ", ".join(f"{s}://" for s in schemes)
            got = redacted(url) if scheme else "a value without scheme://"  # never echo it
            raise ValueError(f"{name}: expected a URL starting {expected}; got {got}")
    if is_sentinel_url(config.redis_url):
        parse_sentinel_url(config.redis_url)  # the sentinels and the master's name
    if config.store not in STORES:
        raise ValueError(f"store: expected one of {', '.join(STORES)}; got {config.store!r}")
    if config.broker not in BROKERS:
        raise ValueError(f"broker: expected one of {', '.join(BROKERS)}; got {config.broker!r}")
    if config.broker == "postgres" and config.store != "postgres":
        raise ValueError("broker: postgres keeps its jobs in the store's database; store: postgres")
    if config.store == "postgres":
        url = config.database_url
        scheme = url.partition("://")[0] if "://" in url else ""
        if scheme not in ("postgresql", "postgres"):
            got = redacted(url) if scheme else "a value without scheme://"  # never echo it
            raise ValueError(
                f"EAI_DATABASE_URL: expected a URL starting postgresql:// or postgres://; got {got}"
            )
        try:
            uuid.UUID(config.tenant_id)
        except ValueError:
            raise ValueError(f"EAI_TENANT_ID: expected a UUID; got {config.tenant_id!r}") from None
    if config.wait_replicas < 0 or config.wait_timeout_ms < 1:
        raise ValueError(
            "wait_replicas: expected a count >= 0 with wait_timeout_ms >= 1; got "
            f"{config.wait_replicas} and {config.wait_timeout_ms}"
        )
    for name in ("connect_timeout_s", "read_timeout_s"):
        value = getattr(config, name)
        if not value > 0:
            raise ValueError(f"{name}: expected a number of seconds > 0; got {value!r}")


def policy_from(
    immediate_retries: int | None = None,
    max_attempts: int | None = None,
    tiers_ms: tuple[int, ...] | None = None,
    jitter: float | None = None,
    seed: int | None = None,
    jitter_buckets: int | None = None,
) -> RetryPolicy:
    base = RetryPolicy()
    return RetryPolicy(
        immediate_retries=base.immediate_retries
        if immediate_retries is None
        else immediate_retries,
        max_attempts=base.max_attempts if max_attempts is None else max_attempts,
        tiers_ms=DEFAULT_TIERS_MS if tiers_ms is None else tiers_ms,
        jitter=base.jitter if jitter is None else jitter,
        jitter_buckets=base.jitter_buckets if jitter_buckets is None else jitter_buckets,
        seed=base.seed if seed is None else seed,
    )


def redacted(url: str) -> str:
    """The URL with its password replaced (also a `password=` query parameter), for logs and
    error lines."""
    if is_sentinel_url(url):
        try:
            return redacted_sentinel_url(url)
        except ValueError:
            return "<unparsable URL>"
    try:
        parts = urlsplit(url)
        password, port = parts.password, parts.port
    except ValueError:  # not a URL we can take apart: show none of it
        return "<unparsable URL>"
    query = parts.query
    if "password" in query.lower():
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, "***" if k.lower() == "password" else v) for k, v in pairs], safe="*"
        )
    netloc = parts.netloc
    if password is not None:
        host = parts.hostname or ""
        if ":" in host:  # IPv6
            host = f"[{host}]"
        if port:
            host = f"{host}:{port}"
        netloc = f"{parts.username or ''}:***@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def secrets_of(url: str) -> list[str]:
    """The URL's password(s), so an error text quoting one can be scrubbed."""
    if is_sentinel_url(url):
        try:
            return sentinel_secrets(url)
        except ValueError:
            return [url]
    try:
        parts = urlsplit(url)
        found = [parts.password] if parts.password else []
    except ValueError:
        return [url]
    found += [v for k, v in parse_qsl(parts.query) if k.lower() == "password" and v]
    return found


def scrubbed(text: str, url: str) -> str:
    """An error text (a client's, quoted in a line) with the URL's password(s) masked."""
    for secret in secrets_of(url):
        text = text.replace(secret, "***")
    return text


class ServiceUnavailable(ConnectionError):
    """A service the engine needs cannot be used. `str()` is the one line a human reads:
    which service, where (credentials masked), why, and what to do about it. A `reason`
    quoting a client's error text must be `scrubbed` first."""

    def __init__(
        self,
        service: str,
        url: str,
        reason: str,
        env: str,
        *,
        login: bool = False,
        todo: str | None = None,
    ) -> None:
        self.service = service
        self.url = redacted(url)
        self.reason = " ".join(reason.split())[:200]
        what = "cannot log in to" if login else "cannot reach"
        if todo is None:
            todo = f"check the credentials in {env}" if login else f"start it or set {env}"
        super().__init__(f"{what} {service} at {self.url} ({self.reason}); {todo}")


def network_reason(exc: BaseException, timeout_s: float) -> str | None:
    """A short reason for a failed connection (refused, unknown host, timed out...), read
    from the exception or what caused it; None when it is not a network failure."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, socket.gaierror):
            return "unknown host"
        if isinstance(cur, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cur, ConnectionResetError | BrokenPipeError):
            return "connection closed by the other side"
        if isinstance(cur, TimeoutError) or type(cur).__name__ == "TimeoutError":
            return f"no answer within {timeout_s:g} s"
        errno_ = cur.errno if isinstance(cur, OSError) else None
        if errno_ is None and cur.args and isinstance(cur.args[0], int):
            errno_ = cur.args[0]  # aiormq: AMQPConnectionError(111, "Connect call failed")
        if errno_ == errno.ECONNREFUSED:
            return "connection refused"
        if errno_ in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return "host unreachable"
        cur = cur.__cause__ or cur.__context__
    return None
