"""`prune_only_dependents`: with F the rules `permanently_failed` in Redis (without a
result: a result beats a status, as recovery reads it), the rules left without a result
must be exactly the transitive dependents of F, outside F. A dependent with a result ran
although a dependency never succeeded; an independent rule without one was pruned or
abandoned. The final evaluation state must match (completed: every rule has a result,
failed: none has, partial: in between).
"""

from __future__ import annotations

from typing import Any

from chaos.checker.context import (
    FINISHED_STATES,
    Context,
    Outcome,
    listed,
    of,
    timeline,
)
from chaos.checker.oracle import PERMANENTLY_FAILED, dependents_of
from chaos.checker.records import Violation
from engine.plan import Plan


def check_prune_only_dependents(cx: Context) -> Outcome:
    """F = rules `permanently_failed` without a result, D = their transitive dependents.
    At any time: no rule of D has a result or failed permanently (it ran), and every
    `rules_skipped` names dependents of a rule in F. On evaluations that finished
    (completed / partial / failed, not cancelled): every rule outside F and D has a
    result, every rule of D was recorded skipped (`rules_skipped`: the engine says what it
    pruned, and why), and the state matches (completed: all results; failed: none)."""
    out: list[Violation] = []
    judged = 0
    for a in cx.evaluations:
        plan, fin = cx.plans.get(a), cx.final_of(a)
        if plan is None or fin is None:
            continue
        judged += 1
        evs = cx.by_eval[a]
        results = {r for r in fin.results if r in plan.rules}
        failed = {
            r
            for r, s in fin.statuses.items()
            if s == PERMANENTLY_FAILED and r not in results and r in plan.rules
        }
        doomed = dependents_of(plan, failed)

        for r in plan.rules:
            if r in doomed and (r in results or r in failed):
                root = _root_cause(plan, failed, r)
                what = "has a result" if r in results else "failed permanently"
                out.append(
                    Violation(
                        "prune_only_dependents",
                        a,
                        r,
                        f"{r} {what} although its dependency {root} failed permanently: it "
                        "ran instead of being skipped",
                        _prune_evidence(evs, r, root),
                    )
                )
        for e in of(evs, "rules_skipped"):
            because = str(e.get("because_of"))
            named = [str(x) for x in e.get("rule_ids") or []]
            wrong = [x for x in named if x not in _deps(plan, because)]
            if wrong or because not in failed:
                why = (
                    f"{listed(wrong)} do(es) not depend on {because}"
                    if wrong
                    else f"{because} is not permanently failed in Redis"
                )
                out.append(
                    Violation(
                        "prune_only_dependents",
                        a,
                        wrong[0] if len(wrong) == 1 else None,
                        f"skipped {listed(named)} because of {because}, but {why}",
                        timeline([e], [x for x in evs if x.get("rule_id") == because]),
                    )
                )
        if fin.state not in FINISHED_STATES or a in cx.cancelled:
            continue
        told = {str(x) for e in of(evs, "rules_skipped") for x in e.get("rule_ids") or []}
        untold = sorted(doomed - told)
        if untold:
            out.append(
                Violation(
                    "prune_only_dependents",
                    a,
                    untold[0] if len(untold) == 1 else None,
                    f"evaluation {fin.state}, but {listed(untold)} (pruned: a dependency "
                    "failed permanently) never recorded as skipped",
                    timeline(of(evs, "evaluation_terminal", "rules_skipped", "status_written")),
                )
            )
        missing = [r for r in plan.rules if r not in results and r not in failed | doomed]
        if missing:
            context = [e for e in evs if e.get("rule_id") in missing]
            out.append(
                Violation(
                    "prune_only_dependents",
                    a,
                    missing[0] if len(missing) == 1 else None,
                    f"evaluation {fin.state}, but {listed(missing)} never completed although "
                    "no dependency failed permanently"
                    + (f" (permanently failed: {listed(sorted(failed))})" if failed else ""),
                    timeline(
                        of(evs, "evaluation_terminal", "rules_skipped")
                        + of(context, "status_written"),
                        context,
                    ),
                )
            )
        expected = (
            "completed"
            if len(results) == len(plan.rules)
            else ("failed" if not results else "partial")
        )
        if fin.state != expected:
            out.append(
                Violation(
                    "prune_only_dependents",
                    a,
                    None,
                    f"evaluation is {fin.state} but {len(results)} of {len(plan.rules)} rules "
                    f"have a result: expected {expected}",
                    timeline(of(evs, "evaluation_terminal", "rules_skipped", "final_published")),
                )
            )
    return judged, out


def _deps(plan: Plan, rule_id: str) -> frozenset[str]:
    return dependents_of(plan, [rule_id]) if rule_id in plan.rules else frozenset()


def _root_cause(plan: Plan, failed: set[str], rule_id: str) -> str:
    """The first permanently failed rule (in plan order) that `rule_id` depends on."""
    return next(f for f in plan.rules if f in failed and rule_id in _deps(plan, f))


def _prune_evidence(evs: list[dict], rule_id: str, root: str) -> list[dict[str, Any]]:
    root_evs = [
        e
        for e in evs
        if e.get("rule_id") == root
        and e.get("ev") == "status_written"
        and e.get("status") == PERMANENTLY_FAILED
    ]
    mine = [e for e in evs if e.get("rule_id") == rule_id]
    key = root_evs + of(mine, "rule_started", "result_persisted", "status_written")
    return timeline(key, of(evs, "rules_skipped", "recovered"))
