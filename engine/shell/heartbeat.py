"""The heartbeat: each evaluation in memory keeps its lease while its worker lives.

Every `heartbeat_ms`, one fenced renewal of every lease this worker holds (one pipelined
batch) also stamps each evaluation in the running index, which the sweepers read. An
evaluation whose lease another worker took is dropped from memory (its deliveries handed
back); one that a Redis which lost writes no longer knows is ours again, and its plan is
written back, so that a resume can still find it. Redis away: leases may lapse, the owner
keeps going, and its next fenced write tells it whether it still may.

Each renewal is recorded (`lease_renewed`: the evaluation, the token, what the store
answered, when it was sent, the lease it asked for and when the store says it runs out
once renewed), so that the checker can prove the
heartbeat keeps every lease it holds and that no one takes a lease before it ran out: a
fenced write keeps a lease alive too, and would hide a heartbeat that does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from engine.shell.effects import NOW, Log, Record, Sleep, Step, Store

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.shell.orchestrator import PassExecutionOrchestrator

#: `renew`'s answer per evaluation: lost to another worker, still ours, forgotten by Redis.
LOST, HELD, FORGOTTEN = 0, 1, 2


def heartbeat(
    config: EngineConfig,
    worker_id: str,
    evaluations: Mapping[str, PassExecutionOrchestrator],
    recording: bool = True,
) -> Step:
    """The loop, for as long as the worker runs; `recording` False: the renewals are not
    recorded (the host's history discards every event)."""
    lease_ms = config.stale_ms if recording else None
    while True:
        yield Sleep(config.heartbeat_ms / 1000)
        try:
            yield from beat(worker_id, evaluations, lease_ms)
        except Exception as exc:
            yield Log("warning", f"heartbeat failed: {exc}", exc)


def beat(
    worker_id: str,
    evaluations: Mapping[str, PassExecutionOrchestrator],
    lease_ms: int | None = None,
) -> Step:
    """One renewal of every lease held; each recorded when `lease_ms` (the lease the
    renewal asks for) is given."""
    held = {a: orch.fence for a, orch in evaluations.items() if not orch.leaving}
    if not held:
        return
    sent_ms = (yield NOW) if lease_ms is not None else 0
    ours = yield Store("renew", (held, worker_id))
    if lease_ms is not None:
        for attempt_id, still in ours.items():
            yield Record(
                "lease_renewed",
                {
                    "attempt_id": attempt_id,
                    "fence": held.get(attempt_id),
                    "held": int(still),
                    "sent_ms": sent_ms,
                    "lease_ms": lease_ms,
                    "expires_ms": getattr(still, "expires_ms", None),
                },
            )
    for attempt_id, still in ours.items():
        orch = evaluations.get(attempt_id)
        if orch is None or still == HELD:
            continue
        if still == FORGOTTEN:
            yield from orch.reinstate()
        else:
            yield from orch.abandon("lease lost")
