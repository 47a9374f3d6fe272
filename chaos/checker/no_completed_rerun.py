"""`no_completed_rerun`: once a result of (attemptId, ruleId) is durably written (the first
`result_persisted` with `won: true`, recorded after the `SET NX` returned), no
`rule_started` of that pair may follow. A start recorded later on any clock of this
machine began after the write, so the engine ran finished work. Repeated starts of one
attempt *before* the write (a crash mid-call, the write window) are allowed and counted.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

from chaos.checker.context import (
    Context,
    Outcome,
    as_int,
    event_time,
    of,
    timeline,
)
from chaos.checker.records import Violation
from chaos.checker.rounds import Round


def check_no_completed_rerun(cx: Context) -> Outcome:
    """For each (attemptId, ruleId), T = the first `result_persisted` with `won: true`.
    A `rule_started` after T is a violation. A second start of the same attempt before T
    is a rerun: allowed, counted (`reruns`, `rerun_tokens`: tokens of its calls). Every
    `rule_finished` of a pair but the first is duplicated cost (`duplicated_tokens`).

    Reruns by kind (`rerun_kinds`), so that a count never reads as a broken promise:
    `write_window` (the execution before it finished its call but its write never
    landed), `in_flight` (the one before it never finished: a crash, kill or lease loss
    interrupted the call), `after_completion` (a start after T: each one a violation; not
    in `reruns`, which the `max_reruns` budget bounds)."""
    out: list[Violation] = []
    reruns = rerun_tokens = window = duplicated = completed_reruns = 0
    calls = tokens = judged = 0
    for (a, r), evs in sorted(cx.by_pair.items()):
        # one pass over the pair's events (the hottest check: every seed, every pair)
        starts: list[dict] = []
        finished = 0
        # T: the first write, won or not: a losing SET NX found a result already durable
        # (a retried write whose first try landed before its connection dropped finds its own)
        won: dict | None = None
        for e in evs:
            ev = e.get("ev")
            if ev == "rule_started":
                starts.append(e)
            elif ev == "rule_finished":
                spent = as_int(e.get("tokens"))
                tokens += spent
                if finished:  # every rule_finished but the first is duplicated cost
                    duplicated += spent
                finished += 1
            elif ev == "rule_failed":
                tokens += as_int(e.get("tokens"))
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
                    f"{event_time(late[0]) - event_time(won):.3f} s after, by {late[0].get('src')}",
                    timeline(
                        [won, *late[:3]],
                        of(evs, "rule_finished", "result_persisted")
                        + of(cx.by_eval[a], "recovered", "delivered", "evaluation_started"),
                    ),
                )
            )
        rounds_of_pair = cx.rounds((a, r))
        if len(rounds_of_pair) < 2:
            continue  # no second execution: no rerun
        by_attempt: dict[int, list[Round]] = defaultdict(list)
        for rnd in rounds_of_pair:
            by_attempt[rnd.attempt].append(rnd)
        for rounds in by_attempt.values():
            for prev, rnd in itertools.pairwise(rounds):
                if won is not None and event_time(rnd.start) > event_time(won):
                    continue  # a violation above, not a rerun
                reruns += 1
                rerun_tokens += rnd.tokens
                if prev.finished and not prev.persisted:
                    window += 1
    cx.stats.update(
        calls=calls,
        tokens_total=tokens,
        reruns=reruns,
        rerun_tokens=rerun_tokens,
        write_window_reruns=window,
        in_flight_reruns=reruns - window,
        duplicated_tokens=duplicated,
        completed_reruns=completed_reruns,
        rerun_kinds={
            "write_window": window,
            "in_flight": reruns - window,
            "after_completion": completed_reruns,
        },
    )
    return judged, out
