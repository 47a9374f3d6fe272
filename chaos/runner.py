"""The live runner: one scenario against real workers, a real Redis and a real RabbitMQ.

Jepsen's split, in small pieces: the *client* submits evaluations and cancels them
(`engine.submit.EngineClient`); the *nemesis* fires the scenario's faults (SIGKILL a worker,
Redis or the broker and bring it back, arm failpoints in worker processes); the *generator*
is the fault schedule, planned as data from the scenario's seed before the run starts;
a *consumer* of `evaluation.completed`, bound before the first submit, records what a
downstream service would receive; the *checker* (`chaos.checker`) reads the recorded
history and the final Redis state (its keys, TTLs and the engine's indexes) once
everything has stopped. The runner itself only supervises: it restarts crashed workers,
watches the history for event-triggered faults, and waits until every evaluation is
terminal or the deadline passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustConnection,
)

from chaos.checker import CheckResult, CheckSpec, EvaluationFinal, FinalState, check
from chaos.checker.records import LIVE_SCHEDULING_SLACK_S
from chaos.scenario import EventTriggers, LoadedScenario, PlannedFault, fault_schedule
from chaos.services import Services
from chaos.supervision import Exited, Healed, Slot, Start, fired, supervise
from chaos.workers import WorkerProcess
from engine.config import EngineConfig
from engine.core.states import TERMINAL_EVALUATION_STATUSES
from engine.history import FileHistory, read_history
from engine.plan import Plan
from engine.runtime.store import RedisStore, eval_key, glob_escape
from engine.submit import EngineClient

TERMINAL = {s.value for s in TERMINAL_EVALUATION_STATUSES}
READY_TIMEOUT_S = 30.0
#: The harness's durable queue of `evaluation.completed` (in the run's namespace).
COMPLETED_QUEUE = "chaos.completed"
#: How long the end of a run waits for the consumer to hold every announced evaluation.
DELIVERY_PATIENCE_S = 10.0


def run_prefix(namespace: str, *, shared_redis: bool) -> str:
    """What a run puts before the seed's attemptIds: its unique namespace on a shared Redis
    (another run of the same seed may be using it), nothing on its own."""
    return namespace if shared_redis else ""


class RunRefused(ValueError):
    """The scenario cannot run in this mode (a kill fault against a shared service)."""


def refusal(loaded: LoadedScenario, killable: set[str]) -> str | None:
    """Why the scenario cannot run against these services, in one line (None: it can)."""
    spec = loaded.spec
    kills = {"kill_redis": "redis", "kill_broker": "broker"}
    needed = {kills[f.action] for f in spec.faults if getattr(f, "action", "") in kills}
    missing = needed - killable
    if missing:
        names = " and ".join(sorted(missing))
        return (
            f"{loaded.path}: faults: kills {names}, but this run uses a shared service "
            "(REDIS_URL/AMQP_URL); unset them to let the run start its own"
        )
    # settings only the run's own instances take: a node's consumer_timeout, an AOF to cut
    owned = [
        ("broker.consumer_timeout_s", "broker", "AMQP_URL", spec.broker.consumer_timeout_s),
        ("redis.lose_last_writes", "redis", "REDIS_URL", spec.redis.lose_last_writes or None),
    ]
    for field_name, service, variable, value in owned:
        if value is not None and service not in killable:
            return (
                f"{loaded.path}: {field_name}: needs the run's own {service}, but this run "
                f"uses a shared one ({variable}); unset it to let the run start its own"
            )
    return None


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
class _Worker(Slot[WorkerProcess]):
    """A worker index (`restart_at` on the monotonic clock), and where the log of its
    current incarnation starts."""

    log_offset: int = 0


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
        # Queues and index keys are the run's own (`ns`). On the run's own Redis the
        # attemptIds are the seed's (as the simulator's are), and leftovers of an earlier run
        # of the same ids are cleared first; on a shared one (REDIS_URL) they carry `ns` too,
        # so two runs of one seed never read, overwrite or delete each other's keys.
        self.run_prefix = run_prefix(self.ns, shared_redis=services.redis is None)
        self.id_prefix = self.run_prefix + loaded.id_prefix(self.seed)
        self.seed_plans: dict[str, Plan] = loaded.evaluations(self.seed)
        self.plans: dict[str, Plan] = {self.run_prefix + a: p for a, p in self.seed_plans.items()}
        self.attempt_ids: list[str] = list(self.plans)
        self.cancelled: set[str] = set()
        self.workers: list[_Worker] = []
        self._events_conn: AbstractRobustConnection | None = None  # the consumer's
        self._events_queue: AbstractQueue | None = None
        self._received: set[str] = set()  # attemptIds whose evaluation.completed arrived
        self._fault_ids = itertools.count(1)  # fault_fired / worker_exited -> fault_healed
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

    # --- workers ------------------------------------------------------------------------

    def _start_worker(self, w: _Worker) -> None:
        failpoints = w.failpoints if w.incarnation == 0 else []
        module = ("chaos.mutants", self.mutant) if self.mutant else ("engine.worker",)
        log = self.run_dir / f"worker{w.index}.log"
        w.log_offset = log.stat().st_size if log.exists() else 0
        proc = WorkerProcess(
            self.worker_args(failpoints),
            env={"REDIS_URL": self.services.redis_url, "AMQP_URL": self.services.amqp_url},
            log_path=self.run_dir / f"worker{w.index}.log",
            name=f"worker{w.index}",
            module=module,
        ).start()
        if w.incarnation:
            self.history.record("worker_restarted", worker=w.index, pid=proc.pid)
        w.started(proc)

    async def _wait_ready(self, w: _Worker) -> None:
        assert w.proc is not None
        proc = w.proc
        ok = await asyncio.to_thread(proc.wait_for_log, "ready", READY_TIMEOUT_S)
        if not ok and proc.alive:
            raise RuntimeError(f"worker {w.index} did not get ready in {READY_TIMEOUT_S:.0f} s")

    def _kill_worker(self, w: _Worker, restart_after_s: float | None, fault_id: int) -> None:
        """SIGKILL; the fault heals once a restarted worker is ready (never without one)."""
        if w.proc is None or not w.proc.alive:
            self._healed(fault_id)  # nothing to kill: nothing broken
            return
        pid = w.proc.pid
        w.proc.kill()
        self.history.record("worker_killed", worker=w.index, pid=pid)
        w.killed(time.monotonic(), restart_after_s, fault_id)

    def _healed(self, fault_id: int) -> None:
        """The fault's window closes: the checker reads it from here, not from guesses."""
        self.history.record("fault_healed", fault_id=fault_id)

    def _ready(self, w: _Worker) -> bool:
        """Whether the current incarnation has said "ready" in its log (no waiting)."""
        if w.proc is None or w.proc.log_path is None or not w.proc.log_path.exists():
            return False
        with open(w.proc.log_path, "rb") as fh:
            fh.seek(w.log_offset)
            return b" ready: " in fh.read()

    def _supervise(self) -> None:
        """Restart workers that crashed (a failpoint) or were killed, when it is time."""
        delay = self.spec.restart_delay_s if self.spec.restart_crashed_workers else None
        now = time.monotonic()
        for d in supervise(self.workers, now, _alive, self._ready, self._fault_ids, delay):
            match d:
                case Healed(fault_id=fault_id):
                    self._healed(fault_id)
                case Exited(slot=Slot(proc=proc)):
                    self.history.record("worker_exited", **d.record(proc.returncode, proc.pid))
                case Start(slot=w):
                    self._start_worker(w)
        self.progress.workers_alive = sum(1 for w in self.workers if w.proc and w.proc.alive)

    # --- faults -------------------------------------------------------------------------

    async def _fire(self, fault: PlannedFault) -> None:
        """Fire one fault (`chaos.supervision.fired` says what its record holds)."""
        self.progress.faults_fired += 1
        fault_id = next(self._fault_ids)
        self.history.record("fault_fired", **fired(fault, fault_id))
        if fault.action == "kill_worker":
            self._kill_worker(self.workers[fault.target], fault.restart_after_s, fault_id)
        elif fault.action == "restart_worker":
            w = self.workers[fault.target]
            if w.proc is not None:
                await asyncio.to_thread(w.proc.terminate)
            w.restart(time.monotonic(), fault_id)
        elif fault.action == "pause_worker":
            w = self.workers[fault.target]
            if w.proc is None or not w.proc.alive:
                self._healed(fault_id)  # nothing to pause: nothing broken
                return
            proc = w.proc
            proc.pause()
            self.history.record("worker_paused", worker=w.index, pid=proc.pid)
            self._later(fault.pause_s or 0.0, self._resume_worker(w, proc, fault_id))
        elif fault.action in ("kill_redis", "kill_broker"):
            name = "redis" if fault.action == "kill_redis" else "broker"
            svc = self.services.service(name)
            await asyncio.to_thread(svc.kill)
            self.history.record("service_killed", service=name)
            if fault.restart_after_s is not None:
                self._later(fault.restart_after_s, self._restart_service(name, fault_id))
        elif fault.action == "cancel":
            attempt_id = self.attempt_ids[fault.target]
            self.cancelled.add(attempt_id)
            self.history.record("cancel_requested", attempt_id=attempt_id)
            async with EngineClient(self.config()) as client:
                state = await client.cancel(attempt_id)
            self.history.record("cancel_written", attempt_id=attempt_id, state=state)
            self._healed(fault_id)

    async def _resume_worker(self, w: _Worker, proc: WorkerProcess, fault_id: int) -> None:
        if w.proc is proc and proc.alive:
            proc.resume()
            self.history.record("worker_resumed", worker=w.index, pid=proc.pid)
        self._healed(fault_id)

    async def _restart_service(self, name: str, fault_id: int) -> None:
        svc = self.services.service(name)
        extra = {}
        if name == "redis" and self.spec.redis.lose_last_writes:
            extra["lost_writes"] = await self._lose_redis_writes()
        await asyncio.to_thread(svc.restart)
        self.history.record("service_restarted", service=name, **extra)
        self._healed(fault_id)

    async def _lose_redis_writes(self) -> int:
        """`redis.lose_last_writes`: the stopped server's append-only file loses its last
        writes before it comes back (`chaos.aof`), as after a failover to a lagging replica."""
        return await asyncio.to_thread(
            self.services.lose_redis_writes, self.spec.redis.lose_last_writes
        )

    async def _lose_retries(self, client: EngineClient) -> None:
        """`broker.dead_letter_loss`: each delayed retry the workers publish is lost or not,
        by the draw the simulator makes on the same id (`BrokerSpec.loses`); a lost one is
        taken off its delay queue and acknowledged before its TTL sends it on."""
        broker = self.spec.broker
        if not broker.dead_letter_loss or client.broker.connection is None:
            return
        channel = await client.broker.connection.channel()
        try:
            async for ev in self._history_events():
                if ev.get("ev") != "retry_published":
                    continue
                a, rule, n = ev.get("attempt_id"), ev.get("rule_id"), ev.get("attempt")
                seed_id = f"{str(a).removeprefix(self.run_prefix)}:{rule}:{n}"
                if broker.loses(self.seed, seed_id):
                    queue = client.broker.delay_queues.get((int(ev["tier"]) - 1, ev["bucket"]))
                    taken = queue is not None and await _take(channel, queue, f"{a}:{rule}:{n}")
                    self.history.record(
                        "retry_lost" if taken else "retry_loss_missed",
                        attempt_id=a,
                        rule_id=rule,
                        attempt=n,
                    )
        finally:
            with contextlib.suppress(Exception):
                await channel.close()

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

    async def _history_events(self) -> AsyncIterator[dict[str, Any]]:
        """The events the workers and the runner append, as they land (whole lines only)."""
        offset = 0
        while True:
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
                    yield json.loads(line)
                except ValueError:
                    continue

    async def _event_faults(self) -> None:
        triggers = EventTriggers(self.schedule)
        if triggers.done:
            return
        async for ev in self._history_events():
            for fault in triggers.feed(ev):
                if fault.delay_s:  # a repetition: `every_s` after the one before
                    self._later(fault.delay_s, self._fire(fault))
                else:
                    await self._fire(fault)
            if triggers.done:
                return

    # --- the run ------------------------------------------------------------------------

    async def run(self) -> Outcome:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        spec = self.spec
        self.workers = [
            _Worker(i, [s for s in [self.loaded.failpoint_specs(i, self.attempt_ids)] if s])
            for i in range(spec.workers)
        ]
        started = time.monotonic()
        await asyncio.to_thread(self.services.configure, spec.broker.consumer_timeout_s)
        await self._clear_earlier_runs()
        self.history.record("run_started", scenario=spec.name, seed=self.seed, mutant=self.mutant)
        tasks: list[asyncio.Task[None]] = []
        try:
            for w in self.workers:
                self._start_worker(w)
            await asyncio.gather(*(self._wait_ready(w) for w in self.workers))
            async with EngineClient(self.config()) as client:
                await self._bind_consumer()
                self._t0 = time.monotonic()
                for attempt_id in self.attempt_ids:
                    plan = self.plans[attempt_id]
                    self.history.record("submitted", attempt_id=attempt_id, plan=plan.id)
                    await client.submit(plan, attempt_id)
                tasks = [
                    asyncio.ensure_future(self._timed_faults()),
                    asyncio.ensure_future(self._event_faults()),
                    asyncio.ensure_future(self._lose_retries(client)),
                ]
                await self._wait_terminal(client, tasks)
                await self._wait_delivered(client)
        finally:
            for task in [*tasks, *self._pending]:
                task.cancel()
            await asyncio.gather(*tasks, *self._pending, return_exceptions=True)
            await self._stop_workers()
            await self._close_consumer()
        final = await self._final_state()
        self.history.record("run_finished", duration_s=round(time.monotonic() - started, 3))
        self.history.close()
        history, final = self._as_seed_run(
            read_history(self.raw_history, keep_unreadable=True), final
        )
        result = check(history, final, self.check_spec())
        extra: dict[str, Any] = {"seed": self.seed, "mutant": self.mutant, "namespace": self.ns}
        if self.run_prefix:
            extra["attempt_id_prefix"] = self.run_prefix
        return Outcome(
            scenario=spec.name,
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
            if ev.get("ev") == "completed_received":  # the message names the run's ids
                body = ev.get("body")
                if isinstance(body, dict):
                    body = {**body, "attempt_id": bare(body.get("attempt_id"))}
                ev = {**ev, "message_id": bare(ev.get("message_id")), "body": body}
            return ev

        evaluations = {
            a.removeprefix(prefix): dataclasses.replace(f, attempt_id=a.removeprefix(prefix))
            for a, f in final.evaluations.items()
        }
        key_ttls = {
            k.replace(f"attempt:{prefix}", "attempt:", 1): ttl for k, ttl in final.key_ttls.items()
        }
        indexes = None
        if final.indexes is not None:
            indexes = {
                key: {bare(m): score for m, score in members.items()}
                for key, members in final.indexes.items()
            }
        seed_final = dataclasses.replace(
            final, evaluations=evaluations, key_ttls=key_ttls, indexes=indexes
        )
        return [event(ev) for ev in history], seed_final

    async def _clear_earlier_runs(self) -> None:
        """Leftovers of an earlier run of the same seed on the run's own Redis. On a shared
        one there are none to clear: the ids carry this run's own prefix."""
        if self.run_prefix:
            return
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

    # --- the harness's consumer of evaluation.completed ---------------------------------

    async def _bind_consumer(self) -> None:
        """Before the first submit: a durable queue (a broker kill keeps what it holds and
        what was confirmed into it) bound to the events exchange for `evaluation.completed`,
        consumed on a robust connection of its own. Every delivery is recorded as
        `completed_received`, then acknowledged. `x-expires` removes the queue should the
        runner die before deleting it."""
        config = self.config()
        url = self.services.amqp_url
        self._events_conn = await aio_pika.connect_robust(url, reconnect_interval=0.5)
        channel = await self._events_conn.channel()
        await channel.set_qos(prefetch_count=64)
        exchange = await channel.declare_exchange(
            config.name("evaluation.events"), aio_pika.ExchangeType.TOPIC, durable=True
        )
        name = config.name(COMPLETED_QUEUE)
        queue = await channel.declare_queue(name, durable=True, arguments={"x-expires": 600_000})
        await queue.bind(exchange, routing_key="evaluation.completed")
        await queue.consume(self._on_completed, no_ack=False)
        self._events_queue = queue
        self.history.record("events_consumer_bound", queue=name, routing_key="evaluation.completed")

    async def _on_completed(self, message: AbstractIncomingMessage) -> None:
        try:
            body: Any = json.loads(message.body)
        except ValueError:
            body = message.body.decode("utf-8", "replace")
        self.history.record(
            "completed_received",
            attempt_id=body.get("attempt_id") if isinstance(body, dict) else None,
            message_id=message.message_id,
            body=body,
            redelivered=message.redelivered,
        )
        if isinstance(body, dict):
            self._received.add(str(body.get("attempt_id")))
        with contextlib.suppress(Exception):  # the channel went with the broker: redelivered
            await message.ack()

    async def _wait_delivered(self, client: EngineClient) -> None:
        """Until the consumer holds an evaluation.completed of every evaluation announced
        (Redis' `final_published`), or `DELIVERY_PATIENCE_S` passed: deliveries trail the
        publisher's confirm by a little."""
        until = time.monotonic() + DELIVERY_PATIENCE_S
        ids = list(self.attempt_ids)
        while time.monotonic() < until:
            try:
                flags = await client.store.redis.mget([eval_key(a, "final_published") for a in ids])
            except Exception:  # Redis is down (a fault): look again shortly
                flags = [None] * len(ids)
            got = self._received
            if all(a in got for a, flag in zip(ids, flags, strict=True) if flag):
                return
            await asyncio.sleep(0.05)

    async def _close_consumer(self) -> None:
        """Delete the queue (a shared broker keeps nothing of the run) and disconnect."""
        queue, conn = self._events_queue, self._events_conn
        self._events_queue = self._events_conn = None
        if queue is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(queue.delete(if_unused=False, if_empty=False), 5.0)
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 5.0)

    async def _final_state(self) -> FinalState:
        for name in ("redis",):  # the final state needs Redis up
            svc = self.services.redis if name == "redis" else None
            if svc is not None and not svc.alive:
                if self.spec.redis.lose_last_writes:
                    await self._lose_redis_writes()
                await asyncio.to_thread(svc.restart)
        store = RedisStore(self.config())
        try:
            evaluations: dict[str, EvaluationFinal] = {}
            for attempt_id in self.attempt_ids:
                plan = self.plans[attempt_id]
                snap = await store.snapshot(attempt_id, plan.order)
                record = await store.record(attempt_id)
                passes = await store.redis.hgetall(eval_key(attempt_id, "passes"))
                evaluations[attempt_id] = EvaluationFinal(
                    attempt_id=attempt_id,
                    state=record.state,
                    results=dict(snap.results),
                    statuses=dict(snap.statuses),
                    published=record.final_published,
                    passes=dict(sorted(passes.items())),
                )
            # Every key the engine wrote: the evaluations' and its own (`{ns}engine:*`, named
            # without the namespace, as the simulator names them), with their TTLs.
            ttls: dict[str, int] = {}
            keys: list[str] = []
            for pattern in (f"attempt:{self.id_prefix}*", f"{glob_escape(self.ns)}*"):
                keys += [k async for k in store.redis.scan_iter(match=pattern, count=1000)]
            if keys:
                async with store.redis.pipeline(transaction=False) as pipe:
                    for k in keys:
                        pipe.ttl(k)
                    for k, ttl in zip(keys, await pipe.execute(), strict=True):
                        ttls[k.removeprefix(self.ns)] = int(ttl)
            indexes: dict[str, dict[str, float]] = {}
            for key in (store.running_index, store.retries_index):
                members = await store.redis.zrange(key, 0, -1, withscores=True)
                indexes[key.removeprefix(self.ns)] = {str(m): float(v) for m, v in members}
            return FinalState(evaluations=evaluations, key_ttls=ttls, indexes=indexes)
        finally:
            await store.close()

    def check_spec(self) -> CheckSpec:
        from engine.agent import AgentProfile

        agent = AgentProfile.from_dict(self.agent_dict())
        cancelled = {a.removeprefix(self.run_prefix) for a in self.cancelled}
        spec = self.loaded.check_spec(self.seed, self.seed_plans, cancelled, agent)
        return dataclasses.replace(spec, scheduling_slack_s=LIVE_SCHEDULING_SLACK_S)


async def _take(channel: AbstractChannel, queue_name: str, message_id: str) -> bool:
    """Take the message `message_id` off a queue for good (get, then ACK), handing back the
    ones got before it (NACK with requeue: they keep their place and their TTL)."""
    queue = await channel.get_queue(queue_name, ensure=False)
    others: list[AbstractIncomingMessage] = []
    found = False
    try:
        while True:
            message = await queue.get(no_ack=False, fail=False, timeout=5.0)
            if message is None:
                break
            if message.message_id == message_id:
                await message.ack()
                found = True
                break
            others.append(message)
    finally:
        for message in others:
            await message.nack(requeue=True)
    return found


def _alive(proc: WorkerProcess) -> bool:
    return proc.alive
