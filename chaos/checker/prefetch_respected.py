"""`prefetch_respected`: flow control. No worker takes more deliveries than it can soon
begin: its prefetch is bounded (neither 0, RabbitMQ's "no limit", nor above
4 x max_evaluations, the engine's setting), and no consumer of it ever holds more
unsettled deliveries than that prefetch allows.

Each worker records `prefetch_window` (`engine.shell.window`) whenever its largest count
of deliveries held unsettled by one consumer grows, with the prefetch it set and its
`max_evaluations`. RabbitMQ never sends a consumer more than its prefetch: a count above
it means the broker was told otherwise. An unbounded prefetch hands a busy worker the
whole queue: the deliveries wait in its memory for a slot (a retry that is due starts
late), and a worker that dies takes them all down with it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from chaos.checker.context import Context, Outcome, as_int, of, proc_of, timeline
from chaos.checker.records import Violation

WINDOW = "prefetch_window"
#: The engine's prefetch, per evaluation it runs at once (`EngineConfig.prefetch`).
PER_EVALUATION = 4


def check_prefetch_respected(cx: Context) -> Outcome:
    """One case per worker process that received a delivery; a violation per process whose
    prefetch is unbounded or above the engine's, or that held more than it."""
    by_proc: dict[tuple[str, Any], list[dict]] = defaultdict(list)
    for e in of(cx.events, WINDOW):
        by_proc[proc_of(e)].append(e)
    out: list[Violation] = []
    peak_all = 0
    for (src, _), evs in by_proc.items():
        last = max(evs, key=lambda e: as_int(e.get("in_flight")))
        peak = as_int(last.get("in_flight"))
        peak_all = max(peak_all, peak)
        prefetch = as_int(last.get("prefetch"))
        design = PER_EVALUATION * as_int(last.get("max_evaluations"))
        problem = None
        if prefetch <= 0:
            problem = f"{src} consumes with prefetch {prefetch} (no limit)"
        elif prefetch > design:
            problem = (
                f"{src} consumes with prefetch {prefetch}, above 4 x max_evaluations = {design}"
            )
        bound = min(prefetch, design) if prefetch > 0 else design
        if peak > bound:
            held = f"held {peak} deliveries unsettled on {last.get('queue')}, above {bound}"
            problem = f"{problem}, and {held}" if problem else f"{src} {held}"
        if problem:
            out.append(Violation("prefetch_respected", "", None, problem, timeline(evs[-3:])))
    cx.stats["deliveries_in_flight_max"] = peak_all
    return len(by_proc), out
