"""What the live adapters of the workflow engines (`temporal`, `dbos`) share: one server of
the run's own that faults kill, stop, pause and bring back; a client whose wait for each
workflow's result is the events' consumer (the result is the evaluation's announcement:
`completed_received`, and a `pass_received` per pass); the final state read from the
workflows' results; and what is the engine's and not theirs, refused in one line before
anything starts.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from chaos import acts
from chaos.checker import EvaluationFinal, FinalState
from chaos.conductor import EVENT_KEYS, delivered
from chaos.scenario import LoadedScenario
from chaos.scenario.schema import service_action
from chaos.systems.core_workflow import Ended, Job
from engine.core.results import RuleResult

if TYPE_CHECKING:
    from chaos.runner import ScenarioRun

#: What a workflow's result stands for on RabbitMQ: a persistent message.
DURABLE = 2
#: The failpoints a call honours (the engine's others are its shell's).
FAILPOINTS = ("rule_before_call", "rule_after_call_before_write")


def refusal(
    loaded: LoadedScenario, killable: set[str], design: str, why_cancel: str, why_poison: str
) -> str | None:
    """Why the scenario cannot run on a workflow engine, in one line (None: it can)."""
    spec, path = loaded.spec, loaded.path
    for i, fault in enumerate(spec.faults):
        failpoint = getattr(fault, "failpoint", None)
        if failpoint is not None and failpoint not in FAILPOINTS:
            return (
                f"{path}: faults[{i}].failpoint: {design} has {' and '.join(FAILPOINTS)} "
                f"(inside the call), not {failpoint}"
            )
        action = getattr(fault, "action", "")
        if action in ("cancel", "publish_poison"):
            why = why_cancel if action == "cancel" else why_poison
            return f"{path}: faults[{i}].action: {design} has no {action} ({why})"
        on = service_action(fault)
        if on is not None and on[0] not in killable:
            return f"{path}: faults[{i}]: kills {on[0]}, which is not this run's own"
    return None


class Server(Protocol):
    """The one service of the design's own (`PostgresServer`, `TemporalServer`)."""

    @property
    def alive(self) -> bool: ...
    def kill(self) -> None: ...
    def terminate(self, timeout: float) -> None: ...
    def restart(self) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...


class WorkflowEngineLive:
    """The acts every workflow engine carries out alike; a design adds its workers, its
    client (`on_connect`, `on_submit`) and how it reads a workflow's end (`_result_now`)."""

    #: The design's name, and its server's (the one service a fault may stop).
    design = ""
    server_name = ""
    #: The runner's events consumer as the history names its "queue".
    results_queue = ""

    def __init__(self, run: ScenarioRun, services: Any) -> None:
        self.run = run
        self.spec = run.spec
        self.services = services
        self.run_prefix = ""  # workflow ids of the run's own
        self._ended: dict[str, Ended] = {}  # attempt id -> the workflow's result
        self._watching: set[asyncio.Task[None]] = set()
        self._stopped: set[str] = set()

    def _job(self, a: acts.Submit) -> Job:
        """What the evaluation's workflow is started with."""
        return Job.of(
            a.attempt_id,
            a.plan,
            self.spec.retry.policy(self.run.seed),
            self.run.agent_dict(),
            self.spec.time_scale,
            self.spec.engine.max_parallel,
        )

    def _server(self) -> Server:
        return self.services.service(self.server_name)

    async def start(self) -> None:
        await self.network.start()  # type: ignore[attr-defined]

    async def stop(self) -> None:
        await self.on_close_consumer()
        await self.network.close()  # type: ignore[attr-defined]

    def seed_final(self, final: FinalState) -> FinalState:
        return final

    def _watch(self, attempt_id: str, ended: Any) -> None:
        """Wait for the coroutine `ended` (the workflow's result) alongside, and record it
        once it comes. A workflow that failed (its code raised: never the core's way to end)
        gives None and announces nothing: the evaluation stays unfinished, for
        `all_terminal` to say."""

        async def watch() -> None:
            result = await ended
            if result is not None:
                self._announce(attempt_id, result)

        task = asyncio.get_running_loop().create_task(watch())
        self._watching.add(task)
        task.add_done_callback(self._watching.discard)

    def _announce(self, attempt_id: str, ended: Ended) -> None:
        """The workflow's result recorded as the consumer of the other designs records their
        announcements."""
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

    # --- its server -----------------------------------------------------------------------

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

    async def _bring_back(self) -> None:
        """The server up again if a fault left it down or paused to the end."""
        server = self._server()
        if not server.alive:
            await asyncio.to_thread(server.restart)
        elif self.server_name in self._stopped:
            await asyncio.to_thread(server.resume)
        self._stopped.clear()

    async def on_kill_sentinel(self, a: acts.KillSentinel) -> None:
        raise NotImplementedError(f"{self.design} has no Sentinel")  # refused before the run

    async def on_restart_sentinel(self, a: acts.RestartSentinel) -> None:
        raise NotImplementedError(f"{self.design} has no Sentinel")

    async def on_await_failover(self, a: acts.AwaitFailover) -> bool:
        return False

    # --- the client -------------------------------------------------------------------------

    async def on_disconnect(self, a: acts.Disconnect | None = None) -> None:
        """The client stays: the final state is read through it."""

    async def on_cancel(self, a: acts.Cancel) -> str:
        raise NotImplementedError(f"{self.design}: a cancel is refused before the run")

    async def on_resume(self, a: acts.Resume) -> dict[str, Any]:
        raise NotImplementedError(f"{self.design} has no resume from a checkpoint")

    async def on_publish_raw(self, a: acts.PublishRaw) -> None:
        raise NotImplementedError(f"{self.design} has no work queue to poison")

    # --- what the server holds ----------------------------------------------------------------

    async def on_settled(self, a: acts.Settled) -> int:
        """Workflows ended whose result the client holds: their end is the announcement."""
        return sum(1 for attempt_id in a.attempt_ids if attempt_id in self._ended)

    async def on_leases(self, a: acts.Leases) -> dict[str, str] | None:
        """None: no leases here (when a call runs again is the workflow engine's to say)."""
        return None

    async def on_announced(self, a: acts.Announced) -> set[str]:
        return {attempt_id for attempt_id in a.attempt_ids if attempt_id in self._ended}

    async def on_bind_consumer(self, a: acts.BindConsumer) -> None:
        for key in EVENT_KEYS:
            self.run.history.record(
                "events_consumer_bound", queue=self.results_queue, routing_key=key
            )

    async def on_close_consumer(self, a: acts.CloseConsumer | None = None) -> None:
        """The results not in yet are not waited for any longer."""
        for task in list(self._watching):
            task.cancel()
        await asyncio.gather(*self._watching, return_exceptions=True)

    async def _result_now(self, attempt_id: str) -> Ended | None:
        """The workflow's result if it has ended, else None (not waited for)."""
        raise NotImplementedError

    async def on_read_final(self, a: acts.ReadFinal) -> FinalState:
        """Each evaluation's end from its workflow's result; one still running (or never
        started) has no state. The server is brought back first if a fault left it down."""
        await self._bring_back()
        evaluations: dict[str, EvaluationFinal] = {}
        for attempt_id in self.run.attempt_ids:
            ended = self._ended.get(attempt_id) or await self._result_now(attempt_id)
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
