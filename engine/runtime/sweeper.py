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

from engine.core import parse_status
from engine.runtime.context import Runtime, log
from engine.runtime.store import now_ms, split_member


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
        rt = self.rt
        stale_ms = rt.config.stale_ms
        held = set(self.held())
        for attempt_id in await rt.store.stale_evaluations(stale_ms):
            claimed_from_ms = now_ms()  # the claim is atomic, somewhere after this
            if attempt_id in held or not await rt.store.claim_stale(attempt_id, stale_ms):
                continue
            body = {
                "type": "execute",
                "attempt_id": attempt_id,
                "reason": "stale_heartbeat",
                "published_ms": now_ms(),
            }
            await rt.broker.publish_work(body, f"{attempt_id}:resume:{body['published_ms']}")
            rt.history.record(
                "sweeper_resumed", attempt_id=attempt_id, claimed_from_ms=claimed_from_ms
            )
        grace = rt.config.grace_ms
        for member in await rt.store.overdue_retries(grace):
            claimed_from_ms = now_ms()
            status = await rt.store.claim_retry(member, grace)
            attempt_id, rule_id = split_member(member)
            n = parse_status(status) if status else None
            if n is None:
                continue
            body = {
                "type": "retry",
                "attempt_id": attempt_id,
                "rule_id": rule_id,
                "attempt": n + 1,
                "reason": "lost_retry",
                "published_ms": now_ms(),
                "delay_ms": 0,
            }
            await rt.broker.publish_work(body, f"{attempt_id}:{rule_id}:{n + 1}")
            rt.history.record(
                "sweeper_retried",
                attempt_id=attempt_id,
                rule_id=rule_id,
                attempt=n + 1,
                claimed_from_ms=claimed_from_ms,
            )
