"""`retry_budget`: every rule gets its retries, and no more.

With N = the scenario's `immediate_retries` + 1 (level 1's calls per attempt) and M = the
rule's `max_attempts` (the plan's, else the scenario's), per (attemptId, ruleId):

- an execution of an attempt (one process, from try 1) makes at most N calls, and retries
  at once only after a failure the policy retries (not after a permanent one); a try made
  again in it is the same call redone, not another, only when a fault that touched its
  process came between the two (a killed server lost the first one's answer, a frozen
  worker's call was handed to it again), as `touching` proves from the history;
- attempt k >= 2 (a delayed retry) starts only after an execution of attempt k - 1 spent
  level 1: N calls, each failed with an error worth retrying;
- `permanently_failed` is written only after attempt M spent level 1, or right after an
  error the policy calls permanent (`oracle.PERMANENT_ERRORS`: the same call would fail the
  same way).

The numbers come from the scenario and the plan; which errors are permanent, from the
checker's own table, never from the `retryable` flag the engine recorded.
"""

from __future__ import annotations

from chaos.checker.context import (
    Context,
    Outcome,
    as_int,
    event_time,
    proc_of,
    sort_key,
    timeline,
)
from chaos.checker.oracle import is_permanent_error
from chaos.checker.records import Violation
from chaos.checker.rounds import Round
from chaos.checker.touching import Touch, touching

NAME = "retry_budget"


def _failures(rnd: Round) -> list[dict]:
    return [e for e in rnd.outcomes if e.get("ev") == "rule_failed"]


def _spent(rnd: Round, calls: int) -> bool:
    """Whether the execution made all `calls` calls of level 1, each failing transiently."""
    failed = _failures(rnd)
    return (
        len(rnd.starts) >= calls
        and len(failed) >= calls
        and not any(is_permanent_error(e.get("kind")) for e in failed)
    )


def _calls(rnd: Round, windows: list[Touch]) -> list[dict]:
    """The execution's calls: its starts but a try started again after a fault that
    touched its process since that try's previous start (the same call redone)."""
    calls: list[dict] = []
    made: dict[int, dict] = {}  # try -> its latest start
    for e in rnd.starts:
        try_no = as_int(e.get("try_no"), 1)
        before = made.get(try_no)
        made[try_no] = e
        if before is not None and touching(
            windows, proc_of(e)[1], event_time(before), event_time(e)
        ):
            continue
        calls.append(e)
    return calls


def _last(rnd: Round) -> dict:
    return max([*rnd.starts, *rnd.outcomes], key=sort_key)


def check_retry_budget(cx: Context) -> Outcome:
    """One case per (attemptId, ruleId) with a start; a violation per broken rule above,
    with the execution(s) that prove it."""
    out: list[Violation] = []
    calls = cx.spec.policy.immediate_retries + 1
    cases = 0
    for (a, r), evs in sorted(cx.by_pair.items()):
        rounds = cx.rounds((a, r))
        if not rounds:
            continue
        firsts: dict[int, dict] = {}  # each attempt's first start
        writes: list[dict] = []
        for e in evs:  # one pass: asked of every pair of every run
            ev = e.get("ev")
            if ev == "rule_started":
                firsts.setdefault(as_int(e.get("attempt"), 1), e)
            elif ev == "status_written":
                writes.append(e)
        cases += 1
        limit = cx.max_attempts(a, r)

        def flag(message: str, key: list[dict], a: str = a, r: str = r) -> None:
            out.append(Violation(NAME, a, r, message, timeline(key)))

        for rnd in rounds:
            if len(rnd.starts) > calls and len(counted := _calls(rnd, cx.touches())) > calls:
                flag(
                    f"{r} attempt {rnd.attempt} made {len(counted)} calls in one execution; "
                    f"level 1 allows {calls} (immediate_retries {calls - 1} + 1)",
                    rnd.starts + _failures(rnd),
                )
            for fail, nxt in zip(_failures(rnd), rnd.starts[1:], strict=False):
                if is_permanent_error(fail.get("kind")):
                    flag(
                        f"{r} attempt {rnd.attempt} was called again after a permanent "
                        f"{fail.get('kind')} error",
                        [fail, nxt],
                    )
                    break
        for k, start in sorted(firsts.items()):
            if k < 2:
                continue
            before = [
                rnd
                for rnd in rounds
                if rnd.attempt == k - 1 and sort_key(_last(rnd)) < sort_key(start)
            ]
            if not any(_spent(rnd, calls) for rnd in before):
                shown = max(before, key=lambda x: len(_failures(x)), default=None)
                made = "no execution" if shown is None else f"{len(shown.starts)} call(s)"
                flag(
                    f"{r} attempt {k} (a delayed retry) started although attempt {k - 1} "
                    f"made {made} with {len(_failures(shown)) if shown else 0} transient "
                    f"failure(s) before it; level 1 needs {calls}",
                    ([*shown.starts, *shown.outcomes] if shown else []) + [start],
                )
        for write in writes:
            if write.get("status") != "permanently_failed" or write.get("kept"):
                continue
            before = [rnd for rnd in rounds if sort_key(rnd.start) < sort_key(write)]
            last = max(before, key=lambda x: sort_key(x.start), default=None)
            if last is None:
                flag(f"{r} written permanently_failed without any call before it", [write])
                continue
            failed = _failures(last)
            permanent = bool(failed) and is_permanent_error(failed[-1].get("kind"))
            exhausted = last.attempt >= limit and _spent(last, calls)
            if not (permanent or exhausted):
                flag(
                    f"{r} written permanently_failed after attempt {last.attempt} of {limit} "
                    f"with {len(failed)} failure(s) of {calls} and no permanent error",
                    [*last.starts, *last.outcomes, write],
                )
    cx.stats["retry_budget_calls_per_attempt"] = calls
    return cases, out
