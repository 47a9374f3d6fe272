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

import contextlib
import dataclasses
import inspect
import random
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import simpy

from chaos import acts
from chaos.acts import Step
from chaos.checker import CheckResult, CheckSpec, EvaluationFinal, FinalState, check
from chaos.conductor import COMPLETED_QUEUE, EVENT_KEYS, RECEIVED_AS, Conductor, delivered
from chaos.insim import mutants
from chaos.proxy import model as proxy_model
from chaos.reference import Draws
from chaos.scenario import LoadedScenario, Scenario
from engine.agent import AgentProfile, Draw, FakeAgent
from engine.config import EngineConfig
from engine.core.messages import SUBMIT_REASON
from engine.core.states import TERMINAL_EVALUATION_STATUSES, EvaluationStatus
from engine.history import error_fields
from engine.keys import eval_key
from engine.plan import Plan
from engine.shell.effects import Stepper
from sim.broker import WORK_QUEUE, BrokerClient, Delivery, SimBroker
from sim.drive import ENGINE_ERROR_LIMIT
from sim.history import Source, history_hash
from sim.network import Network
from sim.redis import RedisClient, SimRedis
from sim.sentinel import SimSentinel
from sim.worker import EXIT_KILLED, SimWorker
from sim.world import SimOptions

TERMINAL = frozenset(s.value for s in TERMINAL_EVALUATION_STATUSES)
RUNNER_PID = 1
#: The runner's own publishes (submits, a cancel's announcement): `engine.submit`'s, in a
#: process of its own live, which a mutant of the worker never reaches.
RUNNER_DELIVERY_MODE = 2


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


#: Faults the simulator has no model of (a frozen RabbitMQ node: connections held, nothing
#: delivered or confirmed): such a scenario runs live or in containers only.
NOT_SIMULATED = frozenset({"pause_broker"})


def refusal(loaded: LoadedScenario) -> str | None:
    """Why the simulator cannot run this scenario, in one line (None: it can)."""
    for i, fault in enumerate(loaded.spec.faults):
        action = getattr(fault, "action", "")
        if action in NOT_SIMULATED:
            return (
                f"{loaded.path}: faults[{i}].action: {action} is not simulated (a frozen "
                "node); run it with --mode live or --mode containers"
            )
    return None


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
        problem = refusal(loaded)
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
        self.sentinel = (  # the seed's deployment: a replica the sentinels promote
            SimSentinel(
                self.env,
                self.redis,
                random.Random(f"{tag}:sentinel"),
                spec.redis.down_after_ms / 1000,
                self.options.redis_boot_s,
                (
                    float(spec.redis.min_replicas_max_lag_s)
                    if spec.redis.min_replicas_to_write
                    else None
                ),
            )
            if spec.redis.topology == "sentinel"
            else None
        )
        self.store = RedisClient(self.env, self.redis, self.net_rng, self.options.redis_latency_s)
        # the workers' proxies (the runner's own clients go around them, as live)
        self.network = Network(self.env, self.seed, proxy_model)
        self._spawned: list[simpy.Process] = []  # the conductor's steps alongside
        self._client: BrokerClient | None = None  # the runner's, as `EngineClient`
        self._events: BrokerClient | None = None  # the consumer of evaluation.completed
        self._received: set[str] = set()  # attempt ids whose evaluation.completed it holds

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
        same_seed = self.seed == self.spec.seed
        return self.spec.engine_config(
            policy=self.loaded.retry_policy if same_seed else self.spec.retry.policy(self.seed),
            sweeper=self.spec.engine.sweeper,
        )

    def agent_dict(self) -> dict[str, Any]:
        agent = dict(self.spec.agent)
        agent.setdefault("seed", self.seed)
        return agent

    def _agent(self) -> FakeAgent:
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
        while (act := stepper.advance(_NOW, self)) is not None:
            try:
                stepper.reply((yield from _LATER[type(act)](act, self)))
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
        self._spawned.append(self.env.process(_quiet(self._drive(a.step))))

    def on_stop_spawned(self, a: acts.StopSpawned) -> None:
        for proc in self._spawned:
            if proc.is_alive:
                proc.interrupt()

    def on_sleep(self, a: acts.Sleep) -> Generator[Any, Any, None]:
        yield self.env.timeout(a.seconds)

    def on_start_worker(self, a: acts.StartWorker) -> SimWorker:
        slot = a.slot
        config = dataclasses.replace(self.config)  # each process parses its own, as live
        return SimWorker(
            self, slot.index, slot.incarnation + 1, a.failpoints, self._agent(), config
        )

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

    def on_kill_service(self, a: acts.KillService) -> int | None:
        """The broker says how many messages it held (the model counts them)."""
        # a clean stop (`a.graceful`) is a kill here: the engine sees its connections go
        # either way, and neither an fsync-always Redis nor durable queues lose anything
        # (persistent messages: a transient one is lost either way)
        if a.name == "redis" and self.sentinel is not None:
            self.sentinel.kill_primary()
            return None
        if a.name == "redis":
            self.redis.kill()
            return None
        return self.broker.kill()

    def on_restart_service(self, a: acts.RestartService) -> Generator[Any, Any, int | None]:
        o = self.options
        if a.name == "redis" and self.sentinel is not None:
            yield from self.sentinel.restart_killed()
            return None
        yield self.env.timeout(o.redis_boot_s if a.name == "redis" else o.broker_boot_s)
        if a.name == "redis":
            return self.redis.restart()
        return self.broker.restart()  # the messages it found

    def on_pause_service(self, a: acts.PauseService) -> None:
        assert a.name == "redis", "only Redis is paused"
        if self.sentinel is not None:
            self.sentinel.pause_primary()
        else:
            self.redis.pause()

    def on_resume_service(self, a: acts.ResumeService) -> bool:
        if self.sentinel is not None:
            return self.sentinel.resume_primary()
        return self.redis.resume()

    def on_kill_sentinel(self, a: acts.KillSentinel) -> None:
        assert self.sentinel is not None, "a sentinel without Sentinel"
        self.sentinel.kill_sentinel()

    def on_restart_sentinel(self, a: acts.RestartSentinel) -> None:
        assert self.sentinel is not None, "a sentinel without Sentinel"
        self.sentinel.restart_sentinel()

    def on_await_failover(self, a: acts.AwaitFailover) -> Generator[Any, Any, bool]:
        assert self.sentinel is not None, "a failover without Sentinel"
        return (yield from self.sentinel.wait_back())

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
        if link == "replication":  # the replica's link to the primary: one, not per worker
            assert self.sentinel is not None, "a replication link without Sentinel"
            self.sentinel.partition(cut)
            return
        for w in workers:
            proxy = self.network.link(w, link)
            proxy.cut() if cut else proxy.restore()

    def on_reset_links(self, a: acts.ResetLinks) -> None:
        self.network.reset()
        if self.sentinel is not None:
            self.sentinel.partition(False)

    def on_connect(self, a: acts.Connect) -> Generator[Any, Any, None]:
        client = BrokerClient(self.env, self.broker, "runner", delivery_mode=RUNNER_DELIVERY_MODE)
        while not (yield from client.connect()):  # connect_robust waits for the node
            yield self.env.timeout(self.options.reconnect_interval_s)
        self._client = client

    def on_disconnect(self, a: acts.Disconnect) -> Generator[Any, Any, None]:
        if self._client is not None:
            yield from self._client.close()

    def on_submit(self, a: acts.Submit) -> Generator[Any, Any, None]:
        assert self._client is not None
        body = {
            "type": "execute",
            "attempt_id": a.attempt_id,
            "plan": a.plan,  # the live message carries plan.to_dict(); the sim, the plan
            "reason": SUBMIT_REASON,
            "published_ms": int(self.env.now * 1000),
        }
        yield from self._client.publish_work(body, a.attempt_id)

    def on_cancel(self, a: acts.Cancel) -> Generator[Any, Any, str]:
        """`EngineClient.cancel`, on a connection of its own."""
        attempt_id = a.attempt_id
        client = BrokerClient(
            self.env, self.broker, "runner-cancel", delivery_mode=RUNNER_DELIVERY_MODE
        )
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
        yield from client.close()
        return kept or EvaluationStatus.CANCELLED.value

    def on_publish_raw(self, a: acts.PublishRaw) -> Generator[Any, Any, None]:
        """On a connection of its own, as `on_cancel`."""
        client = BrokerClient(
            self.env, self.broker, "runner-poison", delivery_mode=RUNNER_DELIVERY_MODE
        )
        while not (yield from client.connect()):
            yield self.env.timeout(self.options.reconnect_interval_s)
        yield from client.publish_work(a.body, a.message_id)
        yield from client.close()

    def on_settled(self, a: acts.Settled) -> int:
        if not self.redis.up:
            return 0
        settled = 0
        for attempt_id in a.attempt_ids:
            state, _, published = self.redis.record(attempt_id)
            settled += state in TERMINAL and published
        return settled

    def on_leases(self, a: acts.Leases) -> dict[str, str] | None:
        if not self.redis.up:
            return None
        holders = {i: self.redis.holder(i) for i in a.attempt_ids}
        return {i: h for i, h in holders.items() if h is not None}

    def on_announced(self, a: acts.Announced) -> set[str]:
        redis = self.redis
        return {i for i in a.attempt_ids if redis.up and redis.record(i)[2]}

    def on_received(self, a: acts.Received) -> set[str]:
        return self._received

    def on_tail(self, a: acts.Tail) -> tuple[list[dict[str, Any]], int]:
        return self.events[a.cursor or 0 :], len(self.events)

    def on_read_final(self, a: acts.ReadFinal) -> FinalState:
        if not self.redis.up:  # the final state needs Redis back
            self.redis.restart()
        return self._final_state()

    def _final_state(self) -> FinalState:
        """`ScenarioRun.on_read_final`: each evaluation's keys, every key's TTL (the engine's
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
        ttls = redis.ttls(f"attempt:{self.id_prefix}")
        ttls.update(
            {k.removeprefix(ns): t for k, t in redis.ttls(self.config.name("engine:")).items()}
        )
        indexes = {
            key.removeprefix(ns): {
                str(m): float(v) for m, v in sorted((redis.get(key) or {}).items())
            }
            for key in (redis.running_index, redis.retries_index)
        }
        return FinalState(evaluations=evaluations, key_ttls=ttls, indexes=indexes)

    # --- the harness's consumer of evaluation.completed -----------------------------------

    def on_bind_consumer(self, a: acts.BindConsumer) -> Generator[Any, Any, None]:
        """`acts.BindConsumer`, on a robust connection of its own."""
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
        for key in EVENT_KEYS:
            self.broker.bind_events(queue, key)

        def received(d: Delivery) -> None:
            body = orjson.loads(orjson.dumps(d.body))  # a copy, as JSON carries it
            fields = delivered(body, d.message_id, d.redelivered, d.delivery_mode)
            ev = RECEIVED_AS.get(d.routing_key, "completed_received")
            self.runner.record(ev, **fields)
            if ev == "completed_received" and isinstance(body, dict):
                self._received.add(str(body.get("attempt_id")))
            events.settle(d)

        events.consume(queue, 64, received)
        self._events = events
        for key in EVENT_KEYS:
            self.runner.record("events_consumer_bound", queue=queue, routing_key=key)

    def on_close_consumer(self, a: acts.CloseConsumer) -> Generator[Any, Any, None]:
        """The live runner's: first what is left in the work and delay queues
        (`queues_drained`), then the consumer closed."""
        if self.broker.up:
            left = [
                str(m.message_id)
                for q in self.broker.queues.values()
                if q.owner is None and (q.delay or q.name == WORK_QUEUE)
                for m in q.messages
            ]
            for q in self.broker.queues.values():
                if q.owner is None and (q.delay or q.name == WORK_QUEUE):
                    q.messages.clear()
            self.runner.record("queues_drained", message_ids=sorted(left))
        if self._events is not None:
            yield from self._events.close()

    def _final_or_nothing(self) -> FinalState:
        """The store as the run left it; a store a broken engine left unreadable (a key or
        an index member of the wrong type) is an engine error, judged with nothing read."""
        try:
            return self.on_read_final(acts.ReadFinal())
        except Exception as exc:
            self.runner.record_fields("engine_error", error_fields(exc, "reading the final state"))
            return FinalState()

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
        with mutants.patched(self.mutant):
            main = self.env.process(self._drive(self.conductor.run()))
            try:
                self.env.run(until=main | self.stopped)
                done = main.value if main.processed else None
                final = done if isinstance(done, FinalState) else self._final_or_nothing()
            except Exception as exc:  # a verdict, never an exception out of the simulator
                self.runner.record_fields("engine_error", error_fields(exc, "simulation"))
                final = self._final_or_nothing()
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


_NOW, _LATER = acts.handlers(SimRun, waits=inspect.isgeneratorfunction)
