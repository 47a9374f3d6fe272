"""What the budgets on the cost of faults bound (`records.COST_BUDGETS`), measured from
the history only when a scenario sets one of them: the duplicated tokens against the
fault-free bill (`cost`), their price, the p99 retry latency of each level in production
seconds and the p99 recovery time after a fault that stops work (`latency`)."""

from __future__ import annotations

from typing import Any

from chaos.checker.cost import duplicated_cost
from chaos.checker.latency import percentiles, recoveries, retry_latencies
from chaos.checker.records import CheckSpec


def measure(
    history: list[dict[str, Any]],
    time_scale: float,
    mutant: str | None = None,
    reference_tokens: int | None = None,
) -> dict[str, Any]:
    """What one run's faults cost, as plain data (small enough to send back from an
    explorer's worker process): the tokens, duplicated and by cause, against the fault-free
    bill (`reference_tokens`, the reference's; None: the first executions'), each retry's
    level and latency in production seconds, each recovery's time to the next rule start,
    and how many evaluations never ended. The budgets, reports, comparisons and sweeps all
    read it."""
    cost = duplicated_cost(history, mutant)
    submitted = {e.get("attempt_id") for e in history if e.get("ev") == "submitted"}
    ended = {e.get("attempt_id") for e in history if e.get("ev") == "evaluation_terminal"}
    scale = time_scale or 1.0
    return {
        "tokens_total": cost.tokens_total,
        "duplicated_tokens": cost.duplicated_tokens,
        "reference_tokens": cost.reference_tokens if reference_tokens is None else reference_tokens,
        "by_cause": cost.by_cause(),
        "retries": [[x.level, x.seconds / scale] for x in retry_latencies(history)],
        "recoveries": [r.next_start_s for r in recoveries(history) if r.next_start_s is not None],
        "unfinished": len(submitted - ended),
    }


def cost_stats(
    events: list[dict[str, Any]], spec: CheckSpec, reference_tokens: int | None
) -> dict[str, Any]:
    """The stats `COST_BUDGETS` bound, from `measure`."""
    m = measure(events, spec.time_scale, reference_tokens=reference_tokens)
    reference, duplicated = m["reference_tokens"], m["duplicated_tokens"]
    stats: dict[str, Any] = {
        "duplicated_ratio": round(duplicated / reference, 6) if reference else 0.0,
        "duplicated_usd": round(duplicated / 1000 * spec.price_per_1k_tokens, 6),
    }
    for level in (1, 2, 3):
        p = percentiles([s for n, s in m["retries"] if n == level])
        if p["n"]:
            stats[f"retry_p99_l{level}_s"] = round(p["p99"], 6)
    if m["recoveries"]:
        stats["recovery_p99_s"] = round(percentiles(m["recoveries"])["p99"], 6)
    return stats
