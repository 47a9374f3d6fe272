"""`all_terminal`: every submitted evaluation ends completed, partial, failed or cancelled."""

from __future__ import annotations

from chaos.checker.context import (
    TERMINAL_STATES,
    Context,
    Outcome,
    of,
    timeline,
)
from chaos.checker.records import Violation


def check_all_terminal(cx: Context) -> Outcome:
    """Every submitted evaluation (runner `submitted` events, else `spec.plans`) has a
    final state in completed / partial / failed / cancelled."""
    out: list[Violation] = []
    wanted = sorted(cx.submitted) if cx.submitted else sorted(cx.spec.plans)
    for a in wanted:
        fin = cx.final_of(a)
        state = fin.state if fin else None
        if state in TERMINAL_STATES:
            continue
        evs = cx.by_eval[a]
        last = evs[-1] if evs else None
        tail = (
            f"; last event {last.get('ev')} by {last.get('src')}" if last else "; no event at all"
        )
        out.append(
            Violation(
                "all_terminal",
                a,
                None,
                f"evaluation ended {state or 'with no state'}, not terminal{tail}",
                timeline(  # who started it last: the holder of an evaluation stuck in memory
                    of(evs, "submitted") + of(evs, "evaluation_started")[-2:] + evs[-6:],
                    of(evs, "parked", "crash", "evaluation_abandoned") + cx.faults,
                ),
            )
        )
    cx.stats["evaluations_submitted"] = len(wanted)
    return len(wanted), out
