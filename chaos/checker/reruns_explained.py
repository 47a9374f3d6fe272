"""`reruns_explained`: every repeated start of a rule attempt follows a fault that explains it.

A *round* is one execution of one attempt of a rule in one process (a `rule_started` with
`try_no` 1, its level-1 tries aside). Each round after the first of the same (evaluation,
rule, attempt) is a rerun, and the engine only owes one when, between the earlier round's
start and the rerun's, something broke what the earlier round's process held:

- that process died: its `crash`, the runner's `worker_killed` of its pid, its
  `worker_stopped` (a restart the runner asked for);
- that process let the evaluation go (`evaluation_abandoned`: a lost lease, a failed
  delivery) because of an injected fault: an `InjectedFault` (`raise` failpoint), or any
  fault open meanwhile;
- a failpoint stalled or raised in either process (`failpoint_fired`, a stall lasting its
  `stall_ms`);
- a fault that touched that execution was open meanwhile (`chaos.checker.touching`): of a
  service it used (a Redis or broker kill until its restart, a pause, a Sentinel failover),
  or of one of its two processes (a pause of it, a network fault on its own link, a
  consumer timeout of its channel), each until healed, plus `fault_recovery_s`. A fault
  elsewhere in the run (another worker paused, another process's link cut) explains
  nothing about it.

Anything else is an engine that gave up work it held, and a violation with its evidence:
the two starts and what each process did in between (an engine that needlessly gives up its
leases and reruns work must fail).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from typing import Any

from chaos.checker.context import (
    Context,
    Outcome,
    as_int,
    event_time,
    of,
    proc_of,
    timeline,
)
from chaos.checker.holding import Proc, death_of, deaths
from chaos.checker.records import Violation
from chaos.checker.rounds import Round
from chaos.checker.touching import Touch, touches, touching

#: What a process records while it resumes or takes over an evaluation: shown as evidence.
_AROUND = (
    "delivered",
    "lease_taken_over",
    "recovered",
    "sweeper_resumed",
    "evaluation_abandoned",
    "evaluation_started",
    "forwarded",
)


def _stalls(cx: Context) -> dict[Proc, list[tuple[float, float, dict]]]:
    out: dict[Proc, list[tuple[float, float, dict]]] = defaultdict(list)
    for e in of(cx.events, "failpoint_fired"):
        t = event_time(e)
        out[proc_of(e)].append((t, t + as_int(e.get("stall_ms")) / 1000.0, e))
    return out


def check_reruns_explained(cx: Context) -> Outcome:
    """One case per round (an execution is judged a first run or a rerun); a violation per
    rerun (a round after the first of its attempt) no fault explains, with both starts and
    what their processes did in between."""
    out: list[Violation] = []
    faults: tuple[Any, ...] = ()  # deaths, windows, stalls: worked out at the first rerun
    slack = float(getattr(cx.spec, "fault_recovery_s", 0.0) or 0.0)
    cases = reruns = 0
    why: dict[str, int] = defaultdict(int)
    # per evaluation, its `_AROUND` events and their times: the evidence of a rerun is
    # looked up by bisection (a scan per rerun is quadratic on a long history)
    around: dict[str, tuple[list[dict], list[float]]] = {}
    for a, r in sorted(cx.by_pair):
        rounds = cx.rounds((a, r))
        if len(rounds) < 2:  # one round: judged, and no rerun (most pairs of most runs)
            cases += len(rounds)
            continue
        by_attempt: dict[int, list[Round]] = defaultdict(list)
        for rnd in rounds:
            by_attempt[rnd.attempt].append(rnd)
        for attempt_rounds in by_attempt.values():
            cases += len(attempt_rounds)  # a first round is judged too: it is no rerun
            for i in range(1, len(attempt_rounds)):
                prev, rnd = attempt_rounds[i - 1], attempt_rounds[i]
                reruns += 1
                if not faults:
                    faults = (deaths(cx.events), touches(cx.events), _stalls(cx))
                dead, windows, stalls = faults
                reason = _explained(cx, a, prev, rnd, dead, windows, stalls, slack)
                if reason is not None:
                    why[reason] += 1
                    continue
                if a not in around:
                    kept = of(cx.by_eval[a], *_AROUND)
                    times = [event_time(e) for e in kept]
                    if any(t != t for t in times):  # NaN: not sorted, no bisection
                        times = []
                    around[a] = (kept, times)
                kept, times = around[a]
                t0, t1 = event_time(prev.start), event_time(rnd.start)
                if times:
                    kept = kept[bisect_left(times, t0) : bisect_right(times, t1)]
                between = [
                    e
                    for e in kept
                    if t0 <= event_time(e) <= t1
                    and (proc_of(e) in (prev.proc, rnd.proc) or e.get("ev") == "sweeper_resumed")
                ]
                out.append(
                    Violation(
                        "reruns_explained",
                        a,
                        r,
                        f"{r} attempt {rnd.attempt} started again by {rnd.proc[0]} "
                        f"{event_time(rnd.start) - event_time(prev.start):.3f} s after "
                        f"{prev.proc[0]} started it, with no "
                        f"crash, kill, stall or service fault in between to explain it",
                        timeline([prev.start, rnd.start, *between], prev.outcomes),
                    )
                )
    cx.stats.update(reruns_judged=reruns, reruns_explained_by=dict(sorted(why.items())))
    return cases, out


def _explained(
    cx: Context,
    a: str,
    prev: Round,
    rnd: Round,
    dead: Any,
    windows: list[Touch],
    stalls: dict[Proc, list[tuple[float, float, dict]]],
    slack: float,
) -> str | None:
    """The kind of fault that explains the rerun, or None."""
    t0, t1 = event_time(prev.start), event_time(rnd.start)
    died = death_of(dead, prev.proc, t0)
    if died is not None and event_time(died) <= t1:
        return str(died.get("ev"))
    for proc in (prev.proc, rnd.proc):
        for s, e, _ in stalls.get(proc, []):
            if s <= t1 and e + slack >= t0:
                return "failpoint"
    for proc in (prev.proc, rnd.proc):
        touched = touching(windows, proc[1], t0, t1, slack)
        if touched is not None:
            return "service_fault" if touched.pids is None else "process_fault"
    for e in of(cx.by_eval[a], "evaluation_abandoned", "delivery_failed"):
        if proc_of(e) == prev.proc and t0 <= event_time(e) <= t1:
            text = str(e.get("reason") or e.get("error") or "")
            if "InjectedFault" in text:
                return "injected_raise"
    return None
