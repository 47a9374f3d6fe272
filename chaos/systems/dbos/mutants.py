"""Deliberately broken DBOS designs: the harness must catch each on DBOS as it catches the
engine's mutants on the engine's designs (`tests/live/test_dbos_system_live.py`).

`python -m chaos.systems.dbos.mutants NAME WORKER-ARGS...` is a DBOS worker
(`chaos.systems.dbos.worker`) with the mutant's patch applied first; a run starts its
workers so with `ScenarioRun(..., mutant=NAME)` on `dbos`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence


def calls_not_steps() -> None:
    """no_completed_rerun: the agent call is a plain coroutine, not a DBOS step: nothing
    keeps its answer, so a recovery runs every finished call again."""
    from chaos.systems.dbos import workflow

    workflow.call_rule = inspect.unwrap(workflow.call_rule)


#: Name -> (the invariant it breaks, its patch).
MUTANTS: dict[str, tuple[str, Callable[[], None]]] = {
    "calls_not_steps": ("no_completed_rerun", calls_not_steps),
}


def main(argv: Sequence[str] | None = None) -> int:
    from chaos.systems.dbos import worker

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in MUTANTS:
        print(f"chaos.systems.dbos.mutants: expected one of {', '.join(MUTANTS)}", file=sys.stderr)
        return 2
    MUTANTS[args[0]][1]()
    return worker.main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
