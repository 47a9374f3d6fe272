"""`no_completed_rerun`: once a result of (attemptId, ruleId) is durably written (the first
`result_persisted` with `won: true`, recorded after the `SET NX` returned), no
`rule_started` of that pair may follow. A start recorded later on any clock of this
machine began after the write, so the engine ran finished work. Repeated starts of one
attempt *before* the write (a crash mid-call, the write window) are allowed and counted.

Only a resume from a checkpoint that deleted the result (the runner's `resume_written`
naming the rule among those `discarded`) makes the rule unfinished again: from then on it
is judged afresh, against its next durable write. A rule the resume kept (at or before
its checkpoint) is still finished, and may never start again. A write recorded after the
resume's answer belongs to the life before it when its token is one that was current
before the resume was asked for (an `evaluation_started` recorded before
`resume_requested` carried it): the resume moved the fence, so a write under an older
token that landed committed before it (the resume then deleted it), only its answer came
late.
"""

from __future__ import annotations

from chaos.checker.context import (
    Context,
    Outcome,
    as_int,
    event_time,
    of,
    timeline,
)
from chaos.checker.records import Violation


def check_no_completed_rerun(cx: Context) -> Outcome:
    """For each (attemptId, ruleId), T = the first `result_persisted` with `won: true`.
    A `rule_started` after T is a violation (`completed_reruns` counts them). A second start
    of the same attempt before T is a rerun: allowed. What reruns cost, and why each ran, is
    not counted here but in `reports.cost` (the one definition of every figure:
    `reruns_by_cause`, `duplicated_by_cause`), which the checker adds to the stats."""
    out: list[Violation] = []
    calls = judged = completed_reruns = 0
    discards = resume_discards(cx)
    for (a, r), pair_evs in sorted(cx.by_pair.items()):
        for evs in _lives(pair_evs, discards.get((a, r), [])):
            # one pass over the pair's events (the hottest check: every seed, every pair)
            starts: list[dict] = []
            # T: the first write, won or not: a losing SET NX found a result already durable
            # (a retried write whose first try landed before its connection dropped finds
            # its own)
            won: dict | None = None
            for e in evs:
                ev = e.get("ev")
                if ev == "rule_started":
                    starts.append(e)
                elif ev == "result_persisted" and won is None:
                    won = e
            calls += len(starts)
            judged += bool(starts)
            late = [e for e in starts if won is not None and event_time(e) > event_time(won)]
            if won is not None and late:
                completed_reruns += len({id(e) for e in late if as_int(e.get("try_no"), 1) == 1})
                out.append(
                    Violation(
                        "no_completed_rerun",
                        a,
                        r,
                        f"{r} started {len(late)} time(s) after its result (attempt "
                        f"{won.get('attempt')}) was persisted; first "
                        f"{event_time(late[0]) - event_time(won):.3f} s after, by "
                        f"{late[0].get('src')}",
                        timeline(
                            [won, *late[:3]],
                            of(evs, "rule_finished", "result_persisted")
                            + of(cx.by_eval[a], "recovered", "delivered", "evaluation_started"),
                        ),
                    )
                )
    cx.stats.update(calls=calls, completed_reruns=completed_reruns)
    return judged, out


#: A resume that deleted a pair's result: when its answer was recorded, and the tokens that
#: were current before it was asked for (writes under them landed before it, if at all).
Cut = tuple[float, frozenset[str]]


def resume_discards(cx: Context) -> dict[tuple[str, str], list[Cut]]:
    """When a resume deleted each (evaluation, rule)'s result: the runner's `resume_written`
    and the rules it names `discarded`, with the tokens of the begins recorded before its
    `resume_requested`."""
    out: dict[tuple[str, str], list[Cut]] = {}
    for e in of(cx.events, "resume_written"):
        a, t = str(e.get("attempt_id")), event_time(e)
        asked = [event_time(q) for q in of(cx.by_eval[a], "resume_requested")]
        since = max((q for q in asked if q <= t), default=t)
        old = frozenset(
            str(b.get("fence"))
            for b in of(cx.by_eval[a], "evaluation_started")
            if event_time(b) < since and b.get("fence")
        )
        for r in e.get("discarded") or ():
            out.setdefault((a, str(r)), []).append((t, old))
    return out


def _lives(evs: list[dict], cuts: list[Cut]) -> list[list[dict]]:
    """The pair's events, split where a resume deleted its result (most pairs: one life);
    a write answered after the cut under a token older than the resume, before it."""
    if not cuts:
        return [evs]
    bounds = sorted(cuts, key=lambda c: c[0])
    lives: list[list[dict]] = [[] for _ in range(len(bounds) + 1)]
    for e in evs:
        t = event_time(e)
        life = sum(1 for at, _ in bounds if t > at)
        while (
            life > 0
            and e.get("ev") == "result_persisted"
            and str(e.get("fence")) in bounds[life - 1][1]
        ):
            life -= 1
        lives[life].append(e)
    return lives
