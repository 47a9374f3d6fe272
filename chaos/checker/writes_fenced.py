"""`writes_fenced`: every write that landed carried the evaluation's current token.

Each acquisition of a lease (`begin`, recorded as `evaluation_started` with the token it
got) makes a new token, `n:worker`, n one more than the last; every write of the owner (a
result, a status, the final state) carries its token and is recorded with it, whether it
landed or the fence refused it. A write sent after another begin's token was recorded
carries a stale token if its own is older, and must have been refused: one that landed is
an owner that lost its lease writing over its successor. A Redis fault in between (a
restart or failover may roll the token back) excuses it.
"""

from __future__ import annotations

from chaos.checker.context import Context, Outcome, event_time, of, timeline
from chaos.checker.leases import _redis_fault, _sent
from chaos.checker.records import Violation

#: The write events of an owner, each with its `fence` and `landed`.
WRITES = ("result_persisted", "status_written", "evaluation_terminal")


def _number(token: object) -> int | None:
    head = token.partition(":")[0] if isinstance(token, str) else ""
    return int(head) if head.isdigit() else None


def check_writes_fenced(cx: Context) -> Outcome:
    """One case per landed write that carried a token; a violation per one whose token was
    older than a token `begin` gave before it was sent."""
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
        for w in of(evs, *WRITES):
            n = _number(w.get("fence"))
            if n is None or w.get("landed") is not True:
                continue
            cases += 1
            sent = _sent(w)
            newer = [(t, m, e) for t, m, e in begins if t < sent and m > n]
            if not newer:
                continue
            t, _, begin = min(newer, key=lambda x: x[0])
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
                    f"sent {sent - t:.3f} s after {begin.get('src')} began {a} with token "
                    f"{begin.get('fence')}",
                    timeline([begin, w], evs),
                )
            )
    return cases, out
