"""The live runner: one scenario against real worker processes of a system under test.

Jepsen's split, in small pieces: the *client* submits evaluations and cancels them; the
*generator* is the fault schedule, planned as data from the scenario's seed; the *nemesis*
fires it, and the runner supervises the workers, as `chaos.conductor` plans both, for this
runner and the simulated one alike. This module carries out the acts that are the same
for every design: time, the history, worker processes started, SIGKILLed, SIGSTOPped, the
proxies' toxics. What is the design's own (its services, its client, its consumer of
`evaluation.completed`, its final state for the *checker*) is its system's
(`chaos.systems`), reached through one seam (`chaos.systems.seam.LiveSystem`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos import acts
from chaos.acts import Step
from chaos.checker import CheckResult, CheckSpec, FinalState, check
from chaos.conductor import (
    EVENT_POLL_S,
    RECEIVED_AS,
    STOP_TIMEOUT_S,
    Conductor,
    Progress,
)
from chaos.errors import HarnessError, RunRefused
from chaos.scenario import LoadedScenario
from chaos.supervision import Slot
from chaos.systems import on_system
from chaos.systems import system as system_named
from chaos.systems.seam import LiveSystem
from chaos.workers import WorkerProcess
from engine.history import FileHistory, read_history
from engine.plan import Plan
from engine.shell.effects import Stepper

READY_TIMEOUT_S = 30.0

#: How long one act of a live run may take (a service restarted, a worker stopped, the
#: final state read) before the run ends in a `HarnessError` naming it: the slowest bounded
#: one (a RabbitMQ node's start, 60 s) several times over on a loaded machine. A client
#: library that never returns (a robust AMQP connection that swallows its cancellation
#: while it waits for a broker) ends the scenario in one line instead of hanging CI.
ACT_LIMIT_S = 300.0

__all__ = ["HarnessError", "Outcome", "RunRefused", "ScenarioRun"]


@dataclass
class Outcome:
    scenario: str
    result: CheckResult
    history: list[dict[str, Any]]
    duration_s: float
    attempt_ids: list[str]
    final: FinalState
    extra: dict[str, Any] = field(default_factory=dict)


class ScenarioRun:
    def __init__(
        self,
        loaded: LoadedScenario,
        services: Any,
        run_dir: Path,
        *,
        seed: int | None = None,
        mutant: str | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        system: str | None = None,
    ) -> None:
        """`services`: what the system's services are (`Services` for `redis-rabbitmq`);
        `system`: the design, instead of the scenario's `system:`."""
        loaded = on_system(loaded, system)
        self.loaded = loaded
        self.spec = loaded.spec
        self.run_dir = run_dir
        self.seed = self.spec.seed if seed is None else seed
        self.mutant = mutant
        self.on_progress = on_progress or (lambda p: None)
        self.ns = f"chaos{uuid.uuid4().hex[:8]}."
        run_dir.mkdir(parents=True, exist_ok=True)
        self.raw_history = run_dir / "history.raw.jsonl"
        self.history = FileHistory(self.raw_history, "runner")
        self.system_name = self.spec.system
        self.system: LiveSystem = system_named(self.system_name).adapter("live")(self, services)
        self.run_prefix = self.system.run_prefix
        self.id_prefix = self.run_prefix + loaded.id_prefix(self.seed)
        self.seed_plans: dict[str, Plan] = loaded.evaluations(self.seed)
        self.plans: dict[str, Plan] = {self.run_prefix + a: p for a, p in self.seed_plans.items()}
        self.attempt_ids: list[str] = list(self.plans)
        self.conductor = Conductor(loaded, self.seed, mutant, self.plans)
        self.cancelled = self.conductor.cancelled
        self.progress = self.conductor.progress
        self.received: set[str] = set()  # attemptIds whose evaluation.completed arrived
        self._spawned: list[asyncio.Task[Any]] = []  # the conductor's steps alongside
        self.network = self.system.network
        if self.system.refused:
            raise RunRefused(self.system.refused)
        if mutant is not None:
            from chaos.mutants import refusal as mutant_refusal

            if problem := mutant_refusal(mutant, self.system_name):
                raise RunRefused(f"{loaded.path}: {problem}")
        self._now, self._later = _tables(type(self.system))

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
            "--connect-timeout-s", str(e.connect_timeout_s),
            "--read-timeout-s", str(e.read_timeout_s),
            "--wait-replicas", str(e.wait_replicas),
            "--wait-timeout-ms", str(e.wait_timeout_ms),
            "--immediate-retries", str(r.immediate_retries),
            "--max-attempts", str(r.max_attempts),
            "--tiers-ms", ",".join(str(t) for t in r.tiers_ms),
            "--jitter", str(r.jitter),
            "--jitter-buckets", str(r.jitter_buckets),
            "--seed", str(self.seed),
            "--agent", json.dumps(self.agent_dict()),
            "--history", str(self.raw_history),
            "--log-level", "INFO",
        ]  # fmt: skip
        if e.retry_grace_ms is not None:
            args += ["--retry-grace-ms", str(e.retry_grace_ms)]
        if self.run_prefix:  # the agent draws what the seed's ids draw
            args += ["--agent-id-prefix", self.run_prefix]
        if not e.sweeper:
            args.append("--no-sweeper")
        for fp in failpoints:
            args += ["--failpoint", fp]
        return args

    def agent_dict(self) -> dict[str, Any]:
        agent = dict(self.spec.agent)
        agent.setdefault("seed", self.seed)
        return agent

    # --- the acts of `chaos.conductor` ---------------------------------------------------

    async def _drive(self, step: Step) -> Any:
        """Carry `step` out to its end; what it returns is returned. An act that needs no
        waiting is carried out in place."""
        stepper = Stepper(step)
        while (act := stepper.advance(self._now, self)) is not None:
            try:
                limit = ACT_LIMIT_S + (act.seconds if isinstance(act, acts.Sleep) else 0.0)
                reply = await _within(self._later[type(act)](act, self), limit, type(act).__name__)
                stepper.reply(reply)
            except BaseException as exc:  # into the step (a cancellation too)
                stepper.fail(exc)
        return stepper.value

    def on_now(self, a: acts.Now) -> float:
        return time.monotonic()

    def on_record(self, a: acts.Record) -> None:
        self.history.record(a.event, **a.fields)

    def on_show(self, a: acts.Show) -> None:
        self.on_progress(self.progress)

    def on_spawn(self, a: acts.Spawn) -> None:
        self._spawned.append(asyncio.ensure_future(self._drive(a.step)))

    async def on_stop_spawned(self, a: acts.StopSpawned | None = None) -> None:
        tasks, self._spawned = self._spawned, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def on_sleep(self, a: acts.Sleep) -> None:
        for task in self._spawned:  # a failing nemesis is a harness bug: surface it
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        await asyncio.sleep(a.seconds)

    def on_start_worker(self, a: acts.StartWorker) -> WorkerProcess:
        failpoints = [a.failpoints] if a.failpoints else []
        return self.system.worker(a.slot.index, failpoints, self.mutant).start()

    async def on_wait_ready(self, a: acts.WaitReady) -> None:
        async def ready(slot: Slot[WorkerProcess]) -> None:
            proc = slot.proc
            assert proc is not None
            ok = await asyncio.to_thread(proc.wait_for_log, "ready", READY_TIMEOUT_S)
            if not ok and proc.alive:
                raise RuntimeError(
                    f"worker {slot.index} did not get ready in {READY_TIMEOUT_S:.0f} s"
                )

        await asyncio.gather(*(ready(slot) for slot in a.slots))

    def on_kill_worker(self, a: acts.KillWorker) -> None:
        a.slot.proc.kill()

    async def on_terminate_worker(self, a: acts.TerminateWorker) -> None:
        if a.slot.proc is not None:
            await asyncio.to_thread(a.slot.proc.terminate, a.timeout_s)

    def on_pause_worker(self, a: acts.PauseWorker) -> None:
        a.slot.proc.pause()

    def on_resume_worker(self, a: acts.ResumeWorker) -> None:
        a.slot.proc.resume()

    async def on_add_toxic(self, a: acts.AddToxic) -> None:
        await self.network.add_toxic(a.link, a.workers, a.toxic)

    async def on_update_toxic(self, a: acts.UpdateToxic) -> None:
        await self.network.update_toxic(a.link, a.workers, a.toxic)

    async def on_remove_toxic(self, a: acts.RemoveToxic) -> None:
        await self.network.remove_toxic(a.link, a.workers, a.name)

    async def on_cut_link(self, a: acts.CutLink) -> None:
        await self.network.set_enabled(a.link, a.workers, False)

    async def on_restore_link(self, a: acts.RestoreLink) -> None:
        await self.network.set_enabled(a.link, a.workers, True)

    async def on_reset_links(self, a: acts.ResetLinks) -> None:
        await self.network.reset()

    def on_received(self, a: acts.Received) -> set[str]:
        return self.received

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """A task of the system's alongside the run (a fault injector), stopped with the
        conductor's steps."""
        self._spawned.append(asyncio.ensure_future(work))

    def on_tail(self, a: acts.Tail) -> tuple[list[dict[str, Any]], int]:
        """The events the workers and the runner appended since the cursor (a byte offset),
        whole lines only."""
        offset = a.cursor or 0
        if not self.raw_history.exists():
            return [], offset
        with open(self.raw_history, "rb") as fh:
            fh.seek(offset)
            chunk = fh.read()
        end = chunk.rfind(b"\n") + 1
        events = []
        for line in chunk[:end].splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
        return events, offset + end

    async def history_events(self) -> AsyncIterator[dict[str, Any]]:
        """The events the workers and the runner append, as they land."""
        cursor = None
        while True:
            await asyncio.sleep(EVENT_POLL_S)
            events, cursor = self.on_tail(acts.Tail(cursor))
            for ev in events:
                yield ev

    # --- the run ------------------------------------------------------------------------

    async def run(self) -> Outcome:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            await _within(self.system.start(), ACT_LIMIT_S, "the system's start")
            final: FinalState = await self._drive(self.conductor.run())
        except BaseException:  # what the run left standing (a run that ends stops it all)
            for name, undo in (
                ("StopSpawned", self.on_stop_spawned),
                ("Disconnect", self.system.on_disconnect),
                ("TerminateWorker", self._stop_workers),
                ("CloseConsumer", self.system.on_close_consumer),
                ("the system's stop", self.system.stop),
            ):
                with contextlib.suppress(HarnessError):  # the first error is the run's
                    await _within(undo(), ACT_LIMIT_S, name)
            raise
        await _within(self.system.stop(), ACT_LIMIT_S, "the system's stop")
        self.history.close()
        history, final = self._as_seed_run(
            read_history(self.raw_history, keep_unreadable=True), final
        )
        result = check(history, final, self.check_spec())
        extra: dict[str, Any] = {"seed": self.seed, "mutant": self.mutant, "namespace": self.ns}
        extra["system"] = self.system_name
        extra["settings"] = self.spec.settings()
        extra["network"] = self.network.kind
        design = getattr(self.system, "design_settings", None)
        if design:  # what decides how fast this design recovers (a peer's timeouts)
            extra["design_settings"] = design
        if self.run_prefix:
            extra["attempt_id_prefix"] = self.run_prefix
        return Outcome(
            scenario=self.spec.name,
            result=result,
            history=history,
            duration_s=time.monotonic() - started,
            attempt_ids=list(self.seed_plans),
            final=final,
            extra=extra,
        )

    def _as_seed_run(
        self, history: list[dict[str, Any]], final: FinalState
    ) -> tuple[list[dict[str, Any]], FinalState]:
        """The run as the seed's ids name it: the checker, the outputs and the comparisons
        with the simulator see `s7-plan-0`, whatever prefix kept it apart in a shared Redis
        (`extra.attempt_id_prefix` records it). The workers' agent drew from these ids."""
        prefix = self.run_prefix
        if not prefix:
            return history, final

        def bare(value: Any) -> Any:
            return value.removeprefix(prefix) if isinstance(value, str) else value

        def event(ev: dict[str, Any]) -> dict[str, Any]:
            a = ev.get("attempt_id")
            if isinstance(a, str) and a.startswith(prefix):
                ev = {**ev, "attempt_id": a.removeprefix(prefix)}
            if ev.get("ev") in RECEIVED_EVENTS:  # the message names the run's ids
                body = ev.get("body")
                if isinstance(body, dict):
                    body = {**body, "attempt_id": bare(body.get("attempt_id"))}
                ev = {**ev, "message_id": bare(ev.get("message_id")), "body": body}
            return ev

        return [event(ev) for ev in history], self.system.seed_final(final)

    async def _stop_workers(self) -> None:
        def stop() -> None:
            for slot in self.conductor.slots:
                if slot.proc is not None:
                    slot.proc.terminate(timeout=STOP_TIMEOUT_S)

        await asyncio.to_thread(stop)

    def check_spec(self) -> CheckSpec:
        from engine.agent import AgentProfile

        agent = AgentProfile.from_dict(self.agent_dict())
        cancelled = {a.removeprefix(self.run_prefix) for a in self.cancelled}
        return self.loaded.check_spec(self.seed, self.seed_plans, cancelled, agent)


#: The consumer's records of a delivery: their message names the run's ids.
RECEIVED_EVENTS = frozenset(RECEIVED_AS.values())


async def _within(work: Coroutine[Any, Any, Any], limit_s: float, what: str) -> Any:
    """What `work` returns, or a `HarnessError` once it has run `limit_s`: then it is
    cancelled and left behind, not waited for (`asyncio.wait_for` would wait for a task
    that swallows its cancellation for as long as it swallows it)."""
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=limit_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise HarnessError(f"the runner's {what} did not end within {limit_s:.0f} s")
    return task.result()


@functools.cache
def _tables(system: type) -> tuple[dict[type, acts.Handler], dict[type, acts.Handler]]:
    return acts.handlers(ScenarioRun, system, waits=inspect.iscoroutinefunction)
