"""PassExecutionOrchestrator: one evaluation in memory, carrying out what the core decides.

It feeds the core one input at a time (under a lock) and executes the returned actions in
order, awaiting every durable write before the next action: the write window is exactly
the time between the agent's answer and the `SET NX` of its result. Rules run as tasks,
`max_parallel` at once (the core counts them); level-1 retries are the core's `RunRule`
with `try_no` > 1, run here in memory with no state persisted, as the seed has it.

If anything below the protocol fails unexpectedly (an injected `raise`, Redis gone for
good), the evaluation is dropped from memory as if its worker had crashed: leases and
unacknowledged retries are handed back, and the sweeper or a redelivery resumes it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

from aio_pika.abc import AbstractIncomingMessage

from engine.agent import AgentError
from engine.core import (
    AckRetry,
    Action,
    Evaluation,
    Finish,
    Park,
    PersistResult,
    PersistStatus,
    PublishPassResult,
    Recovered,
    RunRule,
    ScheduleRetry,
    SkipRules,
)
from engine.core.results import RuleResult
from engine.core.states import EvaluationStatus, RuleState
from engine.runtime.context import Runtime, log, settle
from engine.runtime.module import EvaluationModule
from engine.runtime.store import LeaseLost


class PassExecutionOrchestrator:
    def __init__(
        self,
        rt: Runtime,
        core: Evaluation,
        on_done: Callable[[PassExecutionOrchestrator], None],
        fence: str = "",
    ) -> None:
        self.rt = rt
        self.core = core
        self.fence = fence  # the lease's token: every write of this copy carries it
        self.attempt_id = core.attempt_id
        self.module = EvaluationModule(rt)
        self.retry_messages: dict[tuple[str, int], AbstractIncomingMessage] = {}
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._on_done = on_done
        self._closed = False
        self.holds_slot = False
        self._starts: list[tuple[str, int]] = []  # first tries of the actions being executed
        # Starts of each rule's attempt as the start marker counted them (the `runs` key),
        # then which execution of its attempt each running rule is: the agent is told, so
        # that a rerun is known as one (a drifting agent may answer it differently).
        self._counted: dict[str, int] = {}
        self._execution: dict[str, int] = {}
        self._kept: dict[str, str] = {}  # rule -> verdict of another write that came first
        self._looked = False  # the state was read for the actions being executed
        self._over: str | None = None  # the terminal state the store showed (a cancel)
        self._lease_until = 0.0  # monotonic time the lease runs to, by the last fenced write

    # --- inputs -------------------------------------------------------------------------

    def start(self) -> None:
        self._spawn(self._feed(self.core.start))

    def retry_due(self, rule_id: str, attempt: int, message: AbstractIncomingMessage) -> None:
        if self._closed:  # leaving memory: the redelivery will resume it from Redis
            self._spawn(settle(message, ack=False))
            return
        if (rule_id, attempt) in self.retry_messages:  # a copy of a retry already under way
            self.rt.history.record(
                "stale_retry_dropped", attempt_id=self.attempt_id, rule_id=rule_id, attempt=attempt
            )
            self._spawn(settle(message))
            return
        self.retry_messages[(rule_id, attempt)] = message
        self._spawn(self._feed(self.core.retry_due, rule_id, attempt))

    def cancel(self) -> None:
        self._spawn(self._feed(self.core.cancel))

    async def reinstate(self) -> None:
        """Redis lost what `begin` wrote (a failover): the heartbeat took the lease back,
        and the plan is written back, so that a resume can still find it."""
        restored = await self.rt.store.reinstate(self.attempt_id, self.core.plan.to_json())
        self.rt.history.record(
            "evaluation_reinstated", attempt_id=self.attempt_id, plan_restored=restored
        )

    async def abandon(self, reason: str) -> None:
        """Drop the evaluation without touching its durable state; hand deliveries back."""
        if self._closed:
            return
        self._closed = True
        self.rt.history.record("evaluation_abandoned", attempt_id=self.attempt_id, reason=reason)
        log.warning("evaluation %s abandoned: %s", self.attempt_id, reason)
        held, self.retry_messages = list(self.retry_messages.values()), {}
        for message in held:
            await settle(message, ack=False)
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()
        await self.rt.store.release(self.attempt_id, self.rt.worker_id)
        self._on_done(self)

    # --- machinery ----------------------------------------------------------------------

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._reap)

    def _reap(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not self._closed:
            if isinstance(exc, LeaseLost):  # fenced off: another worker owns it now
                log.warning("evaluation %s: %s", self.attempt_id, exc)
            else:
                log.error("evaluation %s failed", self.attempt_id, exc_info=exc)
            self._spawn(self.abandon(f"{type(exc).__name__}: {exc}"))

    async def _feed(self, fn: Callable[..., list[Action]], *args: object, **kw: object) -> None:
        async with self._lock:
            if self._closed:
                return
            actions = fn(*args, **kw)
            # Rules about to start for the first time in their attempt get a start marker
            # (to count reruns), written with the result that made them ready when there
            # is one, so a rule's durable bookkeeping stays within two round trips.
            self._starts = [(x.rule_id, x.attempt) for x in actions if _first_try(x)]
            self._looked = False  # the evaluation state not read yet for these actions
            for action in actions:
                if self._closed:
                    return
                await self._execute(action)
            if self._over is not None and not self.core.finished:
                # The store says the evaluation is over (a cancel, seen before its
                # broadcast arrived): what the core does on a cancel, at once.
                self.rt.history.record("cancel_seen", attempt_id=self.attempt_id, state=self._over)
                for action in self.core.cancel():
                    if self._closed:
                        return
                    await self._execute(action)

    def _look(self, over: str | None) -> None:
        """The state check that rode on a write: a terminal state stops every start."""
        self._looked = True
        if over is not None:
            self._over = over
            self._starts = []

    def _leased(self, sent: float) -> None:
        """A fenced write sent at `sent` landed, so the lease ran on from then at least."""
        self._lease_until = sent + self.rt.config.stale_ms / 1000

    def _lease_short(self) -> bool:
        """Too little of the lease is known to be left to start a rule on it: the worker
        was paused or lagged since its last fenced write (the reply that allowed the starts
        may be seconds old), so the store is asked again, fenced, before any start."""
        return time.monotonic() > self._lease_until - self.rt.config.heartbeat_ms / 1000

    async def _still_ours(self) -> bool:
        """Right before a call: a worker paused since the store last ran its lease on (the
        start was allowed seconds ago) asks again, fenced; a refusal raises `LeaseLost`."""
        while self._over is None and self._lease_short():  # a pause may strike again
            sent = time.monotonic()
            _, over = await self.rt.store.mark_started(self.attempt_id, [], self.fence)
            self._leased(sent)
            self._look(over)
        return self._over is None

    def _mark_starts(self, counts: list[int]) -> None:
        for (rule_id, _), count in zip(self._starts, counts, strict=True):
            self._counted[rule_id] = count
        self._starts = []

    async def _execute(self, action: Action) -> None:
        rt, a = self.rt, self.attempt_id
        match action:
            case RunRule():
                # Before any start, the store's word on a cancel: on the start markers'
                # round trip, or (a level-1 retry has none) a look at the state alone.
                if self._over is None and (self._starts or not self._looked or self._lease_short()):
                    sent = time.monotonic()
                    counts, over = await rt.store.mark_started(a, self._starts, self.fence)
                    self._leased(sent)
                    self._look(over)
                    self._mark_starts(counts)
                if self._over is not None:
                    return  # the evaluation is over: this rule does not start
                if action.try_no == 1:
                    self._execution[action.rule_id] = self._counted.pop(action.rule_id, 1)
                self._spawn(self._run_rule(action, self._execution.get(action.rule_id, 1)))
            case PersistResult(rule_id=rule_id, result=result):
                sent = time.monotonic()
                existing, counts, over = await rt.store.write_result(
                    a, result, self._starts, self.fence
                )
                self._leased(sent)
                self._look(over)
                self._mark_starts(counts)
                rt.history.record(
                    "result_persisted",
                    attempt_id=a,
                    rule_id=rule_id,
                    attempt=result.attempt,
                    verdict=result.verdict,
                    score=result.score,
                    won=existing is None,
                    kept_verdict=None if existing is None else existing.verdict,
                )
                if existing is not None and not await self._adopt(rule_id, existing):
                    return
                await rt.failpoints.hit("rule_after_write", rule_id, a)
            case PersistStatus():
                self._look(await self.module.persist_status(a, action, self.fence))
            case ScheduleRetry():
                if self._over is not None:  # over: a retry would only be dropped
                    rt.history.record(
                        "retry_not_scheduled",
                        attempt_id=a,
                        rule_id=action.rule_id,
                        attempt=action.attempt,
                        state=self._over,
                    )
                else:
                    await self.module.schedule_retry(a, action)
            case AckRetry(rule_id=rule_id, attempt=attempt):
                message = self.retry_messages.pop((rule_id, attempt), None)
                if message is not None:
                    await settle(message)
                    rt.history.record("retry_acked", attempt_id=a, rule_id=rule_id, attempt=attempt)
            case SkipRules(rule_ids=rule_ids, because_of=because_of):
                rt.history.record(
                    "rules_skipped", attempt_id=a, rule_ids=list(rule_ids), because_of=because_of
                )
            case PublishPassResult():
                await rt.failpoints.hit("before_pass_publish", None, a)
                rules = self._durable(action.rules)
                body = {
                    "attempt_id": a,
                    "pass_id": action.pass_id,
                    "outcome": action.outcome,
                    "rules": rules,
                }
                await rt.broker.publish_event(
                    "evaluation.pass_result", body, f"{a}:pass:{action.pass_id}"
                )
                await rt.store.mark_pass_published(a, action.pass_id, action.outcome, self.fence)
                rt.history.record(
                    "pass_published",
                    attempt_id=a,
                    pass_id=action.pass_id,
                    outcome=action.outcome,
                    rules=rules,
                )
            case Recovered():
                rt.metrics.loaded.inc(len(action.loaded))
                rt.history.record(
                    "recovered",
                    attempt_id=a,
                    loaded=list(action.loaded),
                    retrying=dict(action.retrying),
                    failed=list(action.failed),
                    fresh=list(action.fresh),
                )
            case Park(waiting=waiting):
                await rt.store.park(a, rt.worker_id, self.fence, list(waiting))
                rt.history.record("parked", attempt_id=a, waiting=dict(waiting))
                # A retry that arrived while parking is handed back, not dropped: its
                # redelivery resumes the evaluation from Redis.
                await self._close(release=False, requeue_held=True)
            case Finish():
                await self._finish(action)

    async def _run_rule(self, action: RunRule, execution: int) -> None:
        rt, a = self.rt, self.attempt_id
        rerun = action.try_no == 1 and execution > 1
        rule = self.core.plan.rules[action.rule_id]
        await rt.failpoints.hit("rule_before_call", rule.id, a)
        if not await self._still_ours():
            return
        if action.try_no > 1:
            rt.metrics.retries.labels(level="1").inc()
        if rerun:
            rt.metrics.reruns.inc()
        rt.history.record(
            "rule_started",
            attempt_id=a,
            rule_id=rule.id,
            attempt=action.attempt,
            try_no=action.try_no,
            rerun=rerun,
            execution=execution,
        )
        try:
            result = await rt.agent.evaluate(
                a, rule, action.attempt, action.try_no, execution=execution
            )
        except AgentError as err:
            tokens = int(getattr(err, "tokens", 0) or 0)
            self._spend(tokens, rerun)
            rt.metrics.calls.labels(outcome=err.kind).inc()
            rt.history.record(
                "rule_failed",
                attempt_id=a,
                rule_id=rule.id,
                attempt=action.attempt,
                try_no=action.try_no,
                kind=err.kind,
                retryable=err.retryable,
                tokens=tokens,
            )
            await self._feed(self.core.rule_failed, rule.id, err.kind, retryable=err.retryable)
            return
        self._spend(result.tokens, rerun)
        rt.metrics.calls.labels(outcome="ok").inc()
        rt.history.record(
            "rule_finished",
            attempt_id=a,
            rule_id=rule.id,
            attempt=action.attempt,
            try_no=action.try_no,
            verdict=result.verdict,
            score=result.score,
            tokens=result.tokens,
        )
        await rt.failpoints.hit("rule_after_call_before_write", rule.id, a)
        await self._feed(self.core.rule_succeeded, rule.id, result)

    def _spend(self, tokens: int, rerun: bool) -> None:
        self.rt.metrics.tokens.inc(tokens)
        if rerun:
            self.rt.metrics.rerun_tokens.inc(tokens)

    async def _adopt(self, rule_id: str, kept: RuleResult) -> bool:
        """Another write of `rule_id`'s result came first. Without the lease (this worker
        ran the rule after its lease lapsed: a frozen process) its view is stale: it steps
        aside before starting or announcing anything, and the owner carries on. With the
        lease (a retried script met its own write, or a late writer beat this one) the
        kept result is the rule's from now on, in the core and in what is announced.
        False when the evaluation was abandoned."""
        held = await self.rt.store.renew({self.attempt_id: self.fence}, self.rt.worker_id)
        if not held.get(self.attempt_id):
            await self.abandon(f"{rule_id}: another write of its result came first")
            return False
        self.core.result_kept(rule_id, kept)
        self._kept[rule_id] = kept.verdict
        return True

    def _durable(self, verdicts: Mapping[str, str]) -> dict[str, str]:
        """Verdicts to announce: those computed before a write lost, replaced by the kept."""
        return {r: self._kept.get(r, v) for r, v in verdicts.items()}

    async def _finish(self, action: Finish) -> None:
        rt, a = self.rt, self.attempt_id
        kept = await self._confirm_final(action)
        status = kept or action.status.value
        verdicts = self._durable(action.verdicts)
        rt.history.record(
            "evaluation_terminal",
            attempt_id=a,
            status=status,
            won=kept is None,
            decided=action.status.value,  # the core's own decision (a cancel heard, or not)
            verdicts=verdicts,
        )
        if kept is None:
            rt.metrics.evaluations.labels(status=status).inc()
            # The terminal state is this copy's and durable: its announcement goes out even
            # if the lease is lost meanwhile (`abandon` cancels this task, not the shield).
            await asyncio.shield(self._announce(action, status, verdicts))
            await self._close(release=False)
            return
        if action.status is not EvaluationStatus.CANCELLED:
            log.info("evaluation %s was already %s", a, kept)
        await rt.store.unindex(a)
        await self._close()

    async def _announce(self, action: Finish, status: str, verdicts: dict[str, str]) -> None:
        rt, a = self.rt, self.attempt_id
        await rt.failpoints.hit("before_final_publish", None, a)
        held = await publish_completed(rt, a, status, verdicts)
        for _ in range(3):
            if held is not False:
                break
            # A lossy Redis restart swallowed the final state after it was written: what
            # was announced is made durable again before the evaluation leaves.
            await self._confirm_final(action, again=True)
            held = await rt.store.done(a, rt.worker_id)
        await rt.failpoints.hit("after_final_publish", None, a)

    async def _confirm_final(self, action: Finish, again: bool = False) -> str | None:
        """Write the final state once Redis holds every result and permanent failure the
        verdicts name (a Redis that lost acknowledged writes gets them back from memory,
        in the same round trip); return the terminal state kept instead, if any."""
        core, a = self.core, self.attempt_id
        results = {r: core.results[r] for r in action.verdicts if r in core.results}
        failed = [r for r in core.rules_in(RuleState.PERMANENTLY_FAILED) if r in action.verdicts]
        kept, restored = await self.rt.store.finish(
            a, action.status.value, results, failed, self.fence
        )
        if restored or again:
            self.rt.history.record(
                "final_state_restored" if again else "results_restored",
                attempt_id=a,
                rule_ids=restored,
                status=kept or action.status.value,
            )
        return kept

    async def _close(self, release: bool = True, requeue_held: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        held, self.retry_messages = list(self.retry_messages.items()), {}
        for (rule_id, attempt), message in held:
            # Finished or cancelled: whatever retry is still held is stale.
            await settle(message, ack=not requeue_held)
            self.rt.history.record(
                "retry_requeued" if requeue_held else "stale_retry_dropped",
                attempt_id=self.attempt_id,
                rule_id=rule_id,
                attempt=attempt,
            )
        if release:
            await self.rt.store.release(self.attempt_id, self.rt.worker_id)
        self._on_done(self)


def _first_try(action: Action) -> bool:
    return isinstance(action, RunRule) and action.try_no == 1


async def publish_completed(rt: Runtime, attempt_id: str, status: str, verdicts: dict) -> bool:
    """Publish evaluation.completed for the final state, then flag it, unindex, release.

    A crash between the publish and the flag publishes it again on recovery: consumers
    dedupe on the message id (`{attemptId}:completed`). False when the final state was no
    longer in Redis to be flagged (a restart lost it): the caller restores it.
    """
    body = {"attempt_id": attempt_id, "status": status, "verdicts": verdicts}
    await rt.broker.publish_event("evaluation.completed", body, f"{attempt_id}:completed")
    held = await rt.store.done(attempt_id, rt.worker_id)
    rt.history.record("final_published", attempt_id=attempt_id, status=status)
    return held
