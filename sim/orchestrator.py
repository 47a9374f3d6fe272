"""PassExecutionOrchestrator in the simulator: the core's actions, carried out in order.

A line-by-line mirror of `engine.runtime.orchestrator`: one input fed to the core at a
time (a FIFO lock), every action executed front to back and every durable write awaited
before the next, rules run as concurrent processes, start markers written with the result
that made a rule ready. A process that fails with an error the live worker would log
(an injected `raise`, Redis or the broker unreachable for good, a `ProtocolError`) makes
the evaluation leave memory, exactly as the live `_reap` does: held retries are handed
back, the other processes cancelled, the lease released.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from typing import TYPE_CHECKING, Any

import simpy

from engine.agent import ERROR_KINDS
from engine.core import (
    AckRetry,
    Action,
    Evaluation,
    Finish,
    Park,
    PersistResult,
    PersistStatus,
    ProtocolError,
    PublishPassResult,
    Recovered,
    RuleResult,
    RuleState,
    RunRule,
    ScheduleRetry,
    SkipRules,
)
from engine.failpoints import InjectedFault
from engine.runtime.store import LeaseLost
from sim import module
from sim.broker import Delivery, Unroutable
from sim.sync import Lock

if TYPE_CHECKING:
    from sim.worker import SimWorker

#: What a live task may fail with short of a bug in the simulator: logged, then abandoned.
TASK_ERRORS = (InjectedFault, ConnectionError, Unroutable, ProtocolError, LeaseLost)
_CANCELLED = True


class Orchestrator:
    def __init__(
        self,
        w: SimWorker,
        core: Evaluation,
        on_done: Callable[[Orchestrator], None],
        fence: str = "",
    ) -> None:
        self.w = w
        self.core = core
        self.fence = fence  # the lease's token: every write of this copy carries it
        self.attempt_id = core.attempt_id
        self.retry_messages: dict[tuple[str, int], Delivery] = {}
        self._lock = Lock(w.env)
        self._tasks: dict[simpy.Process, bool] = {}  # process -> cancelled
        self._on_done = on_done
        self._closed = False
        self.holds_slot = False
        self._starts: list[tuple[str, int]] = []
        self._counted: dict[str, int] = {}  # the `runs` key's count of each start
        self._execution: dict[str, int] = {}  # which execution of its attempt each rule runs
        self._kept: dict[str, str] = {}  # rule -> verdict of another write that came first
        self._looked = False  # the state was read for the actions being executed
        self._over: str | None = None  # the terminal state the store showed (a cancel)
        self._lease_until = 0.0  # time the lease runs to, by the last fenced write

    # --- inputs -------------------------------------------------------------------------

    def start(self) -> None:
        self._spawn(self._feed(self.core.start))

    def retry_due(self, rule_id: str, attempt: int, message: Delivery) -> None:
        if self._closed:
            self.w.broker.settle(message, ack=False)
            return
        if (rule_id, attempt) in self.retry_messages:
            self.w.record(
                "stale_retry_dropped", attempt_id=self.attempt_id, rule_id=rule_id, attempt=attempt
            )
            self.w.broker.settle(message)
            return
        self.retry_messages[(rule_id, attempt)] = message
        self._spawn(self._feed(self.core.retry_due, rule_id, attempt))

    def cancel(self) -> None:
        self._spawn(self._feed(self.core.cancel))

    def reinstate(self) -> Generator[Any, Any, None]:
        """`PassExecutionOrchestrator.reinstate`: the plan written back."""
        w = self.w
        restored = yield from w.store.call(w.redis.reinstate, self.attempt_id, self.core.plan)
        w.record("evaluation_reinstated", attempt_id=self.attempt_id, plan_restored=restored)

    def abandon(self, reason: str) -> Generator[Any, Any, None]:
        if self._closed:
            return
        self._closed = True
        w = self.w
        w.record("evaluation_abandoned", attempt_id=self.attempt_id, reason=reason)
        held, self.retry_messages = list(self.retry_messages.values()), {}
        for message in held:
            w.broker.settle(message, ack=False)
        current = w.env.active_process
        for task in list(self._tasks):
            if task is not current and task.is_alive:
                self._tasks[task] = _CANCELLED
                task.interrupt()
        yield from w.store.call(w.redis.release, self.attempt_id, w.worker_id)
        self._on_done(self)

    # --- machinery ----------------------------------------------------------------------

    def _spawn(self, gen: Generator) -> None:
        task = self.w.spawn(self._task(gen))
        if task is not None:
            self._tasks[task] = False
            task.callbacks.append(self._reaped)

    def _reaped(self, task: simpy.Event) -> None:
        self._tasks.pop(task, None)  # type: ignore[call-overload]

    def _task(self, gen: Generator) -> Generator[Any, Any, None]:
        if self._tasks.get(self.w.env.active_process):  # cancelled before its first step
            gen.close()
            return
        try:
            yield from gen
        except TASK_ERRORS as exc:
            if isinstance(exc, ProtocolError):
                self.w.run.shell_errors.append(f"{self.w.worker_id}: {exc}")
            if not self._closed:
                self._spawn(self.abandon(f"{type(exc).__name__}: {exc}"))

    def _feed(self, fn: Callable[..., list[Action]], *args: Any, **kw: Any) -> Generator:
        yield from self._lock.acquire()
        try:
            if self._closed:
                return
            actions = fn(*args, **kw)
            self._starts = [
                (x.rule_id, x.attempt) for x in actions if isinstance(x, RunRule) and x.try_no == 1
            ]
            self._looked = False
            for action in actions:
                if self._closed:
                    return
                yield from self._execute(action)
            if self._over is not None and not self.core.finished:
                self.w.record("cancel_seen", attempt_id=self.attempt_id, state=self._over)
                for action in self.core.cancel():
                    if self._closed:
                        return
                    yield from self._execute(action)
        finally:
            self._lock.release()

    def _look(self, over: str | None) -> None:
        self._looked = True
        if over is not None:
            self._over = over
            self._starts = []

    def _leased(self, sent: float) -> None:
        self._lease_until = sent + self.w.config.stale_ms / 1000

    def _lease_short(self) -> bool:
        """The live `_lease_short`: a start after a pause asks the store again first."""
        return self.w.env.now > self._lease_until - self.w.config.heartbeat_ms / 1000

    def _still_ours(self) -> Generator[Any, Any, bool]:
        """The live `_still_ours`: right before a call, a paused worker asks again."""
        while self._over is None and self._lease_short():  # a pause may strike again
            sent = self.w.env.now
            _, over = yield from self.w.store.call(
                self.w.redis.mark_started, self.attempt_id, [], self.fence
            )
            self._leased(sent)
            self._look(over)
        return self._over is None

    def _mark_starts(self, counts: list[int]) -> None:
        for (rule_id, _), count in zip(self._starts, counts, strict=True):
            self._counted[rule_id] = count
        self._starts = []

    def _execute(self, action: Action) -> Generator[Any, Any, None]:
        w, a = self.w, self.attempt_id
        match action:
            case RunRule():
                if self._over is None and (self._starts or not self._looked or self._lease_short()):
                    sent = w.env.now
                    counts, over = yield from w.store.call(
                        w.redis.mark_started, a, self._starts, self.fence
                    )
                    self._leased(sent)
                    self._look(over)
                    self._mark_starts(counts)
                if self._over is not None:
                    return
                if action.try_no == 1:
                    self._execution[action.rule_id] = self._counted.pop(action.rule_id, 1)
                self._spawn(self._run_rule(action, self._execution.get(action.rule_id, 1)))
            case PersistResult(rule_id=rule_id, result=result):
                sent = w.env.now
                existing, counts, over = yield from w.store.call(
                    w.redis.write_result, a, result, self._starts, self.fence
                )
                self._leased(sent)
                self._look(over)
                self._mark_starts(counts)
                w.record(
                    "result_persisted",
                    attempt_id=a,
                    rule_id=rule_id,
                    attempt=result.attempt,
                    verdict=result.verdict,
                    score=result.score,
                    won=existing is None,
                    kept_verdict=None if existing is None else existing.verdict,
                )
                if existing is not None and not (yield from self._adopt(rule_id, existing)):
                    return
                if w.fp:
                    yield from w.fp.hit("rule_after_write", rule_id, a)
            case PersistStatus():
                self._look((yield from module.persist_status(w, a, action, self.fence)))
            case ScheduleRetry():
                if self._over is not None:
                    w.record(
                        "retry_not_scheduled",
                        attempt_id=a,
                        rule_id=action.rule_id,
                        attempt=action.attempt,
                        state=self._over,
                    )
                else:
                    yield from module.schedule_retry(w, a, action)
            case AckRetry(rule_id=rule_id, attempt=attempt):
                message = self.retry_messages.pop((rule_id, attempt), None)
                if message is not None:
                    w.broker.settle(message)
                    w.record("retry_acked", attempt_id=a, rule_id=rule_id, attempt=attempt)
            case SkipRules(rule_ids=rule_ids, because_of=because_of):
                w.record(
                    "rules_skipped", attempt_id=a, rule_ids=list(rule_ids), because_of=because_of
                )
            case PublishPassResult():
                if w.fp:
                    yield from w.fp.hit("before_pass_publish", None, a)
                rules = self._durable(action.rules)
                body = {
                    "attempt_id": a,
                    "pass_id": action.pass_id,
                    "outcome": action.outcome,
                    "rules": rules,
                }
                yield from w.broker.publish_event(
                    "evaluation.pass_result", body, f"{a}:pass:{action.pass_id}"
                )
                yield from w.store.call(
                    w.redis.mark_pass_published, a, action.pass_id, action.outcome, self.fence
                )
                w.record(
                    "pass_published",
                    attempt_id=a,
                    pass_id=action.pass_id,
                    outcome=action.outcome,
                    rules=rules,
                )
            case Recovered():
                w.record(
                    "recovered",
                    attempt_id=a,
                    loaded=list(action.loaded),
                    retrying=dict(action.retrying),
                    failed=list(action.failed),
                    fresh=list(action.fresh),
                )
            case Park(waiting=waiting):
                yield from w.store.call(w.redis.park, a, w.worker_id, self.fence, list(waiting))
                w.record("parked", attempt_id=a, waiting=dict(waiting))
                yield from self._close(release=False, requeue_held=True)
            case Finish():
                yield from self._finish(action)

    def _run_rule(self, action: RunRule, execution: int) -> Generator[Any, Any, None]:
        w, a, rule_id = self.w, self.attempt_id, action.rule_id
        rerun = action.try_no == 1 and execution > 1
        if w.fp:
            yield from w.fp.hit("rule_before_call", rule_id, a)
        if not (yield from self._still_ours()):
            return
        w.record(
            "rule_started",
            attempt_id=a,
            rule_id=rule_id,
            attempt=action.attempt,
            try_no=action.try_no,
            rerun=rerun,
            execution=execution,
        )
        d = w.agent.draw(a, rule_id, action.attempt, action.try_no, execution)  # FakeAgent.evaluate
        delay = d.latency_ms * w.config.time_scale / 1000.0
        if delay > 0:
            yield w.env.timeout(delay)
        if d.error is not None:
            retryable = ERROR_KINDS[d.error]
            w.record(
                "rule_failed",
                attempt_id=a,
                rule_id=rule_id,
                attempt=action.attempt,
                try_no=action.try_no,
                kind=d.error,
                retryable=retryable,
                tokens=d.tokens,
            )
            yield from self._feed(self.core.rule_failed, rule_id, d.error, retryable=retryable)
            return
        result = d.result
        assert result is not None
        w.record(
            "rule_finished",
            attempt_id=a,
            rule_id=rule_id,
            attempt=action.attempt,
            try_no=action.try_no,
            verdict=result.verdict,
            score=result.score,
            tokens=result.tokens,
        )
        if w.fp:
            yield from w.fp.hit("rule_after_call_before_write", rule_id, a)
        yield from self._feed(self.core.rule_succeeded, rule_id, result)

    def _adopt(self, rule_id: str, kept: RuleResult) -> Generator[Any, Any, bool]:
        """Another write came first: without the lease step aside, with it adopt the kept
        result (the live `_adopt`). False when the evaluation was abandoned."""
        w, a = self.w, self.attempt_id
        held = yield from w.store.call(
            w.redis.renew, {a: self.fence}, w.worker_id, w.store.now_ms()
        )
        if not held.get(a):
            yield from self.abandon(f"{rule_id}: another write of its result came first")
            return False
        self.core.result_kept(rule_id, kept)
        self._kept[rule_id] = kept.verdict
        return True

    def _durable(self, verdicts: Mapping[str, str]) -> dict[str, str]:
        return {r: self._kept.get(r, v) for r, v in verdicts.items()}

    def _finish(self, action: Finish) -> Generator[Any, Any, None]:
        w, a = self.w, self.attempt_id
        kept = yield from self._confirm_final(action)
        status = kept or action.status.value
        verdicts = self._durable(action.verdicts)
        w.record(
            "evaluation_terminal",
            attempt_id=a,
            status=status,
            won=kept is None,
            decided=action.status.value,  # the core's own decision (a cancel heard, or not)
            verdicts=verdicts,
        )
        if kept is None:
            # The live `asyncio.shield`: the announcement runs as a process of its own,
            # which losing the lease (`abandon`) does not interrupt.
            announcing = w.spawn(self._task(self._announce(action, status, verdicts)))
            if announcing is not None:
                yield announcing
            yield from self._close(release=False)
            return
        yield from w.store.call(w.redis.unindex, a)
        yield from self._close()

    def _announce(
        self, action: Finish, status: str, verdicts: dict[str, str]
    ) -> Generator[Any, Any, None]:
        w, a = self.w, self.attempt_id
        if w.fp:
            yield from w.fp.hit("before_final_publish", None, a)
        held = yield from publish_completed(w, a, status, verdicts)
        for _ in range(3):
            if held is not False:
                break
            yield from self._confirm_final(action, again=True)
            held = yield from w.store.call(w.redis.done, a, w.worker_id)
        if w.fp:
            yield from w.fp.hit("after_final_publish", None, a)

    def _confirm_final(self, action: Finish, again: bool = False) -> Generator[Any, Any, Any]:
        """`RedisStore.finish`: the final state, once every named result is in Redis."""
        core, a, w = self.core, self.attempt_id, self.w
        results = {r: core.results[r] for r in action.verdicts if r in core.results}
        failed = [r for r in core.rules_in(RuleState.PERMANENTLY_FAILED) if r in action.verdicts]
        kept, restored = yield from w.store.call(
            w.redis.finish, a, action.status.value, results, failed, self.fence
        )
        if restored or again:
            w.record(
                "final_state_restored" if again else "results_restored",
                attempt_id=a,
                rule_ids=restored,
                status=kept or action.status.value,
            )
        return kept

    def _close(self, release: bool = True, requeue_held: bool = False) -> Generator:
        if self._closed:
            return
        self._closed = True
        w = self.w
        held, self.retry_messages = list(self.retry_messages.items()), {}
        for (rule_id, attempt), message in held:
            w.broker.settle(message, ack=not requeue_held)
            w.record(
                "retry_requeued" if requeue_held else "stale_retry_dropped",
                attempt_id=self.attempt_id,
                rule_id=rule_id,
                attempt=attempt,
            )
        if release:
            yield from w.store.call(w.redis.release, self.attempt_id, w.worker_id)
        self._on_done(self)


def publish_completed(
    w: SimWorker, a: str, status: str, verdicts: dict[str, str]
) -> Generator[Any, Any, bool]:
    """evaluation.completed, then flag it, unindex, release (twice for double_final_publish);
    False when the final state was no longer there to flag (lost writes)."""
    held = True
    for _ in range(2 if w.double_final_publish else 1):
        body = {"attempt_id": a, "status": status, "verdicts": verdicts}
        yield from w.broker.publish_event("evaluation.completed", body, f"{a}:completed")
        held = yield from w.store.call(w.redis.done, a, w.worker_id)
        w.record("final_published", attempt_id=a, status=status)
    return held
