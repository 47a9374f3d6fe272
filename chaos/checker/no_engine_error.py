"""`no_engine_error`: no exception escapes the engine's code unexplained by a fault.

A worker records `engine_error` (its error, where, and the traceback) when an exception no
fault raises reaches the shell's log or ends one of its tasks: live, the kinds no service
or network fault raises (`engine.runtime.drive.ENGINE_BUGS`: a `KeyError`, a `TypeError`...);
in the simulator, anything but the failures a fault explains (`sim.drive.TASK_ERRORS`),
and the simulated run records one itself when anything escapes the simulation. Each is a
violation, whatever the other invariants make of the run: a bug that the engine absorbs
(the delivery handed back, the evaluation resumed elsewhere) is still a bug, and the
simulator never ends a run with no verdict.
"""

from __future__ import annotations

from typing import Any

from chaos.checker.context import Context, Outcome, of, proc_of, timeline
from chaos.checker.records import Violation

ENGINE_ERROR = "engine_error"
#: The errors shown one by one, each with its evidence; the rest are counted in one.
MAX_SHOWN = 20


def check_no_engine_error(cx: Context) -> Outcome:
    """One case per process that recorded anything (the runner included); a violation per
    `engine_error`, its traceback in the evidence."""
    out: list[Violation] = []
    by_proc: dict[Any, list[dict]] = {}
    for e in cx.events:  # once: a rescan per error is quadratic when every delivery raises
        by_proc.setdefault(proc_of(e), []).append(e)
    errors = of(cx.events, ENGINE_ERROR)
    for e in errors[:MAX_SHOWN]:
        src, _ = proc_of(e)
        context = [x for x in by_proc[proc_of(e)] if x is not e]
        out.append(
            Violation(
                "no_engine_error",
                str(e.get("attempt_id") or ""),
                None,
                f"{e.get('error')} escaped the engine in {src} ({e.get('during')})",
                timeline([e], context, limit=6),
            )
        )
    if len(errors) > MAX_SHOWN:  # one violation each would bury the report, not prove more
        rest = errors[MAX_SHOWN:]
        out.append(
            Violation(
                "no_engine_error",
                "",
                None,
                f"and {len(rest)} more engine_error(s), the last {rest[-1].get('error')}",
                timeline(rest[-1:], []),
            )
        )
    cx.stats["engine_errors"] = len(errors)
    return len(by_proc), out
