"""The figures of a run's faults, computed once here from the history and the fault-free
reference, and read by everything that shows or bounds them: the checker's stats (so
the journal, the summary line and the budgets, `reports.measure.BUDGETS`), the reports,
`compare` and sweeps (`reports.measure.measure`). Cost: `reports.cost` (the one definition of
duplicated tokens and its causes); latency: `reports.latency` (scenario time as it
happened, and a production estimate that scales back only what scales)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from chaos.checker.records import CheckSpec
from reports.cost import CallKey, Cost, Figures, figures
from reports.latency import percentiles, recoveries, retry_latencies

#: The latency budgets (`records.COST_BUDGETS`), measured only when one is set.
LATENCY_STATS = ("retry_p99_l1_s", "retry_p99_l2_s", "retry_p99_l3_s", "recovery_p99_s")


def reference_calls(spec: CheckSpec, evaluations: Iterable[str]) -> Mapping[CallKey, int] | None:
    """The fault-free reference's calls of `evaluations`, call by call (None: no
    reference, or one without its calls: built by hand, it gives its bill alone,
    `reference_bill`, if it has one)."""
    ref = spec.reference
    if ref is None:
        return None
    out: dict[CallKey, int] = {}
    for a in evaluations:
        o = ref.evaluations.get(a)
        if o is None:
            continue
        if not o.calls or sum(o.calls.values()) != o.tokens:
            return None
        out.update({(a, r, n, t): tokens for (r, n, t), tokens in o.calls.items()})
    return out


def reference_bill(spec: CheckSpec, evaluations: Iterable[str]) -> int | None:
    """What the fault-free reference pays for `evaluations` (None: no reference, or one
    built by hand that knows no bill: neither calls nor tokens; a real evaluation makes
    at least one call)."""
    ref = spec.reference
    if ref is None:
        return None
    mine = [o for a in evaluations if (o := ref.evaluations.get(a)) is not None]
    if any(not o.calls and not o.tokens for o in mine):
        return None
    return sum(o.tokens for o in mine)


def run_figures(
    events: list[dict[str, Any]], spec: CheckSpec, evaluations: list[str], cost: Cost | None = None
) -> Figures:
    """The figures of a run being checked: against the reference, call by call."""
    evaluations = list(evaluations)
    return figures(
        events,
        reference_calls=reference_calls(spec, evaluations),
        reference_tokens=reference_bill(spec, evaluations),
        cost=cost,
    )


def latency_stats(events: list[dict[str, Any]], spec: CheckSpec) -> dict[str, Any]:
    """The latency stats the budgets bound: p99 retry latency per level as a production
    estimate (`RetryLatency.production_s`), p99 recovery in scenario seconds."""
    stats: dict[str, Any] = {}
    latencies = retry_latencies(events)
    for level in (1, 2, 3):
        p = percentiles([x.production_s(spec.time_scale) for x in latencies if x.level == level])
        if p["n"]:
            stats[f"retry_p99_l{level}_s"] = round(p["p99"], 6)
    recs = [r.next_start_s for r in recoveries(events) if r.next_start_s is not None]
    if recs:
        stats["recovery_p99_s"] = round(percentiles(recs)["p99"], 6)
    return stats
