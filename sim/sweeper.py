"""Heartbeat and sweeper in the simulator, as `engine.runtime.sweeper` runs them.

The heartbeat renews the lease of each evaluation in memory every `heartbeat_ms` (one
pipelined batch) and drops those whose lease another worker took. The sweeper, every
`sweep_ms`, re-publishes evaluations whose running-index stamp is stale and whose lease
expired, then delayed retries overdue by more than the grace, each behind its claim
script. Both swallow what the live loops only log (Redis or the broker unreachable).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from engine.shell import sweeper as shell
from sim.broker import Unroutable
from sim.drive import drive

if TYPE_CHECKING:
    from sim.worker import SimWorker


def heartbeat(w: SimWorker) -> Generator[Any, Any, None]:
    period = w.config.heartbeat_ms / 1000
    while True:
        yield w.env.timeout(period)
        held = {a: orch.fence for a, orch in w.controller.evaluations.items()}
        if not held:
            continue
        try:
            ours = yield from w.store.call(w.redis.renew, held, w.worker_id, w.store.now_ms())
            for attempt_id, still in ours.items():
                orch = w.controller.evaluations.get(attempt_id)
                if orch is None or still == 1:
                    continue
                if still == 2:  # forgotten by a lossy Redis: ours again
                    yield from orch.reinstate()
                else:
                    yield from orch.abandon("lease lost")
        except ConnectionError:
            pass  # Redis away: leases may lapse, the owner keeps going


def sweeper(w: SimWorker) -> Generator[Any, Any, None]:
    period = w.config.sweep_ms / 1000
    while True:
        yield w.env.timeout(period)
        with contextlib.suppress(ConnectionError, Unroutable):  # logged by the live loop
            yield from sweep(w)


def sweep(w: SimWorker) -> Generator[Any, Any, None]:
    """The live sweep, `engine.shell.sweeper.sweep` itself, driven on the simulated stack."""
    yield from drive(shell.sweep(w.config, set(w.controller.evaluations)), w)
