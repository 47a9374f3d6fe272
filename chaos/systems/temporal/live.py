"""`temporal` live: an evaluation as a Temporal workflow whose body is the engine's core.

What the runner asks of this design: each worker is `python -m chaos.systems.temporal.worker`
polling the run's own task queue (its namespace) through a proxy of its own (the link
`temporal`, the worker's gRPC connection to the server), writing the engine's history
vocabulary (`chaos.systems.temporal.workflow`); the run's dev server is killed, stopped,
paused and brought back on its own file; the runner's client starts one workflow per
evaluation, and its wait for each workflow's result is the events' consumer (the result
is the evaluation's announcement: `completed_received`, and a `pass_received` per pass);
the final state is read from the workflows' results.

What is the engine's and not this design's is refused before anything starts, in one line:
a service other than the server, a cancel (a signal, not a durable state write: the
activities already scheduled still start), a resume from a checkpoint, poison messages
(there is no work queue to poison), the failpoints other than the two an activity has. Of
the engine's settings, `max_parallel` is the workflow's (the core's); the rest (leases,
heartbeats, the sweeper, the prefetch) name mechanisms Temporal does not have: its own are
the activity's heartbeat timeout and the sticky queue's schedule-to-start timeout, 1 s
each (`HEARTBEAT_TIMEOUT`, `worker.serve`), and the server's timer shift, 10 ms, and its
queues' poll rate, 1000 a second (`server.DYNAMIC_CONFIG`), said in the run's journal
(`extra.design_settings`).
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from chaos import acts
from chaos.links import Network
from chaos.scenario import LoadedScenario
from chaos.systems import workflow_engine
from chaos.systems.core_workflow import Ended
from chaos.systems.temporal.mutants import MUTANTS
from chaos.systems.temporal.server import DYNAMIC_CONFIG
from chaos.systems.temporal.services import TemporalServices
from chaos.systems.workflow_engine import WorkflowEngineLive
from chaos.workers import WorkerProcess

if TYPE_CHECKING:
    from temporalio.client import Client, WorkflowHandle

    from chaos.runner import ScenarioRun

#: How long the client waits for the server when it reads or starts (seconds).
RPC_TIMEOUT_S = 5.0

#: How long a workflow task a worker took may run before the server gives it to another:
#: the SDK's default, 10 s, added itself to the recovery after a kill that caught a task
#: under way (p99 9.95 s in `chaos compare --designs durable`, against 1.3 to 2.2 s for
#: the engine's designs); a task replaying a long history on a busy machine takes well
#: under 2 s.
WORKFLOW_TASK_TIMEOUT = timedelta(seconds=2)
#: The settings that decide how fast this design recovers (the report says them).
SETTINGS = {
    "activity_heartbeat_timeout_s": 1.0,
    "sticky_schedule_to_start_timeout_s": 1.0,
    "workflow_task_timeout_s": WORKFLOW_TASK_TIMEOUT.total_seconds(),
    "activity_retry": "at once, without end (a worker's death; agent errors are the core's)",
    "level_1_retry": "on the worker of the try it retries, for up to 2 s, then on any",
    "timer_max_time_shift_ms": 10,  # the server's default 1 s: timers up to 1 s late
    # the server's default 20: a workflow's hops paced to 100 ms each after a burst
    "queue_poll_rps": int(DYNAMIC_CONFIG["history.transferProcessorMaxPollRPS"]),
}


def refusal(loaded: LoadedScenario, killable: set[str]) -> str | None:
    """Why the scenario cannot run on this design, in one line (None: it can)."""
    return workflow_engine.refusal(
        loaded,
        killable,
        "temporal",
        "a cancel is a signal here, not a durable state write",
        "there is no work queue to poison",
    )


class TemporalLive(WorkflowEngineLive):
    """The design's side of one live run (`chaos.systems.seam.LiveSystem`)."""

    design = server_name = "temporal"
    results_queue = "temporal workflow results"

    def __init__(self, run: ScenarioRun, services: TemporalServices) -> None:
        super().__init__(run, services)
        self.network = Network(
            run.ns,
            run.seed,
            run.spec.workers,
            None,
            None,
            upstreams={"temporal": f"temporal://{services.address}"},
        )
        self.refused = refusal(run.loaded, services.killable)
        if run.mutant is not None and run.mutant not in MUTANTS:
            self.refused = f"--mutant: temporal has its own mutants ({', '.join(MUTANTS)})"
        self.design_settings = SETTINGS
        self._client: Client | None = None
        self._handles: dict[str, WorkflowHandle[Any, Any]] = {}

    async def stop(self) -> None:
        await super().stop()
        self._client = None

    def worker(self, index: int, failpoints: list[str], mutant: str | None) -> WorkerProcess:
        """`python -m chaos.systems.temporal.worker` through its own proxy, its failpoints
        armed as the engine's workers arm theirs."""
        address = urlsplit(self.network.url(index, "temporal")).netloc
        args = ["--address", address, "--task-queue", self.run.ns]
        return WorkerProcess(
            [*args, "--history", str(self.run.raw_history)],
            env={"ENGINE_FAILPOINTS": ";".join(failpoints)},
            log_path=self.run.run_dir / f"worker{index}.log",
            name=f"worker{index}",
            module=("chaos.systems.temporal.mutants", mutant)
            if mutant
            else ("chaos.systems.temporal.worker",),
        )

    async def _connect(self) -> Client:
        from temporalio.client import Client

        from chaos.systems.temporal.server import NAMESPACE

        if self._client is None:
            self._client = await Client.connect(self.services.address, namespace=NAMESPACE)
        return self._client

    async def on_connect(self, a: acts.Connect) -> None:
        await self._connect()

    async def on_submit(self, a: acts.Submit) -> None:
        from chaos.systems.temporal.workflow import EvaluationWorkflow

        job = self._job(a)
        client = await self._connect()
        handle = await client.start_workflow(
            EvaluationWorkflow.run,
            job,
            id=f"{self.run.ns}{a.attempt_id}",
            task_queue=self.run.ns,
            task_timeout=WORKFLOW_TASK_TIMEOUT,
            rpc_timeout=timedelta(seconds=RPC_TIMEOUT_S),
        )
        self._handles[a.attempt_id] = handle
        self._watch(a.attempt_id, self._wait(handle))

    async def _wait(self, handle: WorkflowHandle[Any, Any]) -> Ended | None:
        """The workflow's result, waited for through the server's restarts (None: the
        workflow failed)."""
        from temporalio.client import WorkflowFailureError

        while True:
            try:
                return await handle.result()
            except asyncio.CancelledError:
                raise
            except WorkflowFailureError:
                return None
            except Exception:  # the server away: ask again once it answers
                await asyncio.sleep(0.2)

    async def _result_now(self, attempt_id: str) -> Ended | None:
        from temporalio.client import WorkflowExecutionStatus

        handle = self._handles.get(attempt_id)
        if handle is None:
            return None
        with contextlib.suppress(Exception):
            desc = await handle.describe(rpc_timeout=timedelta(seconds=RPC_TIMEOUT_S))
            if desc.status == WorkflowExecutionStatus.COMPLETED:
                return await handle.result(rpc_timeout=timedelta(seconds=RPC_TIMEOUT_S))
        return None
