"""The checker's own expectations, computed from the scenario and the plan as plain data.

Nothing here calls the engine's policy or plan methods: the delay tiers come from the
scenario's retry settings (`tiers_ms`, `jitter`, `time_scale`) and the set to prune from the
plan's `depends_on` edges, by code written for the checker. A bug shared by the engine and
its checker (a wrong tier table lookup, a wrong closure) would otherwise be invisible: both
would agree on the wrong answer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from chaos.checker.records import RetrySettings

#: Agent errors the policy does not retry: the same call would fail the same way (the
#: `AgentService` contract: an invalid output). Every other kind (timeout, quota, a missing
#: tool) is worth retrying. The checker's own table, not the engine's `retryable` flag.
PERMANENT_ERRORS: frozenset[str] = frozenset({"invalid_output"})

#: The stored statuses, as the seed spells them: the checker's own reading, not the engine's
#: (`engine.core.states`), so that a change there cannot change what is judged.
PERMANENTLY_FAILED = "permanently_failed"
_FAILED_ATTEMPT = re.compile(r"^failed_attempt_([1-9][0-9]*)$")
#: `status_rank` of `permanently_failed`: above every attempt count.
_GIVEN_UP_RANK = 1_000_000


def parse_status(status: str) -> int | None:
    """The N of `failed_attempt_N`, None for `permanently_failed`; ValueError otherwise
    (a status the engine never writes)."""
    if status == PERMANENTLY_FAILED:
        return None
    m = _FAILED_ATTEMPT.match(status)
    if not m:
        raise ValueError(f"unknown rule status {status!r}")
    return int(m.group(1))


def status_rank(status: str | None) -> int:
    """Order of stored statuses (none, failed_attempt_1, 2, ..., permanently_failed): a
    rule's never goes backwards."""
    if status is None:
        return 0
    n = parse_status(status)
    return _GIVEN_UP_RANK if n is None else n


#: The engine rounds a scaled delay to whole milliseconds (and to at least 1 ms): the
#: bounds below allow that much either way.
ROUNDING_MS = 1.0


@dataclass(frozen=True)
class DelayBounds:
    """What the retry after `failed_attempt_{failed}` must wait, in run seconds: its tier
    (1-based, as the history records it) times `time_scale`, up to `jitter` more."""

    failed: int
    tier: int
    tier_ms: int
    low_s: float
    high_s: float


def delay_bounds(settings: RetrySettings, time_scale: float, failed: int) -> DelayBounds:
    """The retry after `failed_attempt_{failed}` (failed >= 1) goes to tier `failed`, and
    every attempt past the table reuses the last tier; jitter is positive only, so the
    delay lies in [tier, tier * (1 + jitter)], scaled by `time_scale`."""
    if failed < 1:
        raise ValueError(f"a retry follows failed_attempt_N with N >= 1; got {failed}")
    tiers = settings.tiers_ms
    index = min(failed, len(tiers)) - 1
    tier_ms = tiers[index]
    low_ms = max(tier_ms * time_scale - ROUNDING_MS, 0.0)
    high_ms = max(tier_ms * (1.0 + settings.jitter) * time_scale, 1.0) + ROUNDING_MS
    return DelayBounds(failed, index + 1, tier_ms, low_ms / 1000.0, high_ms / 1000.0)


def retry_delay_ms(
    settings: RetrySettings, time_scale: float, failed: int, bucket: Any
) -> int | None:
    """The one delay (ms, scaled and rounded as the queue's TTL) the retry after
    `failed_attempt_{failed}` may carry from jitter bucket `bucket`: its tier stretched by
    `jitter x bucket / (jitter_buckets - 1)`; None for a bucket no delay queue has (without
    jitter, or with one bucket a tier, only bucket 0 exists)."""
    buckets = 1 if settings.jitter == 0.0 else settings.jitter_buckets
    if not (isinstance(bucket, int) and not isinstance(bucket, bool) and 0 <= bucket < buckets):
        return None
    tier_ms = settings.tiers_ms[min(failed, len(settings.tiers_ms)) - 1]
    if buckets > 1:
        tier_ms = round(tier_ms * (1.0 + settings.jitter * bucket / (buckets - 1)))
    return round(tier_ms * time_scale)


def dependents_of(plan: Any, roots: Iterable[str]) -> frozenset[str]:
    """Every rule that depends, directly or not, on one of `roots` (the roots excluded
    unless a cycle leads back to them), from each rule's `depends_on` alone."""
    roots = list(roots)
    if not roots:  # the common case (no rule failed for good): nothing to walk
        return frozenset()
    rules: Mapping[str, Any] = plan.rules
    children: dict[str, list[str]] = {r: [] for r in rules}
    for rid, rule in rules.items():
        for dep in rule.depends_on:
            children.setdefault(dep, []).append(rid)
    seen: set[str] = set()
    stack = [c for r in roots for c in children.get(r, ())]
    while stack:
        rid = stack.pop()
        if rid not in seen:
            seen.add(rid)
            stack.extend(children.get(rid, ()))
    return frozenset(seen)


def max_attempts_of(plan: Any, rule_id: str, settings: RetrySettings) -> int:
    """The rule's own `max_attempts` in the plan, else the scenario's."""
    rule = plan.rules.get(rule_id) if plan is not None else None
    own = getattr(rule, "max_attempts", None)
    return own if isinstance(own, int) and own >= 1 else settings.max_attempts


def is_permanent_error(kind: Any) -> bool:
    """Whether a failed call's error `kind` is one the policy gives up on at once."""
    return kind in PERMANENT_ERRORS
