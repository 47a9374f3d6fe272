"""`retries_acked`: a delayed retry is ACKed by the process that ran it, once the outcome of
the attempt it started is durable.

A retry message is held, unacknowledged, while the attempt it asked for runs: a crash then
redelivers the retry itself. Once that attempt's outcome is in the store (its result, or
its `failed_attempt_N` or `permanently_failed`), the message has done its work and must be
ACKed (`retry_acked`). One held past that point takes a prefetch slot of the consumer for
nothing, comes back after a crash as a stale copy, and is ACKed as stale at the
evaluation's end, or NACKed back by a park, to be delivered once more.

Per process and rule attempt k >= 2 that the process started (`rule_started`, first try)
after a retry of that attempt was delivered to it: after the process's durable outcome of
that attempt (`result_persisted` of attempt k; `status_written` of `failed_attempt_k`, or of
`permanently_failed` after the start), the same process records `retry_acked` for it
before the evaluation ends or parks there, unless it abandons the evaluation first (a
lost lease, a failed task: the delivery goes back) or dies before the evaluation ends.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from chaos.checker.context import Context, Outcome, as_int, event_time, proc_of, timeline
from chaos.checker.records import Violation

NAME = "retries_acked"
_KINDS = frozenset(
    {
        "delivered",
        "rule_started",
        "result_persisted",
        "status_written",
        "retry_acked",
        "evaluation_abandoned",
        "evaluation_terminal",
        "parked",
    }
)
#: Where an evaluation leaves a process's memory with what it holds settled: an ACK still
#: owed then was held to the end.
_ENDS = frozenset({"evaluation_terminal", "parked"})


def _outcome_of(e: dict, started: dict[str, int]) -> tuple[str, int] | None:
    """The (rule, attempt) whose outcome `e` made durable in its process, if any."""
    ev, r = e.get("ev"), e.get("rule_id")
    if not isinstance(r, str):
        return None
    if ev == "result_persisted" and e.get("landed") is True:
        return r, as_int(e.get("attempt"))
    if ev == "status_written":
        status = str(e.get("status"))
        number = status.removeprefix("failed_attempt_")
        if status.startswith("failed_attempt_") and number.isdigit():  # the status is text
            return r, int(number)
        if status == "permanently_failed" and r in started:
            return r, started[r]
    return None


def check_retries_acked(cx: Context) -> Outcome:
    """One case per held retry whose attempt's outcome became durable in its process."""
    died = cx.deaths()
    out: list[Violation] = []
    cases = 0
    for a, evs in sorted(cx.by_eval.items()):
        by_proc: dict[tuple[str, Any], list[dict]] = defaultdict(list)
        for e in evs:
            if e.get("ev") in _KINDS:
                by_proc[proc_of(e)].append(e)
        for proc, mine in by_proc.items():
            mine.sort(key=lambda e: e.get("seq") or 0)
            ends = [event_time(d) for d in (*died.get(proc, ()), *died.get(proc[1], ()))]
            received: set[tuple[str, int]] = set()  # retries delivered here
            running: dict[str, int] = {}  # rule -> attempt started here from a held retry
            owed: dict[tuple[str, int], dict] = {}  # outcome durable, ACK owed
            late: list[tuple[str, int, dict, dict]] = []  # still owed at the end or park
            for e in mine:
                ev = e.get("ev")
                key = (str(e.get("rule_id")), as_int(e.get("attempt")))
                if ev == "delivered" and e.get("kind") == "retry":
                    received.add(key)
                elif ev == "rule_started" and as_int(e.get("try_no"), 1) == 1:
                    if key[1] >= 2 and key in received:
                        running[key[0]] = key[1]
                    else:
                        running.pop(key[0], None)
                elif ev == "retry_acked":
                    owed.pop(key, None)
                elif ev == "evaluation_abandoned":
                    owed.clear()
                    running.clear()
                elif ev in _ENDS:
                    late.extend((r, k, o, e) for (r, k), o in owed.items())
                    owed.clear()
                    running.clear()
                else:
                    done = _outcome_of(e, running)
                    if done is not None and running.get(done[0]) == done[1]:
                        del running[done[0]]
                        owed[done] = e
                        cases += 1
            for (r, k), o in owed.items():
                if not any(t >= event_time(o) for t in ends):  # no death took it back
                    late.append((r, k, o, o))
            for r, k, o, end in late:
                where = "" if end is o else f", until the evaluation's {end.get('ev')}"
                out.append(
                    Violation(
                        NAME,
                        a,
                        r,
                        f"{proc[0]} held the retry of attempt {k} past the attempt's durable "
                        f"outcome ({o.get('ev')}){where} without ACKing it",
                        timeline([o, end, *[x for x in mine if x.get("ev") == "retry_acked"]]),
                    )
                )
    return cases, out
