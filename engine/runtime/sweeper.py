"""Heartbeat and sweeper: how the hole after the ACK is closed.

Once `evaluation.execute` is acknowledged, RabbitMQ forgets it; if the worker dies then,
nobody would ever resume the evaluation (the seed's design as written). The heartbeat
renews each in-memory evaluation's lease and stamps it in a running index; the sweeper of
any worker re-publishes an evaluation whose stamp went stale and whose lease expired, and
a delayed retry that is overdue by more than the grace (dead-lettering is not publisher-
confirmed: a retry can be lost, or never published if the worker died after writing
`failed_attempt_N`). Claims are compare-and-set scripts, so two sweepers never both act.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

from engine.runtime.context import Runtime, log
from engine.runtime.drive import drive
from engine.shell import sweeper as shell


class Heartbeat:
    def __init__(
        self,
        rt: Runtime,
        held: Callable[[], Mapping[str, str]],
        on_lost: Callable[..., Awaitable[None]],
    ) -> None:
        self.rt = rt
        self.held = held
        self.on_lost = on_lost

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.rt.config.heartbeat_ms / 1000)
            try:
                await self.beat()
            except Exception as exc:  # Redis away: leases may lapse, the owner keeps going
                log.warning("heartbeat failed: %s", exc)

    async def beat(self) -> None:
        ours = await self.rt.store.renew(self.held(), self.rt.worker_id)
        for attempt_id, still in ours.items():
            if still == 0:
                await self.on_lost(attempt_id)
            elif still == 2:  # Redis lost writes and forgot it: ours again
                await self.on_lost(attempt_id, forgotten=True)


class Sweeper:
    def __init__(self, rt: Runtime, held: Callable[[], Mapping[str, str]]) -> None:
        self.rt = rt
        self.held = held

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.rt.config.sweep_ms / 1000)
            try:
                await self.sweep()
            except Exception as exc:
                log.warning("sweep failed: %s", exc)

    async def sweep(self) -> None:
        await drive(shell.sweep(self.rt.config, set(self.held())), self.rt)
