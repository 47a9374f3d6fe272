"""`reruns_explained`: every repeated start of a rule attempt follows a fault that explains it.

A *round* is one execution of one attempt of a rule in one process (a `rule_started` with
`try_no` 1, its level-1 tries aside). Each round after the first of the same (evaluation,
rule, attempt) is a rerun, and the engine only owes one when, between the earlier round's
start and the rerun's, something broke what the earlier round's process held:

- that process died: its `crash`, the runner's `worker_killed` of its pid, its
  `worker_stopped` (a restart the runner asked for);
- that process was stopping (a graceful stop hands back its calls in flight from its
  start: its `worker_stopping`, or its first `evaluation_abandoned` "worker stopping");
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

- a resume from a checkpoint was asked for meanwhile (the runner's `resume_written`): it
  takes the lease from the owner (its calls in flight are dropped) and deletes the results
  after the checkpoint, so it explains the rerun of a rule it deleted (`discarded`) or
  that had no durable result yet when it came; never that of a rule it kept. "Meanwhile"
  starts when the earlier round's process last began the evaluation, not at the round's
  start: a copy the resume has already fenced off learns it at its next write, and may
  start a round before that (seen in the gate on `pg/resume_from_checkpoint`: a start
  20 ms after the resume, its next write refused).

Anything else is an engine that gave up work it held, and a violation with its evidence:
the two starts and what each process did in between (an engine that needlessly gives up its
leases and reruns work must fail).

A stop explains only a clean hand-over: a stopping process stops consuming before it hands
anything back, so from its stop's start it takes no delivery on and begins no evaluation.
One that does (it still consumed, and what it requeued came straight back to it: a new
lease, rules started only to be dropped again) is a violation; each stop is a case.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from chaos.checker.context import (
    Context,
    Outcome,
    event_time,
    of,
    proc_of,
    stall_ends,
    timeline,
)
from chaos.checker.holding import Proc, death_of, stop_starts
from chaos.checker.records import Violation
from chaos.checker.rounds import Round
from chaos.checker.touching import Touch, touching

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
    fired = of(cx.events, "failpoint_fired", "failpoint_released")
    ended = stall_ends(fired)
    for e in fired:
        if e.get("ev") == "failpoint_fired":
            t = event_time(e)
            out[proc_of(e)].append((t, ended.get(id(e), t), e))
    return out


#: What a process records when it takes a delivery on, and when it begins an evaluation.
_TAKEN_ON = ("delivered", "evaluation_started")


def _after_stopping(cx: Context, stops: dict[Proc, dict]) -> list[Violation]:
    """A violation per delivery taken on or evaluation begun by a process after its stop
    started, with the stop's first event and what it abandoned."""
    out: list[Violation] = []
    for e in of(cx.events, *_TAKEN_ON):
        stop = stops.get(proc_of(e))
        if stop is None or event_time(e) <= event_time(stop):
            continue
        a = str(e.get("attempt_id"))
        src = proc_of(e)[0]
        ms = 1000 * (event_time(e) - event_time(stop))
        what = "began evaluation" if e.get("ev") == "evaluation_started" else "took a delivery of"
        handed = [
            x
            for x in of(cx.events, "evaluation_abandoned")
            if proc_of(x) == proc_of(e) and x.get("attempt_id") == a
        ]
        out.append(
            Violation(
                "reruns_explained",
                a,
                e.get("rule_id"),
                f"{src} {what} {a} {ms:.1f} ms after it started "
                "stopping: a stopping worker must stop consuming before it hands work back",
                timeline([stop, e], handed),
            )
        )
    return out


def check_reruns_explained(cx: Context) -> Outcome:
    """One case per round (an execution is judged a first run or a rerun) and per graceful
    stop; a violation per rerun (a round after the first of its attempt) no fault
    explains, with both starts and what their processes did in between, and per delivery
    taken on or evaluation begun by a process that had started stopping."""
    stops = stop_starts(cx.events)
    out: list[Violation] = _after_stopping(cx, stops)
    faults: tuple[Any, ...] = ()  # deaths, windows, stalls: worked out at the first rerun
    slack = float(getattr(cx.spec, "fault_recovery_s", 0.0) or 0.0)
    cases, reruns = len(stops), 0
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
                    faults = (
                        cx.deaths(),
                        cx.touches(),
                        _stalls(cx),
                        _injected(cx),
                        _resumes(cx),
                    )
                dead, windows, stalls, injected, resumes = faults
                reason = _explained(cx, a, prev, rnd, dead, windows, stalls, slack, stops, injected)
                if reason is None and _resumed(cx, a, r, prev, rnd, resumes):
                    reason = "resume"
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
    stops: dict[Proc, dict],
    injected: Mapping[tuple[str, Proc], list[float]],
) -> str | None:
    """The kind of fault that explains the rerun, or None."""
    t0, t1 = event_time(prev.start), event_time(rnd.start)
    died = death_of(dead, prev.proc, t0)
    if died is not None and event_time(died) <= t1:
        return str(died.get("ev"))
    stop = stops.get(prev.proc)
    if stop is not None and event_time(stop) <= t1:  # handed back from the stop's start
        return "worker_stopping"
    for proc in (prev.proc, rnd.proc):
        for s, e, _ in stalls.get(proc, []):
            if s <= t1 and e + slack >= t0:
                return "failpoint"
    for proc in (prev.proc, rnd.proc):
        touched = touching(windows, proc[1], t0, t1, slack)
        if touched is not None:
            return "service_fault" if touched.pids is None else "process_fault"
    raised = injected.get((a, prev.proc))
    if raised and bisect_right(raised, t1) > bisect_left(raised, t0):
        return "injected_raise"
    return None


def _resumes(cx: Context) -> dict[str, list[tuple[float, frozenset[str]]]]:
    """Per evaluation, each resume that was done: when, and the rules it deleted."""
    out: dict[str, list[tuple[float, frozenset[str]]]] = defaultdict(list)
    for e in of(cx.events, "resume_written"):
        if e.get("resume") is not None:  # not refused
            deleted = frozenset(str(r) for r in e.get("discarded") or ())
            out[str(e.get("attempt_id"))].append((event_time(e), deleted))
    return out


def _resumed(
    cx: Context,
    a: str,
    r: str,
    prev: Round,
    rnd: Round,
    resumes: Mapping[str, list[tuple[float, frozenset[str]]]],
) -> bool:
    """A resume between the two starts that deleted the rule's result, or came while it
    had none durable (the round it fenced off was in flight); or one before the earlier
    start that fenced off the copy that made it (its process began the evaluation before
    the resume, and not again since)."""
    t0, t1 = event_time(prev.start), event_time(rnd.start)
    began = [
        event_time(e)
        for e in of(cx.by_eval.get(a, []), "evaluation_started")
        if proc_of(e) == prev.proc and event_time(e) <= t0
    ]
    if began:
        t0 = max(began)
    for t, deleted in resumes.get(a, ()):
        if not t0 <= t <= t1:
            continue
        if r in deleted:
            return True
        kept = any(event_time(e) <= t for e in of(cx.by_pair.get((a, r), []), "result_persisted"))
        if not kept:
            return True
    return False


def _injected(cx: Context) -> dict[tuple[str, Proc], list[float]]:
    """When each process gave up an evaluation's delivery to an injected raise, by
    evaluation and process, sorted: looked up by bisection (a scan per rerun is quadratic
    when a broken engine gives up every delivery)."""
    out: dict[tuple[str, Proc], list[float]] = defaultdict(list)
    for a, evs in cx.by_eval.items():
        for e in of(evs, "evaluation_abandoned", "delivery_failed"):
            if "InjectedFault" in str(e.get("reason") or e.get("error") or ""):
                out[(a, proc_of(e))].append(event_time(e))
    for times in out.values():
        times.sort()
    return out
