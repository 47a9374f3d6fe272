"""Retry latency and recovery time, read from a run's history.

Retry latency: for each rule that failed at least once, the time from its first failure
(`rule_failed`) to its end: its result written (`result_persisted`) or its permanent
failure (`status_written` of `permanently_failed`). Its level is the furthest the engine
went: 1 (immediate retries were enough), 2 (a delayed retry, on the tier of its last
`failed_attempt_N`), 3 (it failed for good).

Units. A retry latency is measured in scenario time (seconds of the run, as it happened).
Only part of it scales with the scenario's `time_scale`: the engine's tier waits (each
`retry_published`'s `delay_ms`, already scaled) and the agent's calls (their latency is
scaled too). Outages, toxics, pauses, leases, heartbeats and the sweeper's period do not.
So the production estimate scales back only that part, and keeps the rest, fault windows
included, as it happened: `RetryLatency.production_s`. `fault_s` is how much of the
latency fell inside a fault window (`chaos.checker.context.fault_windows`), as it happened.

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

from reports.history import as_int, event_time, fault_windows

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
    seconds: float  # scenario time, as it happened
    outcome: str  # "succeeded" or "permanently_failed"
    scaled_s: float = 0.0  # of `seconds`: tier waits and agent calls outside fault windows
    fault_s: float = 0.0  # of `seconds`: inside a fault window
    estimate: float | None = None  # the production estimate, when measured elsewhere

    def production_s(self, time_scale: float | None) -> float:
        """The production estimate: the scaled part scaled back by `time_scale`, the rest
        (fault windows, leases, hops) as it happened. No scale: the scenario time."""
        if self.estimate is not None:
            return self.estimate
        if not time_scale:
            return self.seconds
        return self.seconds - self.scaled_s + self.scaled_s / time_scale


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
    scaled: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    open_calls: dict[tuple[str, str, str, int, int], float] = {}
    waited: set[tuple[str, str, int]] = set()  # one tier wait per attempt (a duplicate publish)
    for e in history:
        ev = e.get("ev")
        key = (str(e.get("attempt_id")), str(e.get("rule_id")))
        if ev == "rule_started":
            call = (
                *key,
                str(e.get("src")),
                as_int(e.get("attempt"), 1),
                as_int(e.get("try_no"), 1),
            )
            open_calls[call] = event_time(e)
        elif ev in ("rule_finished", "rule_failed"):
            call = (
                *key,
                str(e.get("src")),
                as_int(e.get("attempt"), 1),
                as_int(e.get("try_no"), 1),
            )
            began = open_calls.pop(call, None)
            if began is not None:
                scaled[key].append((began, event_time(e)))
        elif ev == "retry_published" and (*key, as_int(e.get("attempt"))) not in waited:
            waited.add((*key, as_int(e.get("attempt"))))
            t = event_time(e)
            scaled[key].append((t, t + max(0.0, float(e.get("delay_ms") or 0)) / 1000))
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
    faults = _merged([(w.start, w.end) for w in fault_windows(list(history))]) if ended else []
    out = []
    for key, t0 in sorted(first_failure.items()):
        if key not in ended:
            continue  # never ended: the run's other checks say why
        t1, outcome = ended[key]
        level = 3 if outcome == PERMANENT else (2 if key in tier else 1)
        window = [(t0, max(t0, t1))]
        fault_s = _overlap(window, faults)
        mine = _merged([(max(a, t0), min(b, t1)) for a, b in scaled[key] if b > t0 and a < t1])
        scaled_s = max(0.0, _overlap(window, mine) - _overlap(mine, faults))
        out.append(
            RetryLatency(
                key[0], key[1], level, tier.get(key), max(0.0, t1 - t0), outcome, scaled_s, fault_s
            )
        )
    return out


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of `spans`, as disjoint spans in time order."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """How long two unions of disjoint, sorted spans overlap."""
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


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


def result_write_waits(history: list[dict[str, Any]]) -> list[float]:
    """Seconds each result write took, from its send to the store's answer (a
    `result_persisted`'s record less its `sent_ms`, on the worker's clock): what a store
    that waits for its replica (a synchronous standby, WAIT) costs each write."""
    waits = []
    for e in history:
        if e.get("ev") == "result_persisted" and as_int(e.get("sent_ms")) > 0:
            waits.append(max(0.0, event_time(e) - as_int(e.get("sent_ms")) / 1000))
    return waits


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
