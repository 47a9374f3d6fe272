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

Each delivery is a step of its own (aio-pika runs each callback as a task; the simulator
a process); the evaluations in memory are `PassExecutionOrchestrator`s.
"""

from __future__ import annotations

import collections
from typing import Any

import orjson

from engine.config import EngineConfig
from engine.core.messages import problem as message_problem
from engine.core.recovery import announce_again, retry_is_fresh
from engine.core.routing import may_be_held_elsewhere
from engine.core.states import TERMINAL_EVALUATION_STATUSES
from engine.plan import Plan, PlanError, plan_from_dict
from engine.shell import orchestrator as shell
from engine.shell.effects import (
    Acquire,
    Count,
    Failpoint,
    Forward,
    Gauge,
    Host,
    Log,
    PublishEvent,
    Record,
    Settle,
    Sleep,
    Step,
    Store,
    Unroutable,
)
from engine.shell.orchestrator import PassExecutionOrchestrator
from engine.shell.reevaluate import ReEvaluateUseCase

_TERMINAL = {s.value for s in TERMINAL_EVALUATION_STATUSES}


class EvaluationController:
    def __init__(self, host: Host, config: EngineConfig, worker_id: str) -> None:
        self.host = host
        self._recording = host.recording  # False: events are discarded, not even built
        self.config = config
        self.worker_id = worker_id
        self.evaluations: dict[str, PassExecutionOrchestrator] = {}
        self.reevaluate = ReEvaluateUseCase(config, worker_id)
        self._slots = host.semaphore(config.max_evaluations)
        self._plans: dict[str, Plan] = {}
        self._guards: dict[str, Any] = {}  # one delivery set up at a time, per evaluation
        self._setting_up: set[str] = set()  # holding an evaluation slot, not in memory yet
        self._guard_users: collections.Counter[str] = collections.Counter()

    # --- deliveries ---------------------------------------------------------------------

    def on_message(self, delivery: Any, body: Any, redelivered: bool) -> Step:
        """One delivery; `body` is the decoded message (None: it did not decode)."""
        wrong = message_problem(body)
        if wrong is not None:  # a poison message: it would fail at every delivery
            yield Log("error", f"dropping a malformed message: {wrong}")
            rejected = {"reason": "malformed", "detail": wrong}
            named = body.get("attempt_id") if isinstance(body, dict) else None
            if isinstance(named, str) and named:
                rejected["attempt_id"] = named
            yield Record("message_rejected", rejected)
            yield Settle(delivery)
            return
        kind, attempt_id = body["type"], body["attempt_id"]
        try:
            if kind == "cancel":
                yield from self._on_cancel(attempt_id, delivery)
            elif kind in ("execute", "retry"):
                yield Failpoint("on_delivery", body.get("rule_id"), attempt_id)
                yield from self._on_work(kind, attempt_id, body, delivery, redelivered)
            else:
                yield Record("message_rejected", {"attempt_id": attempt_id, "reason": kind})
                yield Settle(delivery)
        except Exception as exc:
            yield Log("error", f"delivery for {attempt_id} failed: {exc}", exc)
            error = f"{type(exc).__name__}: {exc}"
            yield Record("delivery_failed", {"attempt_id": attempt_id, "error": error})
            orch = self.evaluations.get(attempt_id)
            if orch is not None:
                yield from orch.abandon("delivery failed")
            else:  # the store may be what failed: the delivery goes back whatever it says
                yield from shell.release(attempt_id, self.worker_id)
            yield Settle(delivery, ack=False)

    def _on_work(
        self, kind: str, attempt_id: str, body: dict[str, Any], delivery: Any, redelivered: bool
    ) -> Step:
        if self._recording:
            yield Record(
                "delivered",
                {
                    "attempt_id": attempt_id,
                    "kind": kind,
                    "rule_id": body.get("rule_id"),
                    "attempt": body.get("attempt"),
                    "redelivered": redelivered,
                    "reason": body.get("reason"),
                    "published_ms": body.get("published_ms"),
                    "delay_ms": body.get("delay_ms"),
                },
            )
        if (yield from self._passed_on(kind, attempt_id, body, delivery, redelivered)):
            return
        # One delivery of an evaluation is set up at a time in this worker: a second one
        # (two retries due together) waits, then finds the evaluation in memory.
        lock = self._guards.setdefault(attempt_id, self.host.lock())
        self._guard_users[attempt_id] += 1
        try:
            yield Acquire(lock)
            try:
                yield from self._dispatch(kind, attempt_id, body, delivery, redelivered)
            finally:
                lock.release()
        finally:
            self._guard_users[attempt_id] -= 1
            if not self._guard_users[attempt_id]:  # the last one out drops the lock
                del self._guard_users[attempt_id], self._guards[attempt_id]

    def _passed_on(
        self, kind: str, attempt_id: str, body: dict[str, Any], delivery: Any, redelivered: bool
    ) -> Step:
        """With every slot taken, a message for an evaluation another worker holds is passed
        on at once, not held until a slot frees (its retry would start late); looked at
        before the evaluation's guard too, where another delivery may wait for a slot."""
        if attempt_id in self.evaluations or not (
            self._slots.locked() and may_be_held_elsewhere(kind, body, redelivered)
        ):
            return False
        holder = yield Store("holder", (attempt_id,))
        if holder is None or holder == self.worker_id:
            return False
        yield from self._forward(attempt_id, holder, delivery)
        return True

    def _dispatch(
        self, kind: str, attempt_id: str, body: dict[str, Any], delivery: Any, redelivered: bool
    ) -> Step:
        rule_id, attempt = body.get("rule_id"), body.get("attempt") or 0
        orch = self.evaluations.get(attempt_id)
        if orch is not None:
            if kind == "retry" and rule_id is not None:
                yield from orch.retry_due(rule_id, attempt, delivery)
            elif orch.closing:
                # Leaving memory (its lease lost, a delivery failed): this message may be the
                # one that resumes it (a sweeper's, a resume's), so it goes back, to find the
                # evaluation gone from memory next time, instead of being dropped.
                yield Settle(delivery, ack=False)
            else:
                yield Record("duplicate_dropped", {"attempt_id": attempt_id, "kind": kind})
                yield Settle(delivery)
            return

        # 1. Load the config: the plan travels in the message, or was stored at first start.
        raw = body.get("plan")
        try:
            if raw:
                plan: Plan | None = self._plan(raw, attempt_id)
            else:
                stored = yield Store("stored_plan", (attempt_id,))
                plan = self._plan(stored, attempt_id) if stored else None
        except PlanError as exc:
            yield Log("error", str(exc))
            yield Record("message_rejected", {"attempt_id": attempt_id, "reason": str(exc)})
            yield Settle(delivery)
            return

        # A slot is taken before the lease and held while the evaluation is in memory;
        # `_done` gives it back. A delivery that puts nothing in memory gives it back here.
        if (yield from self._passed_on(kind, attempt_id, body, delivery, redelivered)):
            return
        # Every evaluation slot taken: the wait is recorded, with the evaluations this
        # worker holds, so that a late retry can be told from one held back for nothing.
        # Those being set up hold a slot too (their begin under way), named apart.
        waits = self._recording and self._slots.locked()
        if waits:
            wait = {
                "attempt_id": attempt_id,
                "slot": "evaluation",
                "kind": kind,
                "held": sorted(self.evaluations),
                "slots": self.config.max_evaluations,
            }
            if self._setting_up:
                wait["setting_up"] = sorted(self._setting_up)
            yield Record("slot_wait", wait)
        yield Acquire(self._slots)
        self._setting_up.add(attempt_id)
        if waits:
            yield Record("slot_granted", {"attempt_id": attempt_id, "slot": "evaluation"})
        try:
            yield from self._begin(kind, attempt_id, body, delivery, plan, bool(raw))
        finally:
            self._setting_up.discard(attempt_id)
            if attempt_id not in self.evaluations:
                self._slots.release()

    def _begin(
        self,
        kind: str,
        attempt_id: str,
        body: dict[str, Any],
        delivery: Any,
        plan: Plan | None,
        plan_in_message: bool,
    ) -> Step:
        # 2. Lease, state, plan and ReEvaluateUseCase's read of Redis, in one round trip.
        # Where events are rows of the store, `evaluation.started` is begin's (its store
        # sets `resumed`: whether the snapshot holds a result or a status).
        started: dict[str, Any] = {"attempt_id": attempt_id}
        if plan is not None:
            started.update(plan=plan.id, resumed=False, worker=self.worker_id)
        event = PublishEvent("evaluation.started", started, f"{attempt_id}:started")
        outbox = self.host.outbox and plan is not None
        begun = yield from self.reevaluate.read(
            attempt_id, plan, plan_in_message, event if outbox else None
        )
        if begun.holder is not None:
            yield from self._forward(attempt_id, begun.holder, delivery)
            return
        if begun.terminal is not None:
            if announce_again(begun.published, plan):
                snapshot = yield Store("snapshot", (attempt_id, plan.order))
                verdicts = self.reevaluate.rebuild(plan, attempt_id, snapshot, {}).stored_verdicts()
                terminal = begun.terminal
                yield from shell.publish_completed(
                    self.worker_id, attempt_id, terminal, verdicts, outbox=self.host.outbox
                )
            yield Record("terminal_dropped", {"attempt_id": attempt_id, "kind": kind})
            yield Settle(delivery)
            return
        if begun.no_plan or plan is None or begun.snapshot is None:
            yield Record("message_rejected", {"attempt_id": attempt_id, "reason": "no plan"})
            yield Store("release", (attempt_id, self.worker_id))
            yield Settle(delivery)
            return
        snapshot = begun.snapshot

        due: dict[str, int] = {}
        if kind == "retry":
            rule_id, attempt = body["rule_id"], body["attempt"]
            if retry_is_fresh(plan, snapshot, rule_id, attempt):
                due[rule_id] = attempt
            else:
                yield Record(
                    "stale_retry_dropped",
                    {"attempt_id": attempt_id, "rule_id": rule_id, "attempt": attempt},
                )
                yield Settle(delivery)
                kind = "resume"
        core = self.reevaluate.rebuild(plan, attempt_id, snapshot, due)

        # 3. The job is initialised (by `begin`); announce it, and only then ACK.
        resumed = not snapshot.empty
        if not outbox:
            started["resumed"] = resumed
            yield event
        if self._recording:
            yield Record(
                "evaluation_started",
                {
                    "attempt_id": attempt_id,
                    "plan": plan.id,
                    "resumed": resumed,
                    "kind": kind,
                    "reason": body.get("reason"),
                    "fence": begun.fence,
                    "lease_ms": self.config.stale_ms,  # what begin's lease runs for
                },
            )
        if resumed:  # counted with its record (no wait between): the two always agree
            yield Count("resumes", labels=(("reason", body.get("reason") or kind),))
        orch = PassExecutionOrchestrator(
            self.host, self.config, self.worker_id, core, self._done, begun.fence
        )
        self.evaluations[attempt_id] = orch
        orch.holds_slot = True
        yield Gauge("running", len(self.evaluations))
        yield Failpoint("before_ack", None, attempt_id)
        if kind == "execute":
            yield Settle(delivery)
            if self._recording:
                yield Record("acked", {"attempt_id": attempt_id})
            yield Failpoint("after_ack", None, attempt_id)
        elif kind == "retry":
            orch.retry_messages[(body["rule_id"], body["attempt"])] = delivery
        orch.start()

    def _forward(self, attempt_id: str, holder: str, delivery: Any) -> Step:
        """Pass the message on to the worker holding the lease. Unroutable, it goes back to
        the queue after a pause (a heartbeat, at most): the holder's queue comes back, or
        its lease expires and the next `begin` takes the evaluation."""
        try:
            yield Forward(holder, delivery)
        except Unroutable:
            yield Record("forward_failed", {"attempt_id": attempt_id, "to": holder})
            yield Sleep(min(self.config.heartbeat_ms, 200) / 1000)
            yield Settle(delivery, ack=False)
            return
        yield Record("forwarded", {"attempt_id": attempt_id, "to": holder})
        yield Settle(delivery)

    def _done(self, orch: PassExecutionOrchestrator) -> Step:
        if self.evaluations.get(orch.attempt_id) is orch:
            del self.evaluations[orch.attempt_id]
            if orch.holds_slot:
                self._slots.release()
        yield Gauge("running", len(self.evaluations))

    def _plan(self, raw: Any, attempt_id: str) -> Plan:
        """The plan of a message or of the store: JSON live (parsed once per text), the
        `Plan` itself in the simulator, where nothing is serialised."""
        if isinstance(raw, Plan):
            return raw
        if not isinstance(raw, str):
            raw = orjson.dumps(raw, option=orjson.OPT_SORT_KEYS).decode()
        plan = self._plans.get(raw)
        if plan is None:
            plan = plan_from_dict(orjson.loads(raw), source=f"plan of {attempt_id}")
            if len(self._plans) > 256:
                self._plans.clear()
            self._plans[raw] = plan
        return plan

    def _on_cancel(self, attempt_id: str, delivery: Any) -> Step:
        orch = self.evaluations.get(attempt_id)
        yield Record("cancel_received", {"attempt_id": attempt_id, "held": orch is not None})
        if orch is not None:
            orch.cancel()
        yield Settle(delivery)

    def shutdown(self) -> Step:
        for orch in list(self.evaluations.values()):
            yield from orch.abandon("worker stopping")
