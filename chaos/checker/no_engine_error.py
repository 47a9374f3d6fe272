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

from chaos.checker.context import Context, Outcome, of, proc_of, timeline
from chaos.checker.records import Violation

ENGINE_ERROR = "engine_error"


def check_no_engine_error(cx: Context) -> Outcome:
    """One case per process that recorded anything (the runner included); a violation per
    `engine_error`, its traceback in the evidence."""
    out: list[Violation] = []
    procs = {proc_of(e) for e in cx.events}
    errors = of(cx.events, ENGINE_ERROR)
    for e in errors:
        src, _ = proc_of(e)
        context = [x for x in cx.events if proc_of(x) == proc_of(e) and x is not e]
        out.append(
            Violation(
                "no_engine_error",
                str(e.get("attempt_id") or ""),
                None,
                f"{e.get('error')} escaped the engine in {src} ({e.get('during')})",
                timeline([e], context, limit=6),
            )
        )
    cx.stats["engine_errors"] = len(errors)
    return len(procs), out
