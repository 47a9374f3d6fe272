"""`single_final_result`: one winning `evaluation_terminal`, equal to the final state; every
`final_published` carries that state, and a second one only follows a stop of a process
that was announcing it: a crash, a kill, or a pause (`pause_worker`, a `freeze`) long
enough for its lease to lapse, after which a sweeper announces again what it had already
sent (`final_published` is recorded once the flag is written, after the send: the two
events of such a pair may come in either order).
"""

from __future__ import annotations

import itertools

from chaos.checker.context import (
    TERMINAL_STATES,
    Context,
    Outcome,
    event_time,
    listed,
    of,
    timeline,
)
from chaos.checker.records import Violation

#: What stops a process from the outside view of its announcements.
_STOPS = ("crash", "worker_killed", "worker_paused", "failpoint_fired")


def _stopped(cx: Context, publisher: dict, t0: float, t1: float) -> bool:
    """Whether the process that recorded `publisher` crashed, was killed or was paused (a
    `worker_paused`, a `freeze` failpoint) in [t0, t1]."""
    src, pid = publisher.get("src"), publisher.get("pid")
    for e in of(cx.events, *_STOPS):
        if not t0 <= event_time(e) <= t1:
            continue
        ev = e.get("ev")
        own = (e.get("src"), e.get("pid")) == (src, pid)
        if ev == "crash" and own:
            return True
        if ev == "failpoint_fired" and own and e.get("action") == "freeze":
            return True
        if ev in ("worker_killed", "worker_paused") and (
            (pid is not None and e.get("pid") == pid) or (src and e.get("worker") == src)
        ):
            return True
    return False


def _deciding(evs: list[dict], publisher: dict) -> float:
    """Since when the publisher's process may have been deciding its final state: its last
    event of the evaluation before its `evaluation_terminal` (that event is recorded once
    the state write's reply is read, which a pause can delay by seconds); its
    `final_published` when it won no terminal state (a resume that found it)."""
    proc = (publisher.get("src"), publisher.get("pid"))
    mine = [e for e in evs if (e.get("src"), e.get("pid")) == proc]
    term = next((e for e in mine if e.get("ev") == "evaluation_terminal"), None)
    if term is None:
        return event_time(publisher)
    before = [event_time(e) for e in mine if event_time(e) < event_time(term)]
    return max(before, default=event_time(term))


def check_single_final_result(cx: Context) -> Outcome:
    """Per evaluation: at most one `evaluation_terminal` with `won: true`, with the final
    state's status; every `final_published` carries the final state; and each
    `final_published` after the first follows a stop (crash, kill, pause) of either
    process of the pair while it was deciding or announcing (a cancelled evaluation may
    have none: the canceller publishes)."""
    out: list[Violation] = []
    judged = 0
    published = 0
    for a in cx.evaluations:
        evs = cx.by_eval[a]
        fin = cx.final_of(a)
        state = fin.state if fin else None
        won = [e for e in of(evs, "evaluation_terminal") if e.get("won") is True]
        pubs = of(evs, "final_published")
        published += len(pubs)
        if won or pubs or state in TERMINAL_STATES:
            judged += 1
        if len(won) > 1:
            out.append(
                Violation(
                    "single_final_result",
                    a,
                    None,
                    f"{len(won)} workers won the terminal state: "
                    f"{listed([str(e.get('status')) for e in won])}",
                    timeline(won + pubs),
                )
            )
        for e in won:
            if state is not None and e.get("status") != state:
                out.append(
                    Violation(
                        "single_final_result",
                        a,
                        None,
                        f"terminal state {e.get('status')} was won, but Redis ends with {state}",
                        timeline([e, *pubs]),
                    )
                )
        statuses = sorted({str(e.get("status")) for e in pubs})
        wrong = [e for e in pubs if state is not None and e.get("status") != state]
        if len(statuses) > 1 or wrong:
            out.append(
                Violation(
                    "single_final_result",
                    a,
                    None,
                    f"final results published with status {listed(statuses)}; "
                    f"Redis ends with {state}",
                    timeline(pubs + won),
                )
            )
        for prev, nxt in itertools.pairwise(pubs):
            t1 = event_time(nxt)
            if not any(
                _stopped(cx, p, min(_deciding(evs, p), event_time(prev)), t1) for p in (prev, nxt)
            ):
                out.append(
                    Violation(
                        "single_final_result",
                        a,
                        None,
                        f"final result published again by {nxt.get('src')} "
                        f"{event_time(nxt) - event_time(prev):.3f} s after {prev.get('src')} "
                        "published it, "
                        "with no crash, kill or pause of either publisher in between",
                        timeline([prev, nxt], won + cx.faults),
                    )
                )
    cx.stats["final_published"] = published
    return judged, out
