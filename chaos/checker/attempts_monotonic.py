"""`attempts_monotonic`: per rule, attempts started and statuses durably held never go
back, no attempt exceeds `max_attempts`, and the final status and result agree with the
highest attempt started: attempt k >= 2 starts only after `failed_attempt_{k-1}` is
written, and statuses are only ever replaced by higher ones, so Redis must still hold
`failed_attempt_{M-1}` or `failed_attempt_M` (or a result of attempt status + 1).
"""

from __future__ import annotations

from typing import Any

from chaos.checker.context import (
    Context,
    Outcome,
    as_int,
    event_time,
    of,
    timeline,
)
from chaos.checker.oracle import PERMANENTLY_FAILED, parse_status, status_rank
from chaos.checker.records import Violation


def _rank(status: str | None) -> int | None:
    try:
        return status_rank(status)
    except ValueError:
        return None


def check_attempts_monotonic(cx: Context) -> Outcome:
    """Per (attemptId, ruleId), in time order:
    - the attempt of each `rule_started` is >= every earlier one, and <= `max_attempts`;
    - the status Redis holds after each `status_written` (the one written, or the `kept`
      one when the script refused to go back) ranks >= every earlier one, and the final
      status ranks >= all of them (failed_attempt_N ranks N, permanently_failed above all);
    - with M the highest attempt started, the final status `failed_attempt_N` needs
      N <= M <= N + 1; no status at all needs M = 1 unless a result says otherwise;
    - a final result of attempt k needs status `failed_attempt_{k-1}` (none for k = 1);
    - no `rule_started` follows the write of `permanently_failed` (a given-up rule is as
      final as a finished one: a resume reads it back and never runs it again)."""
    out: list[Violation] = []
    refused = 0
    judged = 0
    pairs = set(cx.by_pair)
    for a, kept in cx.final.evaluations.items():
        pairs |= {(a, r) for r in kept.statuses}
    for a, r in sorted(pairs):
        evs = cx.by_pair.get((a, r), [])
        starts: list[dict] = []
        writes: list[dict] = []
        for e in evs:  # one pass: asked of every pair of every run
            ev = e.get("ev")
            if ev == "rule_started":
                starts.append(e)
            elif ev == "status_written":
                writes.append(e)
        fin = cx.final_of(a)
        final_status = fin.statuses.get(r) if fin else None
        if starts or writes or final_status:
            judged += 1

        def flag(message: str, key: list[dict], a: str = a, r: str = r) -> None:
            out.append(Violation("attempts_monotonic", a, r, message, timeline(key)))

        top: Any = None  # the highest attempt started so far (a dict once one is)
        for e in starts:
            n = as_int(e.get("attempt"), 1)
            if top is not None and n < as_int(top.get("attempt"), 1):
                flag(f"{r} started attempt {n} after attempt {top.get('attempt')}", [top, e])
                break
            if top is None or n > as_int(top.get("attempt"), 1):
                top = e
        m = as_int(top.get("attempt"), 1) if top is not None else None
        limit = cx.max_attempts(a, r)
        if m is not None and m > limit:
            flag(f"{r} started attempt {m}, beyond max_attempts {limit}", [top, *writes[-3:]])
        held: dict | None = None
        held_rank = 0
        for e in writes:
            effective = e.get("kept") or e.get("status")
            rank = _rank(effective)
            if e.get("kept"):
                refused += 1
            if rank is None:
                flag(f"{r}: status {effective!r} is not one the engine writes", [e])
                continue
            if held is not None and rank < held_rank:
                flag(f"{r}: status went back from {held.get('status')} to {effective}", [held, e])
            if rank >= held_rank:
                held, held_rank = e, rank
        given_up = next(
            (e for e in writes if (e.get("kept") or e.get("status")) == PERMANENTLY_FAILED), None
        )
        if given_up is not None:
            t_given_up = event_time(given_up)
            later = next((e for e in starts if event_time(e) > t_given_up), None)
            if later is not None:
                flag(
                    f"{r} started attempt {later.get('attempt')} after it was written "
                    "permanently_failed",
                    [given_up, later],
                )
        if fin is None:
            continue  # the runner read no final state for this evaluation: nothing to compare
        final_rank = _rank(final_status)
        if final_status is not None and final_rank is None:
            flag(f"{r}: final status {final_status!r} is not one the engine writes", writes[-3:])
            continue
        if held is not None and final_rank is not None and final_rank < held_rank:
            flag(
                f"{r}: Redis ends with {final_status or 'no status'} although "
                f"{held.get('kept') or held.get('status')} was written",
                [held],
            )
        result = cx.result_of(a, r)
        n_failed = None
        if final_status is not None and final_status != PERMANENTLY_FAILED:
            n_failed = parse_status(final_status)
        if m is not None:
            if n_failed is not None and not n_failed <= m <= n_failed + 1:
                flag(
                    f"{r} ends with {final_status} but its highest attempt started is {m}",
                    [top, *writes[-3:]],
                )
            elif final_status is None and m >= 2:
                flag(
                    f"{r} started attempt {m} but Redis holds no failed_attempt status",
                    [top, *writes[-3:]],
                )
        if result is not None and final_status != PERMANENTLY_FAILED:
            expected = 1 if n_failed is None else n_failed + 1
            if result.attempt != expected:
                flag(
                    f"{r}'s result is from attempt {result.attempt} but its status is "
                    f"{final_status or 'absent'}: expected attempt {expected}",
                    of(evs, "result_persisted") + writes[-3:],
                )
    cx.stats["status_writes_refused"] = refused
    return judged, out
