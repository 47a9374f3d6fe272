"""Retry policy: the three levels of the seed, and the delay tiers of level 2, in one place."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

#: Level-2 delay tiers (ms): the retry after `failed_attempt_N` waits TIERS_MS[N-1]; an attempt
#: past the table reuses the last tier.
DEFAULT_TIERS_MS: tuple[int, ...] = (30_000, 120_000, 600_000)


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
        if self.immediate_retries < 0:
            raise ValueError("immediate_retries must be >= 0")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if not self.tiers_ms or any(t <= 0 for t in self.tiers_ms):
            raise ValueError("tiers_ms must be a non-empty list of positive delays")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError("jitter must be within [0, 1]")
        if self.jitter_buckets < 1:
            raise ValueError("jitter_buckets must be >= 1")

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
