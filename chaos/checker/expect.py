"""What a final state implies the engine announced, in the engine's own terms, and the
fault-free reference's view of one evaluation (`CheckSpec.reference`, when filled)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chaos.checker.context import as_result
from chaos.checker.oracle import dependents_of

PERMANENTLY_FAILED = "permanently_failed"
SKIPPED = "skipped"
PENDING = "pending"
#: Values of an announcement's rules that are states, not verdicts.
STATES = frozenset({PERMANENTLY_FAILED, SKIPPED, PENDING, "running", "waiting_retry"})


def final_verdicts(plan: Any, fin: Any) -> dict[str, str]:
    """Rule -> its result's verdict, else `permanently_failed` (that status, no result),
    else `skipped` (a dependent of one), else `pending`: what the core announces."""
    results = {r: as_result(v, r) for r, v in (fin.results if fin is not None else {}).items()}
    statuses = fin.statuses if fin is not None else {}
    failed = {r for r, s in statuses.items() if s == PERMANENTLY_FAILED and r not in results}
    doomed = dependents_of(plan, failed)
    out: dict[str, str] = {}
    for r in plan.order:
        res = results.get(r)
        if res is not None:
            out[r] = str(res.verdict)
        elif r in failed:
            out[r] = PERMANENTLY_FAILED
        elif r in doomed:
            out[r] = SKIPPED
        else:
            out[r] = PENDING
    return out


def pass_outcome(rules: Mapping[str, str]) -> str | None:
    """complete (every rule a verdict), partial (every rule terminal, some not a verdict),
    None (a rule not terminal yet)."""
    values = set(rules.values())
    if values & {PENDING, "running", "waiting_retry"}:
        return None
    return "partial" if values & STATES else "complete"


def expected_passes(plan: Any, fin: Any) -> dict[str, tuple[str | None, dict[str, str]]]:
    """Pass id -> (outcome or None, rule -> verdict or state), from a final state."""
    verdicts = final_verdicts(plan, fin)
    out = {}
    for p in plan.passes:
        rules = {r: verdicts[r] for r in p.rule_ids}
        out[p.id] = (pass_outcome(rules), rules)
    return out


def kinds(rules: Mapping[str, str]) -> dict[str, str]:
    """Rule -> succeeded / permanently_failed / skipped: the rule sets, verdicts aside."""
    return {str(r): (str(v) if v in STATES else "succeeded") for r, v in rules.items()}


def reference_of(spec: Any, attempt_id: str) -> Any:
    """The reference's outcome of one evaluation (`chaos.reference.Outcome`), or None when
    there is no reference or it did not finish that evaluation."""
    ref = getattr(spec, "reference", None)
    if ref is None:
        return None
    return ref.of(attempt_id)


def reference_drifts(spec: Any) -> bool:
    """Whether the agent may answer a rerun with another verdict (then verdicts are not
    the reference's to judge; rule sets and outcomes still are)."""
    ref = getattr(spec, "reference", None)
    return bool(getattr(ref, "drift", 0.0) or 0.0)
