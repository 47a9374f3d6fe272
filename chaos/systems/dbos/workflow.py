"""An evaluation as a DBOS workflow (one step an agent call) on PostgreSQL.

DBOS recovers a workflow by running its function again, each step that finished answering
from the database instead of running: the function must take the same path, which the
engine's core gives (`engine.core.Evaluation`: deterministic, no I/O) as long as it is fed
its inputs in the same order. Calls and durable sleeps (the delay tiers) run concurrently;
the answers are fed to the core in the order they came, and that order is made durable by
a step of its own (`picked`: the answers taken, by the order their calls started), so a
recovery feeds them in the same order, and no answer waits for a slower one started before
it. The price: one more row in the system database for each batch of answers taken.

The harness's history is written in the engine's vocabulary: the call's step records what
a worker's call does (`rule_started`, `rule_finished`, `rule_failed`, and for a delayed
retry its `delivered`: the sleep's end reaching the worker), the workflow what the shell
records of the core's actions (`result_persisted`, `status_written`, `retry_published`,
`pass_published`, `evaluation_terminal`...), only for the answers whose `picked` step ran
in this execution of the function, never for those a recovery replays (the execution that
took them recorded them). DBOS does not count a step's executions (a step has a row once it
finished, none when it starts): the worker counts them in files of the run's own (`--starts`),
as the engine's start markers do, so a call run again after a crash says it is a rerun.
DBOS recovers only its own executor's workflows, at launch: a worker slot keeps its executor
id across restarts (`chaos.systems.dbos.worker`), and another's are taken over only when an
operator asks DBOS's recovery for that executor id (`chaos.systems.dbos.live`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import os
import time
import uuid
from typing import Any

from dbos import DBOS, DBOSClient

from chaos.systems.core_workflow import (
    STOPPING,
    WRITES,
    Job,
    action_events,
    agent_of,
    failpoints,
    plan_of,
    record,
    record_unless_stopping,
)
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
#: The directory where the worker counts each step's executions (unset: each is the first).
STARTS_ENV = "CHAOS_DBOS_STARTS"
#: The evaluations this process runs now (what a stopping worker lets go of).
RUNNING: set[str] = set()


async def _unless_stopping() -> None:
    """Wait for the cancel of a stopping worker's `DBOS.destroy`, if it is stopping: from
    then on nothing begins here (a call or an evaluation waits to be cancelled with the
    rest, unrecorded; a step must not fail: its error would be its durable answer)."""
    if STOPPING[0]:
        await asyncio.Event().wait()


def _execution(key: str) -> int:
    """This call's execution: one more than the starts counted before it (a file a call,
    a byte a start, under a lock: two processes never count the same)."""
    where = os.environ.get(STARTS_ENV)
    if not where:
        return 1
    fd = os.open(os.path.join(where, key), os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b".")
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


@DBOS.step(name="call_rule")
async def call_rule(call: dict[str, Any]) -> dict[str, Any]:
    """The agent's call; its error is an answer (the core's to retry), not DBOS's."""
    await _unless_stopping()
    rule = plan_of(call["plan"]).rules[call["rule_id"]]
    rule_of = {"attempt_id": call["attempt_id"], "rule_id": rule.id, "attempt": call["attempt"]}
    try_no = call["try_no"]
    before = call.get("execution")  # a level-1 retry's: the execution of the try it retries
    execution = before or _execution(f"{call['attempt_id']}.{rule.id}.{call['attempt']}")
    # each recorded unless the worker began stopping since the look above (on the main
    # thread): then the step waits to be cancelled with the rest, unrecorded
    if call.get("published_ms") is not None and not record_unless_stopping(  # a delayed retry
        "delivered",
        **rule_of,
        kind="retry",
        redelivered=execution > 1,
        reason=None,
        published_ms=call["published_ms"],
        delay_ms=call["delay_ms"],
    ):
        await _unless_stopping()
    rerun = try_no == 1 and execution > 1
    if not record_unless_stopping(
        "rule_started", **rule_of, try_no=try_no, rerun=rerun, execution=execution
    ):
        await _unless_stopping()
    armed = failpoints()
    await armed.hit("rule_before_call", rule.id, call["attempt_id"])
    calls = os.environ.get(CALLS_ENV)
    if calls:
        with open(calls, "a") as log:
            log.write(f"{call['attempt_id']} {rule.id} {call['attempt']} {try_no}\n")
    try:
        agent = agent_of(call["agent"], call["time_scale"], call["immediate_retries"])
        result = await agent.evaluate(
            call["attempt_id"], rule, call["attempt"], try_no, execution=execution
        )
        record(
            "rule_finished",
            **rule_of,
            try_no=try_no,
            verdict=result.verdict,
            score=result.score,
            tokens=result.tokens,
        )
        await armed.hit("rule_after_call_before_write", rule.id, call["attempt_id"])
    except AgentError as err:
        tokens = int(getattr(err, "tokens", 0) or 0)
        record(
            "rule_failed",
            **rule_of,
            try_no=try_no,
            kind=err.kind,
            retryable=err.retryable,
            tokens=tokens,
        )
        return {
            "error": err.kind,
            "retryable": err.retryable,
            "tokens": tokens,
            "execution": execution,
        }
    return {"result": result.to_json(), "execution": execution}


@DBOS.step(name="picked")
async def picked(taken: list[int], execution: str) -> dict[str, Any]:
    """The answers taken next (by their place among those started), made durable: its row
    says which execution of the function took them (a recovery reads another's), and
    when (the delays set then count from it, in a recovery too)."""
    return {"taken": taken, "execution": execution, "at_ms": int(time.time() * 1000)}


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


class _Run:
    """One execution of the workflow's function: what it records, and only when the
    answers it carries out were taken by this execution."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.token = uuid.uuid4().hex  # this execution's, in the `picked` rows it writes
        self.now = False  # the answers being carried out were taken by this execution
        self.at_ms = 0  # ... when
        self.resumed = False  # this execution recovers one before it
        self.found: dict[str, Any] = {}  # what it said it recovered, last
        self.statuses: dict[str, str] = {}
        self.timers: dict[tuple[str, int], tuple[int, int]] = {}  # retry -> set at, delay
        self.fence = f"1:{job.attempt_id}"

    def record(self, ev: str, sent: bool = False, **fields: Any) -> None:
        """An event of the harness's history, if this execution took what it carries out;
        a write says it landed under the workflow's one fence (its id: DBOS runs one
        execution of it at a time)."""
        if not self.now:
            return
        if sent:
            fields["sent_ms"] = int(time.time() * 1000)
        if ev in WRITES:
            fields.update(fence=self.fence, landed=True)
        record(ev, attempt_id=self.job.attempt_id, **fields)

    def begin(self, plan_id: str, resumed: bool) -> None:
        self.resumed = resumed
        record(
            "evaluation_started",
            attempt_id=self.job.attempt_id,
            plan=plan_id,
            resumed=resumed,
            kind="execute",
            reason="stale_heartbeat" if resumed else "submit",
            fence=self.fence,
            lease_ms=0,
        )

    def recovered(self, core: Evaluation, retrying: dict[str, int]) -> None:
        """What a recovery found durable once it replayed what the execution before it
        took (that one may have died before recording it), as a worker of the engine
        says what it loaded when it resumes an evaluation."""
        states = {r: s.value for r, s in core.state.items()}
        found = {
            "loaded": sorted(core.results),
            "retrying": retrying,
            "failed": sorted(r for r, s in states.items() if s == "permanently_failed"),
            "fresh": [],
        }
        if found != self.found:  # said once, and again when it grew
            self.found = found
            record("recovered", attempt_id=self.job.attempt_id, **found)

    def took(self, row: dict[str, Any]) -> None:
        """The answers of a `picked` row are carried out next: recorded if this execution
        took them, their delays counted from when they were taken."""
        self.now = row["execution"] == self.token
        self.at_ms = int(row["at_ms"])

    def carry_out(self, action: Any) -> None:
        """What the engine's shell records of an action (PersistResult, PersistStatus,
        SkipRules, PublishPassResult, Finish; ScheduleRetry as its sleep's record)."""
        if isinstance(action, ScheduleRetry):
            delay_ms = round(action.delay_ms * self.job.time_scale)
            self.timers[(action.rule_id, action.attempt)] = (self.at_ms, delay_ms)
        for ev, sent, fields in action_events(action, self.at_ms, self.job.time_scale):
            if ev == "status_written":
                self.statuses[fields["rule_id"]] = fields["status"]
            self.record(ev, sent, **fields)


@DBOS.workflow(name="evaluation")
async def evaluation(data: dict[str, Any]) -> dict[str, Any]:
    """One evaluation: the core decides, the workflow carries its actions out."""
    job = Job(**data)
    run = _Run(job)
    RUNNING.add(job.attempt_id)
    try:
        return await _evaluate(job, run)
    finally:
        RUNNING.discard(job.attempt_id)


async def _evaluate(job: Job, run: _Run) -> dict[str, Any]:
    plan = plan_of(job.plan)
    policy = job.retry_policy()
    core = Evaluation(plan, job.attempt_id, policy, max_parallel=job.max_parallel)
    started: list[tuple[str, Any, asyncio.Task[Any]]] = []  # in the order started
    waiting: set[int] = set()  # places in `started` not taken yet
    answered: dict[str, dict[str, Any]] = {}  # rule -> the answer of its last try
    passes: dict[str, dict[str, Any]] = {}

    def due() -> dict[str, int]:
        """The delayed retries set and not come due yet: rule -> its attempt."""
        return {k[0]: k[1] for kind, k, _ in (started[i] for i in waiting) if kind == "due"}

    def start(kind: str, key: Any, work: Any) -> None:
        waiting.add(len(started))
        started.append((kind, key, asyncio.ensure_future(work)))

    def carry_out(actions: list[Any]) -> dict[str, Any] | None:
        """The core's actions carried out; the workflow's result once it finished."""
        for action in actions:
            if isinstance(action, RunRule):
                if run.resumed and not run.now:  # a call the recovery may run again: after
                    # what it found durable (the execution before may not have said it)
                    run.recovered(core, due())
                before = answered.get(action.rule_id) if action.try_no > 1 else None
                timer = run.timers.pop((action.rule_id, action.attempt), (None, None))
                call = {
                    "attempt_id": job.attempt_id,
                    "plan": job.plan,
                    "rule_id": action.rule_id,
                    "attempt": action.attempt,
                    "try_no": action.try_no,
                    "agent": job.agent,
                    "time_scale": job.time_scale,
                    "immediate_retries": policy.immediate_retries,
                    "published_ms": timer[0],
                    "delay_ms": timer[1],
                    "execution": None if before is None else before["execution"],
                }
                start("answer", action.rule_id, call_rule(call))
                continue
            run.carry_out(action)
            if isinstance(action, ScheduleRetry):
                seconds = action.delay_ms * job.time_scale / 1000.0
                start("due", (action.rule_id, action.attempt), DBOS.sleep_async(seconds))
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
                    "statuses": dict(run.statuses),
                }
            # AckRetry, Park, Recovered: nothing to carry out here
        return None

    run.took(await picked([], run.token))
    await _unless_stopping()
    run.begin(plan.id, resumed=not run.now)
    ended = carry_out(list(core.start()))
    while ended is None:
        await asyncio.wait([started[i][2] for i in waiting], return_when=asyncio.FIRST_COMPLETED)
        row = await picked(sorted(i for i in waiting if started[i][2].done()), run.token)
        replaying = not run.now
        run.took(row)
        if replaying and run.now:  # a recovery past what the execution before it took
            run.recovered(core, due())
        for i in row["taken"]:
            waiting.discard(i)
            kind, key, task = started[i]
            value = await task
            if kind == "due":
                ended = carry_out(list(core.retry_due(*key)))
            else:
                answered[key] = value
                if "result" in value:
                    result = RuleResult.from_json(value["result"])
                    ended = carry_out(list(core.rule_succeeded(key, result)))
                else:
                    failed = core.rule_failed(key, value["error"], retryable=value["retryable"])
                    ended = carry_out(list(failed))
            if ended is not None:
                break
    return ended
