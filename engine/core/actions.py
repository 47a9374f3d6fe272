"""What the core asks its shell to do. Plain data; the shell carries them out in order.

Ordering matters and is part of the contract: a `PersistResult` or `PersistStatus` comes
before any action that depends on it (a `RunRule` of a dependent, a `ScheduleRetry`, an
`AckRetry`), so a shell that executes the list front to back, awaiting each durable write,
keeps the write window as small as the protocol allows.

Not frozen, though nobody changes an action once returned: a frozen dataclass builds
itself through `object.__setattr__`, three times the cost, and the core returns a few
actions a rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.core.results import RuleResult
from engine.core.states import EvaluationStatus


@dataclass(slots=True)
class RunRule:
    """Call the agent for one rule. `try_no` > 1 is a level-1 (immediate) retry."""

    rule_id: str
    attempt: int
    try_no: int = 1


@dataclass(slots=True)
class PersistResult:
    rule_id: str
    result: RuleResult


@dataclass(slots=True)
class PersistStatus:
    """Write `failed_attempt_N` or `permanently_failed` (level 2 / level 3)."""

    rule_id: str
    status: str
    error: str = ""
    retry_due_in_ms: int | None = None  # for failed_attempt_N: when the retry is due


@dataclass(slots=True)
class ScheduleRetry:
    """Publish a retry message to delay queue (tier, bucket); it runs `attempt`."""

    rule_id: str
    attempt: int
    tier: int
    bucket: int
    delay_ms: int


@dataclass(slots=True)
class AckRetry:
    """The retry message that asked for (rule, attempt) is done with: its outcome is durable."""

    rule_id: str
    attempt: int


@dataclass(slots=True)
class SkipRules:
    """Dependents of a permanently failed rule; independent branches never appear here."""

    rule_ids: tuple[str, ...]
    because_of: str


@dataclass(slots=True)
class PublishPassResult:
    pass_id: str
    outcome: str  # "complete" | "partial"
    rules: Mapping[str, str] = field(default_factory=dict)  # rule id -> verdict or state


@dataclass(slots=True)
class Recovered:
    """ReEvaluateUseCase's classification of what Redis remembered."""

    loaded: tuple[str, ...]
    retrying: Mapping[str, int]
    failed: tuple[str, ...]
    fresh: tuple[str, ...]


@dataclass(slots=True)
class Park:
    """Only delayed retries are left: drop the evaluation from memory until one arrives."""

    waiting: Mapping[str, int]  # rule id -> the attempt it waits to run


@dataclass(slots=True)
class Finish:
    status: EvaluationStatus
    verdicts: Mapping[str, str] = field(default_factory=dict)


Action = (
    RunRule
    | PersistResult
    | PersistStatus
    | ScheduleRetry
    | AckRetry
    | SkipRules
    | PublishPassResult
    | Recovered
    | Park
    | Finish
)
