"""An evaluation as a Temporal workflow whose body is the engine's own decision core.

`engine.core.Evaluation` is deterministic and does no I/O, which is what a workflow's replay
asks: the workflow feeds it the same inputs as the other shells (agent outcomes, retries
coming due, a cancel) and carries out its actions the Temporal way. Each agent call is an
activity with a heartbeat; the delay tiers are durable timers; levels 1 to 3 are the core's
(an agent error is an answer the activity returns, never an error Temporal would retry),
and what Temporal retries is a worker's death: the activity's next attempt is the rerun,
and its attempt number the agent's `execution`, as a redelivery's is on the other designs.
Results need no write of their own: an activity's completion is in the workflow's history,
which is this design's durable memory.

The harness's history is written in the engine's vocabulary: the activity records what a
worker's call does (`rule_started`, `rule_finished`, `rule_failed`, and for a delayed
retry its `delivered`: the timer's task reaching a worker), the workflow what the shell
records of the core's actions (`result_persisted` once the activity's completion is in the
workflow's history, `status_written`, `retry_published`, `pass_published`,
`evaluation_terminal`...), never while it replays: a replay re-runs the code, not the
events.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from temporalio import activity, workflow
from temporalio.common import RetryPolicy as TemporalRetry
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from chaos.systems.core_workflow import (
        STOPPING,
        WRITES,
        Ended,
        Job,
        action_events,
        agent_of,
        failpoints,
        plan_of,
        record,
    )
    from engine.agent import AgentError
    from engine.core.actions import (
        Finish,
        PublishPassResult,
        RunRule,
        ScheduleRetry,
    )
    from engine.core.evaluation import Evaluation
    from engine.core.results import RuleResult
    from engine.policy import RetryPolicy

#: The task queue the harness's workers poll.
TASK_QUEUE = "evaluations"
#: A call that stops heartbeating for this long is taken to have died with its worker.
HEARTBEAT_TIMEOUT = timedelta(seconds=1)
#: What Temporal retries: the activity after a worker's death (or a timeout), at once and
#: without end; an agent's errors never reach it (see `call_rule`).
WORKER_DEATH_RETRY = TemporalRetry(
    initial_interval=timedelta(milliseconds=100), backoff_coefficient=1.0, maximum_attempts=0
)
#: How long a level-1 retry waits for the worker of the try it retries (on that worker's own
#: task queue: level 1 is immediate, in the same process, as the engine's) before it runs
#: on any worker: that one died.
SAME_WORKER_WAIT = timedelta(seconds=2)
#: This process's own task queue (set by the worker; None: it has none).
OWN_QUEUE: list[str | None] = [None]


@dataclass
class Call:
    """One agent call (an activity's input)."""

    attempt_id: str
    plan: dict[str, Any]
    rule_id: str
    attempt: int
    try_no: int
    agent: dict[str, Any]
    time_scale: float
    immediate_retries: int
    published_ms: int | None = None  # a delayed retry's: when its timer was set
    delay_ms: int | None = None  # ... and for how long
    execution: int | None = None  # a level-1 retry's: the execution of the try it retries


@dataclass
class Answer:
    """An agent call's outcome: a result, or the agent's error as data."""

    result: str | None = None  # RuleResult.to_json()
    error: str | None = None
    retryable: bool = True
    tokens: int = 0
    execution: int = 1
    worker_queue: str | None = None  # the task queue of the worker that answered alone


@activity.defn(name="call_rule")
async def call_rule(call: Call) -> Answer:
    """The agent's call, heartbeating while it runs; a first try's execution is this
    activity's attempt (2 and more: a rerun after a worker died mid-call), a level-1
    retry's that of the try it retries."""
    if STOPPING[0]:  # polled before the stop began: handed back, never begun
        raise RuntimeError("worker stopping: the call goes to another worker")
    rule = plan_of(call.plan).rules[call.rule_id]
    execution = call.execution or activity.info().attempt

    async def beat() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(HEARTBEAT_TIMEOUT.total_seconds() / 4)

    beating = asyncio.ensure_future(beat())
    armed = failpoints()
    agent = agent_of(call.agent, call.time_scale, call.immediate_retries)
    rule_of = {"attempt_id": call.attempt_id, "rule_id": rule.id, "attempt": call.attempt}
    if call.published_ms is not None:  # a delayed retry, reaching a worker
        record(
            "delivered",
            **rule_of,
            kind="retry",
            redelivered=execution > 1,
            reason=None,
            published_ms=call.published_ms,
            delay_ms=call.delay_ms,
        )
    rerun = call.try_no == 1 and execution > 1
    record("rule_started", **rule_of, try_no=call.try_no, rerun=rerun, execution=execution)
    try:
        await armed.hit("rule_before_call", rule.id, call.attempt_id)
        result = await agent.evaluate(
            call.attempt_id, rule, call.attempt, call.try_no, execution=execution
        )
        record(
            "rule_finished",
            **rule_of,
            try_no=call.try_no,
            verdict=result.verdict,
            score=result.score,
            tokens=result.tokens,
        )
        await armed.hit("rule_after_call_before_write", rule.id, call.attempt_id)
    except AgentError as err:
        tokens = int(getattr(err, "tokens", 0) or 0)
        record(
            "rule_failed",
            **rule_of,
            try_no=call.try_no,
            kind=err.kind,
            retryable=err.retryable,
            tokens=tokens,
        )
        here = {"execution": execution, "worker_queue": OWN_QUEUE[0]}
        return Answer(error=err.kind, retryable=err.retryable, tokens=tokens, **here)
    finally:
        beating.cancel()
    here = {"execution": execution, "worker_queue": OWN_QUEUE[0]}
    return Answer(result=result.to_json(), tokens=result.tokens, **here)


@workflow.defn(name="evaluation")
class EvaluationWorkflow:
    """One evaluation: the core decides, the workflow carries its actions out."""

    def __init__(self) -> None:
        self._inputs: list[tuple[str, Any]] = []
        self._cancel = False
        self._tasks: set[asyncio.Task[None]] = set()  # calls and timers under way
        self._timers: dict[tuple[str, int], tuple[int, int]] = {}  # retry -> set at, delay
        self._attempt_id = self._plan_id = ""
        self._fence = ""
        self._statuses: dict[str, str] = {}
        self._begun = False  # this worker recorded its begin of the evaluation
        self._answered: dict[str, Answer] = {}  # rule -> the answer of its last try

    @workflow.signal
    def cancel(self) -> None:
        self._cancel = True

    def _now_ms(self) -> int:
        return int(workflow.now().timestamp() * 1000)

    def _record(self, ev: str, sent: bool = False, **fields: Any) -> None:
        """An event of the harness's history, written when the code runs for the first
        time, never on a replay (its events were written by the worker that ran it). A
        worker that took the workflow over (its first owner died, or the cache dropped it)
        replays the history first, then says it began the evaluation, as a worker of the
        engine resuming a stale one does. `sent`: a write's, sent now by the wall clock (the
        workflow's own clock is its task's start)."""
        if workflow.unsafe.is_replaying():
            return
        with workflow.unsafe.sandbox_unrestricted():
            if not self._begun and ev != "evaluation_started":
                self._begin(resumed=True)
            if sent:
                fields["sent_ms"] = int(time.time() * 1000)
            record(ev, attempt_id=self._attempt_id, **fields)

    def _begin(self, resumed: bool) -> None:
        self._begun = True
        record(
            "evaluation_started",
            attempt_id=self._attempt_id,
            plan=self._plan_id,
            resumed=resumed,
            kind="execute",
            reason="stale_heartbeat" if resumed else "submit",
            fence=self._fence,
            lease_ms=0,
        )

    def _let_go(self) -> None:
        """The SDK evicts the workflow from this worker's cache (its tasks cancelled, under
        replay): the server gave it to another worker (this one was cut off or stalled past
        the sticky queue's timeout), or this worker is stopping. Said as the engine's
        workers say they dropped an evaluation, if this worker had said it began it."""
        if self._begun:
            self._begun = False
            why = "worker stopping" if STOPPING[0] else "lease lost"
            with workflow.unsafe.sandbox_unrestricted():
                record("evaluation_abandoned", attempt_id=self._attempt_id, reason=why)

    def _written(self) -> dict[str, Any]:
        """What a write carries in the engine's vocabulary: the workflow's run is the one
        writer (a stale worker's task completion is the server's to refuse)."""
        return {"fence": self._fence, "landed": True}

    @workflow.run
    async def run(self, job: Job) -> Ended:
        plan = plan_of(job.plan)
        policy = job.retry_policy()
        core = Evaluation(plan, job.attempt_id, policy, max_parallel=job.max_parallel)
        self._attempt_id, self._plan_id = job.attempt_id, plan.id
        self._fence = f"1:{workflow.info().run_id}"
        if not workflow.unsafe.is_replaying():
            with workflow.unsafe.sandbox_unrestricted():
                self._begin(resumed=False)
        passes: dict[str, dict[str, Any]] = {}
        pending = list(core.start())
        while True:
            for action in pending:
                if isinstance(action, RunRule):
                    self._call(job, policy, action)
                    continue
                for ev, sent, fields in action_events(action, self._now_ms(), job.time_scale):
                    if ev == "status_written":
                        self._statuses[fields["rule_id"]] = fields["status"]
                    written = self._written() if ev in WRITES else {}
                    self._record(ev, sent=sent, **fields, **written)
                if isinstance(action, ScheduleRetry):
                    self._later(action, job.time_scale)
                elif isinstance(action, PublishPassResult):
                    rules = dict(action.rules)
                    passes[action.pass_id] = {"outcome": action.outcome, "rules": rules}
                elif isinstance(action, Finish):
                    return Ended(
                        status=str(action.status.value),
                        announced=dict(action.verdicts),
                        states={r: s.value for r, s in core.state.items()},
                        results={r: res.to_json() for r, res in core.results.items()},
                        passes=passes,
                        statuses=dict(self._statuses),
                    )
                # AckRetry, Park, Recovered: nothing to carry out (a fired timer has no
                # message to acknowledge; nothing is ever parked or recovered here)
            try:
                await workflow.wait_condition(lambda: bool(self._inputs) or self._cancel)
            except asyncio.CancelledError:  # evicted from this worker's cache: let go
                self._let_go()
                raise
            if self._cancel and not core.finished:
                self._cancel = False
                pending = list(core.cancel())
                continue
            kind, value = self._inputs.pop(0)
            if kind == "answer":
                rule_id, answer = value
                self._answered[rule_id] = answer
                if answer.result is not None:
                    result = RuleResult.from_json(answer.result)
                    pending = list(core.rule_succeeded(rule_id, result))
                else:
                    pending = list(
                        core.rule_failed(rule_id, answer.error, retryable=answer.retryable)
                    )
            else:
                rule_id, attempt = value
                pending = list(core.retry_due(rule_id, attempt))

    def _call(self, job: Job, policy: RetryPolicy, action: RunRule) -> None:
        timer = self._timers.pop((action.rule_id, action.attempt), None)
        before = self._answered.get(action.rule_id) if action.try_no > 1 else None
        call = Call(
            job.attempt_id,
            job.plan,
            action.rule_id,
            action.attempt,
            action.try_no,
            job.agent,
            job.time_scale,
            policy.immediate_retries,
            *(timer or (None, None)),
            execution=None if before is None else before.execution,
        )

        async def run() -> None:
            options: dict[str, Any] = {
                "start_to_close_timeout": timedelta(hours=1),
                "heartbeat_timeout": HEARTBEAT_TIMEOUT,
                "retry_policy": WORKER_DEATH_RETRY,
            }
            answer = None
            if before is not None and before.worker_queue is not None:
                with contextlib.suppress(ActivityError):  # that worker is gone
                    answer = await workflow.execute_activity(
                        call_rule,
                        call,
                        task_queue=before.worker_queue,
                        schedule_to_start_timeout=SAME_WORKER_WAIT,
                        **options,
                    )
            if answer is None:
                answer = await workflow.execute_activity(call_rule, call, **options)
            self._inputs.append(("answer", (action.rule_id, answer)))

        self._keep(asyncio.ensure_future(run()))

    def _later(self, action: ScheduleRetry, time_scale: float) -> None:
        """A delay tier as a durable timer: it outlives the worker and the server (its
        `retry_published` is recorded with the core's other actions)."""
        delay_ms = round(action.delay_ms * time_scale)
        self._timers[(action.rule_id, action.attempt)] = (self._now_ms(), delay_ms)

        async def run() -> None:
            await workflow.sleep(delay_ms / 1000.0)
            self._inputs.append(("due", (action.rule_id, action.attempt)))

        self._keep(asyncio.ensure_future(run()))

    def _keep(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
