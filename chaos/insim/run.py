"""The simulated runner: one scenario file, on simulated time, judged by the live checker.

`run_scenario` carries out the run that `chaos.conductor` plans, the one the live runner
(`chaos.runner`) carries out too, with simpy in place of processes and wall time: the
same attempt ids, fault schedule, failpoints, supervision, consumer of
`evaluation.completed` (a durable queue bound before the first submit, through the
simulated broker) and end, then the same `FinalState`, `CheckSpec` and
`chaos.checker.check`. Only the acts are carried out differently: a worker is a
`sim.worker.SimWorker`, a service kill is the simulated service's, a sleep is simulated
time. Runner times (`at_s`, `restart_after_s`, `deadline_s`...) are simulated seconds; the
engine's own delays are `time_scale`d as live.

Randomness: the schedule draws from `random.Random(seed)` like the live runner; every
other draw (network latencies, boot times, dead-letter losses, the nondeterministic
agent's salts) comes from its own `random.Random` seeded with a string derived from the
seed. Nothing reads the clock, global `random`, `hash()` or a set's order, and simpy
orders simultaneous events by insertion: one seed, one history, byte for byte.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import random
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import simpy

from chaos import acts
from chaos.acts import Step
from chaos.checker import CheckResult, CheckSpec, FinalState, check, collector_paused
from chaos.conductor import Conductor
from chaos.insim import mutants
from chaos.insim.quiet import quiet
from chaos.proxy import model as proxy_model
from chaos.reference import Draws
from chaos.scenario import LoadedScenario, Scenario
from chaos.systems import on_system, refusal
from chaos.systems import system as system_named
from chaos.systems.seam import SimSystem
from engine.agent import AgentProfile, Draw, FakeAgent
from engine.config import EngineConfig
from engine.history import error_fields
from engine.plan import Plan
from engine.shell.effects import Stepper
from sim.drive import ENGINE_ERROR_LIMIT
from sim.history import Source, history_hash
from sim.network import Network
from sim.worker import EXIT_KILLED
from sim.world import SimOptions

RUNNER_PID = 1


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
    if spec.engine.amqp_heartbeat_s is not None:
        changes["amqp_heartbeat_s"] = float(spec.engine.amqp_heartbeat_s)
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
        system: str | None = None,
        adapter: type | None = None,
    ) -> None:
        """`system`: the design, instead of the scenario's `system:`; `adapter`: its
        adapter class instead of the registry's (a test's deliberately broken one)."""
        if mutant is not None and mutant not in mutants.known():
            raise ValueError(f"unknown mutant {mutant!r}; expected one of {mutants.known()}")
        loaded = on_system(loaded, system)
        problem = refusal(loaded, loaded.spec.system, "sim") or mutants.refusal(
            mutant, loaded.spec.system
        )
        if problem is not None:
            raise ValueError(problem)
        self.loaded = loaded
        self.spec = spec = loaded.spec
        self.seed = spec.seed if seed is None else seed
        self.mutant = mutant
        self.options = scenario_options(spec, options or SimOptions())
        self.env = simpy.Environment()
        self.events: list[dict[str, Any]] = []
        self.runner = Source(self.env, self.events, "runner", RUNNER_PID)
        self.shell_errors: list[str] = []
        self.engine_errors = 0
        self.stopped = self.env.event()  # too many engine errors: the run ends early
        tag = f"sim:{self.seed}"
        self.net_rng = random.Random(f"{tag}:net")
        self.boot_rng = random.Random(f"{tag}:boot")
        # a salt matters only to a mutant's agent (`nondeterministic_agent`): without one
        # none is drawn (seeding a generator from a string costs a sha512 and more)
        self.salt_rng = random.Random(f"{tag}:salt") if mutant is not None else None
        self.id_prefix = loaded.id_prefix(self.seed)
        self.plans: dict[str, Plan] = loaded.evaluations(self.seed)
        self.attempt_ids: list[str] = list(self.plans)
        self.conductor = Conductor(loaded, self.seed, mutant, self.plans)
        self.pauses = any(f.action == "pause_worker" for f in self.conductor.schedule)
        self.config = self._config()
        # the loaded scenario's own profile when it is the same (built for the same seed)
        same_seed = self.seed == spec.seed
        self.profile = loaded.agent if same_seed else AgentProfile.from_dict(self.agent_dict())
        self.immediate_retries = self.config.policy.immediate_retries  # for fail_rules
        # what the agents draw, kept for the reference (a mutant's agent may draw otherwise)
        self.draws = Draws(self.profile, self.immediate_retries) if mutant is None else None
        # the workers' proxies (the runner's own clients go around them, as live)
        self.network = Network(self.env, self.seed, proxy_model)
        self._spawned: list[simpy.Process] = []  # the conductor's steps alongside
        self.received: set[str] = set()  # attempt ids whose evaluation.completed it holds
        self.system_name = spec.system
        adapter = adapter or system_named(self.system_name).adapter("sim")
        self.system: SimSystem = adapter(self)
        self._now, self._later = _tables(type(self.system))

    # --- set-up -------------------------------------------------------------------------

    def _config(self) -> EngineConfig:
        same_seed = self.seed == self.spec.seed
        return self.spec.engine_config(
            policy=self.loaded.retry_policy if same_seed else self.spec.retry.policy(self.seed),
            sweeper=self.spec.engine.sweeper,
        )

    def agent_dict(self) -> dict[str, Any]:
        agent = dict(self.spec.agent)
        agent.setdefault("seed", self.seed)
        return agent

    def agent(self) -> FakeAgent:
        """The agent of a new worker process, salted as a live one is (`os.urandom`), from
        the seed (its salt matters only to the `nondeterministic_agent` mutant)."""
        salt = 0 if self.salt_rng is None else self.salt_rng.getrandbits(64)
        if self.draws is not None:
            return _KeepingAgent(
                self.draws,
                self.spec.time_scale,
                salt=salt,
                immediate_retries=self.immediate_retries,
            )
        return FakeAgent(
            self.profile, self.spec.time_scale, salt=salt, immediate_retries=self.immediate_retries
        )

    # --- the acts of `chaos.conductor` ---------------------------------------------------

    def _drive(self, step: Step) -> Generator[Any, Any, Any]:
        """Carry `step` out to its end; what it returns is returned. An act that takes no
        simulated time is carried out in place."""
        stepper = Stepper(step)
        while (act := stepper.advance(self._now, self)) is not None:
            try:
                stepper.reply((yield from self._later[type(act)](act, self)))
            except BaseException as exc:  # into the step (an interrupt at the end too)
                stepper.fail(exc)
        return stepper.value

    def on_now(self, a: acts.Now) -> float:
        return self.env.now

    def on_record(self, a: acts.Record) -> None:
        self.runner.record(a.event, **a.fields)

    def on_show(self, a: acts.Show) -> None:
        pass

    def on_spawn(self, a: acts.Spawn) -> None:
        self._spawned.append(self.env.process(quiet(self._drive(a.step))))

    def on_stop_spawned(self, a: acts.StopSpawned) -> None:
        for proc in self._spawned:
            if proc.is_alive:
                proc.interrupt()

    def on_sleep(self, a: acts.Sleep) -> Generator[Any, Any, None]:
        yield self.env.timeout(a.seconds)

    def on_start_worker(self, a: acts.StartWorker) -> Any:
        return self.system.worker(a.slot.index, a.slot.incarnation + 1, a.failpoints)

    def on_wait_ready(self, a: acts.WaitReady) -> Generator[Any, Any, None]:
        for slot in a.slots:  # its "ready" line, or the process gone
            yield slot.proc.ready | slot.proc.exited

    def on_kill_worker(self, a: acts.KillWorker) -> None:
        a.slot.proc.die(EXIT_KILLED)

    def on_terminate_worker(self, a: acts.TerminateWorker) -> Generator[Any, Any, None]:
        yield from a.slot.proc.terminate(a.timeout_s)

    def on_pause_worker(self, a: acts.PauseWorker) -> None:
        a.slot.proc.freeze(a.pause_s)  # SIGSTOP: none of its processes takes a step

    def on_resume_worker(self, a: acts.ResumeWorker) -> None:
        pass  # its freeze has ended

    def on_add_toxic(self, a: acts.AddToxic) -> None:
        for w in a.workers:
            self.network.link(w, a.link).add(_api(a.toxic))

    def on_update_toxic(self, a: acts.UpdateToxic) -> None:
        for w in a.workers:
            self.network.link(w, a.link).update(_api(a.toxic))

    def on_remove_toxic(self, a: acts.RemoveToxic) -> None:
        for w in a.workers:
            self.network.link(w, a.link).remove(a.name)

    def on_cut_link(self, a: acts.CutLink) -> None:
        self._set_link(a.link, a.workers, cut=True)

    def on_restore_link(self, a: acts.RestoreLink) -> None:
        self._set_link(a.link, a.workers, cut=False)

    def _set_link(self, link: str, workers: tuple[int, ...], cut: bool) -> None:
        if self.system.set_own_link(link, cut):
            return
        for w in workers:
            proxy = self.network.link(w, link)
            proxy.cut() if cut else proxy.restore()

    def on_reset_links(self, a: acts.ResetLinks) -> None:
        self.network.reset()
        self.system.heal_links()

    def on_received(self, a: acts.Received) -> set[str]:
        return self.received

    def on_tail(self, a: acts.Tail) -> tuple[list[dict[str, Any]], int]:
        return self.events[a.cursor or 0 :], len(self.events)

    def engine_error_seen(self) -> None:
        """Counted by `sim.drive.engine_error`: at the limit, the simulation stops (the run
        has failed already; the rest would repeat the same error)."""
        self.engine_errors += 1
        if self.engine_errors == ENGINE_ERROR_LIMIT:
            self.runner.record(
                "simulation_stopped",
                reason=f"the engine raised {ENGINE_ERROR_LIMIT} times (no_engine_error fails)",
            )
            self.stopped.succeed()

    def check_spec(self) -> CheckSpec:
        cancelled = self.conductor.cancelled
        return self.loaded.check_spec(
            self.seed, self.plans, cancelled, self.profile, draws=self.draws
        )

    def run(self) -> SimOutcome:
        with collector_paused():
            return self._run()

    def _run(self) -> SimOutcome:
        with mutants.patched(self.mutant):
            main = self.env.process(self._drive(self.conductor.run()))
            try:
                self.env.run(until=main | self.stopped)
                done = main.value if main.processed else None
                final = (
                    done if isinstance(done, FinalState) else self.system.read_final_or_nothing()
                )
            except Exception as exc:  # a verdict, never an exception out of the simulator
                self.runner.record_fields("engine_error", error_fields(exc, "simulation"))
                final = self.system.read_final_or_nothing()
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
                "system": self.system_name,
                "seed": self.seed,
                "mutant": self.mutant,
                "history_hash": digest,
                "sim_time_s": round(self.env.now, 6),
                **self.system.extra(),
                "shell_errors": list(self.shell_errors),
                "settings": self.spec.settings(),
            },
        )


class _KeepingAgent(FakeAgent):
    """A worker's agent that keeps each first execution's draw in the run's `Draws` (and
    reads it there when a rerun asks again): the reference then draws none of them."""

    def __init__(self, draws: Draws, time_scale: float, **kwargs: Any) -> None:
        super().__init__(draws.profile, time_scale, **kwargs)
        self._kept = draws.table

    def draw(
        self, attempt_id: str, rule_id: str, attempt: int, try_no: int, execution: int = 1
    ) -> Draw:
        if execution > 1:  # a rerun may draw its verdict afresh (drift)
            return super().draw(attempt_id, rule_id, attempt, try_no, execution)
        key = (attempt_id, rule_id, attempt, try_no)
        d = self._kept.get(key)
        if d is None:
            d = self._kept[key] = super().draw(attempt_id, rule_id, attempt, try_no)
        return d


def _api(toxic: Any) -> dict[str, Any]:
    """A toxic as Toxiproxy's API dict (`ToxicSpec.as_api`, or its `wire` shape)."""
    as_api = getattr(toxic, "as_api", None) or toxic.wire
    return as_api()


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


@functools.cache
def _tables(system: type) -> tuple[dict[type, acts.Handler], dict[type, acts.Handler]]:
    return acts.handlers(SimRun, system, waits=inspect.isgeneratorfunction)
