"""PassExecutionOrchestrator: one evaluation in memory, carrying out what the core decides.

It feeds the core one input at a time (under a lock) and executes the returned actions in
order, awaiting every durable write before the next action: the write window is exactly
the time between the agent's answer and the `SET NX` of its result. Rules run as tasks of
their own, `max_parallel` at once (the core counts them); level-1 retries are the core's
`RunRule` with `try_no` > 1, run here in memory with no state persisted, as the seed has it.

If anything below the protocol fails unexpectedly (an injected `raise`, Redis gone for
good), the evaluation is dropped from memory as if its worker had crashed: leases and
unacknowledged retries are handed back, and the sweeper or a redelivery resumes it.

Written once, as steps of effects (`engine.shell.effects`) run by the host's tasks: the
live worker and the simulator carry out this very code.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from typing import Any

from engine.agent import AgentError
from engine.config import EngineConfig
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
from engine.shell import module
from engine.shell.effects import (
    MONO,
    NOW,
    Acquire,
    CallAgent,
    Count,
    Effect,
    Failpoint,
    Host,
    Join,
    Log,
    PublishEvent,
    Record,
    Settle,
    Step,
    Store,
    published_before,
)
from engine.shell.replies import LeaseLost

#: Effects a rule yields as they are, built once.
_CALLED_OK = Count("calls", labels=(("outcome", "ok"),))
_RETRIED_AT_ONCE = Count("retries", labels=(("level", "1"),))
_RERUN = Count("reruns")


class PassExecutionOrchestrator:
    def __init__(
        self,
        host: Host,
        config: EngineConfig,
        worker_id: str,
        core: Evaluation,
        on_done: Callable[[PassExecutionOrchestrator], Step],
        fence: str = "",
    ) -> None:
        self.host = host
        self._recording = host.recording  # False: events are discarded, not even built
        self._failpoints = host.failpoints  # False: none armed, a rule's are left out
        self.config = config
        self.worker_id = worker_id
        self.core = core
        self.fence = fence  # the lease's token: every write of this copy carries it
        self.attempt_id = core.attempt_id
        self.retry_messages: dict[tuple[str, int], Any] = {}  # held deliveries
        self._lock = host.lock()
        self._tasks: set[Any] = set()
        self._on_done = on_done
        self._closed = False
        # Set when this copy gives its lease back (the final `done`, a park, a release):
        # the heartbeat no longer renews it, or a renewal landing after the give-back
        # would take the lease again for an evaluation nobody runs.
        self.leaving = False
        self.holds_slot = False
        self._starts: list[tuple[str, int]] = []  # first tries of the actions being executed
        # Starts of each rule's attempt as the start marker counted them (the `runs` key),
        # then which execution of its attempt each running rule is: the agent is told, so
        # that a rerun is known as one (a drifting agent may answer it differently).
        self._counted: dict[str, int] = {}
        self._execution: dict[str, int] = {}
        self._looked = False  # the state was read for the actions being executed
        # The passes this copy announced (their bodies, by pass id), in order: a store that
        # lost acknowledged writes may have lost their flags, and with an outbox the events
        self._passes: dict[str, dict[str, Any]] = {}
        self._over: str | None = None  # the terminal state the store showed (a cancel)
        self._lease_until = 0.0  # monotonic time the lease runs to, by the last fenced write
        # Due retries the core could not start at once (every slot taken): (rule, attempt),
        # recorded as `slot_wait` when found and `slot_granted` when the rule gets its slot,
        # so that the checker can tell a late start that waited for a slot from one that
        # was held back for nothing (`retry_delays_respected`).
        self._slot_waiting: set[tuple[str, int]] = set()

    @property
    def closing(self) -> bool:
        """Abandoned or finishing: it leaves memory once its last store call returns."""
        return self._closed

    # --- inputs -------------------------------------------------------------------------

    def start(self) -> None:
        self._spawn(self._feed(self.core.start))

    def retry_due(self, rule_id: str, attempt: int, delivery: Any) -> Step:
        """A retry delivery for this evaluation: held until the outcome of its attempt is
        durable (`AckRetry`)."""
        if self._closed:  # leaving memory: the redelivery will resume it from Redis
            yield Settle(delivery, ack=False)
            return
        if (rule_id, attempt) in self.retry_messages:  # a copy of a retry already under way
            yield Record(
                "stale_retry_dropped",
                {"attempt_id": self.attempt_id, "rule_id": rule_id, "attempt": attempt},
            )
            yield Settle(delivery)
            return
        self.retry_messages[(rule_id, attempt)] = delivery
        self._spawn(self._feed(self.core.retry_due, rule_id, attempt))

    def cancel(self) -> None:
        self._spawn(self._feed(self.core.cancel))

    def reinstate(self) -> Generator[Effect, Any, None]:
        """Redis lost what `begin` wrote (a failover): the heartbeat took the lease back,
        and the plan is written back, so that a resume can still find it."""
        restored = yield Store("reinstate", (self.attempt_id, self.core.plan))
        yield Record(
            "evaluation_reinstated", {"attempt_id": self.attempt_id, "plan_restored": restored}
        )

    def abandon(self, reason: str) -> Generator[Effect, Any, None]:
        """Drop the evaluation without touching its durable state; hand deliveries back."""
        if self._closed:
            return
        self._closed = True
        yield Record("evaluation_abandoned", {"attempt_id": self.attempt_id, "reason": reason})
        yield Log("warning", f"evaluation {self.attempt_id} abandoned: {reason}")
        held, self.retry_messages = list(self.retry_messages.values()), {}
        for delivery in held:
            yield Settle(delivery, ack=False)
        current = self.host.current()
        for task in list(self._tasks):
            if task is not current:
                self.host.cancel(task)
        self.leaving = True
        yield from release(self.attempt_id, self.worker_id)
        yield from self._on_done(self)

    # --- machinery ----------------------------------------------------------------------

    def _spawn(self, step: Step, caught: bool = False) -> None:
        """Run `step` as a task of this evaluation; `caught`: it catches its own errors as
        `_task` does (a rule's task: one generator less for each of its effects)."""
        task = self.host.spawn(step if caught else self._task(step), self._tasks.discard)
        if task is not None:
            self._tasks.add(task)

    def _task(self, step: Step) -> Step:
        """A task of this evaluation: one that fails leaves the evaluation (`abandon`)."""
        try:
            yield from step
        except Exception as exc:
            yield from self._failed(exc)

    def _failed(self, exc: Exception) -> Step:
        yield Log("error", f"evaluation {self.attempt_id}: {exc}", exc)
        if not self._closed:
            self._spawn(self.abandon(f"{type(exc).__name__}: {exc}"))

    def _feed(self, fn: Callable[..., list[Action]], *args: object, **kw: object) -> Step:
        waits = self._recording and self._lock.locked() and fn == self.core.retry_due
        if waits:  # a due retry behind another input's writes: recorded, as a slot wait
            due = {"attempt_id": self.attempt_id, "slot": "lock", "rule_id": args[0]}
            due["attempt"] = args[1]
            yield Record("slot_wait", due)
        yield Acquire(self._lock)
        if waits:
            yield Record("slot_granted", due)
        try:
            if self._closed:
                return
            actions = fn(*args, **kw)
            if self.retry_messages and self._recording:
                yield from self._note_slot_waits(actions)
            # Rules about to start for the first time in their attempt get a start marker
            # (to count reruns), written with the result that made them ready when there
            # is one, so a rule's durable bookkeeping stays within two round trips.
            self._starts = [
                (x.rule_id, x.attempt) for x in actions if isinstance(x, RunRule) and x.try_no == 1
            ]
            self._looked = False  # the evaluation state not read yet for these actions
            for action in actions:
                if self._closed:
                    return
                yield from self._execute(action)
            if self._over is not None and not self.core.finished:
                # The store says the evaluation is over (a cancel, seen before its
                # broadcast arrived): what the core does on a cancel, at once.
                yield Record("cancel_seen", {"attempt_id": self.attempt_id, "state": self._over})
                for action in self.core.cancel():
                    if self._closed:
                        return
                    yield from self._execute(action)
        finally:
            self._lock.release()

    def _note_slot_waits(self, actions: list[Action]) -> Step:
        """Record each held retry whose rule is due (pending) but not started by `actions`:
        the core found no free slot. Its `slot_granted` follows when its `RunRule` runs."""
        state = self.core.state
        started = {(x.rule_id, x.attempt) for x in actions if isinstance(x, RunRule)}
        for rule_id, attempt in self.retry_messages:
            key = (rule_id, attempt)
            if (
                key in self._slot_waiting
                or key in started
                or state.get(rule_id) is not RuleState.PENDING
                or self.core.attempt.get(rule_id) != attempt
            ):
                continue
            self._slot_waiting.add(key)
            running = {r: self.core.attempt[r] for r in self.core.rules_in(RuleState.RUNNING)}
            yield Record(
                "slot_wait",
                {
                    "attempt_id": self.attempt_id,
                    "slot": "rule",
                    "rule_id": rule_id,
                    "attempt": attempt,
                    "running": running,
                    "slots": self.core.max_parallel,
                },
            )

    def _look(self, over: str | None) -> None:
        """The state check that rode on a write: a terminal state stops every start."""
        self._looked = True
        if over is not None:
            self._over = over
            self._starts = []

    def _leased(self, sent: float) -> None:
        """A fenced write sent at `sent` landed, so the lease ran on from then at least."""
        self._lease_until = sent + self.config.stale_ms / 1000

    def _lease_short(self, now: float) -> bool:
        """Too little of the lease is known to be left to start a rule on it: the worker
        was paused or lagged since its last fenced write (the reply that allowed the starts
        may be seconds old), so the store is asked again, fenced, before any start."""
        return now > self._lease_until - self.config.heartbeat_ms / 1000

    def _gone(self) -> bool:
        """No call may start for this evaluation any more: the store said it is over, or it
        closed (a cancel's broadcast heard while a started rule waited for its first step)."""
        return self._over is not None or self._closed

    def _still_ours(self) -> Generator[Effect, Any, bool]:
        """Right before a call: a worker paused since the store last ran its lease on (the
        start was allowed seconds ago) asks again, fenced; a refusal raises `LeaseLost`."""
        while self._over is None and self._lease_short(sent := (yield MONO)):
            _, over = yield Store("mark_started", (self.attempt_id, [], self.fence))
            self._leased(sent)
            self._look(over)
        return not self._gone()

    def _mark_starts(self, counts: list[int]) -> None:
        for (rule_id, _), count in zip(self._starts, counts, strict=True):
            self._counted[rule_id] = count
        self._starts = []

    def _execute(self, action: Action) -> Step:
        a = self.attempt_id
        match action:
            case RunRule():
                if self._slot_waiting and (action.rule_id, action.attempt) in self._slot_waiting:
                    self._slot_waiting.discard((action.rule_id, action.attempt))
                    yield Record(
                        "slot_granted",
                        {
                            "attempt_id": a,
                            "slot": "rule",
                            "rule_id": action.rule_id,
                            "attempt": action.attempt,
                        },
                    )
                # Before any start, the store's word on a cancel: on the start markers'
                # round trip, or (a level-1 retry has none) a look at the state alone.
                sent = yield MONO
                if self._over is None and (
                    self._starts or not self._looked or self._lease_short(sent)
                ):
                    counts, over = yield Store("mark_started", (a, self._starts, self.fence))
                    self._leased(sent)
                    self._look(over)
                    self._mark_starts(counts)
                    if action.attempt > 1 and action.try_no == 1 and self._recording:
                        # a delayed retry's start waits for this write: how long, measured
                        yield Record(
                            "start_marked",
                            {
                                "attempt_id": a,
                                "rule_id": action.rule_id,
                                "attempt": action.attempt,
                                "write_ms": round(((yield MONO) - sent) * 1000, 3),
                            },
                        )
                if self._over is not None:
                    return  # the evaluation is over: this rule does not start
                if action.try_no == 1:
                    self._execution[action.rule_id] = self._counted.pop(action.rule_id, 1)
                execution = self._execution.get(action.rule_id, 1)
                self._spawn(self._run_rule(action, execution), caught=True)
            case PersistResult(rule_id=rule_id, result=result):
                sent = yield MONO
                sent_ms = (yield NOW) if self._recording else 0
                try:
                    existing, counts, over = yield Store(
                        "write_result", (a, result, self._starts, self.fence)
                    )
                except LeaseLost:
                    yield from self._refused("result", rule_id, sent_ms)
                    raise
                self._leased(sent)
                self._look(over)
                self._mark_starts(counts)
                if self._recording:
                    yield Record(
                        "result_persisted",
                        {
                            "attempt_id": a,
                            "rule_id": rule_id,
                            "attempt": result.attempt,
                            "verdict": result.verdict,
                            "score": result.score,
                            "won": existing is None,
                            "kept_verdict": None if existing is None else existing.verdict,
                            "fence": self.fence,
                            "landed": True,
                            "sent_ms": sent_ms,
                        },
                    )
                if existing is not None and not (yield from self._adopt(rule_id, existing)):
                    return
                if self._failpoints:
                    yield Failpoint("rule_after_write", rule_id, a)
            case PersistStatus():
                sent_ms = (yield NOW) if self._recording else 0
                try:
                    over = yield from module.persist_status(
                        self.config, a, action, self.fence, sent_ms
                    )
                except LeaseLost:
                    yield from self._refused("status", action.rule_id, sent_ms)
                    raise
                self._look(over)
            case ScheduleRetry():
                if self._over is not None:  # over: a retry would only be dropped
                    yield Record(
                        "retry_not_scheduled",
                        {
                            "attempt_id": a,
                            "rule_id": action.rule_id,
                            "attempt": action.attempt,
                            "state": self._over,
                        },
                    )
                else:
                    yield from module.schedule_retry(self.config, a, action)
            case AckRetry(rule_id=rule_id, attempt=attempt):
                delivery = self.retry_messages.pop((rule_id, attempt), None)
                if delivery is not None:
                    yield Settle(delivery)
                    yield Record(
                        "retry_acked", {"attempt_id": a, "rule_id": rule_id, "attempt": attempt}
                    )
            case SkipRules(rule_ids=rule_ids, because_of=because_of):
                yield Record(
                    "rules_skipped",
                    {"attempt_id": a, "rule_ids": list(rule_ids), "because_of": because_of},
                )
            case PublishPassResult():
                if self._failpoints:
                    yield Failpoint("before_pass_publish", None, a)
                rules = self.core.announced(action.rules)
                body = {
                    "attempt_id": a,
                    "pass_id": action.pass_id,
                    "outcome": action.outcome,
                    "rules": rules,
                }
                mark = Store("mark_pass_published", (a, action.pass_id, action.outcome, self.fence))
                yield from published_before(
                    self.host.outbox,
                    PublishEvent("evaluation.pass_result", body, f"{a}:pass:{action.pass_id}"),
                    mark,
                )
                sent_ms = (yield NOW) if self._recording else 0  # the flag's write, fenced
                try:
                    yield mark
                except LeaseLost:
                    yield from self._refused("pass", None, sent_ms)
                    raise
                self._passes[action.pass_id] = body
                if self._recording:
                    yield Record(
                        "pass_published",
                        {
                            "attempt_id": a,
                            "pass_id": action.pass_id,
                            "outcome": action.outcome,
                            "rules": rules,
                            "fence": self.fence,
                            "landed": True,
                            "sent_ms": sent_ms,
                        },
                    )
            case Recovered():
                yield Count("loaded", len(action.loaded))
                yield Record(
                    "recovered",
                    {
                        "attempt_id": a,
                        "loaded": list(action.loaded),
                        "retrying": dict(action.retrying),
                        "failed": list(action.failed),
                        "fresh": list(action.fresh),
                    },
                )
            case Park(waiting=waiting):
                if self._over is not None:
                    # The store said the evaluation is over (a status write's reply, in this
                    # batch): no park; the cancel the core hears next finishes it.
                    return
                sent_ms = (yield NOW) if self._recording else 0
                self.leaving = True
                if self._recording:  # sent: it may land though this process dies first
                    yield Record("parking", {"attempt_id": a, "sent_ms": sent_ms})
                try:
                    yield Store("park", (a, self.worker_id, self.fence, list(waiting)))
                except LeaseLost:
                    yield from self._refused("park", None, sent_ms)
                    raise
                if self._recording:  # with when the lease was let go: before the reply
                    yield Record(
                        "parked",
                        {
                            "attempt_id": a,
                            "waiting": dict(waiting),
                            "fence": self.fence,
                            "landed": True,
                            "sent_ms": sent_ms,
                        },
                    )
                # A retry that arrived while parking is handed back, not dropped: its
                # redelivery resumes the evaluation from Redis.
                yield from self._close(requeue_held=True)
            case Finish():
                yield from self._finish(action)

    def _run_rule(self, action: RunRule, execution: int) -> Step:
        """A rule's task. Its errors are caught here as `_task` catches them, and its
        sub-steps are written inline: every generator between the driver and an effect is
        resumed for each effect, and a rule yields about a dozen."""
        a = self.attempt_id
        try:
            rerun = action.try_no == 1 and execution > 1
            rule = self.core.plan.rules[action.rule_id]
            if self._failpoints:
                yield Failpoint("rule_before_call", rule.id, a)
            # `_still_ours`, its usual case (the lease long enough) without its generator;
            # a short lease leaves it to `_still_ours`, which reads the clock again.
            if self._gone():
                return
            if self._lease_short((yield MONO)) and not (yield from self._still_ours()):
                # a cancel the store told of, or the evaluation closed during the look
                # (`_still_ours` is False for nothing else; a lease lost raises): the core
                # hears it (a closed one's feed does nothing)
                yield from self._feed(_no_input)
                return
            if action.try_no > 1:
                yield _RETRIED_AT_ONCE
            if rerun:
                yield _RERUN
            if self._recording:
                yield Record(
                    "rule_started",
                    {
                        "attempt_id": a,
                        "rule_id": rule.id,
                        "attempt": action.attempt,
                        "try_no": action.try_no,
                        "rerun": rerun,
                        "execution": execution,
                    },
                )
            try:
                result = yield CallAgent(a, rule, action.attempt, action.try_no, execution)
            except AgentError as err:
                tokens = int(getattr(err, "tokens", 0) or 0)
                yield Count("tokens", tokens)
                if rerun:
                    yield Count("rerun_tokens", tokens)
                yield Count("calls", labels=(("outcome", err.kind),))
                yield Record(
                    "rule_failed",
                    {
                        "attempt_id": a,
                        "rule_id": rule.id,
                        "attempt": action.attempt,
                        "try_no": action.try_no,
                        "kind": err.kind,
                        "retryable": err.retryable,
                        "tokens": tokens,
                    },
                )
                if self._failpoints:
                    yield Failpoint("rule_after_call_failed", rule.id, a)
                yield from self._feed(
                    self.core.rule_failed, rule.id, err.kind, retryable=err.retryable
                )
                return
            yield Count("tokens", result.tokens)
            if rerun:
                yield Count("rerun_tokens", result.tokens)
            yield _CALLED_OK
            if self._recording:
                yield Record(
                    "rule_finished",
                    {
                        "attempt_id": a,
                        "rule_id": rule.id,
                        "attempt": action.attempt,
                        "try_no": action.try_no,
                        "verdict": result.verdict,
                        "score": result.score,
                        "tokens": result.tokens,
                    },
                )
            if self._failpoints:
                yield Failpoint("rule_after_call_before_write", rule.id, a)
            yield from self._feed(self.core.rule_succeeded, rule.id, result)
        except Exception as exc:
            yield from self._failed(exc)

    def _refused(self, write: str, rule_id: str | None, sent_ms: int) -> Step:
        """A write of this copy the fence refused (its lease is another's): recorded, so
        that the checker sees every write sent with the token it carried."""
        if self._recording:
            yield Record(
                "write_refused",
                {
                    "attempt_id": self.attempt_id,
                    "rule_id": rule_id,
                    "write": write,
                    "fence": self.fence,
                    "landed": False,
                    "sent_ms": sent_ms,
                },
            )

    def _adopt(self, rule_id: str, kept: RuleResult) -> Generator[Effect, Any, bool]:
        """Another write of `rule_id`'s result came first. Without the lease (this worker
        ran the rule after its lease lapsed: a frozen process) its view is stale: it steps
        aside before starting or announcing anything, and the owner carries on. With the
        lease (a retried script met its own write, or a late writer beat this one) the
        kept result is the rule's from now on, in the core and in what is announced.
        False when the evaluation was abandoned."""
        held = yield Store("renew", ({self.attempt_id: self.fence}, self.worker_id))
        if not held.get(self.attempt_id):
            yield from self.abandon(f"{rule_id}: another write of its result came first")
            return False
        self.core.result_kept(rule_id, kept)
        return True

    def _finish(self, action: Finish) -> Step:
        a = self.attempt_id
        if self._failpoints:
            yield Failpoint("before_final_write", None, a)
        sent_ms = (yield NOW) if self._recording else 0
        try:
            kept = yield from self._confirm_final(action)
        except LeaseLost:
            yield from self._refused("final", None, sent_ms)
            raise
        kept = self._other_end(kept, action)
        if self._failpoints:
            yield Failpoint("after_final_write", None, a)
        status = kept or action.status.value
        verdicts = self.core.announced(action.verdicts)
        terminal = Record(
            "evaluation_terminal",
            {
                "attempt_id": a,
                "status": status,
                "won": kept is None,
                "decided": action.status.value,  # the core's own decision (a cancel heard)
                "verdicts": verdicts,
                "fence": self.fence,
                "landed": True,
                "sent_ms": sent_ms,
            },
        )
        if kept is None:
            if self._recording:
                yield terminal
            yield Count("evaluations", labels=(("status", status),))
            # The terminal state is this copy's and durable: its announcement goes out even
            # if the lease is lost meanwhile (`abandon` cancels this task, not that one).
            announcing = self.host.spawn(self._announce(action, status, verdicts))
            if announcing is not None:
                yield Join(announcing)
            yield from self._close()
            return
        if action.status is not EvaluationStatus.CANCELLED:
            yield Log("info", f"evaluation {a} was already {kept}")
        # Over without this copy: out of the indexes and the lease given back before the
        # copy says it ended it (the runner reads the leases once every copy has: recorded
        # at the reply, a release still on the wire was read as a lease left behind).
        try:
            yield Store("unindex", (a,))
        except Exception:
            if self._recording:  # the store's reply to the final write is known all the same
                yield terminal
            raise
        self.leaving = True
        yield from release(a, self.worker_id)
        if self._recording:
            yield terminal
        yield from self._close()

    def _other_end(self, kept: str | None, action: Finish) -> str | None:
        """The end the final write found written by another (None: none, or this copy's
        own). A first write that landed while its reply was lost (a store stalled past the
        read timeout) is sent again by the client and finds its own end: the fence let
        this token through, and only the owner writes an end other than a cancel, so the
        announcement is still this copy's to make."""
        if kept == action.status.value and action.status is not EvaluationStatus.CANCELLED:
            return None
        return kept

    def _announce(self, action: Finish, status: str, verdicts: dict[str, str]) -> Step:
        a = self.attempt_id
        yield Failpoint("before_final_publish", None, a)
        held = yield from publish_completed(
            self.worker_id,
            a,
            status,
            verdicts,
            self._recording,
            self._let_go,
            self.host.outbox,
            written=self.host.outbox,  # the final state's transaction wrote it
        )
        for _ in range(3):
            if held is not False:
                break
            # A lossy Redis restart swallowed the final state after it was written: what
            # was announced is made durable again before the evaluation leaves.
            yield from self._confirm_final(action, again=True)
            held = yield Store("done", (a, self.worker_id))
        yield Failpoint("after_final_publish", None, a)

    def _confirm_final(self, action: Finish, again: bool = False) -> Step:
        """Write the final state once Redis holds every result and permanent failure the
        verdicts name (a Redis that lost acknowledged writes gets them back from memory,
        in the same round trip); return the terminal state kept instead, if any."""
        core, a = self.core, self.attempt_id
        results = {r: core.results[r] for r in action.verdicts if r in core.results}
        failed = [r for r in core.rules_in(RuleState.PERMANENTLY_FAILED) if r in action.verdicts]
        finish = Store("finish", (a, action.status.value, results, failed, self.fence))
        if self.host.outbox:  # announced by the transaction that writes it, if it wins
            status = action.status.value
            finish.event = completed_event(a, status, core.announced(action.verdicts))
        kept, restored = yield finish
        if restored or again:
            yield Record(
                "final_state_restored" if again else "results_restored",
                {"attempt_id": a, "rule_ids": restored, "status": kept or action.status.value},
            )
        if restored and kept is None and self._passes:
            yield from self._announce_passes_again()
        return kept

    def _announce_passes_again(self) -> Step:
        """The store lost acknowledged writes: the flags of the passes announced before may
        be gone with them, and where events are rows of the store (an outbox) the events
        too, before a consumer read them. Each is announced again, with its flag (consumers
        dedupe on the message id, as after any redelivery)."""
        a = self.attempt_id
        for pass_id, body in self._passes.items():
            mark = Store("mark_pass_published", (a, pass_id, body["outcome"], self.fence))
            yield from published_before(
                self.host.outbox,
                PublishEvent("evaluation.pass_result", body, f"{a}:pass:{pass_id}"),
                mark,
            )
            yield mark
        if self._recording:
            yield Record("passes_restored", {"attempt_id": a, "pass_ids": list(self._passes)})

    def _close(self, requeue_held: bool = False) -> Step:
        """Out of memory, the lease already let go by the caller's write (the final state,
        the park) or its `release` (a copy that found the evaluation over)."""
        if self._closed:
            return
        self._closed = True
        held, self.retry_messages = list(self.retry_messages.items()), {}
        for (rule_id, attempt), delivery in held:
            # Finished or cancelled: whatever retry is still held is stale.
            yield Settle(delivery, ack=not requeue_held)
            yield Record(
                "retry_requeued" if requeue_held else "stale_retry_dropped",
                {"attempt_id": self.attempt_id, "rule_id": rule_id, "attempt": attempt},
            )
        yield from self._on_done(self)

    def _let_go(self) -> None:
        self.leaving = True


def _no_input() -> list[Action]:
    """Nothing for the core: a feed for what `_feed` does after any input (a terminal state
    the store told of is heard as a cancel)."""
    return []


def release(attempt_id: str, worker_id: str) -> Step:
    """Give the lease back, if the store takes it: an evaluation leaves memory whether or not
    (a store that refuses now, Redis down or a write not replicated, lets the lease expire),
    so that no slot, delivery or hold is kept for an evaluation nobody runs any more."""
    try:
        yield Store("release", (attempt_id, worker_id))
    except Exception as exc:
        yield Log("warning", f"evaluation {attempt_id}: lease left to expire ({exc})")


def publish_completed(
    worker_id: str,
    attempt_id: str,
    status: str,
    verdicts: Mapping[str, str],
    recording: bool = True,
    letting_go: Callable[[], None] | None = None,
    outbox: bool = False,
    written: bool = False,
) -> Generator[Effect, Any, bool]:
    """Publish evaluation.completed for the final state, then flag it, unindex, release.

    A crash between the publish and the flag publishes it again on recovery: consumers
    dedupe on the message id (`{attemptId}:completed`). False when the final state was no
    longer in Redis to be flagged (a restart lost it): the caller restores it. On an outbox
    (`outbox`) the event rides the flag, unless the final state's own transaction wrote it
    (`written`).
    """
    event = completed_event(attempt_id, status, verdicts)
    if not outbox:
        yield event
    if letting_go is not None:  # `done` gives the lease back: no renewal after it
        letting_go()
    sent_ms = (yield NOW) if recording else 0
    held = yield Store("done", (attempt_id, worker_id), None if written or not outbox else event)
    if recording:  # with when the lease was let go: before the reply
        yield Record(
            "final_published", {"attempt_id": attempt_id, "status": status, "sent_ms": sent_ms}
        )
    return bool(held)


def completed_event(attempt_id: str, status: str, verdicts: Mapping[str, str]) -> PublishEvent:
    body = {"attempt_id": attempt_id, "status": status, "verdicts": dict(verdicts)}
    return PublishEvent("evaluation.completed", body, f"{attempt_id}:completed")
