"""The simulated runner: one scenario file, on simulated time, judged by the live checker.

`run_scenario` does what `chaos.runner.ScenarioRun.run` does, step for step, with simpy
in place of processes and wall time: the same attempt ids, the same fault schedule
(`chaos.scenario.fault_schedule` with `random.Random(seed)`), the same failpoint specs
per worker (first incarnation only), the same supervision (a 50 ms poll that notes
`worker_exited` and restarts workers), the same 20 ms watch of the history for
event-triggered faults, the same consumer of `evaluation.completed` (a durable queue bound
before the first submit, through the simulated broker), the same end (every evaluation
terminal and announced, and delivered, no fault or restart pending, or the deadline), then
the same `FinalState` and `CheckSpec`, and
`chaos.checker.check`. Runner times (`at_s`, `restart_after_s`, `deadline_s`...) are
simulated seconds; the engine's own delays are `time_scale`d as live.

Randomness: the schedule draws from `random.Random(seed)` like the live runner; every
other draw (network latencies, boot times, dead-letter losses, the nondeterministic
agent's salts) comes from its own `random.Random` seeded with a string derived from the
seed. Nothing reads the clock, global `random`, `hash()` or a set's order, and simpy
orders simultaneous events by insertion: one seed, one history, byte for byte.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import simpy

from chaos.checker import CheckResult, CheckSpec, EvaluationFinal, FinalState, check
from chaos.insim import mutants
from chaos.scenario import EventTriggers, LoadedScenario, PlannedFault, Scenario, fault_schedule
from chaos.supervision import Exited, Healed, Slot, Start, fired, supervise
from engine.agent import AgentProfile, FakeAgent
from engine.config import EngineConfig
from engine.core.routing import SUBMIT_REASON
from engine.core.states import TERMINAL_EVALUATION_STATUSES, EvaluationStatus
from engine.plan import Plan
from engine.runtime.store import eval_key
from sim.broker import BrokerClient, Delivery, SimBroker
from sim.history import Source, history_hash
from sim.redis import RedisClient, SimRedis
from sim.worker import EXIT_KILLED, SimWorker
from sim.world import SimOptions

TERMINAL = frozenset(s.value for s in TERMINAL_EVALUATION_STATUSES)
RUNNER_PID = 1
#: The harness's durable queue of `evaluation.completed` (in the run's namespace).
COMPLETED_QUEUE = "chaos.completed"
#: How long the end of a run waits for the consumer to hold every announced evaluation.
DELIVERY_PATIENCE_S = 10.0


def scenario_options(spec: Scenario, options: SimOptions) -> SimOptions:
    """The simulated machines, with what the scenario file sets of them (`broker:` and
    `redis:`) taking precedence over `options`."""
    changes: dict[str, Any] = {}
    if spec.broker.consumer_timeout_s is not None:
        changes["consumer_timeout_s"] = spec.broker.consumer_timeout_s
    if spec.broker.dead_letter_loss:
        changes["dead_letter_loss"] = spec.broker.dead_letter_loss
    if spec.redis.lose_last_writes:
        changes["redis_failover_loss"] = spec.redis.lose_last_writes
    return dataclasses.replace(options, **changes) if changes else options


@dataclass
class SimOutcome:
    """What `chaos.runner.Outcome` holds, on simulated time, plus the history's hash.

    `history` is in the order events happened (the live raw file's order); `history_hash`
    is `sim.history.history_hash` of it: sha256 of one sorted-keys JSON object a line."""

    scenario: str
    result: CheckResult
    history: list[dict[str, Any]]
    final: FinalState
    history_hash: str
    sim_time_s: float
    attempt_ids: list[str]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.sim_time_s


class SimRun:
    def __init__(
        self,
        loaded: LoadedScenario,
        seed: int | None = None,
        mutant: str | None = None,
        options: SimOptions | None = None,
    ) -> None:
        if mutant is not None and mutant not in mutants.known():
            raise ValueError(f"unknown mutant {mutant!r}; expected one of {mutants.known()}")
        self.loaded = loaded
        self.spec = spec = loaded.spec
        self.seed = spec.seed if seed is None else seed
        self.mutant = mutant
        self.history_drops = mutants.history_drops(mutant)
        self.options = scenario_options(spec, options or SimOptions())
        self.env = simpy.Environment()
        self.events: list[dict[str, Any]] = []
        self.runner = Source(self.env, self.events, "runner", RUNNER_PID)
        self.shell_errors: list[str] = []
        tag = f"sim:{self.seed}"
        self.net_rng = random.Random(f"{tag}:net")
        self.boot_rng = random.Random(f"{tag}:boot")
        self.salt_rng = random.Random(f"{tag}:salt")
        self.schedule: list[PlannedFault] = fault_schedule(spec, random.Random(self.seed))
        self.pauses = any(f.action == "pause_worker" for f in self.schedule)
        self.id_prefix = loaded.id_prefix(self.seed)
        self.plans: dict[str, Plan] = loaded.evaluations(self.seed)
        self.attempt_ids: list[str] = list(self.plans)
        self.cancelled: set[str] = set()
        self.config = self._config()
        self.profile = AgentProfile.from_dict(self.agent_dict())
        self.immediate_retries = self.config.policy.immediate_retries  # for fail_rules
        self.agent = FakeAgent(
            self.profile, self.spec.time_scale, salt=0, immediate_retries=self.immediate_retries
        )
        self.redis = SimRedis(
            self.env,
            running_index=self.config.name("engine:running"),
            retries_index=self.config.name("engine:retries"),
            ttl_s=self.config.state_ttl_s,
            lease_ms=self.config.stale_ms,
            failover_loss=self.options.redis_failover_loss,
        )
        delay_queues = {}
        for tier, bucket, ms in self.config.policy.delay_queues():
            ttl_ms = max(1, round(ms * spec.time_scale))
            name = f"evaluation.retry.t{tier + 1}.b{bucket}.{ttl_ms}ms"
            delay_queues[(tier, bucket)] = (name, ttl_ms / 1000)
        self.broker = SimBroker(
            self.env,
            self.net_rng,
            self.options.broker_latency_s,
            delay_queues,
            dead_letter_loss=self.options.dead_letter_loss,
            consumer_timeout_s=self.options.consumer_timeout_s,
            loses=self._loses if spec.broker.dead_letter_loss else None,
            on_lost=self._retry_lost,
        )
        self.slots = [
            Slot[SimWorker](i, loaded.failpoint_specs(i, self.attempt_ids))
            for i in range(spec.workers)
        ]
        self.store = RedisClient(self.env, self.redis, self.net_rng, self.options.redis_latency_s)
        self._t0 = 0.0
        self._later: list[simpy.Process] = []
        self._fault_ids = itertools.count(1)  # fault_fired / worker_exited -> fault_healed
        self._faults: list[simpy.Process] = []
        self._events: BrokerClient | None = None  # the consumer of evaluation.completed

    # --- set-up -------------------------------------------------------------------------

    def _loses(self, message_id: str | None) -> bool:
        """`broker.dead_letter_loss`: the live runner's draw, on the same id."""
        return self.spec.broker.loses(self.seed, message_id)

    def _retry_lost(self, body: dict[str, Any]) -> None:
        """A dead-lettered retry vanished (the live runner records the one it takes)."""
        self.runner.record(
            "retry_lost",
            attempt_id=body.get("attempt_id"),
            rule_id=body.get("rule_id"),
            attempt=body.get("attempt"),
        )

    def _config(self) -> EngineConfig:
        return self.spec.engine_config(
            policy=self.spec.retry.policy(self.seed),
            sweeper=self.spec.engine.sweeper and self.mutant != "no_sweeper",
        )

    def agent_dict(self) -> dict[str, Any]:
        agent = dict(self.spec.agent)
        agent.setdefault("seed", self.seed)
        return agent

    def _agent(self) -> FakeAgent:
        """The agent of a new worker process: the shared one, or (mutant) one salted anew."""
        if self.mutant != "nondeterministic_agent":
            return self.agent
        salt = self.salt_rng.getrandbits(64)  # per process, like os.urandom in a live one
        return FakeAgent(
            self.profile,
            self.spec.time_scale,
            nondeterministic=True,
            salt=salt,
            immediate_retries=self.immediate_retries,
        )

    # --- workers ------------------------------------------------------------------------

    def _start_worker(self, slot: Slot[SimWorker]) -> None:
        failpoints = slot.failpoints if slot.incarnation == 0 else ""
        w = SimWorker(
            self,
            slot.index,
            slot.incarnation + 1,
            failpoints,
            self._agent(),
            self.config,
        )
        if slot.incarnation:
            self.runner.record("worker_restarted", worker=slot.index, pid=w.pid)
        slot.started(w)

    def _kill_worker(
        self, slot: Slot[SimWorker], restart_after_s: float | None, fault_id: int
    ) -> None:
        """SIGKILL; the fault heals once a restarted worker is ready (never without one)."""
        w = slot.proc
        if w is None or not w.alive:
            self._healed(fault_id)  # nothing to kill: nothing broken
            return
        w.die(EXIT_KILLED)
        self.runner.record("worker_killed", worker=slot.index, pid=w.pid)
        slot.killed(self.env.now, restart_after_s, fault_id)

    def _healed(self, fault_id: int) -> None:
        """The fault's window closes: the checker reads it from here, not from guesses."""
        self.runner.record("fault_healed", fault_id=fault_id)

    def _supervise(self) -> None:
        delay = self.spec.restart_delay_s if self.spec.restart_crashed_workers else None
        for d in supervise(self.slots, self.env.now, _alive, _ready, self._fault_ids, delay):
            match d:
                case Healed(fault_id=fault_id):
                    self._healed(fault_id)
                case Exited(slot=Slot(proc=w)):
                    self.runner.record("worker_exited", **d.record(w.exit_code, w.pid))
                case Start(slot=slot):
                    self._start_worker(slot)

    # --- faults -------------------------------------------------------------------------

    def _fire(self, fault: PlannedFault) -> Generator[Any, Any, None]:
        """`ScenarioRun._fire`: `fault_fired` with a `fault_id`, and `fault_healed` with
        it once the runner has undone the fault."""
        fault_id = next(self._fault_ids)
        self.runner.record("fault_fired", **fired(fault, fault_id))
        if fault.action == "kill_worker":
            self._kill_worker(self.slots[fault.target], fault.restart_after_s, fault_id)
        elif fault.action == "restart_worker":
            slot = self.slots[fault.target]
            if slot.proc is not None:
                yield from slot.proc.terminate(5.0)
            slot.restart(self.env.now, fault_id)
        elif fault.action == "pause_worker":
            w = self.slots[fault.target].proc
            if w is None or not w.alive:
                self._healed(fault_id)
                return
            w.freeze(fault.pause_s or 0.0)  # SIGSTOP: none of its processes takes a step
            self.runner.record("worker_paused", worker=fault.target, pid=w.pid)
            self._later_do(fault.pause_s or 0.0, self._resume_worker(fault.target, w, fault_id))
        elif fault.action in ("kill_redis", "kill_broker"):
            name = "redis" if fault.action == "kill_redis" else "broker"
            (self.redis if name == "redis" else self.broker).kill()
            self.runner.record("service_killed", service=name)
            if fault.restart_after_s is not None:
                self._later_do(fault.restart_after_s, self._restart_service(name, fault_id))
        elif fault.action == "cancel":
            attempt_id = self.attempt_ids[fault.target]
            self.cancelled.add(attempt_id)
            self.runner.record("cancel_requested", attempt_id=attempt_id)
            yield from self._cancel(attempt_id)
            self._healed(fault_id)

    def _restart_service(self, name: str, fault_id: int) -> Generator[Any, Any, None]:
        o = self.options
        yield self.env.timeout(o.redis_boot_s if name == "redis" else o.broker_boot_s)
        if name == "redis":
            lost = self.redis.restart()
            extra = {"lost_writes": lost} if self.spec.redis.lose_last_writes else {}
            self.runner.record("service_restarted", service=name, **extra)
        else:
            self.broker.restart()
            self.runner.record("service_restarted", service=name)
        self._healed(fault_id)

    def _cancel(self, attempt_id: str) -> Generator[Any, Any, None]:
        """`EngineClient.cancel`, on a connection of its own."""
        client = BrokerClient(self.env, self.broker, "runner-cancel")
        while not (yield from client.connect()):  # connect_robust waits for the node
            yield self.env.timeout(self.options.reconnect_interval_s)
        kept = yield from self.store.call(
            self.redis.set_state, attempt_id, EvaluationStatus.CANCELLED.value
        )
        if kept is None:
            body = {"attempt_id": attempt_id, "status": "cancelled", "verdicts": {}}
            yield from client.publish_event("evaluation.completed", body, f"{attempt_id}:completed")
            yield from self.store.call(self.redis.done, attempt_id, "")
            yield from client.publish_control({"type": "cancel", "attempt_id": attempt_id})
        state = kept or EvaluationStatus.CANCELLED.value
        self.runner.record("cancel_written", attempt_id=attempt_id, state=state)
        yield from client.close()

    def _resume_worker(self, index: int, w: SimWorker, fault_id: int) -> Generator[Any, Any, None]:
        if self.slots[index].proc is w and w.alive:
            self.runner.record("worker_resumed", worker=index, pid=w.pid)
        self._healed(fault_id)
        yield from ()

    def _later_do(self, delay_s: float, gen: Generator) -> None:
        def later() -> Generator[Any, Any, None]:
            yield self.env.timeout(delay_s)
            yield from gen

        self._later.append(self.env.process(_quiet(later())))

    def _timed_faults(self) -> Generator[Any, Any, None]:
        for fault in sorted(
            (f for f in self.schedule if f.at_s is not None), key=lambda f: f.at_s or 0.0
        ):
            delay = self._t0 + (fault.at_s or 0.0) - self.env.now
            if delay > 0:
                yield self.env.timeout(delay)
            yield from self._fire(fault)

    def _event_faults(self) -> Generator[Any, Any, None]:
        triggers = EventTriggers(self.schedule)
        offset = 0
        while not triggers.done:
            yield self.env.timeout(self.options.event_poll_s)
            fresh, offset = self.events[offset:], len(self.events)
            for ev in fresh:
                for fault in triggers.feed(ev):
                    if fault.delay_s:
                        self._later_do(fault.delay_s, self._fire(fault))
                    else:
                        yield from self._fire(fault)

    # --- the run ------------------------------------------------------------------------

    def main(self) -> Generator[Any, Any, FinalState]:
        env, spec = self.env, self.spec
        started = env.now
        self.runner.record("run_started", scenario=spec.name, seed=self.seed, mutant=self.mutant)
        for slot in self.slots:
            self._start_worker(slot)
        for slot in self.slots:  # `_wait_ready`: the "ready" line, or the process gone
            assert slot.proc is not None
            yield slot.proc.ready | slot.proc.exited
        client = BrokerClient(env, self.broker, "runner")
        while not (yield from client.connect()):
            yield env.timeout(self.options.reconnect_interval_s)
        yield from self._bind_consumer()
        self._t0 = env.now
        for attempt_id in self.attempt_ids:
            plan = self.plans[attempt_id]
            self.runner.record("submitted", attempt_id=attempt_id, plan=plan.id)
            body = {
                "type": "execute",
                "attempt_id": attempt_id,
                "plan": plan,  # the live message carries plan.to_dict(); the sim, the plan
                "reason": SUBMIT_REASON,
                "published_ms": int(env.now * 1000),
            }
            yield from client.publish_work(body, attempt_id)
        self._faults = [
            env.process(_quiet(self._timed_faults())),
            env.process(_quiet(self._event_faults())),
        ]
        yield from self._wait_terminal()
        yield from self._wait_delivered()
        for proc in [*self._faults, *self._later]:
            if proc.is_alive:
                proc.interrupt()
        yield from client.close()
        for slot in self.slots:  # `_stop_workers`: SIGTERM, SIGKILL after 3 s
            if slot.proc is not None:
                yield from slot.proc.terminate(3.0)
        if self._events is not None:
            yield from self._events.close()
        if not self.redis.up:  # the final state needs Redis back
            self.redis.restart()
        final = self._final_state()
        self.runner.record("run_finished", duration_s=round(env.now - started, 3))
        return final

    def _wait_terminal(self) -> Generator[Any, Any, None]:
        env, redis = self.env, self.redis
        deadline = self._t0 + self.spec.deadline_s
        timed = self._faults[0]
        while True:
            self._supervise()
            terminal = 0
            if redis.up:
                for a in self.attempt_ids:
                    state, _, published = redis.record(a)
                    terminal += state in TERMINAL and published
            elapsed = env.now - self._t0
            pending_faults = timed.is_alive and any(
                f.at_s is not None and f.at_s > elapsed for f in self.schedule
            )
            restarting = any(s.restart_at is not None for s in self.slots) or any(
                p.is_alive for p in self._later
            )
            if terminal == len(self.attempt_ids) and not pending_faults and not restarting:
                return
            if env.now >= deadline:
                return
            yield env.timeout(self.options.poll_s)

    def _final_state(self) -> FinalState:
        """`ScenarioRun._final_state`: each evaluation's keys, every key's TTL (the engine's
        own `engine:*` keys too) and the members of its indexes."""
        redis = self.redis
        evaluations: dict[str, EvaluationFinal] = {}
        for attempt_id in self.attempt_ids:
            snap = redis.snapshot(attempt_id, self.plans[attempt_id].order)
            state, _, published = redis.record(attempt_id)
            passes = redis.get(eval_key(attempt_id, "passes")) or {}
            evaluations[attempt_id] = EvaluationFinal(
                attempt_id=attempt_id,
                state=state,
                results=dict(snap.results),
                statuses=dict(snap.statuses),
                published=published,
                passes={str(p): str(o) for p, o in sorted(passes.items())},
            )
        ns = self.config.name("")
        ttls = {k: redis.ttl_of(k) for k in redis.keys(f"attempt:{self.id_prefix}")}
        ttls.update(
            {k.removeprefix(ns): redis.ttl_of(k) for k in redis.keys(self.config.name("engine:"))}
        )
        indexes = {
            key.removeprefix(ns): {
                str(m): float(v) for m, v in sorted((redis.get(key) or {}).items())
            }
            for key in (redis.running_index, redis.retries_index)
        }
        return FinalState(evaluations=evaluations, key_ttls=ttls, indexes=indexes)

    # --- the harness's consumer of evaluation.completed -----------------------------------

    def _bind_consumer(self) -> Generator[Any, Any, None]:
        """`ScenarioRun._bind_consumer`: a durable queue bound to the events exchange for
        `evaluation.completed` before the first submit, consumed on a robust connection of
        its own; every delivery is recorded (`completed_received`), then acknowledged."""
        env = self.env
        events = BrokerClient(
            env,
            self.broker,
            "runner-events",
            reconnect_interval_s=self.options.reconnect_interval_s,
            spawn=lambda gen: env.process(_quiet(gen)),
        )
        while not (yield from events.connect()):
            yield env.timeout(self.options.reconnect_interval_s)
        queue = self.config.name(COMPLETED_QUEUE)
        self.broker.bind_events(queue, "evaluation.completed")

        def received(d: Delivery) -> None:
            body = orjson.loads(orjson.dumps(d.body))  # a copy, as JSON carries it
            self.runner.record(
                "completed_received",
                attempt_id=body.get("attempt_id") if isinstance(body, dict) else None,
                message_id=d.message_id,
                body=body,
                redelivered=d.redelivered,
            )
            events.settle(d)

        events.consume(queue, 64, received)
        self._events = events
        self.runner.record("events_consumer_bound", queue=queue, routing_key="evaluation.completed")

    def _wait_delivered(self) -> Generator[Any, Any, None]:
        """`ScenarioRun._wait_delivered`: until the consumer holds an evaluation.completed
        of every evaluation announced, or `DELIVERY_PATIENCE_S` passed."""
        until = self.env.now + DELIVERY_PATIENCE_S
        while self.env.now < until:
            got = {e.get("attempt_id") for e in self.events if e.get("ev") == "completed_received"}
            announced = [a for a in self.attempt_ids if self.redis.up and self.redis.record(a)[2]]
            if all(a in got for a in announced):
                return
            yield self.env.timeout(self.options.event_poll_s)

    def check_spec(self) -> CheckSpec:
        return self.loaded.check_spec(self.seed, self.plans, self.cancelled, self.profile)

    def run(self) -> SimOutcome:
        with mutants.patched(self.mutant):
            main = self.env.process(self.main())
            self.env.run(until=main)
        final: FinalState = main.value
        result = check(self.events, final, self.check_spec())
        digest = history_hash(self.events)
        return SimOutcome(
            scenario=self.spec.name,
            result=result,
            history=self.events,
            final=final,
            history_hash=digest,
            sim_time_s=self.env.now,
            attempt_ids=list(self.attempt_ids),
            extra={
                "mode": "sim",
                "seed": self.seed,
                "mutant": self.mutant,
                "history_hash": digest,
                "sim_time_s": round(self.env.now, 6),
                "dead_letters_lost": self.broker.dead_letters_lost,
                "shell_errors": list(self.shell_errors),
            },
        )


def _quiet(gen: Generator) -> Generator[Any, Any, None]:
    """A runner task cancelled at the end of the run stops where it waits."""
    with contextlib.suppress(simpy.Interrupt):
        yield from gen


def run_scenario(
    loaded: LoadedScenario,
    seed: int | None = None,
    mutant: str | None = None,
    *,
    options: SimOptions | None = None,
) -> SimOutcome:
    """Run a loaded scenario in the simulator and check it (`seed` overrides the file's)."""
    return SimRun(loaded, seed, mutant, options).run()


def outputs(outcome: SimOutcome, out_dir: str | Path) -> None:
    """`history.jsonl` and `journal.json` in `out_dir`, as `python -m chaos run` writes them."""
    from chaos.journal import write_outputs

    extra = {**outcome.extra, "mode": "sim", "history_hash": outcome.history_hash}
    write_outputs(out_dir, outcome.scenario, outcome.history, outcome.result, extra)


def _alive(w: SimWorker) -> bool:
    return w.alive


def _ready(slot: Slot[SimWorker]) -> bool:
    """The live runner reads "ready" in a worker's log; here the worker says it."""
    return slot.proc is not None and slot.proc.ready.triggered
