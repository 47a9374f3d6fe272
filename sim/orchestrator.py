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

from collections.abc import Callable, Generator
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
    RunRule,
    ScheduleRetry,
    SkipRules,
)
from engine.failpoints import InjectedFault
from sim import module
from sim.broker import Delivery, Unroutable
from sim.sync import Lock

if TYPE_CHECKING:
    from sim.worker import SimWorker

#: What a live task may fail with short of a bug in the simulator: logged, then abandoned.
TASK_ERRORS = (InjectedFault, ConnectionError, Unroutable, ProtocolError)
_CANCELLED = True


class Orchestrator:
    def __init__(
        self, w: SimWorker, core: Evaluation, on_done: Callable[[Orchestrator], None]
    ) -> None:
        self.w = w
        self.core = core
        self.attempt_id = core.attempt_id
        self.retry_messages: dict[tuple[str, int], Delivery] = {}
        self._lock = Lock(w.env)
        self._tasks: dict[simpy.Process, bool] = {}  # process -> cancelled
        self._on_done = on_done
        self._closed = False
        self.holds_slot = False
        self._starts: list[tuple[str, int]] = []
        self._reruns: dict[str, bool] = {}

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
            for action in actions:
                if self._closed:
                    return
                yield from self._execute(action)
        finally:
            self._lock.release()

    def _mark_starts(self, counts: list[int]) -> None:
        for (rule_id, _), count in zip(self._starts, counts, strict=True):
            self._reruns[rule_id] = count > 1
        self._starts = []

    def _execute(self, action: Action) -> Generator[Any, Any, None]:
        w, a = self.w, self.attempt_id
        match action:
            case RunRule():
                if self._starts:
                    counts = yield from w.store.call(w.redis.mark_started, a, self._starts)
                    self._mark_starts(counts)
                rerun = action.try_no == 1 and self._reruns.pop(action.rule_id, False)
                self._spawn(self._run_rule(action, rerun))
            case PersistResult(rule_id=rule_id, result=result):
                existing, counts = yield from w.store.call(
                    w.redis.write_result, a, result, self._starts
                )
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
                if w.fp:
                    yield from w.fp.hit("rule_after_write", rule_id, a)
            case PersistStatus():
                yield from module.persist_status(w, a, action)
            case ScheduleRetry():
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
                body = {
                    "attempt_id": a,
                    "pass_id": action.pass_id,
                    "outcome": action.outcome,
                    "rules": dict(action.rules),
                }
                yield from w.broker.publish_event(
                    "evaluation.pass_result", body, f"{a}:pass:{action.pass_id}"
                )
                yield from w.store.call(
                    w.redis.mark_pass_published, a, action.pass_id, action.outcome
                )
                w.record(
                    "pass_published", attempt_id=a, pass_id=action.pass_id, outcome=action.outcome
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
                yield from w.store.call(w.redis.park, a, w.worker_id)
                w.record("parked", attempt_id=a, waiting=dict(waiting))
                yield from self._close(release=False, requeue_held=True)
            case Finish():
                yield from self._finish(action)

    def _run_rule(self, action: RunRule, rerun: bool) -> Generator[Any, Any, None]:
        w, a, rule_id = self.w, self.attempt_id, action.rule_id
        if w.fp:
            yield from w.fp.hit("rule_before_call", rule_id, a)
        w.record(
            "rule_started",
            attempt_id=a,
            rule_id=rule_id,
            attempt=action.attempt,
            try_no=action.try_no,
            rerun=rerun,
        )
        # FakeAgent.evaluate: a per-process call counter, taken before the call sleeps
        key = (a, rule_id)
        call_index = w.calls.get(key, 0)
        w.calls[key] = call_index + 1
        d = w.agent.draw(a, rule_id, action.attempt, action.try_no, call_index)
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

    def _finish(self, action: Finish) -> Generator[Any, Any, None]:
        w, a = self.w, self.attempt_id
        kept = yield from w.store.call(w.redis.set_state, a, action.status.value)
        status = kept or action.status.value
        w.record(
            "evaluation_terminal",
            attempt_id=a,
            status=status,
            won=kept is None,
            verdicts=dict(action.verdicts),
        )
        if kept is None:
            if w.fp:
                yield from w.fp.hit("before_final_publish", None, a)
            yield from publish_completed(w, a, status, dict(action.verdicts))
            if w.fp:
                yield from w.fp.hit("after_final_publish", None, a)
            yield from self._close(release=False)
            return
        yield from w.store.call(w.redis.unindex_running, a)
        yield from self._close()

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
) -> Generator[Any, Any, None]:
    """evaluation.completed, then flag it, unindex, release (twice for double_final_publish)."""
    for _ in range(2 if w.double_final_publish else 1):
        body = {"attempt_id": a, "status": status, "verdicts": verdicts}
        yield from w.broker.publish_event("evaluation.completed", body, f"{a}:completed")
        yield from w.store.call(w.redis.done, a, w.worker_id)
        w.record("final_published", attempt_id=a, status=status)
