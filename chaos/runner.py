"""The live runner: one scenario against real workers, a real Redis and a real RabbitMQ.

Jepsen's split, in small pieces: the *client* submits evaluations and cancels them
(`engine.submit.EngineClient`); the *generator* is the fault schedule, planned as data from
the scenario's seed; the *nemesis* fires it, and the runner supervises the workers, as
`chaos.conductor` plans both, for this runner and the simulated one alike. This module
only carries the conductor's acts out: worker processes started, SIGKILLed, SIGSTOPped;
Redis and the broker killed and brought back; a *consumer* of `evaluation.completed`,
bound before the first submit, recording what a downstream service would receive; and,
once everything has stopped, the final Redis state (its keys, TTLs and the engine's
indexes) for the *checker* (`chaos.checker`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
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
from aio_pika.exceptions import AMQPError, ChannelInvalidStateError, ChannelNotFoundEntity

from chaos import acts
from chaos.acts import Step
from chaos.checker import CheckResult, CheckSpec, EvaluationFinal, FinalState, check
from chaos.conductor import (
    COMPLETED_QUEUE,
    EVENT_KEYS,
    EVENT_POLL_S,
    RECEIVED_AS,
    STOP_TIMEOUT_S,
    Conductor,
    Progress,
    delivered,
)
from chaos.links import REPLICATION, Network
from chaos.scenario import LoadedScenario
from chaos.scenario.schema import SERVICE_ACTIONS
from chaos.services import SentinelRedis, Services
from chaos.supervision import Slot
from chaos.workers import WorkerProcess
from engine.config import EngineConfig
from engine.core.states import TERMINAL_EVALUATION_STATUSES
from engine.history import FileHistory, read_history
from engine.plan import Plan
from engine.runtime.broker import delay_queue_names
from engine.runtime.store import RedisStore, eval_key, glob_escape
from engine.shell.effects import Stepper
from engine.submit import EngineClient

TERMINAL = {s.value for s in TERMINAL_EVALUATION_STATUSES}
READY_TIMEOUT_S = 30.0
#: How long a clean stop of a service (`stop_redis`, `stop_broker`) may take before SIGKILL.
SERVICE_STOP_TIMEOUT_S = 30.0
#: How often the end of a Redis failover is looked for (Sentinel tells no one).
FAILOVER_POLL_S = 0.05
#: The loss injector (`broker.dead_letter_loss`) rides out the broker faults it runs beside:
#: while the broker is down it waits; once it runs, a take that keeps failing is tried this
#: many times, `INJECTOR_RETRY_S` apart, on a new connection each, before the scenario ends
#: in a `HarnessError`.
INJECTOR_TRIES = 40
INJECTOR_RETRY_S = 0.25
#: What a broker that went away (killed, restarting, paused) makes an AMQP client raise.
_BROKER_AWAY = (AMQPError, OSError, ChannelInvalidStateError)  # TimeoutError is an OSError


class HarnessError(RuntimeError):
    """The harness itself failed in a scenario (a fault injector could not carry out its
    fault): the scenario has no verdict. One line says why; the run goes on to the next."""


def run_prefix(namespace: str, *, shared_redis: bool) -> str:
    """What a run puts before the seed's attemptIds: its unique namespace on a shared Redis
    (another run of the same seed may be using it), nothing on its own."""
    return namespace if shared_redis else ""


class RunRefused(ValueError):
    """The scenario cannot run in this mode (a kill fault against a shared service)."""


def refusal(loaded: LoadedScenario, killable: set[str]) -> str | None:
    """Why the scenario cannot run against these services, in one line (None: it can)."""
    spec = loaded.spec
    needed = {
        SERVICE_ACTIONS[f.action][0]
        for f in spec.faults
        if getattr(f, "action", "") in SERVICE_ACTIONS
    }
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
        # Queues and index keys are the run's own (`ns`). On the run's own Redis the
        # attemptIds are the seed's (as the simulator's are), and leftovers of an earlier run
        # of the same ids are cleared first; on a shared one (REDIS_URL) they carry `ns` too,
        # so two runs of one seed never read, overwrite or delete each other's keys.
        # Behind Sentinel the run has a topology of its own, whatever REDIS_URL says
        # a replication link to fault goes through the run's proxies (`chaos.links`)
        replication = any(getattr(f, "link", None) == REPLICATION for f in self.spec.faults)
        self.sentinel = (
            SentinelRedis(
                self.spec.redis.down_after_ms,
                replication_via=self._replication_via if replication else None,
                min_replicas=(
                    (self.spec.redis.min_replicas_to_write, self.spec.redis.min_replicas_max_lag_s)
                    if self.spec.redis.min_replicas_to_write
                    else None
                ),
            )
            if self.spec.redis.topology == "sentinel"
            else None
        )
        own_redis = services.redis is not None or self.sentinel is not None
        self.run_prefix = run_prefix(self.ns, shared_redis=not own_redis)
        self.id_prefix = self.run_prefix + loaded.id_prefix(self.seed)
        self.seed_plans: dict[str, Plan] = loaded.evaluations(self.seed)
        self.plans: dict[str, Plan] = {self.run_prefix + a: p for a, p in self.seed_plans.items()}
        self.attempt_ids: list[str] = list(self.plans)
        self.conductor = Conductor(loaded, self.seed, mutant, self.plans)
        self.cancelled = self.conductor.cancelled
        self.progress = self.conductor.progress
        self._client: EngineClient | None = None  # the runner's, between Connect and Disconnect
        self._events_conn: AbstractRobustConnection | None = None  # the consumer's
        self._events_queue: AbstractQueue | None = None
        self._received: set[str] = set()  # attemptIds whose evaluation.completed arrived
        self._spawned: list[asyncio.Task[Any]] = []  # the conductor's steps alongside
        self._stopped: set[str] = set()  # services killed, stopped or paused, until back
        self.network = Network(  # behind Sentinel the workers reach the primary directly
            self.ns,
            self.seed,
            self.spec.workers,
            None if self.sentinel is not None else services.redis_url,
            services.amqp_url,
            self.spec.engine.amqp_heartbeat_s,
            replication_upstream=(
                f"127.0.0.1:{self.sentinel.primary_port}"
                if self.sentinel is not None and replication
                else None
            ),
        )
        self._refuse_unsupported()

    # --- set-up -------------------------------------------------------------------------

    @property
    def redis_url(self) -> str:
        """The workers' and the runner's Redis: the topology's sentinels, or the service."""
        return self.sentinel.url if self.sentinel is not None else self.services.redis_url

    def _replication_via(self, host: str, port: int) -> tuple[str, int]:
        """Where the replica replicates from: the run's replication proxy."""
        listen_host, _, listen_port = self.network.replication_listen.rpartition(":")
        return listen_host or host, int(listen_port)

    def _worker_redis_url(self, index: int) -> str:
        """Through the worker's own proxy; behind Sentinel, the sentinels themselves."""
        return self.redis_url if self.sentinel is not None else self.network.url(index, "redis")

    def _refuse_unsupported(self) -> None:
        killable = self.services.killable | ({"redis"} if self.sentinel is not None else set())
        problem = refusal(self.loaded, killable)
        if problem:
            raise RunRefused(problem)

    def config(self) -> EngineConfig:
        return self.spec.engine_config(
            redis_url=self.redis_url,
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
        while (act := stepper.advance(_NOW, self)) is not None:
            try:
                stepper.reply(await _LATER[type(act)](act, self))
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
        module = ("chaos.mutants", self.mutant) if self.mutant else ("engine.worker",)
        index = a.slot.index
        return WorkerProcess(
            self.worker_args([a.failpoints] if a.failpoints else []),
            env={  # through the worker's own proxies (`chaos.links`)
                "REDIS_URL": self._worker_redis_url(index),
                "AMQP_URL": self.network.url(index, "broker"),
            },
            log_path=self.run_dir / f"worker{index}.log",
            name=f"worker{index}",
            module=module,
        ).start()

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

    async def on_kill_service(self, a: acts.KillService) -> None:
        if a.name == "redis" and self.sentinel is not None:
            await asyncio.to_thread(self.sentinel.kill)
            return
        svc = self.services.service(a.name)
        self._stopped.add(a.name)
        if a.graceful:
            await asyncio.to_thread(svc.terminate, SERVICE_STOP_TIMEOUT_S)
        else:
            await asyncio.to_thread(svc.kill)

    async def on_restart_service(self, a: acts.RestartService) -> int | None:
        if a.name == "redis" and self.sentinel is not None:
            await asyncio.to_thread(self.sentinel.restart)
            return None
        lost = None
        if a.name == "redis" and self.spec.redis.lose_last_writes:
            lost = await self._lose_redis_writes()
        await asyncio.to_thread(self.services.service(a.name).restart)
        self._stopped.discard(a.name)  # ready again: the restart waits for it
        return lost

    async def on_pause_service(self, a: acts.PauseService) -> None:
        if a.name == "redis" and self.sentinel is not None:
            await asyncio.to_thread(self.sentinel.pause)
            return
        self._stopped.add(a.name)
        await asyncio.to_thread(self.services.service(a.name).pause)

    async def on_resume_service(self, a: acts.ResumeService) -> bool:
        if a.name == "redis" and self.sentinel is not None:
            return await asyncio.to_thread(self.sentinel.resume)
        await asyncio.to_thread(self.services.service(a.name).resume)
        self._stopped.discard(a.name)
        return False

    async def on_kill_sentinel(self, a: acts.KillSentinel) -> None:
        assert self.sentinel is not None, "a sentinel without Sentinel"
        await asyncio.to_thread(self.sentinel.kill_sentinel, a.index)

    async def on_restart_sentinel(self, a: acts.RestartSentinel) -> None:
        assert self.sentinel is not None, "a sentinel without Sentinel"
        await asyncio.to_thread(self.sentinel.restart_sentinel, a.index)

    async def on_await_failover(self, a: acts.AwaitFailover) -> bool:
        """Until the sentinels name a primary that answers as one (polled: Sentinel tells
        nobody); whether it is the promoted replica."""
        assert self.sentinel is not None, "a failover without Sentinel"
        while (promoted := await asyncio.to_thread(self.sentinel.serving)) is None:
            await asyncio.sleep(FAILOVER_POLL_S)
        return promoted

    async def _lose_redis_writes(self) -> int:
        """`redis.lose_last_writes`: the stopped server's append-only file loses its last
        writes before it comes back (`chaos.aof`), as after a failover to a lagging replica."""
        return await asyncio.to_thread(
            self.services.lose_redis_writes, self.spec.redis.lose_last_writes
        )

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

    async def on_connect(self, a: acts.Connect) -> None:
        client = EngineClient(self.config())
        await client.__aenter__()
        self._client = client
        if self.spec.broker.dead_letter_loss:  # the simulated broker draws its own
            self._spawned.append(asyncio.ensure_future(self._lose_retries(client)))

    async def on_disconnect(self, a: acts.Disconnect | None = None) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.__aexit__(None, None, None)

    async def on_submit(self, a: acts.Submit) -> None:
        assert self._client is not None
        await self._client.submit(a.plan, a.attempt_id)

    async def on_cancel(self, a: acts.Cancel) -> str:
        async with EngineClient(self.config()) as client:
            return await client.cancel(a.attempt_id)

    async def on_publish_raw(self, a: acts.PublishRaw) -> None:
        async with EngineClient(self.config()) as client:
            await client.broker.publish_work_raw(a.body, a.message_id)

    async def on_settled(self, a: acts.Settled) -> int:
        assert self._client is not None
        keys = [eval_key(i, k) for i in a.attempt_ids for k in ("state", "final_published")]
        try:
            values = await self._client.store.redis.mget(keys)
        except Exception:  # Redis is down (a fault): none counts
            return 0
        pairs = zip(values[::2], values[1::2], strict=True)
        return sum(1 for state, published in pairs if state in TERMINAL and published)

    async def on_leases(self, a: acts.Leases) -> dict[str, str] | None:
        assert self._client is not None
        try:
            owners = await self._client.store.redis.mget(
                [eval_key(i, "owner") for i in a.attempt_ids]
            )
        except Exception:  # Redis is down (a fault): nothing to say
            return None
        return {i: o for i, o in zip(a.attempt_ids, owners, strict=True) if o is not None}

    async def on_announced(self, a: acts.Announced) -> set[str]:
        assert self._client is not None
        keys = [eval_key(i, "final_published") for i in a.attempt_ids]
        try:
            flags = await self._client.store.redis.mget(keys)
        except Exception:  # Redis is down (a fault): none counts
            return set()
        return {i for i, flag in zip(a.attempt_ids, flags, strict=True) if flag}

    def on_received(self, a: acts.Received) -> set[str]:
        return self._received

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

    async def _lose_retries(self, client: EngineClient) -> None:
        """`broker.dead_letter_loss`: each delayed retry the workers publish is lost or not,
        by the draw the simulator makes on the same id (`BrokerSpec.loses`); a lost one is
        taken off its delay queue and acknowledged before its TTL sends it on. The injector
        has a connection of its own, opened again after the broker went away (`_Taker`);
        any failure of its own ends the scenario in a `HarnessError` line."""
        broker = self.spec.broker
        if not broker.dead_letter_loss or client.broker.connection is None:
            return
        taker = _Taker(client.broker.config, self._broker_up)
        try:
            async for ev in self._history_events():
                if ev.get("ev") != "retry_published":
                    continue
                a, rule, n = ev.get("attempt_id"), ev.get("rule_id"), ev.get("attempt")
                seed_id = f"{str(a).removeprefix(self.run_prefix)}:{rule}:{n}"
                if broker.loses(self.seed, seed_id):
                    queue = client.broker.delay_queues.get((int(ev["tier"]) - 1, ev["bucket"]))
                    taken = queue is not None and await taker.take(queue, f"{a}:{rule}:{n}")
                    self.history.record(
                        "retry_lost" if taken else "retry_loss_missed",
                        attempt_id=a,
                        rule_id=rule,
                        attempt=n,
                    )
        except HarnessError:
            raise
        except Exception as exc:  # the injector's own bug: one line, not a traceback
            raise HarnessError(
                f"broker.dead_letter_loss: the loss injector failed: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            await taker.close()

    def _broker_up(self) -> bool:
        """Whether the scenario's broker runs and answers: not killed, stopped or paused by
        the run since its last restart or resume came back ready (a broker given by
        AMQP_URL is never stopped by the run)."""
        node = self.services.broker
        return "broker" not in self._stopped and (node is None or node.alive)

    async def _history_events(self) -> AsyncIterator[dict[str, Any]]:
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
        await asyncio.to_thread(self.services.configure, self.spec.broker.consumer_timeout_s)
        try:
            await self.network.start()  # first: the replica may replicate through it
            if self.sentinel is not None:
                await asyncio.to_thread(self.sentinel.start)
            await self._clear_earlier_runs()
            final: FinalState = await self._drive(self.conductor.run())
        except BaseException:  # what the run left standing (a run that ends stops it all)
            await self.on_stop_spawned()
            await self.on_disconnect()
            await self._stop_workers()
            await self.on_close_consumer()
            await self.network.close()
            await self._stop_sentinel()
            raise
        await self.network.close()
        await self._stop_sentinel()
        self.history.close()
        history, final = self._as_seed_run(
            read_history(self.raw_history, keep_unreadable=True), final
        )
        result = check(history, final, self.check_spec())
        extra: dict[str, Any] = {"seed": self.seed, "mutant": self.mutant, "namespace": self.ns}
        extra["settings"] = self.spec.settings()
        extra["network"] = self.network.kind
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

    async def _stop_sentinel(self) -> None:
        if self.sentinel is not None:
            await asyncio.to_thread(self.sentinel.stop)

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
            if self.spec.redis.lose_last_writes and keys:
                await _rewrite_aof(store.redis)
        finally:
            await store.close()

    async def _stop_workers(self) -> None:
        def stop() -> None:
            for slot in self.conductor.slots:
                if slot.proc is not None:
                    slot.proc.terminate(timeout=STOP_TIMEOUT_S)

        await asyncio.to_thread(stop)

    # --- the harness's consumer of evaluation.completed ---------------------------------

    async def on_bind_consumer(self, a: acts.BindConsumer) -> None:
        """Before the first submit: a durable queue (a broker kill keeps what it holds and
        what was confirmed into it) bound to the events exchange for `evaluation.completed`
        and `evaluation.started`, consumed on a robust connection of its own. Every
        delivery is recorded (`RECEIVED_AS`), then acknowledged.
        `x-expires` removes the queue should the runner die before deleting it."""
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
        for key in EVENT_KEYS:
            await queue.bind(exchange, routing_key=key)
        await queue.consume(self._on_completed, no_ack=False)
        self._events_queue = queue
        for key in EVENT_KEYS:
            self.history.record("events_consumer_bound", queue=name, routing_key=key)

    async def _on_completed(self, message: AbstractIncomingMessage) -> None:
        try:
            body: Any = json.loads(message.body)
        except ValueError:
            body = message.body.decode("utf-8", "replace")
        fields = delivered(body, message.message_id, message.redelivered, message.delivery_mode)
        ev = RECEIVED_AS.get(message.routing_key or "", "completed_received")
        self.history.record(ev, **fields)
        if ev == "completed_received" and isinstance(body, dict):
            self._received.add(str(body.get("attempt_id")))
        with contextlib.suppress(Exception):  # the channel went with the broker: redelivered
            await message.ack()

    async def on_close_consumer(self, a: acts.CloseConsumer | None = None) -> None:
        """Delete the queue (a shared broker keeps nothing of the run) and disconnect. At
        the end of a run (the workers stopped: nothing is held unacknowledged), first take
        what is left in the work and delay queues (`queues_drained`, their message ids):
        the messages a broker restart kept that nobody consumed (`nothing_lost_on_restart`)."""
        if a is not None and self._events_conn is not None:
            left = await self._drain_queues(self._events_conn)
            if left is not None:
                self.history.record("queues_drained", message_ids=left)
        queue, conn = self._events_queue, self._events_conn
        self._events_queue = self._events_conn = None
        if queue is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(queue.delete(if_unused=False, if_empty=False), 5.0)
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 5.0)

    async def _drain_queues(self, conn: AbstractRobustConnection) -> list[str] | None:
        """The message ids left in the run's work and delay queues, taken off them (None:
        the broker could not be asked)."""
        config = self.config()
        names = [config.name("evaluation.execute")]
        names += [name for name, _ in delay_queue_names(config).values()]
        names.append(config.name("evaluation.retry.shared"))  # the per_message_ttl mutant's
        left: list[str] = []
        try:
            for name in names:
                channel = await asyncio.wait_for(conn.channel(), 5.0)
                try:
                    queue = await channel.declare_queue(name, passive=True, timeout=5.0)
                except ChannelNotFoundEntity:
                    continue  # never declared (the failed declare closed the channel)
                while (m := await queue.get(no_ack=True, fail=False, timeout=5.0)) is not None:
                    left.append(str(m.message_id))
                await channel.close()
        except Exception:  # the broker is down at the end: nothing to say
            return None
        return sorted(left)

    async def on_read_final(self, a: acts.ReadFinal) -> FinalState:
        redis = self.services.redis if self.sentinel is None else None
        if self.sentinel is not None and await asyncio.to_thread(self.sentinel.serving) is None:
            await asyncio.to_thread(self.sentinel.restart)  # no failover: the primary back
        if redis is not None and not redis.alive:  # the final state needs Redis up
            if self.spec.redis.lose_last_writes:
                await self._lose_redis_writes()
            await asyncio.to_thread(redis.restart)
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
        return self.loaded.check_spec(self.seed, self.seed_plans, cancelled, agent)


class _Taker:
    """The loss injector's own connection to the broker, opened when a take needs it and
    opened again after the broker went away, so that the injector survives a broker kill
    or restart beside it: while the broker is down, a take waits for it; once it runs, a
    take is tried `INJECTOR_TRIES` times before it fails the scenario (`HarnessError`)."""

    def __init__(self, config: EngineConfig, broker_up: Callable[[], bool]) -> None:
        self.url = config.amqp_url
        self.timeout_s = config.connect_timeout_s
        self.broker_up = broker_up
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._channel: AbstractChannel | None = None

    async def take(self, queue: str, message_id: str) -> bool:
        """`_take` on a live channel; False when the message had left its queue."""
        tries = 0
        while True:
            try:
                return await _take(await self._open(), queue, message_id)
            except _BROKER_AWAY as exc:
                await self.close()
                if self.broker_up():
                    tries += 1
                    if tries >= INJECTOR_TRIES:
                        raise HarnessError(
                            f"broker.dead_letter_loss: the loss injector could not take "
                            f"{message_id} off {queue} in {tries} tries with the broker "
                            f"running ({type(exc).__name__}: {exc})"
                        ) from exc
                await asyncio.sleep(INJECTOR_RETRY_S)

    async def _open(self) -> AbstractChannel:
        if self._channel is None or self._channel.is_closed:
            await self.close()
            self._connection = await aio_pika.connect(self.url, timeout=self.timeout_s)
            self._channel = await asyncio.wait_for(self._connection.channel(), self.timeout_s)
        return self._channel

    async def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), self.timeout_s)


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


#: The consumer's records of a delivery: their message names the run's ids.
RECEIVED_EVENTS = frozenset(RECEIVED_AS.values())

_NOW, _LATER = acts.handlers(ScenarioRun, waits=inspect.iscoroutinefunction)


#: How long the AOF rewrite before a lossy run may take (an empty-ish Redis: milliseconds).
AOF_REWRITE_TIMEOUT_S = 30.0


async def _rewrite_aof(redis: Any) -> None:
    """Fold the AOF into its base file, so that `redis.lose_last_writes` (which cuts the
    last incremental file, `chaos.aof`) loses this run's writes only: an earlier scenario's
    leftovers deleted just before would otherwise come back with the cut (a lease of a
    worker long gone, seen in the gate after another seed-2 scenario)."""
    await redis.bgrewriteaof()
    deadline = time.monotonic() + AOF_REWRITE_TIMEOUT_S
    while time.monotonic() < deadline:
        info = await redis.info("persistence")
        if not info.get("aof_rewrite_in_progress") and not info.get("aof_rewrite_scheduled"):
            return
        await asyncio.sleep(0.02)
    raise HarnessError(f"the AOF rewrite did not end within {AOF_REWRITE_TIMEOUT_S:.0f} s")
