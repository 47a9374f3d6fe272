"""Retry policy: the three levels of the seed, and the delay tiers of level 2, in one place."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from engine.validation import is_finite_number

#: Level-2 delay tiers (ms): the retry after `failed_attempt_N` waits TIERS_MS[N-1]; an attempt
#: past the table reuses the last tier.
DEFAULT_TIERS_MS: tuple[int, ...] = (30_000, 120_000, 600_000)

# --- bounds -----------------------------------------------------------------------------------
# Every number a scenario file or a worker flag sets must fit what the engine can hold: the
# history's JSON (64-bit integers), RabbitMQ (32-bit TTLs, a 16-bit prefetch) and the 7-day
# state keys. The scenario loader (chaos/scenario/, scenarios/schema.json) and the worker
# (through RetryPolicy, AgentProfile and `check_engine_settings`) refuse the same values.

#: Seeds are recorded in the history as signed 64-bit integers.
MAX_SEED = 2**63 - 1
#: The state keys' TTL (engine.config.STATE_TTL_SECONDS) in ms: no lease or wait may outlive it.
STATE_TTL_MS = 7 * 24 * 3600 * 1000
#: Longest delay tier: a day, so that even doubled by jitter a retry comes long before the
#: keys of its evaluation expire.
MAX_TIER_MS = 24 * 3600 * 1000
MAX_TIERS = 16
#: Level-2 attempts of a rule (the plan's per-rule `max_attempts` has the same bound).
MAX_ATTEMPTS = 20
MAX_IMMEDIATE_RETRIES = 20
MAX_JITTER_BUCKETS = 64
#: Evaluations per worker and rules in flight per evaluation (4 x max_evaluations is the
#: RabbitMQ prefetch, a 16-bit count).
MAX_CONCURRENCY = 1000
#: `time_scale` multiplies engine delays: 1 is real time; slower would only push the
#: delays towards the key TTL.
MAX_TIME_SCALE = 1.0

#: The worker's integer settings (engine.config.EngineConfig): name -> (least, most).
ENGINE_BOUNDS: dict[str, tuple[int, int]] = {
    "max_evaluations": (1, MAX_CONCURRENCY),
    "max_parallel": (1, MAX_CONCURRENCY),
    "heartbeat_ms": (10, STATE_TTL_MS),
    "stale_ms": (50, STATE_TTL_MS),  # the lease's own TTL
    "sweep_ms": (10, STATE_TTL_MS),
    "retry_grace_ms": (0, STATE_TTL_MS),  # or None: stale_ms
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: Any) -> str:
    """A value for an error line, short whatever it is (an int of 4,000 digits included)."""
    if _is_int(value) and abs(value) >= 10**30:  # repr fails past 4,300 digits
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_int(name: str, value: Any, least: int, most: int) -> None:
    if not (_is_int(value) and least <= value <= most):
        raise ValueError(
            f"{name}: expected an integer within [{least}, {most}]; got {_show(value)}"
        )


def check_engine_settings(config: Any) -> None:
    """Refuse, in one `ValueError` line, worker settings outside ENGINE_BOUNDS.

    `config` is an engine.config.EngineConfig (or anything with its attributes); the
    scenario loader applies the same bounds to a scenario's `engine` and `time_scale`.
    """
    for name, (least, most) in ENGINE_BOUNDS.items():
        value = getattr(config, name)
        if not (name == "retry_grace_ms" and value is None):
            _check_int(name, value, least, most)
    if config.stale_ms <= config.heartbeat_ms:
        raise ValueError(
            f"stale_ms: expected more than heartbeat_ms ({config.heartbeat_ms}); "
            f"got {config.stale_ms}"
        )
    scale = config.time_scale
    if not (is_finite_number(scale) and 0 < scale <= MAX_TIME_SCALE):
        raise ValueError(f"time_scale: expected a number within (0, 1]; got {_show(scale)}")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How hard a rule is retried before it is `permanently_failed`.

    `immediate_retries` (level 1) are extra in-memory calls inside one attempt;
    `max_attempts` (level 2 and 3) counts attempts, each written to Redis as
    `failed_attempt_N` when it fails; attempt `max_attempts` failing is permanent.
    Jitter is positive only (a retry never comes before its tier) and is drawn from a
    hash of the seed and the rule attempt, so a run replays and needs no shared RNG.
    Each tier has `jitter_buckets` delay queues, each with a queue-level TTL: a
    per-message TTL would block behind the head of its queue.
    """

    immediate_retries: int = 2
    max_attempts: int = 3
    tiers_ms: tuple[int, ...] = DEFAULT_TIERS_MS
    jitter: float = 0.1
    jitter_buckets: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        # the bounds above: a worker flag and a scenario file get the same answer
        _check_int("immediate_retries", self.immediate_retries, 0, MAX_IMMEDIATE_RETRIES)
        _check_int("max_attempts", self.max_attempts, 1, MAX_ATTEMPTS)
        tiers = self.tiers_ms
        if not (isinstance(tiers, tuple | list) and 1 <= len(tiers) <= MAX_TIERS):
            raise ValueError(f"tiers_ms: expected 1 to {MAX_TIERS} delays; got {_show(tiers)}")
        for i, tier in enumerate(tiers):
            _check_int(f"tiers_ms[{i}]", tier, 1, MAX_TIER_MS)
        if not (is_finite_number(self.jitter) and 0.0 <= self.jitter <= 1.0):
            raise ValueError(f"jitter: expected a number within [0, 1]; got {_show(self.jitter)}")
        _check_int("jitter_buckets", self.jitter_buckets, 1, MAX_JITTER_BUCKETS)
        _check_int("seed", self.seed, 0, MAX_SEED)

    def tier_for(self, failed_attempt: int) -> int:
        """0-based tier index of the retry that follows `failed_attempt_N`."""
        return min(failed_attempt, len(self.tiers_ms)) - 1

    def bucket_for(self, attempt_id: str, rule_id: str, failed_attempt: int) -> int:
        if self.jitter_buckets == 1 or self.jitter == 0.0:
            return 0
        key = f"{self.seed}:{attempt_id}:{rule_id}:{failed_attempt}".encode()
        digest = hashlib.blake2b(key, digest_size=8).digest()
        return int.from_bytes(digest, "big") % self.jitter_buckets

    def delay_ms(self, tier: int, bucket: int) -> int:
        """The queue-level TTL of one delay queue, before any time scaling."""
        base = self.tiers_ms[tier]
        if self.jitter_buckets == 1:
            return base
        return round(base * (1.0 + self.jitter * bucket / (self.jitter_buckets - 1)))

    def delay_queues(self) -> list[tuple[int, int, int]]:
        """Every (tier, bucket, delay_ms) the broker must declare."""
        buckets = 1 if self.jitter == 0.0 else self.jitter_buckets
        return [
            (t, b, self.delay_ms(t, b)) for t in range(len(self.tiers_ms)) for b in range(buckets)
        ]
