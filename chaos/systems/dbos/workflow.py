"""An evaluation as a DBOS workflow (one step an agent call) on PostgreSQL.

DBOS recovers a workflow by running its function again, each step that finished answering
from the database instead of running: the function must take the same path, which the
engine's core gives (`engine.core.Evaluation`: deterministic, no I/O) as long as it is fed
its inputs in the same order. Calls run concurrently, but their answers (and retries coming
due, durable sleeps) are fed to the core in the order the calls and timers were started,
never in the order they finish: a replay answers at once, the first run did not. The price:
an answer waits for those started before it (a retry's timer holds back the answers of the
calls started after it). DBOS recovers only its own executor's workflows, at launch: a
worker slot keeps its executor id across restarts (`chaos.systems.dbos.worker`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections import deque
from typing import Any

from dbos import DBOS, DBOSClient

from chaos.systems.core_workflow import Job, agent_of, failpoints, plan_of
from engine.agent import AgentError
from engine.core.actions import Finish, PublishPassResult, RunRule, ScheduleRetry
from engine.core.evaluation import Evaluation
from engine.core.results import RuleResult

#: The queue the harness enqueues evaluations on (`DBOSClient.enqueue`).
QUEUE_NAME = "evaluations"
#: Evaluations one worker runs at once.
WORKER_CONCURRENCY = 64
#: The application's name and version, fixed: recovery resumes only the workflows of the
#: running version, and a client enqueues for this one.
APP_NAME = "chaos-evaluations"
APP_VERSION = "1"
#: Where each agent call appends a line "attempt_id rule_id attempt try_no" (a test counts
#: executions with it; unset: nothing is written).
CALLS_ENV = "CHAOS_DBOS_CALLS"


@DBOS.step(name="call_rule")
async def call_rule(call: dict[str, Any]) -> dict[str, Any]:
    """The agent's call; its error is an answer (the core's to retry), not DBOS's."""
    rule = plan_of(call["plan"]).rules[call["rule_id"]]
    armed = failpoints()
    await armed.hit("rule_before_call", rule.id, call["attempt_id"])
    calls = os.environ.get(CALLS_ENV)
    if calls:
        with open(calls, "a") as log:
            log.write(f"{call['attempt_id']} {rule.id} {call['attempt']} {call['try_no']}\n")
    try:
        agent = agent_of(call["agent"], call["time_scale"], call["immediate_retries"])
        result = await agent.evaluate(call["attempt_id"], rule, call["attempt"], call["try_no"])
        await armed.hit("rule_after_call_before_write", rule.id, call["attempt_id"])
    except AgentError as err:
        tokens = int(getattr(err, "tokens", 0) or 0)
        return {"error": err.kind, "retryable": err.retryable, "tokens": tokens}
    return {"result": result.to_json()}


def enqueue(client: DBOSClient, job: Job) -> Any:
    """Submit: the evaluation enqueued for this version's workers, its attemptId the
    workflow's id (so a second enqueue of it is the same workflow)."""
    options: Any = {
        "workflow_name": "evaluation",
        "queue_name": QUEUE_NAME,
        "workflow_id": job.attempt_id,
        "app_version": APP_VERSION,
    }
    return client.enqueue(options, dataclasses.asdict(job))


@DBOS.workflow(name="evaluation")
async def evaluation(data: dict[str, Any]) -> dict[str, Any]:
    """One evaluation: the core decides, the workflow carries its actions out."""
    job = Job(**data)
    plan = plan_of(job.plan)
    policy = job.retry_policy()
    core = Evaluation(plan, job.attempt_id, policy, max_parallel=job.max_parallel)
    started: deque[tuple[str, Any, asyncio.Task[Any]]] = deque()  # in the order started
    passes: dict[str, dict[str, Any]] = {}
    actions = list(core.start())
    while True:
        for action in actions:
            if isinstance(action, RunRule):
                call = {
                    "attempt_id": job.attempt_id,
                    "plan": job.plan,
                    "rule_id": action.rule_id,
                    "attempt": action.attempt,
                    "try_no": action.try_no,
                    "agent": job.agent,
                    "time_scale": job.time_scale,
                    "immediate_retries": policy.immediate_retries,
                }
                task = asyncio.ensure_future(call_rule(call))
                started.append(("answer", action.rule_id, task))
            elif isinstance(action, ScheduleRetry):
                seconds = action.delay_ms * job.time_scale / 1000.0
                task = asyncio.ensure_future(DBOS.sleep_async(seconds))
                started.append(("due", (action.rule_id, action.attempt), task))
            elif isinstance(action, PublishPassResult):
                passes[action.pass_id] = {"outcome": action.outcome, "rules": dict(action.rules)}
            elif isinstance(action, Finish):
                for _, _, task in started:  # calls a cancel or a failure left: not awaited
                    task.cancel()
                return {
                    "status": str(action.status.value),
                    "announced": dict(action.verdicts),
                    "states": {r: s.value for r, s in core.state.items()},
                    "results": {r: res.to_json() for r, res in core.results.items()},
                    "passes": passes,
                }
            # PersistResult / PersistStatus: the step's output row is the durable result;
            # AckRetry, Park, Recovered, SkipRules: nothing to carry out here
        kind, key, task = started.popleft()
        value = await task
        if kind == "due":
            actions = list(core.retry_due(*key))
        elif "result" in value:
            actions = list(core.rule_succeeded(key, RuleResult.from_json(value["result"])))
        else:
            actions = list(core.rule_failed(key, value["error"], retryable=value["retryable"]))
