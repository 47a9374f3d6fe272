"""What one finished run's faults cost, as plain data: the figures its checker recorded
(`figures_of`), and the latencies and ends `measure` reads from its history, for the
reports, the comparisons and the sweeps. Cost: `reports.cost` (the one definition of
duplicated tokens and its causes); latency: `reports.latency`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reports.cost import Figures, figures
from reports.latency import recoveries, retry_latencies

#: Budget name -> the stat it bounds.
BUDGETS: dict[str, str] = {
    "max_duplicated_tokens": "duplicated_tokens",
    "max_reruns": "reruns",
    "max_retry_latency_s": "retry_latency_max_s",
}
#: Budgets on what faults cost: budget name -> the stat it bounds. The cost figures
#: (`reports.cost`) are in every run's stats; the latency ones
#: (`reports.latency`) are measured only when one of their budgets is set.
COST_BUDGETS: dict[str, str] = {
    "max_duplicated_ratio": "duplicated_ratio",
    "max_duplicated_usd": "duplicated_usd",
    "max_p99_retry_l1_s": "retry_p99_l1_s",
    "max_p99_retry_l2_s": "retry_p99_l2_s",
    "max_p99_retry_l3_s": "retry_p99_l3_s",
    "max_p99_recovery_s": "recovery_p99_s",
}
BUDGETS.update(COST_BUDGETS)


def figures_of(
    stats: Mapping[str, Any] | None, history: list[dict[str, Any]], mutant: str | None = None
) -> Figures:
    """A finished run's figures: the ones its checker recorded (`stats`, its journal's),
    else (a journal from before them) worked out from its history against the bill it
    recorded, if any."""
    stats = stats or {}
    recorded = Figures.from_stats(stats)
    if recorded is not None:
        return recorded
    bill = stats.get("reference_tokens")
    return figures(history, mutant, reference_tokens=bill if isinstance(bill, int) else None)


def measure(
    history: list[dict[str, Any]],
    time_scale: float | None,
    stats: Mapping[str, Any] | None = None,
    mutant: str | None = None,
) -> dict[str, Any]:
    """What one run's faults cost, as plain data (small enough to send back from an
    explorer's worker process): its figures (`figures_of`: the checker's, from `stats`),
    each retry's level, scenario seconds, production estimate and seconds inside fault
    windows, each recovery's time to the next rule start (scenario seconds), and how many
    evaluations never ended. The reports, comparisons and sweeps read it."""
    f = figures_of(stats, history, mutant)
    submitted = {e.get("attempt_id") for e in history if e.get("ev") == "submitted"}
    ended = {e.get("attempt_id") for e in history if e.get("ev") == "evaluation_terminal"}
    return {
        "tokens_total": f.tokens_total,
        "reference_tokens": f.reference_tokens,
        "not_run_tokens": f.not_run_tokens,
        "duplicated_tokens": f.duplicated_tokens,
        "duplicated_ratio": f.duplicated_ratio,
        "duplicated_by_cause": dict(f.duplicated_by_cause),
        "reruns_by_cause": dict(f.reruns_by_cause),
        "retries": [
            [x.level, x.seconds, x.production_s(time_scale), x.fault_s]
            for x in retry_latencies(history)
        ],
        "recoveries": [r.next_start_s for r in recoveries(history) if r.next_start_s is not None],
        "unfinished": len(submitted - ended),
    }
