"""EvaluationController in the simulator: deliveries, the late ACK, the lease, forwarding.

A mirror of `engine.runtime.controller`: every delivery runs as its own process (aio-pika
runs each as a task); one delivery of an evaluation is set up at a time (a per-attempt
guard); a slot of `max_evaluations` is held while an evaluation is in memory; the execute
message is acknowledged only after `begin` (lease, plan, state, snapshot) and
`evaluation.started`; a retry message is held until the core acks its attempt. The core is
rebuilt from the snapshot exactly as `ReEvaluateUseCase.rebuild` does.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from engine.core import Evaluation, Snapshot
from engine.core.recovery import retry_is_fresh
from engine.core.routing import may_be_held_elsewhere
from engine.plan import Plan
from engine.shell import orchestrator as shell
from engine.shell.orchestrator import PassExecutionOrchestrator
from sim.broker import Delivery, Unroutable
from sim.drive import TASK_ERRORS, SimHost, drive
from sim.sync import Lock, Semaphore

if TYPE_CHECKING:
    from sim.worker import SimWorker


class Controller:
    def __init__(self, w: SimWorker) -> None:
        self.w = w
        self.host = SimHost(w)
        self.evaluations: dict[str, PassExecutionOrchestrator] = {}
        self._slots = Semaphore(w.env, w.config.max_evaluations)
        self._guards: dict[str, Lock] = {}  # the live `_guard`
        self._guard_users: collections.Counter[str] = collections.Counter()

    # --- deliveries ---------------------------------------------------------------------

    def on_message(self, d: Delivery) -> None:
        self.w.spawn(self._on_message(d))

    def _on_message(self, d: Delivery) -> Generator[Any, Any, None]:
        w = self.w
        body = d.body
        kind = body.get("type")
        attempt_id = body.get("attempt_id")
        if not isinstance(kind, str) or not isinstance(attempt_id, str):
            w.record("message_rejected", reason="malformed")
            w.broker.settle(d)
            return
        try:
            if kind == "cancel":
                self._on_cancel(attempt_id, d)
            elif kind in ("execute", "retry"):
                if w.fp:
                    yield from w.fp.hit("on_delivery", body.get("rule_id"), attempt_id)
                yield from self._on_work(kind, attempt_id, body, d)
            else:
                w.record("message_rejected", attempt_id=attempt_id, reason=kind)
                w.broker.settle(d)
        except TASK_ERRORS as exc:
            w.record("delivery_failed", attempt_id=attempt_id, error=f"{type(exc).__name__}: {exc}")
            orch = self.evaluations.get(attempt_id)
            if orch is not None:
                yield from drive(orch.abandon("delivery failed"), w)
            else:
                yield from w.store.call(w.redis.release, attempt_id, w.worker_id)
            w.broker.settle(d, ack=False)

    def _on_work(
        self, kind: str, attempt_id: str, body: dict[str, Any], d: Delivery
    ) -> Generator[Any, Any, None]:
        attempt = int(body.get("attempt", 0))
        self.w.record(
            "delivered",
            attempt_id=attempt_id,
            kind=kind,
            rule_id=body.get("rule_id"),
            attempt=attempt or None,
            redelivered=d.redelivered,
            reason=body.get("reason"),
            published_ms=body.get("published_ms"),
            delay_ms=body.get("delay_ms"),
        )
        if (yield from self._passed_on(kind, attempt_id, body, d)):
            return
        lock = self._guards.setdefault(attempt_id, Lock(self.w.env))
        self._guard_users[attempt_id] += 1
        try:
            yield from lock.acquire()
            try:
                yield from self._dispatch(kind, attempt_id, body, d)
            finally:
                lock.release()
        finally:
            self._guard_users[attempt_id] -= 1
            if not self._guard_users[attempt_id]:
                del self._guard_users[attempt_id], self._guards[attempt_id]

    def _passed_on(
        self, kind: str, attempt_id: str, body: dict[str, Any], d: Delivery
    ) -> Generator[Any, Any, bool]:
        """The live `_passed_on`: every slot taken, another owner's message goes on at once."""
        w = self.w
        if attempt_id in self.evaluations or not (
            self._slots.locked() and may_be_held_elsewhere(kind, body, d.redelivered)
        ):
            return False
        holder = yield from w.store.call(w.redis.holder, attempt_id)
        if holder is None or holder == w.worker_id:
            return False
        yield from self._forward(attempt_id, holder, body, d)
        return True

    def _dispatch(
        self, kind: str, attempt_id: str, body: dict[str, Any], d: Delivery
    ) -> Generator[Any, Any, None]:
        w = self.w
        rule_id = body.get("rule_id")
        attempt = int(body.get("attempt", 0))
        orch = self.evaluations.get(attempt_id)
        if orch is not None:
            if kind == "retry" and rule_id is not None:
                yield from drive(orch.retry_due(rule_id, attempt, d), w)
            else:
                w.record("duplicate_dropped", attempt_id=attempt_id, kind=kind)
                w.broker.settle(d)
            return
        # 1. The config: in the message, or stored at first start.
        plan: Plan | None = body.get("plan")
        plan_in_message = plan is not None
        if plan is None:
            plan = yield from w.store.call(w.redis.stored_plan, attempt_id)
        if (yield from self._passed_on(kind, attempt_id, body, d)):
            return
        yield from self._slots.acquire()
        try:
            yield from self._begin(kind, attempt_id, body, d, plan, plan_in_message)
        finally:
            if attempt_id not in self.evaluations:
                self._slots.release()

    def _begin(
        self,
        kind: str,
        attempt_id: str,
        body: dict[str, Any],
        d: Delivery,
        plan: Plan | None,
        plan_in_message: bool,
    ) -> Generator[Any, Any, None]:
        w = self.w
        # 2. Lease, state, plan and ReEvaluateUseCase's read of Redis, in one round trip.
        begun = yield from self._read(attempt_id, plan, plan_in_message)
        if begun.holder is not None:
            yield from self._forward(attempt_id, begun.holder, body, d)
            return
        if begun.terminal is not None:
            if not begun.published and plan is not None:
                snapshot = yield from w.store.call(w.redis.snapshot, attempt_id, plan.order)
                verdicts = {r: v.verdict for r, v in snapshot.results.items()}
                terminal = begun.terminal
                announce = shell.publish_completed(w.worker_id, attempt_id, terminal, verdicts)
                yield from drive(announce, w)
            w.record("terminal_dropped", attempt_id=attempt_id, kind=kind)
            w.broker.settle(d)
            return
        if begun.no_plan or plan is None or begun.snapshot is None:
            w.record("message_rejected", attempt_id=attempt_id, reason="no plan")
            yield from w.store.call(w.redis.release, attempt_id, w.worker_id)
            w.broker.settle(d)
            return
        snapshot = begun.snapshot

        due: dict[str, int] = {}
        if kind == "retry":
            rule_id, attempt = str(body["rule_id"]), int(body["attempt"])
            if retry_is_fresh(plan, snapshot, rule_id, attempt):
                due[rule_id] = attempt
            else:
                w.record(
                    "stale_retry_dropped", attempt_id=attempt_id, rule_id=rule_id, attempt=attempt
                )
                w.broker.settle(d)
                kind = "resume"
        core = self._rebuild(plan, attempt_id, snapshot, due)

        # 3. The job is initialised (by `begin`); announce it, and only then ACK.
        resumed = not snapshot.empty
        yield from w.broker.publish_event(
            "evaluation.started",
            {"attempt_id": attempt_id, "plan": plan.id, "resumed": resumed, "worker": w.worker_id},
            f"{attempt_id}:started",
        )
        w.record(
            "evaluation_started", attempt_id=attempt_id, plan=plan.id, resumed=resumed, kind=kind
        )
        orch = PassExecutionOrchestrator(
            self.host, w.config, w.worker_id, core, self._done, begun.fence
        )
        self.evaluations[attempt_id] = orch
        orch.holds_slot = True
        if w.fp:
            yield from w.fp.hit("before_ack", None, attempt_id)
        if kind == "execute":
            w.broker.settle(d)
            w.record("acked", attempt_id=attempt_id)
            if w.fp:
                yield from w.fp.hit("after_ack", None, attempt_id)
        elif kind == "retry":
            orch.retry_messages[(str(body["rule_id"]), int(body["attempt"]))] = d
        orch.start()

    def _read(
        self, attempt_id: str, plan: Plan | None, plan_in_message: bool
    ) -> Generator[Any, Any, Any]:
        w = self.w
        rule_ids = plan.order if plan else ()
        stored = plan if plan is not None and plan_in_message else None
        return (
            yield from w.store.call(
                w.redis.begin, attempt_id, w.worker_id, rule_ids, stored, w.store.now_ms()
            )
        )

    def _rebuild(
        self, plan: Plan, attempt_id: str, snapshot: Snapshot, due: dict[str, int]
    ) -> Evaluation:
        if self.w.no_redis_results:  # the mutant: only RabbitMQ remembers
            done = set(snapshot.results)
            statuses = {r: s for r, s in snapshot.statuses.items() if r not in done}
            snapshot = dataclasses.replace(snapshot, results={}, statuses=statuses)
        config = self.w.config
        return Evaluation(
            plan,
            attempt_id,
            config.policy,
            snapshot=snapshot,
            due=due,
            max_parallel=config.max_parallel,
        )

    def _forward(
        self, attempt_id: str, holder: str, body: dict[str, Any], d: Delivery
    ) -> Generator[Any, Any, None]:
        """The live `_forward`: pass it on, or (unroutable) back to the queue after a pause."""
        w = self.w
        try:
            yield from w.broker.forward(f"worker.{holder}", body, d.message_id)
        except Unroutable:
            w.record("forward_failed", attempt_id=attempt_id, to=holder)
            yield w.env.timeout(min(w.config.heartbeat_ms, 200) / 1000)
            w.broker.settle(d, ack=False)
            return
        w.record("forwarded", attempt_id=attempt_id, to=holder)
        w.broker.settle(d)

    def _done(self, orch: PassExecutionOrchestrator) -> None:
        if self.evaluations.get(orch.attempt_id) is orch:
            del self.evaluations[orch.attempt_id]
            if orch.holds_slot:
                self._slots.release()

    def _on_cancel(self, attempt_id: str, d: Delivery) -> None:
        orch = self.evaluations.get(attempt_id)
        self.w.record("cancel_received", attempt_id=attempt_id, held=orch is not None)
        if orch is not None:
            orch.cancel()
        self.w.broker.settle(d)

    def shutdown(self) -> Generator[Any, Any, None]:
        for orch in list(self.evaluations.values()):
            yield from drive(orch.abandon("worker stopping"), self.w)
