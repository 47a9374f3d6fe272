"""EvaluationController: consumes `evaluation.execute` with a late ACK.

The ACK of an execute message is sent only after the config (the plan) is loaded and
stored, the job initialised (state, running index, lease) and `evaluation.started`
published: a crash before that leaves the message with RabbitMQ, which redelivers it. A
retry message is held longer, until the outcome of the attempt it asked for is durable:
a crash mid-retry redelivers the retry itself, and no sweeper is needed for it.

One worker owns an evaluation at a time (a lease in Redis, renewed by the heartbeat and by
every write of the owner, and fenced: each acquisition gets a new token that every write
carries). A message for an evaluation another worker holds is forwarded to that worker's
private queue. A forward the broker cannot route is no proof that the owner is dead (its
connection may be re-declaring the queue after a broker restart or a closed channel):
the message goes back to the queue and comes round again, until the queue is back or the
lease expires, and only an expired lease hands the evaluation over.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aio_pika.abc import AbstractIncomingMessage

from engine.core.recovery import retry_is_fresh
from engine.core.routing import may_be_held_elsewhere
from engine.core.states import TERMINAL_EVALUATION_STATUSES
from engine.plan import Plan, PlanError, plan_from_dict
from engine.runtime.broker import Unroutable
from engine.runtime.context import Runtime, log, settle
from engine.runtime.drive import LiveHost, drive
from engine.runtime.reevaluate import ReEvaluateUseCase
from engine.shell import orchestrator as shell
from engine.shell.orchestrator import PassExecutionOrchestrator

_TERMINAL = {s.value for s in TERMINAL_EVALUATION_STATUSES}


class EvaluationController:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.host = LiveHost(rt)
        self.evaluations: dict[str, PassExecutionOrchestrator] = {}
        self.reevaluate = ReEvaluateUseCase(rt)
        self._slots = asyncio.Semaphore(rt.config.max_evaluations)
        self._plans: dict[str, Plan] = {}
        self._guards: dict[str, asyncio.Lock] = {}  # one delivery set up at a time
        self._guard_users: collections.Counter[str] = collections.Counter()
        self.private_queue = ""

    # --- deliveries ---------------------------------------------------------------------

    async def on_message(self, message: AbstractIncomingMessage) -> None:
        try:
            body = orjson.loads(message.body)
            kind = body["type"]
            attempt_id = str(body["attempt_id"])
        except (orjson.JSONDecodeError, ValueError, KeyError, TypeError):
            log.error("dropping a malformed message (%d bytes)", len(message.body))
            self.rt.history.record("message_rejected", reason="malformed")
            await settle(message)
            return
        try:
            if kind == "cancel":
                await self._on_cancel(attempt_id, message)
            elif kind in ("execute", "retry"):
                await self.rt.failpoints.hit("on_delivery", body.get("rule_id"), attempt_id)
                await self._on_work(kind, attempt_id, body, message)
            else:
                self.rt.history.record("message_rejected", attempt_id=attempt_id, reason=kind)
                await settle(message)
        except Exception as exc:
            log.exception("delivery for %s failed: %s", attempt_id, exc)
            self.rt.history.record(
                "delivery_failed", attempt_id=attempt_id, error=f"{type(exc).__name__}: {exc}"
            )
            orch = self.evaluations.get(attempt_id)
            if orch is not None:
                await drive(orch.abandon("delivery failed"), self.rt)
            else:
                await self.rt.store.release(attempt_id, self.rt.worker_id)
            await settle(message, ack=False)

    async def _on_work(
        self, kind: str, attempt_id: str, body: dict[str, Any], message: AbstractIncomingMessage
    ) -> None:
        rt = self.rt
        rule_id = body.get("rule_id")
        attempt = int(body.get("attempt", 0))
        rt.history.record(
            "delivered",
            attempt_id=attempt_id,
            kind=kind,
            rule_id=rule_id,
            attempt=attempt or None,
            redelivered=message.redelivered,
            reason=body.get("reason"),
            published_ms=body.get("published_ms"),
            delay_ms=body.get("delay_ms"),
        )
        if await self._passed_on(kind, attempt_id, body, message):
            return
        # One delivery of an evaluation is set up at a time in this worker: a second one
        # (two retries due together) waits, then finds the evaluation in memory.
        async with self._guard(attempt_id):
            await self._dispatch(kind, attempt_id, body, message)

    async def _passed_on(
        self, kind: str, attempt_id: str, body: dict[str, Any], message: AbstractIncomingMessage
    ) -> bool:
        """With every slot taken, a message for an evaluation another worker holds is passed
        on at once, not held until a slot frees (its retry would start late); looked at
        before the evaluation's guard too, where another delivery may wait for a slot."""
        if attempt_id in self.evaluations or not (
            self._slots.locked() and may_be_held_elsewhere(kind, body, message.redelivered)
        ):
            return False
        holder = await self.rt.store.holder(attempt_id)
        if holder is None or holder == self.rt.worker_id:
            return False
        await self._forward(attempt_id, holder, message)
        return True

    @contextlib.asynccontextmanager
    async def _guard(self, attempt_id: str) -> AsyncIterator[None]:
        lock = self._guards.setdefault(attempt_id, asyncio.Lock())
        self._guard_users[attempt_id] += 1
        try:
            async with lock:
                yield
        finally:
            self._guard_users[attempt_id] -= 1
            if not self._guard_users[attempt_id]:  # the last one out drops the lock
                del self._guard_users[attempt_id], self._guards[attempt_id]

    async def _dispatch(
        self, kind: str, attempt_id: str, body: dict[str, Any], message: AbstractIncomingMessage
    ) -> None:
        rt = self.rt
        rule_id = body.get("rule_id")
        attempt = int(body.get("attempt", 0))
        orch = self.evaluations.get(attempt_id)
        if orch is not None:
            if kind == "retry" and rule_id is not None:
                await drive(orch.retry_due(rule_id, attempt, message), rt)
            else:
                rt.history.record("duplicate_dropped", attempt_id=attempt_id, kind=kind)
                await settle(message)
            return

        # 1. Load the config: the plan travels in the message, or was stored at first start.
        try:
            raw = body.get("plan")
            if raw:
                key = orjson.dumps(raw, option=orjson.OPT_SORT_KEYS).decode()
                plan: Plan | None = self._plan(key, attempt_id)
            else:
                stored = await rt.store.stored_plan(attempt_id)
                plan = self._plan(stored, attempt_id) if stored else None
        except PlanError as exc:
            log.error("%s", exc)
            rt.history.record("message_rejected", attempt_id=attempt_id, reason=str(exc))
            await settle(message)
            return

        # A slot is taken before the lease and held while the evaluation is in memory;
        # `_done` gives it back. A delivery that puts nothing in memory gives it back here.
        if await self._passed_on(kind, attempt_id, body, message):
            return
        await self._slots.acquire()
        try:
            await self._begin(kind, attempt_id, body, message, plan, bool(raw))
        finally:
            if attempt_id not in self.evaluations:
                self._slots.release()

    async def _begin(
        self,
        kind: str,
        attempt_id: str,
        body: dict[str, Any],
        message: AbstractIncomingMessage,
        plan: Plan | None,
        plan_in_message: bool,
    ) -> None:
        rt = self.rt
        # 2. Lease, state, plan and ReEvaluateUseCase's read of Redis, in one round trip.
        begun = await self.reevaluate.read(attempt_id, plan, plan_in_message)
        if begun.holder is not None:
            await self._forward(attempt_id, begun.holder, message)
            return
        if begun.terminal is not None:
            if not begun.published and plan is not None:
                snapshot = await rt.store.snapshot(attempt_id, plan.order)
                verdicts = {r: v.verdict for r, v in snapshot.results.items()}
                terminal = begun.terminal
                announce = shell.publish_completed(rt.worker_id, attempt_id, terminal, verdicts)
                await drive(announce, rt)
            rt.history.record("terminal_dropped", attempt_id=attempt_id, kind=kind)
            await settle(message)
            return
        if begun.no_plan or plan is None or begun.snapshot is None:
            reason = "no plan"
            rt.history.record("message_rejected", attempt_id=attempt_id, reason=reason)
            await rt.store.release(attempt_id, rt.worker_id)
            await settle(message)
            return
        snapshot = begun.snapshot

        due: dict[str, int] = {}
        if kind == "retry":
            rule_id, attempt = str(body["rule_id"]), int(body["attempt"])
            if retry_is_fresh(plan, snapshot, rule_id, attempt):
                due[rule_id] = attempt
            else:
                rt.history.record(
                    "stale_retry_dropped", attempt_id=attempt_id, rule_id=rule_id, attempt=attempt
                )
                await settle(message)
                kind = "resume"
        core = self.reevaluate.rebuild(plan, attempt_id, snapshot, due)

        # 3. The job is initialised (by `begin`); announce it, and only then ACK.
        resumed = not snapshot.empty
        if resumed:
            rt.metrics.resumes.labels(reason=body.get("reason") or kind).inc()
        await rt.broker.publish_event(
            "evaluation.started",
            {"attempt_id": attempt_id, "plan": plan.id, "resumed": resumed, "worker": rt.worker_id},
            f"{attempt_id}:started",
        )
        rt.history.record(
            "evaluation_started", attempt_id=attempt_id, plan=plan.id, resumed=resumed, kind=kind
        )
        orch = PassExecutionOrchestrator(
            self.host, rt.config, rt.worker_id, core, self._done, begun.fence
        )
        self.evaluations[attempt_id] = orch
        orch.holds_slot = True
        rt.metrics.running.set(len(self.evaluations))
        await rt.failpoints.hit("before_ack", None, attempt_id)
        if kind == "execute":
            await settle(message)
            rt.history.record("acked", attempt_id=attempt_id)
            await rt.failpoints.hit("after_ack", None, attempt_id)
        elif kind == "retry":
            orch.retry_messages[(str(body["rule_id"]), int(body["attempt"]))] = message
        orch.start()

    async def _forward(
        self, attempt_id: str, holder: str, message: AbstractIncomingMessage
    ) -> None:
        """Pass the message on to the worker holding the lease. Unroutable, it goes back to
        the queue after a pause (a heartbeat, at most): the holder's queue comes back, or
        its lease expires and the next `begin` takes the evaluation."""
        rt = self.rt
        queue = rt.config.name(f"worker.{holder}")
        try:
            await rt.broker.forward(queue, message.body, message.message_id)
        except Unroutable:
            rt.history.record("forward_failed", attempt_id=attempt_id, to=holder)
            await asyncio.sleep(min(rt.config.heartbeat_ms, 200) / 1000)
            await settle(message, ack=False)
            return
        rt.history.record("forwarded", attempt_id=attempt_id, to=holder)
        await settle(message)

    def _done(self, orch: PassExecutionOrchestrator) -> None:
        if self.evaluations.get(orch.attempt_id) is orch:
            del self.evaluations[orch.attempt_id]
            if orch.holds_slot:
                self._slots.release()
        self.rt.metrics.running.set(len(self.evaluations))

    def _plan(self, plan_json: str, attempt_id: str) -> Plan:
        plan = self._plans.get(plan_json)
        if plan is None:
            plan = plan_from_dict(orjson.loads(plan_json), source=f"plan of {attempt_id}")
            if len(self._plans) > 256:
                self._plans.clear()
            self._plans[plan_json] = plan
        return plan

    async def _on_cancel(self, attempt_id: str, message: AbstractIncomingMessage) -> None:
        orch = self.evaluations.get(attempt_id)
        self.rt.history.record("cancel_received", attempt_id=attempt_id, held=orch is not None)
        if orch is not None:
            orch.cancel()
        await settle(message)

    async def shutdown(self) -> None:
        for orch in list(self.evaluations.values()):
            await drive(orch.abandon("worker stopping"), self.rt)
