"""`dbos` live: an evaluation as a DBOS workflow whose body is the engine's core, on the
run's own PostgreSQL.

What the runner asks of this design: each worker is `python -m chaos.systems.dbos.worker`
under a fixed executor id (`worker<N>`, kept across the slot's restarts: DBOS recovers at
launch the workflows its own executor left), reaching PostgreSQL through a proxy of its own
(the link `postgres`), writing the engine's history vocabulary
(`chaos.systems.dbos.workflow`); the run's system database is its own (`dbos_<run>`); the
run's PostgreSQL is killed, stopped, paused and brought back on its data; the runner's
client enqueues one workflow per evaluation, and its wait for each workflow's result is
the events' consumer; the final state is read from the workflows' results.

DBOS has no takeover of its own: a worker that died and is not relaunched keeps its
workflows until an operator asks DBOS's recovery for its executor id (what its admin
server's recovery endpoint and DBOS Conductor do). The harness plays that operator: once a
worker's process has been dead for `OPERATOR_AFTER_S`, it calls that recovery (the
workflows PENDING under the dead executor are enqueued again, for any worker to take), and
records `operator_recovered`. It acts only on a dead process, never on a paused or cut-off
one (DBOS would then run the workflow twice at once), and with a client that fails at once
when PostgreSQL does not answer (it tries again on its next round).

What is the engine's and not this design's is refused before anything starts, in one line:
a service other than PostgreSQL, a cancel (DBOS's own stops the workflow at its next step
and announces nothing), a resume from a checkpoint, poison messages, the failpoints other
than the two a step has. Of the engine's settings, `max_parallel` is the workflow's (the
core's), and `max_evaluations` its queue's concurrency a worker; the rest name mechanisms
DBOS does not have. What decides its recovery is said in the run's journal
(`extra.design_settings`).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from typing import TYPE_CHECKING, Any

from chaos import acts
from chaos.links import Network
from chaos.scenario import LoadedScenario
from chaos.systems import workflow_engine
from chaos.systems.core_workflow import Ended
from chaos.systems.dbos.mutants import MUTANTS
from chaos.systems.dbos.services import DbosServices
from chaos.systems.workflow_engine import WorkflowEngineLive
from chaos.workers import WorkerProcess

if TYPE_CHECKING:
    from dbos import DBOSClient

    from chaos.runner import ScenarioRun

#: How long a worker's process stays dead before the operator recovers its workflows: longer
#: than a crashed worker's relaunch takes by default (`restart_delay_s` 0.2 s, then DBOS's
#: launch), so that a relaunched slot recovers its own, as DBOS intends.
OPERATOR_AFTER_S = 3.0
#: How often the operator looks at the workers and the client at the results (seconds).
POLL_S = 0.1
#: How long the client asks while PostgreSQL does not answer before it gives up (seconds):
#: longer than any outage a shipped scenario makes.
ASK_PATIENCE_S = 60.0
#: The settings that decide how fast this design recovers (the report says them).
SETTINGS = {
    "takeover": "none of DBOS's own: the harness's operator asks DBOS's recovery for a dead "
    f"worker's executor id after {OPERATOR_AFTER_S:g} s; a relaunched worker recovers its own "
    "at launch",
    "queue_polling_interval_s": 0.1,
    "worker_concurrency": "the scenario's engine.max_evaluations",
    "answers": "taken in the order they come, that order a step of its own",
}


def refusal(loaded: LoadedScenario, killable: set[str]) -> str | None:
    """Why the scenario cannot run on this design, in one line (None: it can)."""
    return workflow_engine.refusal(
        loaded,
        killable,
        "dbos",
        "DBOS's own stops the workflow at its next step and announces nothing",
        "there is no work queue of the engine's to poison",
    )


class DbosLive(WorkflowEngineLive):
    """The design's side of one live run (`chaos.systems.seam.LiveSystem`)."""

    design = "dbos"
    server_name = "postgres"
    results_queue = "dbos workflow results"

    def __init__(self, run: ScenarioRun, services: DbosServices) -> None:
        super().__init__(run, services)
        assert services.postgres is not None
        self.database = f"dbos_{run.ns.strip('.')}"
        self.url = services.postgres.url(database=self.database)
        self.network = Network(
            run.ns, run.seed, run.spec.workers, None, None, upstreams={"postgres": self.url}
        )
        self.refused = refusal(run.loaded, services.killable)
        if run.mutant is not None and run.mutant not in MUTANTS:
            self.refused = f"--mutant: dbos has its own mutants ({', '.join(MUTANTS)})"
        self.design_settings = SETTINGS
        self._client: DBOSClient | None = None
        self._workers: dict[int, WorkerProcess] = {}
        self._dead_since: dict[int, float] = {}  # slot -> when its process was seen dead
        self._operator: asyncio.Task[None] | None = None
        self._starts = run.run_dir / "dbos-starts"

    async def start(self) -> None:
        assert self.services.postgres is not None
        await asyncio.to_thread(self.services.postgres.create_database, self.database)
        self._starts.mkdir(exist_ok=True)
        await super().start()

    async def stop(self) -> None:
        if self._operator is not None:
            self._operator.cancel()
            await asyncio.gather(self._operator, return_exceptions=True)
        await super().stop()
        if self._client is not None:
            await asyncio.to_thread(self._client.destroy)
            self._client = None
        shutil.rmtree(self._starts, ignore_errors=True)  # counted in the history already

    def worker(self, index: int, failpoints: list[str], mutant: str | None) -> WorkerProcess:
        """`python -m chaos.systems.dbos.worker` under the slot's executor id, through its
        own proxy, its failpoints armed as the engine's workers arm theirs."""
        from chaos.systems.dbos.worker import URL_ENV
        from chaos.systems.dbos.workflow import STARTS_ENV

        args = ["--executor-id", f"worker{index}", "--worker-id", f"worker{index}"]
        args += ["--concurrency", str(self.spec.engine.max_evaluations)]
        proc = WorkerProcess(
            [*args, "--history", str(self.run.raw_history)],
            env={
                URL_ENV: self.network.url(index, "postgres"),
                STARTS_ENV: str(self._starts),
                "ENGINE_FAILPOINTS": ";".join(failpoints),
            },
            log_path=self.run.run_dir / f"worker{index}.log",
            name=f"worker{index}",
            module=("chaos.systems.dbos.mutants", mutant)
            if mutant
            else ("chaos.systems.dbos.worker",),
        )
        self._workers[index] = proc
        self._dead_since.pop(index, None)
        return proc

    # --- the client and the operator ------------------------------------------------------

    def _make_client(self) -> DBOSClient:
        """A client that fails at once when PostgreSQL does not answer (DBOS's own retries
        back off to a minute, and would hold the run's loop or its operator that long):
        the callers ask again."""
        from dbos import DBOSClient

        return DBOSClient(system_database_url=self.url, retry_connection_errors=False)

    async def _ask(self, call: Any, *args: Any) -> Any:
        """`call(client, *args)` in a thread, asked again every `POLL_S` while PostgreSQL
        does not answer, for up to `ASK_PATIENCE_S` (then its last error is raised)."""

        def ask() -> Any:
            if self._client is None:
                self._client = self._make_client()
            return call(self._client, *args)

        loop = asyncio.get_running_loop()
        deadline = loop.time() + ASK_PATIENCE_S
        while True:
            try:
                return await asyncio.to_thread(ask)
            except asyncio.CancelledError:
                raise
            except Exception:
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(POLL_S)

    async def on_connect(self, a: acts.Connect) -> None:
        await self._ask(lambda client: None)
        if self._operator is None:
            self._operator = asyncio.get_running_loop().create_task(self._operate())

    async def on_submit(self, a: acts.Submit) -> None:
        from chaos.systems.dbos.workflow import enqueue

        job = self._job(a)
        # the attemptId is the workflow's id: enqueued again, it is the same workflow
        await self._ask(enqueue, job)
        self._watch(a.attempt_id, self._wait(a.attempt_id))

    async def _wait(self, attempt_id: str) -> Ended | None:
        """The workflow's result, waited for through PostgreSQL's restarts (None: the
        workflow failed)."""
        while True:
            with contextlib.suppress(Exception):  # a long outage: go on asking
                ended = await self._ask(_ended_of, attempt_id)
                if ended is not _UNDER_WAY:
                    return ended
            await asyncio.sleep(POLL_S)

    async def _result_now(self, attempt_id: str) -> Ended | None:
        ended = await self._ask(_ended_of, attempt_id)
        return None if ended is _UNDER_WAY else ended

    async def _operate(self) -> None:
        """The operator: a worker's process dead for `OPERATOR_AFTER_S` has its workflows
        recovered for any worker (a relaunch of its slot before then recovers them itself)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(POLL_S)
            now = loop.time()
            for index, proc in list(self._workers.items()):
                if proc.proc is None or proc.alive:
                    self._dead_since.pop(index, None)
                    continue
                since = self._dead_since.setdefault(index, now)
                if now - since < OPERATOR_AFTER_S:
                    continue
                recovered = await asyncio.to_thread(self._recover, f"worker{index}")
                if recovered is None:  # PostgreSQL did not answer: the next round
                    continue
                self._dead_since[index] = float("inf")  # once a death
                self.run.history.record(
                    "operator_recovered",
                    executor_id=f"worker{index}",
                    attempt_ids=sorted(recovered),
                )

    def _recover(self, executor_id: str) -> list[str] | None:
        """DBOS's recovery for `executor_id` (its PENDING workflows enqueued again, each
        only while that executor still holds it), as its admin endpoint calls it; None when
        PostgreSQL does not answer."""
        from dbos._utils import INTERNAL_QUEUE_NAME

        from chaos.systems.dbos.workflow import APP_VERSION

        try:
            client = self._make_client()
        except Exception:
            return None
        try:
            sys_db = client._sys_db
            pending = sys_db.get_pending_workflows(executor_id, APP_VERSION)
            return [
                p.workflow_id
                for p in pending
                if sys_db.reenqueue_for_recovery(p.workflow_id, [executor_id], INTERNAL_QUEUE_NAME)
            ]
        except Exception:
            return None
        finally:
            with contextlib.suppress(Exception):
                client.destroy()


#: What `_ended_of` says of a workflow not ended yet.
_UNDER_WAY: Any = object()


def _ended_of(client: DBOSClient, attempt_id: str) -> Any:
    """The workflow's end (None: it failed, or never was), or `_UNDER_WAY`."""
    from dbos._error import DBOSNonExistentWorkflowError

    try:
        status = client.retrieve_workflow(attempt_id).get_status()
    except DBOSNonExistentWorkflowError:
        return None
    if status.status == "SUCCESS":
        return Ended(**client.retrieve_workflow(attempt_id).get_result())
    if status.status in ("PENDING", "ENQUEUED", "DELAYED"):
        return _UNDER_WAY
    return None
