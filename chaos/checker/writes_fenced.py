"""`writes_fenced`: every write that landed carried the evaluation's current token.

Each acquisition of a lease (`begin`, recorded as `evaluation_started` with the token it
got) makes a new token, `n:worker`, n one more than the last; every write of the owner (a
result, a status, the final state, a park, a pass's flag) carries its token and is
recorded with it, whether it landed or the fence refused it. A write sent after another
begin's token was recorded carries a stale token if its own is older, and must have been
refused: one that landed is an owner that lost its lease writing over its successor. A
resume from a checkpoint (the runner's `resume_requested`, answered `resume_written`)
moves the fence too and takes the lease from its holder: a write sent after it was
answered, carrying a token recorded before it was asked for, must have been refused. A
Redis fault in between (a restart or failover may roll the token back) excuses either.
"""

from __future__ import annotations

from chaos.checker.context import Context, Outcome, event_time, of, timeline
from chaos.checker.leases import _redis_fault, _resumes, _sent
from chaos.checker.records import Violation

#: The write events of an owner, each with its `fence` and `landed`.
WRITES = ("result_persisted", "status_written", "evaluation_terminal", "parked", "pass_published")


def _number(token: object) -> int | None:
    head = token.partition(":")[0] if isinstance(token, str) else ""
    return int(head) if head.isdigit() else None


def check_writes_fenced(cx: Context) -> Outcome:
    """One case per landed write that carried a token; a violation per one whose token was
    older than a token `begin` gave before it was sent, or revoked by a resume answered
    before it was sent."""
    slack = float(getattr(cx.spec, "fault_recovery_s", 0.0) or 0.0)
    windows: list | None = None
    cases = 0
    out: list[Violation] = []
    for a in cx.evaluations:
        evs = cx.by_eval.get(a, [])
        begins = [
            (event_time(e), m, e)
            for e in of(evs, "evaluation_started")
            if (m := _number(e.get("fence"))) is not None
        ]
        # each resume done: its answer, and the tokens it revoked (recorded before it was
        # asked for)
        resumes = [
            (event_time(done), {e.get("fence") for t, _, e in begins if t <= asked}, done)
            for asked, done in _resumes(evs)
        ]
        for w in of(evs, *WRITES):
            n = _number(w.get("fence"))
            if n is None or w.get("landed") is not True:
                continue
            cases += 1
            sent = _sent(w)
            newer = [(t, m, e) for t, m, e in begins if t < sent and m > n]
            revoked = [(t, e) for t, tokens, e in resumes if t < sent and w.get("fence") in tokens]
            if not newer and not revoked:
                continue
            if newer:
                t, _, by = min(newer, key=lambda x: x[0])
                what_moved = f"{by.get('src')} began {a} with token {by.get('fence')}"
            else:
                t, by = min(revoked, key=lambda x: x[0])
                what_moved = f"a resume from a checkpoint moved the fence of {a}"
            if windows is None:
                windows = cx.touches()
            if _redis_fault(windows, t, event_time(w), slack) is not None:
                continue
            what = str(w.get("ev")).replace("_", " ")
            out.append(
                Violation(
                    "writes_fenced",
                    a,
                    w.get("rule_id"),
                    f"{w.get('src')}'s write ({what}) landed with token {w.get('fence')}, "
                    f"sent {sent - t:.3f} s after {what_moved}",
                    timeline([by, w], evs),
                )
            )
    return cases, out
