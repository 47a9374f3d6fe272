"""The live runner: one scenario against real workers, a real Redis and a real RabbitMQ.

Jepsen's split, in small pieces: the *client* submits evaluations and cancels them
(`engine.submit.EngineClient`); the *nemesis* fires the scenario's faults (SIGKILL a worker,
Redis or the broker and bring it back, arm failpoints in worker processes); the *generator*
is the fault schedule, planned as data from the scenario's seed before the run starts;
the *checker* (`chaos.checker`) reads the recorded history and the final Redis state once
everything has stopped. The runner itself only supervises: it restarts crashed workers,
watches the history for event-triggered faults, and waits until every evaluation is
terminal or the deadline passes.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.checker import CheckResult, CheckSpec, EvaluationFinal, FinalState, check
from chaos.scenario import EventTriggers, LoadedScenario, PlannedFault, fault_schedule
from chaos.services import Services
from chaos.workers import WorkerProcess
from engine.config import EngineConfig
from engine.core.states import TERMINAL_EVALUATION_STATUSES
from engine.history import FileHistory, read_history
from engine.plan import Plan
from engine.runtime.store import RedisStore
from engine.submit import EngineClient

TERMINAL = {s.value for s in TERMINAL_EVALUATION_STATUSES}
READY_TIMEOUT_S = 30.0


class RunRefused(ValueError):
    """The scenario cannot run in this mode (a kill fault against a shared service)."""


def refusal(loaded: LoadedScenario, killable: set[str]) -> str | None:
    """Why the scenario cannot run against these services, in one line (None: it can)."""
    kills = {"kill_redis": "redis", "kill_broker": "broker"}
    needed = {kills[f.action] for f in loaded.spec.faults if getattr(f, "action", "") in kills}
    missing = needed - killable
    if not missing:
        return None
    names = " and ".join(sorted(missing))
    return (
        f"{loaded.path}: faults: kills {names}, but this run uses a shared service "
        "(REDIS_URL/AMQP_URL); unset them to let the run start its own"
    )


@dataclass
class Progress:
    """What the display shows while a scenario runs."""

    scenario: str
    total: int
    terminal: int = 0
    workers_alive: int = 0
    faults_fired: int = 0
    elapsed_s: float = 0.0
    note: str = ""


@dataclass
class Outcome:
    scenario: str
    result: CheckResult
    history: list[dict[str, Any]]
    duration_s: float
    attempt_ids: list[str]
    final: FinalState
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Worker:
    index: int
    failpoints: list[str]
    proc: WorkerProcess | None = None
    incarnation: int = 0
    restart_at: float | None = None  # monotonic time of a pending restart
    stopped_on_purpose: bool = False


class ScenarioRun:
    def __init__(
        self,
        loaded: LoadedScenario,
        services: Services,
        run_dir: Path,
        *,
        seed: int | None = None,
        mutant: str | None = None,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> None:
        self.loaded = loaded
        self.spec = loaded.spec
        self.services = services
        self.run_dir = run_dir
        self.seed = self.spec.seed if seed is None else seed
        self.mutant = mutant
        self.on_progress = on_progress or (lambda p: None)
        self.ns = f"chaos{uuid.uuid4().hex[:8]}."
        run_dir.mkdir(parents=True, exist_ok=True)
        self.raw_history = run_dir / "history.raw.jsonl"
        self.history = FileHistory(self.raw_history, "runner")
        self.rng = random.Random(self.seed)
        self.schedule: list[PlannedFault] = fault_schedule(self.spec, self.rng)
        # Queues and index keys are the run's own (`ns`); the attemptIds are the seed's,
        # and leftovers of an earlier run of the same ids are cleared first.
        self.id_prefix = loaded.id_prefix(self.seed)
        self.plans: dict[str, Plan] = loaded.evaluations(self.seed)
        self.attempt_ids: list[str] = list(self.plans)
        self.cancelled: set[str] = set()
        self.workers: list[_Worker] = []
        self.progress = Progress(self.spec.name, len(self.attempt_ids))
        self._t0 = 0.0
        self._pending: list[asyncio.Task[None]] = []
        self._refuse_unsupported()

    # --- set-up -------------------------------------------------------------------------

    def _refuse_unsupported(self) -> None:
        problem = refusal(self.loaded, self.services.killable)
        if problem:
            raise RunRefused(problem)

    def config(self) -> EngineConfig:
        return self.spec.engine_config(
            redis_url=self.services.redis_url,
            amqp_url=self.services.amqp_url,
            namespace=self.ns,
            policy=self.spec.retry.policy(self.seed),
        )

    def worker_args(self, failpoints: list[str]) -> list[str]:
        s, e, r = self.spec, self.spec.engine, self.spec.retry
        args = [
            "--namespace", self.ns,
            "--time-scale", str(s.time_scale),
            "--max-evaluations", str(e.max_evaluations),
            "--max-parallel", str(e.max_parallel),
            "--heartbeat-ms", str(e.heartbeat_ms),
            "--stale-ms", str(e.stale_ms),
            "--sweep-ms", str(e.sweep_ms),
            "--immediate-retries", str(r.immediate_retries),
            "--max-attempts", str(r.max_attempts),
            "--tiers-ms", ",".join(str(t) for t in r.tiers_ms),
            "--jitter", str(r.jitter),
            "--seed", str(self.seed),
            "--agent", json.dumps(self.agent_dict()),
            "--history", str(self.raw_history),
            "--log-level", "INFO",
        ]  # fmt: skip
        if e.retry_grace_ms is not None:
            args += ["--retry-grace-ms", str(e.retry_grace_ms)]
        if not e.sweeper:
            args.append("--no-sweeper")
        for fp in failpoints:
            args += ["--failpoint", fp]
        return args

    def agent_dict(self) -> dict[str, Any]:
        agent = dict(self.spec.agent)
        agent.setdefault("seed", self.seed)
        return agent

    # --- workers ------------------------------------------------------------------------

    def _start_worker(self, w: _Worker) -> None:
        failpoints = w.failpoints if w.incarnation == 0 else []
        module = ("chaos.mutants", self.mutant) if self.mutant else ("engine.worker",)
        w.proc = WorkerProcess(
            self.worker_args(failpoints),
            env={"REDIS_URL": self.services.redis_url, "AMQP_URL": self.services.amqp_url},
            log_path=self.run_dir / f"worker{w.index}.log",
            name=f"worker{w.index}",
            module=module,
        ).start()
        if w.incarnation:
            self.history.record("worker_restarted", worker=w.index, pid=w.proc.pid)
        w.incarnation += 1
        w.restart_at = None
        w.stopped_on_purpose = False

    async def _wait_ready(self, w: _Worker) -> None:
        assert w.proc is not None
        proc = w.proc
        ok = await asyncio.to_thread(proc.wait_for_log, "ready", READY_TIMEOUT_S)
        if not ok and proc.alive:
            raise RuntimeError(f"worker {w.index} did not get ready in {READY_TIMEOUT_S:.0f} s")

    def _kill_worker(self, w: _Worker, restart_after_s: float | None) -> None:
        if w.proc is None or not w.proc.alive:
            return
        pid = w.proc.pid
        w.proc.kill()
        w.stopped_on_purpose = True
        self.history.record("worker_killed", worker=w.index, pid=pid)
        if restart_after_s is not None:
            w.restart_at = time.monotonic() + restart_after_s

    def _supervise(self) -> None:
        """Restart workers that crashed (a failpoint) or were killed, when it is time."""
        now = time.monotonic()
        alive = 0
        for w in self.workers:
            if w.proc is not None and w.proc.alive:
                alive += 1
                continue
            if w.restart_at is None and not w.stopped_on_purpose and w.proc is not None:
                code = w.proc.returncode
                self.history.record("worker_exited", worker=w.index, code=code)
                w.stopped_on_purpose = True  # noted once
                if self.spec.restart_crashed_workers:
                    w.restart_at = now + self.spec.restart_delay_s
            if w.restart_at is not None and now >= w.restart_at:
                self._start_worker(w)
                alive += 1
        self.progress.workers_alive = alive

    # --- faults -------------------------------------------------------------------------

    async def _fire(self, fault: PlannedFault) -> None:
        self.progress.faults_fired += 1
        self.history.record(
            "fault_fired", fault=fault.label, action=fault.action, target=fault.target
        )
        if fault.action == "kill_worker":
            self._kill_worker(self.workers[fault.target], fault.restart_after_s)
        elif fault.action == "restart_worker":
            w = self.workers[fault.target]
            if w.proc is not None:
                await asyncio.to_thread(w.proc.terminate)
                w.stopped_on_purpose = True
            w.restart_at = time.monotonic()
        elif fault.action in ("kill_redis", "kill_broker"):
            name = "redis" if fault.action == "kill_redis" else "broker"
            svc = self.services.service(name)
            await asyncio.to_thread(svc.kill)
            self.history.record("service_killed", service=name)
            if fault.restart_after_s is not None:
                self._later(fault.restart_after_s, self._restart_service(name))
        elif fault.action == "cancel":
            attempt_id = self.attempt_ids[fault.target]
            self.cancelled.add(attempt_id)
            self.history.record("cancel_requested", attempt_id=attempt_id)
            async with EngineClient(self.config()) as client:
                await client.cancel(attempt_id)

    async def _restart_service(self, name: str) -> None:
        svc = self.services.service(name)
        await asyncio.to_thread(svc.restart)
        self.history.record("service_restarted", service=name)

    def _later(self, delay_s: float, coro: Any) -> None:
        async def run() -> None:
            await asyncio.sleep(delay_s)
            await coro

        self._pending.append(asyncio.ensure_future(run()))

    async def _timed_faults(self) -> None:
        for fault in sorted(
            (f for f in self.schedule if f.at_s is not None), key=lambda f: f.at_s or 0.0
        ):
            delay = self._t0 + (fault.at_s or 0.0) - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await self._fire(fault)

    async def _event_faults(self) -> None:
        triggers = EventTriggers(self.schedule)
        offset = 0
        while not triggers.done:
            await asyncio.sleep(0.02)
            if not self.raw_history.exists():
                continue
            with open(self.raw_history, "rb") as fh:
                fh.seek(offset)
                chunk = fh.read()
            end = chunk.rfind(b"\n") + 1
            offset += end
            for line in chunk[:end].splitlines():
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                for fault in triggers.feed(ev):
                    if fault.delay_s:  # a repetition: `every_s` after the one before
                        self._later(fault.delay_s, self._fire(fault))
                    else:
                        await self._fire(fault)

    # --- the run ------------------------------------------------------------------------

    async def run(self) -> Outcome:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        spec = self.spec
        self.workers = [
            _Worker(i, [s for s in [self.loaded.failpoint_specs(i, self.attempt_ids)] if s])
            for i in range(spec.workers)
        ]
        started = time.monotonic()
        await self._clear_earlier_runs()
        self.history.record("run_started", scenario=spec.name, seed=self.seed, mutant=self.mutant)
        tasks: list[asyncio.Task[None]] = []
        try:
            for w in self.workers:
                self._start_worker(w)
            await asyncio.gather(*(self._wait_ready(w) for w in self.workers))
            async with EngineClient(self.config()) as client:
                self._t0 = time.monotonic()
                for attempt_id in self.attempt_ids:
                    plan = self.plans[attempt_id]
                    self.history.record("submitted", attempt_id=attempt_id, plan=plan.id)
                    await client.submit(plan, attempt_id)
                tasks = [
                    asyncio.ensure_future(self._timed_faults()),
                    asyncio.ensure_future(self._event_faults()),
                ]
                await self._wait_terminal(client, tasks)
        finally:
            for task in [*tasks, *self._pending]:
                task.cancel()
            await asyncio.gather(*tasks, *self._pending, return_exceptions=True)
            await self._stop_workers()
        final = await self._final_state()
        self.history.record("run_finished", duration_s=round(time.monotonic() - started, 3))
        self.history.close()
        history = read_history(self.raw_history)
        result = check(history, final, self.check_spec())
        return Outcome(
            scenario=spec.name,
            result=result,
            history=history,
            duration_s=time.monotonic() - started,
            attempt_ids=self.attempt_ids,
            final=final,
            extra={"seed": self.seed, "mutant": self.mutant, "namespace": self.ns},
        )

    async def _clear_earlier_runs(self) -> None:
        store = RedisStore(self.config())
        try:
            pattern = f"attempt:{self.id_prefix}*"
            keys = [k async for k in store.redis.scan_iter(match=pattern, count=1000)]
            for i in range(0, len(keys), 1000):
                await store.redis.delete(*keys[i : i + 1000])
        finally:
            await store.close()

    async def _wait_terminal(self, client: EngineClient, tasks: list[asyncio.Task[None]]) -> None:
        deadline = self._t0 + self.spec.deadline_s
        ids = list(self.attempt_ids)
        while True:
            self._supervise()
            for task in tasks:  # a failing nemesis is a harness bug: surface it
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            # Settled: terminal, and evaluation.completed is out (stopping a worker between
            # the two would cut the history short, not break the engine).
            keys = [f"attempt:{a}:{k}" for a in ids for k in ("state", "final_published")]
            try:
                values = await client.store.redis.mget(keys)
            except Exception:  # Redis is down (a fault): look again shortly
                values = [None] * len(keys)
            self.progress.terminal = sum(
                1
                for state, published in zip(values[::2], values[1::2], strict=True)
                if state in TERMINAL and published
            )
            self.progress.elapsed_s = time.monotonic() - self._t0
            self.on_progress(self.progress)
            pending_faults = any(not t.done() for t in tasks) and any(
                f.at_s is not None and f.at_s > self.progress.elapsed_s for f in self.schedule
            )
            restarting = any(w.restart_at is not None for w in self.workers) or any(
                not t.done() for t in self._pending
            )
            if self.progress.terminal == len(ids) and not pending_faults and not restarting:
                return
            if time.monotonic() >= deadline:
                self.progress.note = "deadline passed"
                return
            await asyncio.sleep(0.05)

    async def _stop_workers(self) -> None:
        def stop() -> None:
            for w in self.workers:
                if w.proc is not None:
                    w.proc.terminate(timeout=3.0)

        await asyncio.to_thread(stop)

    async def _final_state(self) -> FinalState:
        for name in ("redis",):  # the final state needs Redis up
            svc = self.services.redis if name == "redis" else None
            if svc is not None and not svc.alive:
                await asyncio.to_thread(svc.restart)
        store = RedisStore(self.config())
        try:
            evaluations: dict[str, EvaluationFinal] = {}
            for attempt_id in self.attempt_ids:
                plan = self.plans[attempt_id]
                snap = await store.snapshot(attempt_id, plan.order)
                record = await store.record(attempt_id)
                evaluations[attempt_id] = EvaluationFinal(
                    attempt_id=attempt_id,
                    state=record.state,
                    results=dict(snap.results),
                    statuses=dict(snap.statuses),
                )
            ttls: dict[str, int] = {}
            pattern = f"attempt:{self.id_prefix}*"
            keys = [k async for k in store.redis.scan_iter(match=pattern, count=1000)]
            if keys:
                async with store.redis.pipeline(transaction=False) as pipe:
                    for k in keys:
                        pipe.ttl(k)
                    for k, ttl in zip(keys, await pipe.execute(), strict=True):
                        ttls[k] = int(ttl)
            return FinalState(evaluations=evaluations, key_ttls=ttls)
        finally:
            await store.close()

    def check_spec(self) -> CheckSpec:
        from engine.agent import AgentProfile

        agent = AgentProfile.from_dict(self.agent_dict())
        return self.loaded.check_spec(self.seed, self.plans, self.cancelled, agent)
