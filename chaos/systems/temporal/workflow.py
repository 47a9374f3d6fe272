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
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from temporalio import activity, workflow
from temporalio.common import RetryPolicy as TemporalRetry

with workflow.unsafe.imports_passed_through():
    from chaos.systems.core_workflow import Job, agent_of, failpoints, plan_of
    from engine.agent import AgentError
    from engine.core.actions import (
        Finish,
        PublishPassResult,
        RunRule,
        ScheduleRetry,
        SkipRules,
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


@dataclass
class Answer:
    """An agent call's outcome: a result, or the agent's error as data."""

    result: str | None = None  # RuleResult.to_json()
    error: str | None = None
    retryable: bool = True
    tokens: int = 0


@dataclass
class Ended:
    """What the workflow returns: the evaluation's end, as the other designs announce it."""

    status: str
    announced: dict[str, str] = field(default_factory=dict)  # rule -> verdict or state
    states: dict[str, str] = field(default_factory=dict)
    results: dict[str, str] = field(default_factory=dict)  # rule -> RuleResult.to_json()
    passes: dict[str, dict[str, Any]] = field(default_factory=dict)


@activity.defn(name="call_rule")
async def call_rule(call: Call) -> Answer:
    """The agent's call, heartbeating while it runs; its execution is this activity's
    attempt (2 and more: a rerun after a worker died mid-call)."""
    rule = plan_of(call.plan).rules[call.rule_id]
    execution = activity.info().attempt

    async def beat() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(HEARTBEAT_TIMEOUT.total_seconds() / 4)

    beating = asyncio.ensure_future(beat())
    armed = failpoints()
    agent = agent_of(call.agent, call.time_scale, call.immediate_retries)
    try:
        await armed.hit("rule_before_call", rule.id, call.attempt_id)
        result = await agent.evaluate(
            call.attempt_id, rule, call.attempt, call.try_no, execution=execution
        )
        await armed.hit("rule_after_call_before_write", rule.id, call.attempt_id)
    except AgentError as err:
        tokens = int(getattr(err, "tokens", 0) or 0)
        return Answer(error=err.kind, retryable=err.retryable, tokens=tokens)
    finally:
        beating.cancel()
    return Answer(result=result.to_json(), tokens=result.tokens)


@workflow.defn(name="evaluation")
class EvaluationWorkflow:
    """One evaluation: the core decides, the workflow carries its actions out."""

    def __init__(self) -> None:
        self._inputs: list[tuple[str, Any]] = []
        self._cancel = False
        self._tasks: set[asyncio.Task[None]] = set()  # calls and timers under way

    @workflow.signal
    def cancel(self) -> None:
        self._cancel = True

    @workflow.run
    async def run(self, job: Job) -> Ended:
        plan = plan_of(job.plan)
        policy = job.retry_policy()
        core = Evaluation(plan, job.attempt_id, policy, max_parallel=job.max_parallel)
        passes: dict[str, dict[str, Any]] = {}
        pending = list(core.start())
        while True:
            for action in pending:
                if isinstance(action, RunRule):
                    self._call(job, policy, action)
                elif isinstance(action, ScheduleRetry):
                    self._later(action, job.time_scale)
                elif isinstance(action, PublishPassResult):
                    passes[action.pass_id] = {
                        "outcome": action.outcome,
                        "rules": dict(action.rules),
                    }
                elif isinstance(action, Finish):
                    return Ended(
                        status=str(action.status.value),
                        announced=dict(action.verdicts),
                        states={r: s.value for r, s in core.state.items()},
                        results={r: res.to_json() for r, res in core.results.items()},
                        passes=passes,
                    )
                elif isinstance(action, SkipRules):
                    pass  # the core's states say so; the end carries them
                # PersistResult / PersistStatus: the history holds the activity's answer;
                # AckRetry, Park, Recovered: nothing to carry out here.
            await workflow.wait_condition(lambda: bool(self._inputs) or self._cancel)
            if self._cancel and not core.finished:
                self._cancel = False
                pending = list(core.cancel())
                continue
            kind, value = self._inputs.pop(0)
            if kind == "answer":
                rule_id, answer = value
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
        call = Call(
            job.attempt_id,
            job.plan,
            action.rule_id,
            action.attempt,
            action.try_no,
            job.agent,
            job.time_scale,
            policy.immediate_retries,
        )

        async def run() -> None:
            answer = await workflow.execute_activity(
                call_rule,
                call,
                start_to_close_timeout=timedelta(hours=1),
                heartbeat_timeout=HEARTBEAT_TIMEOUT,
                retry_policy=WORKER_DEATH_RETRY,
            )
            self._inputs.append(("answer", (action.rule_id, answer)))

        self._keep(asyncio.ensure_future(run()))

    def _later(self, action: ScheduleRetry, time_scale: float) -> None:
        """A delay tier as a durable timer: it outlives the worker and the server."""

        async def run() -> None:
            await workflow.sleep(action.delay_ms * time_scale / 1000.0)
            self._inputs.append(("due", (action.rule_id, action.attempt)))

        self._keep(asyncio.ensure_future(run()))

    def _keep(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
