"""Deliberately broken Temporal designs: the harness must catch each on Temporal as it
catches the engine's mutants on the engine's designs
(`tests/live/test_temporal_system_live.py`).

`python -m chaos.systems.temporal.mutants NAME WORKER-ARGS...` is a Temporal worker
(`chaos.systems.temporal.worker`) with the mutant's patch applied first; a run starts its
workers so with `ScenarioRun(..., mutant=NAME)` on `temporal`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence


def heartbeat_never() -> None:
    """reruns_explained: the call never heartbeats, so the server takes every call longer
    than the heartbeat timeout (1 s) for dead and runs it again beside the one still
    running, with no fault to explain it."""
    from temporalio import activity

    activity.heartbeat = lambda *details: None


#: Name -> (the invariant it breaks, its patch).
MUTANTS: dict[str, tuple[str, Callable[[], None]]] = {
    "heartbeat_never": ("reruns_explained", heartbeat_never),
}


def main(argv: Sequence[str] | None = None) -> int:
    from chaos.systems.temporal import worker

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in MUTANTS:
        print(
            f"chaos.systems.temporal.mutants: expected one of {', '.join(MUTANTS)}",
            file=sys.stderr,
        )
        return 2
    MUTANTS[args[0]][1]()
    return worker.main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
