"""The heartbeat: each evaluation in memory keeps its lease while its worker lives.

Every `heartbeat_ms`, one fenced renewal of every lease this worker holds (one pipelined
batch) also stamps each evaluation in the running index, which the sweepers read. An
evaluation whose lease another worker took is dropped from memory (its deliveries handed
back); one that a Redis which lost writes no longer knows is ours again, and its plan is
written back, so that a resume can still find it. Redis away: leases may lapse, the owner
keeps going, and its next fenced write tells it whether it still may.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from engine.shell.effects import Log, Sleep, Step, Store

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.shell.orchestrator import PassExecutionOrchestrator

#: `renew`'s answer per evaluation: lost to another worker, still ours, forgotten by Redis.
LOST, HELD, FORGOTTEN = 0, 1, 2


def heartbeat(
    config: EngineConfig,
    worker_id: str,
    evaluations: Mapping[str, PassExecutionOrchestrator],
) -> Step:
    """The loop, for as long as the worker runs."""
    while True:
        yield Sleep(config.heartbeat_ms / 1000)
        try:
            yield from beat(worker_id, evaluations)
        except Exception as exc:
            yield Log("warning", f"heartbeat failed: {exc}", exc)


def beat(worker_id: str, evaluations: Mapping[str, PassExecutionOrchestrator]) -> Step:
    """One renewal of every lease held."""
    held = {a: orch.fence for a, orch in evaluations.items()}
    if not held:
        return
    ours = yield Store("renew", (held, worker_id))
    for attempt_id, still in ours.items():
        orch = evaluations.get(attempt_id)
        if orch is None or still == HELD:
            continue
        if still == FORGOTTEN:
            yield from orch.reinstate()
        else:
            yield from orch.abandon("lease lost")
