"""What the budgets on the cost of faults bound (`records.COST_BUDGETS`), measured from
the history only when a scenario sets one of them: the duplicated tokens against the
fault-free bill (`cost`), their price, the p99 retry latency of each level in production
seconds and the p99 recovery time after a fault that stops work (`latency`)."""

from __future__ import annotations

from typing import Any

from chaos.checker.cost import duplicated_cost
from chaos.checker.latency import percentiles, recoveries, retry_latencies
from chaos.checker.records import CheckSpec


def cost_stats(
    events: list[dict[str, Any]], spec: CheckSpec, reference_tokens: int | None
) -> dict[str, Any]:
    """`reference_tokens`: the fault-free reference's bill (None: the first executions')."""
    cost = duplicated_cost(events)
    reference = cost.reference_tokens if reference_tokens is None else reference_tokens
    duplicated = cost.duplicated_tokens
    stats: dict[str, Any] = {
        "duplicated_ratio": round(duplicated / reference, 6) if reference else 0.0,
        "duplicated_usd": round(duplicated / 1000 * spec.price_per_1k_tokens, 6),
    }
    latencies = retry_latencies(events)
    scale = spec.time_scale or 1.0
    for level in (1, 2, 3):
        p = percentiles([x.seconds / scale for x in latencies if x.level == level])
        if p["n"]:
            stats[f"retry_p99_l{level}_s"] = round(p["p99"], 6)
    times = [r.next_start_s for r in recoveries(events) if r.next_start_s is not None]
    if times:
        stats["recovery_p99_s"] = round(percentiles(times)["p99"], 6)
    return stats
