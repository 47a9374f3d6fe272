"""Every state a rule or an evaluation can be in, and the moves between them, as tables.

Like h11's `_state.py`: whatever changes a state must be allowed here, so the code,
the tests and the README read the same rules.
"""

from __future__ import annotations

import re
from enum import StrEnum


class RuleState(StrEnum):
    PENDING = "pending"  # not started, or due to start its next attempt
    RUNNING = "running"  # an agent call is in flight
    WAITING_RETRY = "waiting_retry"  # failed_attempt_N persisted, a delayed retry is on its way
    SUCCEEDED = "succeeded"  # result persisted (or loaded from Redis)
    PERMANENTLY_FAILED = "permanently_failed"
    SKIPPED = "skipped"  # a transitive dependency failed permanently


class EvaluationStatus(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"  # every rule succeeded
    PARTIAL = "partial"  # some rules failed or were skipped, at least one succeeded
    FAILED = "failed"  # no rule succeeded
    CANCELLED = "cancelled"


RULE_TRANSITIONS: dict[RuleState, frozenset[RuleState]] = {
    RuleState.PENDING: frozenset({RuleState.RUNNING, RuleState.SKIPPED}),
    RuleState.RUNNING: frozenset(
        {
            RuleState.RUNNING,  # level 1: an immediate retry
            RuleState.SUCCEEDED,
            RuleState.WAITING_RETRY,  # level 2
            RuleState.PERMANENTLY_FAILED,  # level 3
            RuleState.PENDING,  # cancelled while the call was in flight
        }
    ),
    RuleState.WAITING_RETRY: frozenset({RuleState.PENDING}),
    RuleState.SUCCEEDED: frozenset(),
    RuleState.PERMANENTLY_FAILED: frozenset(),
    RuleState.SKIPPED: frozenset(),
}

TERMINAL_RULE_STATES = frozenset(
    {RuleState.SUCCEEDED, RuleState.PERMANENTLY_FAILED, RuleState.SKIPPED}
)
TERMINAL_EVALUATION_STATUSES = frozenset(
    {
        EvaluationStatus.COMPLETED,
        EvaluationStatus.PARTIAL,
        EvaluationStatus.FAILED,
        EvaluationStatus.CANCELLED,
    }
)

# --- the status strings persisted in Redis, exactly as the seed spells them ------------------

PERMANENTLY_FAILED = "permanently_failed"
_FAILED_ATTEMPT = re.compile(r"^failed_attempt_([1-9][0-9]*)$")


def failed_attempt(n: int) -> str:
    if n < 1:
        raise ValueError("attempt numbers start at 1")
    return f"failed_attempt_{n}"


def parse_status(status: str) -> int | None:
    """The N of `failed_attempt_N`, or None for `permanently_failed`.

    Raises ValueError for anything else: a status the engine never writes is corruption,
    and recovery must not guess.
    """
    if status == PERMANENTLY_FAILED:
        return None
    m = _FAILED_ATTEMPT.match(status)
    if not m:
        raise ValueError(f"unknown rule status {status!r}")
    return int(m.group(1))


def status_rank(status: str | None) -> int:
    """Order of persisted statuses: attempt counts never go backwards."""
    if status is None:
        return 0
    n = parse_status(status)
    return 1_000_000 if n is None else n
