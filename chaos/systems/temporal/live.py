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
each (`HEARTBEAT_TIMEOUT`, `worker.serve`), and the server's timer shift, 10 ms
(`server.DYNAMIC_CONFIG`), said in the run's journal (`extra.design_settings`).
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from chaos import acts
from chaos.checker import EvaluationFinal, FinalState
from chaos.conductor import EVENT_KEYS, delivered
from chaos.links import Network
from chaos.scenario import LoadedScenario
from chaos.scenario.schema import service_action
from chaos.systems.temporal.services import TemporalServices
from chaos.workers import WorkerProcess
from engine.core.results import RuleResult

if TYPE_CHECKING:
    from temporalio.client import Client, WorkflowHandle

    from chaos.runner import ScenarioRun

#: The failpoints an activity honours (the engine's others are its shell's).
FAILPOINTS = ("rule_before_call", "rule_after_call_before_write")
#: The runner's events consumer as the history names its "queue".
RESULTS = "temporal workflow results"
#: What a workflow's result stands for on RabbitMQ: a persistent message.
DURABLE = 2
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
}


def refusal(loaded: LoadedScenario, killable: set[str]) -> str | None:
    """Why the scenario cannot run on this design, in one line (None: it can)."""
    spec, path = loaded.spec, loaded.path
    for i, fault in enumerate(spec.faults):
        failpoint = getattr(fault, "failpoint", None)
        if failpoint is not None and failpoint not in FAILPOINTS:
            return (
                f"{path}: faults[{i}].failpoint: temporal has {' and '.join(FAILPOINTS)} "
                f"(inside the activity), not {failpoint}"
            )
        action = getattr(fault, "action", "")
        if action in ("cancel", "publish_poison"):
            why = (
                "a cancel is a signal here, not a durable state write"
                if action == "cancel"
                else "there is no work queue to poison"
            )
            return f"{path}: faults[{i}].action: temporal has no {action} ({why})"
        on = service_action(fault)
        if on is not None and on[0] not in killable:
            return f"{path}: faults[{i}]: kills {on[0]}, which is not this run's own"
    return None


class TemporalLive:
    """The design's side of one live run (`chaos.systems.seam.LiveSystem`)."""

    def __init__(self, run: ScenarioRun, services: TemporalServices) -> None:
        self.run = run
        self.spec = run.spec
        self.services = services
        self.run_prefix = ""  # a task queue and workflow ids of the run's own
        self.network = Network(
            run.ns,
            run.seed,
            run.spec.workers,
            None,
            None,
            upstreams={"temporal": f"temporal://{services.address}"},
        )
        self.refused = refusal(run.loaded, services.killable)
        self.design_settings = SETTINGS
        self._client: Client | None = None
        self._handles: dict[str, WorkflowHandle[Any, Any]] = {}
        self._ended: dict[str, Any] = {}  # attempt id -> the workflow's result (Ended)
        self._watching: set[asyncio.Task[None]] = set()
        self._stopped: set[str] = set()

    # --- set-up -------------------------------------------------------------------------

    async def start(self) -> None:
        await self.network.start()

    async def stop(self) -> None:
        for task in list(self._watching):
            task.cancel()
        await asyncio.gather(*self._watching, return_exceptions=True)
        self._client = None
        await self.network.close()

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
            module=("chaos.systems.temporal.worker",),
        )

    def seed_final(self, final: FinalState) -> FinalState:
        return final

    async def _connect(self) -> Client:
        from temporalio.client import Client

        from chaos.systems.temporal.server import NAMESPACE

        if self._client is None:
            self._client = await Client.connect(self.services.address, namespace=NAMESPACE)
        return self._client

    # --- its service --------------------------------------------------------------------

    async def on_kill_service(self, a: acts.KillService) -> dict[str, Any]:
        svc = self.services.service(a.name)
        self._stopped.add(a.name)
        if a.graceful:
            await asyncio.to_thread(svc.terminate, 30.0)
        else:
            await asyncio.to_thread(svc.kill)
        return {}

    async def on_restart_service(self, a: acts.RestartService) -> dict[str, Any]:
        await asyncio.to_thread(self.services.service(a.name).restart)
        self._stopped.discard(a.name)
        return {}

    async def on_pause_service(self, a: acts.PauseService) -> None:
        self._stopped.add(a.name)
        await asyncio.to_thread(self.services.service(a.name).pause)

    async def on_resume_service(self, a: acts.ResumeService) -> bool:
        await asyncio.to_thread(self.services.service(a.name).resume)
        self._stopped.discard(a.name)
        return False

    async def on_kill_sentinel(self, a: acts.KillSentinel) -> None:
        raise NotImplementedError("temporal has no Sentinel")  # refused before the run

    async def on_restart_sentinel(self, a: acts.RestartSentinel) -> None:
        raise NotImplementedError("temporal has no Sentinel")

    async def on_await_failover(self, a: acts.AwaitFailover) -> bool:
        return False

    # --- the client -----------------------------------------------------------------------

    async def on_connect(self, a: acts.Connect) -> None:
        await self._connect()

    async def on_disconnect(self, a: acts.Disconnect | None = None) -> None:
        """The client stays: the final state is read through it."""

    async def on_submit(self, a: acts.Submit) -> None:
        from chaos.systems.core_workflow import Job
        from chaos.systems.temporal.workflow import EvaluationWorkflow

        job = Job.of(
            a.attempt_id,
            a.plan,
            self.spec.retry.policy(self.run.seed),
            self.run.agent_dict(),
            self.spec.time_scale,
            self.spec.engine.max_parallel,
        )
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
        task = asyncio.get_running_loop().create_task(self._watch(a.attempt_id, handle))
        self._watching.add(task)
        task.add_done_callback(self._watching.discard)

    async def _watch(self, attempt_id: str, handle: WorkflowHandle[Any, Any]) -> None:
        """Wait for the workflow's result, through the server's restarts, and record it as
        the consumer of the other designs records their announcements. A workflow that
        failed (its code raised: never the core's way to end) announces nothing: the
        evaluation stays unfinished, for `all_terminal` to say."""
        from temporalio.client import WorkflowFailureError

        while True:
            try:
                ended = await handle.result()
                break
            except asyncio.CancelledError:
                raise
            except WorkflowFailureError:
                return
            except Exception:  # the server away: ask again once it answers
                await asyncio.sleep(0.2)
        self._ended[attempt_id] = ended
        for pass_id, p in sorted(ended.passes.items()):
            body = {"attempt_id": attempt_id, "pass_id": pass_id, **p}
            self.run.history.record(
                "pass_received", **delivered(body, f"{attempt_id}:pass:{pass_id}", False, DURABLE)
            )
        body = {"attempt_id": attempt_id, "status": ended.status, "verdicts": ended.announced}
        self.run.history.record(
            "completed_received", **delivered(body, f"{attempt_id}:completed", False, DURABLE)
        )
        self.run.received.add(attempt_id)

    async def on_cancel(self, a: acts.Cancel) -> str:
        raise NotImplementedError("temporal: a cancel is refused before the run")

    async def on_resume(self, a: acts.Resume) -> dict[str, Any]:
        raise NotImplementedError("temporal has no resume from a checkpoint")

    async def on_publish_raw(self, a: acts.PublishRaw) -> None:
        raise NotImplementedError("temporal has no work queue to poison")

    # --- what the server holds --------------------------------------------------------------

    async def on_settled(self, a: acts.Settled) -> int:
        """Workflows ended whose result the client holds: their end is the announcement."""
        return sum(1 for attempt_id in a.attempt_ids if attempt_id in self._ended)

    async def on_leases(self, a: acts.Leases) -> dict[str, str] | None:
        """None: no leases here (a task's timeouts are the server's)."""
        return None

    async def on_announced(self, a: acts.Announced) -> set[str]:
        return {attempt_id for attempt_id in a.attempt_ids if attempt_id in self._ended}

    async def on_bind_consumer(self, a: acts.BindConsumer) -> None:
        for key in EVENT_KEYS:
            self.run.history.record("events_consumer_bound", queue=RESULTS, routing_key=key)

    async def on_close_consumer(self, a: acts.CloseConsumer | None = None) -> None:
        """The results not in yet are not waited for any longer."""
        for task in list(self._watching):
            task.cancel()
        await asyncio.gather(*self._watching, return_exceptions=True)

    async def on_read_final(self, a: acts.ReadFinal) -> FinalState:
        """Each evaluation's end from its workflow's result; one still running (or never
        started) has no state. The server is brought back first if a fault left it down."""
        server = self.services.server
        assert server is not None
        if not server.alive:
            await asyncio.to_thread(server.restart)
        elif "temporal" in self._stopped:  # paused to the end
            await asyncio.to_thread(server.resume)
        self._stopped.clear()
        evaluations: dict[str, EvaluationFinal] = {}
        for attempt_id in self.run.attempt_ids:
            ended = self._ended.get(attempt_id)
            if ended is None and attempt_id in self._handles:
                ended = await self._result_now(self._handles[attempt_id])
            if ended is None:
                evaluations[attempt_id] = EvaluationFinal(attempt_id=attempt_id, state=None)
                continue
            evaluations[attempt_id] = EvaluationFinal(
                attempt_id=attempt_id,
                state=ended.status,
                results={r: RuleResult.from_json(j) for r, j in ended.results.items()},
                statuses=dict(ended.statuses),
                published=True,
                passes={p: str(v["outcome"]) for p, v in sorted(ended.passes.items())},
            )
        return FinalState(evaluations=evaluations, key_ttls={}, indexes=None)

    async def _result_now(self, handle: WorkflowHandle[Any, Any]) -> Any:
        """The workflow's result if it has ended, else None (not waited for)."""
        from temporalio.client import WorkflowExecutionStatus

        with contextlib.suppress(Exception):
            desc = await handle.describe(rpc_timeout=timedelta(seconds=RPC_TIMEOUT_S))
            if desc.status == WorkflowExecutionStatus.COMPLETED:
                return await handle.result(rpc_timeout=timedelta(seconds=RPC_TIMEOUT_S))
        return None
