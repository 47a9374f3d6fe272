"""Recovery classification: what ReEvaluateUseCase makes of the keys Redis kept.

The seed names three categories, and a fourth is implied by level 3:
- a result is present: the rule is finished; load it, never call the agent again;
- `failed_attempt_N`: the rule is retrying; it resumes at attempt N+1 when its retry is due;
- `permanently_failed`: the rule is done, and so are its dependents (skipped);
- nothing: never ran, or its result was lost in the write window; start from zero.
A result beats any status: a rule can fail, then succeed on its retry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from engine.core.results import RuleResult
from engine.core.states import failed_attempt, parse_status
from engine.plan import Plan


class Recovery(StrEnum):
    LOADED = "loaded"
    RETRYING = "retrying"
    FAILED = "failed"
    FRESH = "fresh"


@dataclass(frozen=True)
class Snapshot:
    """Everything Redis remembers of one evaluation, read in one round trip."""

    results: Mapping[str, RuleResult] = field(default_factory=dict)
    statuses: Mapping[str, str] = field(default_factory=dict)
    published_passes: frozenset[str] = frozenset()

    @property
    def empty(self) -> bool:
        return not self.results and not self.statuses


_LOADED, _FRESH, _FAILED = (Recovery.LOADED, 0), (Recovery.FRESH, 0), (Recovery.FAILED, 0)


def classify(plan: Plan, snapshot: Snapshot) -> dict[str, tuple[Recovery, int]]:
    """Each rule's category and the number of failed attempts it carries."""
    out: dict[str, tuple[Recovery, int]] = {}
    results, statuses = snapshot.results, snapshot.statuses
    for rid in plan.order:
        if rid in results:
            out[rid] = _LOADED
            continue
        status = statuses.get(rid)
        if status is None:
            out[rid] = _FRESH
            continue
        n = parse_status(status)
        out[rid] = _FAILED if n is None else (Recovery.RETRYING, n)
    return out


def retry_is_fresh(plan: Plan, snapshot: Snapshot, rule_id: str, attempt: int) -> bool:
    """A retry message that starts its attempt: the rule's stored status is the failure of
    the attempt before, and no result is stored. Anything else is a duplicate or a stale
    copy (publish-then-ack, a redelivery, a sweeper's re-publish): it is dropped, and the
    evaluation resumed anyway (with nothing to run, it parks again at once)."""
    return (
        rule_id in plan.rules
        and attempt >= 2
        and snapshot.statuses.get(rule_id) == failed_attempt(attempt - 1)
        and rule_id not in snapshot.results
    )


def announce_again(published: bool, plan: Plan | None) -> bool:
    """A delivery for an evaluation already terminal: its `evaluation.completed` goes out
    again when the store never flagged it announced (its announcer died between the final
    write and the flag), if the plan is known to read the verdicts back with. Consumers
    dedupe on the message id, so a second copy costs nothing."""
    return not published and plan is not None
