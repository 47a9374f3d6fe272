"""Retry latency and recovery time, read from a run's history.

Retry latency: for each rule that failed at least once, the time from its first failure
(`rule_failed`) to its end: its result written (`result_persisted`) or its permanent
failure (`status_written` of `permanently_failed`). Its level is the furthest the engine
went: 1 (immediate retries were enough), 2 (a delayed retry, on the tier of its last
`failed_attempt_N`), 3 (it failed for good). Scenario time is scaled back to production
time by the scenario's `time_scale` (the engine and the agent scale their delays by it).

Recovery time: for each fault that stops work (a worker killed, crashed, stopped or
paused; Redis or the broker killed; a worker's link to one of them cut), the evaluations it
caught unfinished, and how long each took to start a rule again and to end, counted from
the fault.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from chaos.checker.context import event_time

PERMANENT = "permanently_failed"
#: Faults after which the report measures recovery, and how each names what it stopped.
STOPPING = (
    "worker_killed",
    "worker_exited",
    "worker_paused",
    "service_killed",
    "service_paused",
    "link_cut",
)


@dataclass(frozen=True)
class RetryLatency:
    attempt_id: str
    rule_id: str
    level: int  # 1 immediate, 2 delayed, 3 permanent failure
    tier: int | None  # the delay tier of a level-2 retry (1: 30 s, 2: 2 min, 3: 10 min)
    seconds: float  # scenario time
    outcome: str  # "succeeded" or "permanently_failed"


@dataclass(frozen=True)
class Recovery:
    fault: str  # the event that stopped work, and what it names
    at: float
    attempt_id: str
    next_start_s: float | None  # fault to the evaluation's next `rule_started`
    end_s: float | None  # fault to its `evaluation_terminal`


def retry_latencies(history: list[dict[str, Any]]) -> list[RetryLatency]:
    first_failure: dict[tuple[str, str], float] = {}
    tier: dict[tuple[str, str], int] = {}
    ended: dict[tuple[str, str], tuple[float, str]] = {}
    for e in history:
        ev = e.get("ev")
        key = (str(e.get("attempt_id")), str(e.get("rule_id")))
        if ev == "rule_failed":
            first_failure.setdefault(key, event_time(e))
        elif ev == "status_written" and key in first_failure and key not in ended:
            status = str(e.get("status") or "")
            if status == PERMANENT:
                ended[key] = (event_time(e), PERMANENT)
            elif status.startswith("failed_attempt_"):
                n = status.removeprefix("failed_attempt_")
                if n.isdigit():
                    tier[key] = max(tier.get(key, 0), int(n))
        elif ev == "result_persisted" and key in first_failure and key not in ended:
            ended[key] = (event_time(e), "succeeded")
    out = []
    for key, t0 in sorted(first_failure.items()):
        if key not in ended:
            continue  # never ended: the run's other checks say why
        t1, outcome = ended[key]
        level = 3 if outcome == PERMANENT else (2 if key in tier else 1)
        out.append(RetryLatency(key[0], key[1], level, tier.get(key), max(0.0, t1 - t0), outcome))
    return out


def recoveries(history: list[dict[str, Any]]) -> list[Recovery]:
    """For each stopping fault, each evaluation it caught unfinished: one started and not
    yet terminal (a worker fault: one that worker held, as its last `evaluation_started`
    says; a service fault: every one)."""
    holder: dict[str, str] = {}  # attempt_id -> src of its last evaluation_started
    terminal: set[str] = set()
    src_of_pid: dict[Any, str] = {}
    starts: dict[str, list[float]] = defaultdict(list)
    ends: dict[str, float] = {}
    for e in history:
        ev, a = e.get("ev"), e.get("attempt_id")
        if e.get("src") != "runner" and e.get("pid") is not None:
            src_of_pid.setdefault(e.get("pid"), str(e.get("src")))
        if ev == "rule_started":
            starts[str(a)].append(event_time(e))
        elif ev == "evaluation_terminal":
            ends.setdefault(str(a), event_time(e))
    out: list[Recovery] = []
    for e in history:
        ev, a = e.get("ev"), e.get("attempt_id")
        if ev == "evaluation_started":
            holder[str(a)] = str(e.get("src"))
        elif ev == "evaluation_terminal":
            terminal.add(str(a))
        elif ev in STOPPING:
            t = event_time(e)
            if ev in ("service_killed", "service_paused"):
                caught = [x for x in holder if x not in terminal]
                name = f"{ev} {e.get('service')}"
            elif ev == "link_cut":  # the workers behind the cut proxies, by their pids
                cut = {src_of_pid.get(pid) for pid in e.get("pids") or ()}
                caught = [x for x, s in holder.items() if s in cut and x not in terminal]
                name = f"{ev} {e.get('link')} of workers {e.get('workers')}"
            else:
                src = src_of_pid.get(e.get("pid"))
                caught = [x for x, s in holder.items() if s == src and x not in terminal]
                name = f"{ev} worker {e.get('worker')}"
            for x in sorted(caught):
                nxt = next((s for s in starts.get(x, ()) if s > t), None)
                end = ends.get(x)
                out.append(
                    Recovery(
                        name,
                        t,
                        x,
                        None if nxt is None else nxt - t,
                        None if end is None or end < t else end - t,
                    )
                )
    return out


def percentiles(values: list[float]) -> dict[str, float | int]:
    """n, p50, p95, p99 and max (nearest rank), of `values`."""
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def rank(p: float) -> float:
        return ordered[max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))]

    return {
        "n": len(ordered),
        "p50": rank(50),
        "p95": rank(95),
        "p99": rank(99),
        "max": ordered[-1],
        "mean": statistics.fmean(ordered),
    }
