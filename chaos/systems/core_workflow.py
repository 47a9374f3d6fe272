"""What the peers that run the engine's core as their own workflow share (`temporal`,
`dbos`): the job an evaluation starts with, and their worker processes.

A job is plain data (the workflow engines keep it in their histories): the plan as its file
spells it, the retry numbers, the fake agent's profile and the time scale, from which the
workflow rebuilds the same `engine.core.Evaluation` on every replay. A worker process
builds each plan and agent once (`plan_of`, `agent_of`) and arms the engine's failpoints
from `ENGINE_FAILPOINTS` as the engine's workers do (`failpoints`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.stack import MARKER_ENV, OWNER_ENV, owner_token
from engine.agent import AgentProfile, FakeAgent
from engine.core.actions import (
    Finish,
    PersistResult,
    PersistStatus,
    PublishPassResult,
    ScheduleRetry,
    SkipRules,
)
from engine.failpoints import Failpoints, fired_fields, released_fields
from engine.history import History, open_history
from engine.plan import Plan, plan_from_dict
from engine.policy import RetryPolicy

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Job:
    """What a workflow is started with."""

    attempt_id: str
    plan: dict[str, Any]
    policy: dict[str, Any]
    agent: dict[str, Any]
    time_scale: float
    max_parallel: int = 4

    @classmethod
    def of(
        cls,
        attempt_id: str,
        plan: Plan,
        policy: RetryPolicy,
        agent: dict[str, Any],
        time_scale: float,
        max_parallel: int = 4,
    ) -> Job:
        numbers = {
            "immediate_retries": policy.immediate_retries,
            "max_attempts": policy.max_attempts,
            "tiers_ms": list(policy.tiers_ms),
            "jitter": policy.jitter,
            "jitter_buckets": policy.jitter_buckets,
            "seed": policy.seed,
        }
        return cls(attempt_id, plan.to_dict(), numbers, agent, time_scale, max_parallel)

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(**{**self.policy, "tiers_ms": tuple(self.policy["tiers_ms"])})


@dataclass
class Ended:
    """What a workflow returns: the evaluation's end, as the other designs announce it."""

    status: str
    announced: dict[str, str] = field(default_factory=dict)  # rule -> verdict or state
    states: dict[str, str] = field(default_factory=dict)
    results: dict[str, str] = field(default_factory=dict)  # rule -> RuleResult.to_json()
    passes: dict[str, dict[str, Any]] = field(default_factory=dict)
    statuses: dict[str, str] = field(default_factory=dict)  # rule -> the last status written


#: Whether this process's worker is stopping (set by the worker). Here, not in a design's
#: workflow module: Temporal's sandbox imports a workflow module afresh for its workflows
#: (their copy of a flag of its own would stay False), and passes this one through.
STOPPING: list[bool] = [False]

_plans: dict[str, Plan] = {}
_history: list[History] = [History()]
_recording = threading.Lock()
_agents: dict[str, FakeAgent] = {}
_failpoints: list[Failpoints] = []


def plan_of(data: dict[str, Any]) -> Plan:
    """The plan a job carries, built once a process."""
    key = repr(data)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = plan_from_dict(data)
    return plan


def agent_of(profile: dict[str, Any], time_scale: float, immediate_retries: int) -> FakeAgent:
    """One fake agent a profile in a process: its draws depend on nothing else."""
    key = repr((sorted(profile.items()), time_scale, immediate_retries))
    agent = _agents.get(key)
    if agent is None:
        agent = _agents[key] = FakeAgent(
            AgentProfile.from_dict(profile), time_scale, salt=0, immediate_retries=immediate_retries
        )
    return agent


def failpoints() -> Failpoints:
    """The engine's failpoints these designs have, armed from `ENGINE_FAILPOINTS` at the
    first call (never at import: Temporal's workflow sandbox imports its modules too), each
    firing recorded in the history as the engine's workers record it: `rule_before_call`,
    and `rule_after_call_before_write` while the answer is not durable yet (the activity's
    completion, the step's output, not recorded: the write window)."""
    if not _failpoints:
        armed = Failpoints.from_env()
        armed.on_crash = lambda name, rule, attempt_id: record(
            "crash", failpoint=name, rule=rule, attempt_id=attempt_id
        )
        armed.on_fire = lambda fp, rule, attempt_id: record(
            "failpoint_fired", **fired_fields(fp, rule, attempt_id)
        )
        armed.on_release = lambda fp, rule, attempt_id, came: record(
            "failpoint_released", **released_fields(fp, rule, attempt_id, came)
        )
        path = getattr(_history[0], "path", None)
        armed.history_path = None if path is None else str(path)
        _failpoints.append(armed)
    return _failpoints[0]


def open_recorder(path: str | None, source: str) -> History:
    """The process's history (`--history`, in the engine's vocabulary), opened once by the
    worker's main; until then, and without a path, events are discarded."""
    _history[0] = open_history(path, source)
    return _history[0]


def record(ev: str, **fields: Any) -> None:
    """One event of this worker's history (the same file, and lines, as the engine's),
    under a lock: Temporal runs workflow tasks on threads of their own, next to the
    activities on the event loop, and each event's `seq` must be its own."""
    with _recording:
        _history[0].record(ev, **fields)


def record_unless_stopping(ev: str, **fields: Any) -> bool:
    """`record`, unless the worker is stopping (False: nothing recorded). Checked under the
    lock `stopping` takes: a step that looked before the stop on one thread would
    otherwise record what it takes after the stop's `worker_stopping`, on another."""
    with _recording:
        if STOPPING[0]:
            return False
        _history[0].record(ev, **fields)
        return True


def stopping() -> None:
    """The worker begins stopping: `STOPPING` set and `worker_stopping` recorded at once."""
    with _recording:
        STOPPING[0] = True
        _history[0].record("worker_stopping")


#: The events that are writes of the workflow's (the caller adds who wrote: its fence).
WRITES = ("result_persisted", "status_written", "evaluation_terminal", "pass_published")


def action_events(action: Any, now_ms: int, time_scale: float) -> list[tuple[str, bool, dict]]:
    """What the engine's shell records of one of the core's actions, as (event, whether it
    is a write sent now, its fields): a persisted result, a status, a delayed retry set, the
    rules skipped, a pass, and the end with its announcement (the workflow's result is
    the announcement: the client waiting for it is the events' consumer). `now_ms`: when
    the workflow carried it out, a retry's due time counts from it."""
    if isinstance(action, PersistResult):
        result = action.result
        fields = {"rule_id": action.rule_id, "attempt": result.attempt, "verdict": result.verdict}
        return [
            (
                "result_persisted",
                True,
                {**fields, "score": result.score, "won": True, "kept_verdict": None},
            )
        ]
    if isinstance(action, PersistStatus):
        due = None
        if action.retry_due_in_ms is not None:
            due = now_ms + round(action.retry_due_in_ms * time_scale)
        fields = {"rule_id": action.rule_id, "status": action.status, "kept": None}
        return [("status_written", True, {**fields, "error": action.error, "due_ms": due})]
    if isinstance(action, ScheduleRetry):
        fields = {"rule_id": action.rule_id, "attempt": action.attempt, "tier": action.tier + 1}
        fields.update(bucket=action.bucket, delay_ms=round(action.delay_ms * time_scale))
        return [("retry_published", False, fields)]
    if isinstance(action, SkipRules):
        fields = {"rule_ids": list(action.rule_ids), "because_of": action.because_of}
        return [("rules_skipped", False, fields)]
    if isinstance(action, PublishPassResult):
        fields = {"pass_id": action.pass_id, "outcome": action.outcome, "rules": dict(action.rules)}
        return [("pass_published", True, fields)]
    if isinstance(action, Finish):
        status = str(action.status.value)
        end = {"status": status, "won": True, "decided": status, "verdicts": dict(action.verdicts)}
        return [("evaluation_terminal", True, end), ("final_published", True, {"status": status})]
    return []


class ReadyProcess:
    """A worker process (`python -m MODULE ARGS`) in a session of its own, waited for by the
    line it prints once it serves (not for time); `kill` SIGKILLs its whole group. It
    carries the stack's owner mark, so `chaos clean` reaps it if its starter dies."""

    def __init__(
        self, module: str, args: list[str], ready_line: str, env: dict[str, str] | None = None
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={
                **os.environ,
                MARKER_ENV: uuid.uuid4().hex,
                OWNER_ENV: owner_token(),
                **(env or {}),
            },
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # blocks until it serves, or it died
        if ready_line not in line:
            self.kill()
            raise RuntimeError(f"{module} did not start (exit {self.proc.returncode}): {line!r}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
