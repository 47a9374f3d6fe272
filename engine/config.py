"""Worker settings: flags beat environment, environment beats defaults that work here.

Credentials live in the URLs, which come from the environment (`REDIS_URL`, `AMQP_URL`)
and are never printed: `redacted()` is what logs and errors show.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from engine.policy import DEFAULT_TIERS_MS, RetryPolicy

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"

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

    def scaled(self, ms: int) -> float:
        """Policy milliseconds to real seconds."""
        return ms * self.time_scale / 1000.0

    @property
    def grace_ms(self) -> int:
        return self.retry_grace_ms if self.retry_grace_ms is not None else self.stale_ms

    def name(self, base: str) -> str:
        return f"{self.namespace}{base}"


def env_config(**overrides: object) -> EngineConfig:
    """Defaults, then `ENGINE_*` / `REDIS_URL` / `AMQP_URL` from the environment, then overrides."""
    env = os.environ
    values: dict[str, object] = {}
    if "REDIS_URL" in env:
        values["redis_url"] = env["REDIS_URL"]
    if "AMQP_URL" in env:
        values["amqp_url"] = env["AMQP_URL"]
    for key, cast in (
        ("namespace", str),
        ("time_scale", float),
        ("max_evaluations", int),
        ("max_parallel", int),
        ("heartbeat_ms", int),
        ("stale_ms", int),
        ("sweep_ms", int),
        ("retry_grace_ms", int),
    ):
        raw = env.get(f"ENGINE_{key.upper()}")
        if raw is not None:
            values[key] = cast(raw)
    if "ENGINE_SWEEPER" in env:
        values["sweeper"] = env["ENGINE_SWEEPER"].lower() not in ("0", "false", "no", "off")
    values.update({k: v for k, v in overrides.items() if v is not None})
    return EngineConfig(**values)  # type: ignore[arg-type]


def policy_from(
    immediate_retries: int | None = None,
    max_attempts: int | None = None,
    tiers_ms: tuple[int, ...] | None = None,
    jitter: float | None = None,
    seed: int | None = None,
) -> RetryPolicy:
    base = RetryPolicy()
    return RetryPolicy(
        immediate_retries=base.immediate_retries
        if immediate_retries is None
        else immediate_retries,
        max_attempts=base.max_attempts if max_attempts is None else max_attempts,
        tiers_ms=DEFAULT_TIERS_MS if tiers_ms is None else tiers_ms,
        jitter=base.jitter if jitter is None else jitter,
        seed=base.seed if seed is None else seed,
    )


def redacted(url: str) -> str:
    """The URL with its password replaced, for logs and error lines."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))
