"""Systems under test: each durable design behind one seam.

The conductor, the acts and the checker know no design. A design is a folder here holding
what belongs to it alone (its services, how a worker of it starts, how the runner submits,
cancels, watches and reads its final state), declared below with what it can take: the
services a fault may stop, the links the proxy sits on, the scenario settings it reads,
and the invariants that do not apply to it, each with the reason (`n/a`, never `pass`).
The acts a system carries out are `chaos.acts.SYSTEM_ACTS`; its adapters implement
`chaos.systems.seam.LiveSystem` and `SimSystem`.

This module is light on purpose: the scenario loader and `chaos list` read it without
importing a client library.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chaos.scenario import LoadedScenario

#: A run's design when the scenario names none.
DEFAULT_SYSTEM = "redis-rabbitmq"


@dataclass(frozen=True)
class System:
    """One design: what it is, what it can take, and where its adapters are
    (`module:Class`, imported only when a run needs them; None: not in that mode)."""

    name: str
    summary: str
    #: Services a fault may kill, stop, pause or restart, by name, each with what it is.
    services: dict[str, str]
    #: The workers' links the proxy sits on (a network fault names one).
    links: tuple[str, ...]
    #: Scenario sections of settings only this design reads (`redis:`, `broker:`).
    settings: tuple[str, ...] = ()
    #: Invariant -> why it does not apply to this design (its verdict is `n/a`).
    not_applicable: dict[str, str] = field(default_factory=dict)
    #: `service.how` (`broker.pause`) -> why the simulator has no model of that fault.
    not_simulated: dict[str, str] = field(default_factory=dict)
    #: Its runs can be resumed from a checkpoint (the `resume` action): live, and in sim
    #: when `sim_resumes`.
    resumes: bool = False
    sim_resumes: bool = False
    #: Its PostgreSQL can fail over to a streaming standby of its own (`postgres.standby`),
    #: live and in sim.
    standby: bool = False
    #: The design whose store this one runs as it is (its store's mutants apply here too).
    store_of: str | None = None
    #: Its services that hold the work queue and the delayed retries.
    brokers: tuple[str, ...] = ("broker",)
    #: Its workers count a rule's executions with a start marker of their own (False: the
    #: workflow engine's server counts them, as the activity's attempt).
    start_markers: bool = True
    #: Its delayed retries come out in the order they fall due: a queue per delay, claims
    #: by due time (False: a timer each, in no order across evaluations).
    retries_in_due_order: bool = True
    #: A worker's stale copy of an evaluation another one took over may still act (the
    #: engine's: a run waits for its old holders before it ends; False: the server refuses
    #: a stale worker's commands, and a workflow engine's worker is never told it lost one).
    stale_copies_act: bool = True
    #: Its workers are the engine's (`python -m engine.worker`), so the engine's mutants
    #: reach them (False: a workflow engine's worker runs the core inside its workflow).
    engine_worker: bool = True
    live: str | None = None
    sim: str | None = None
    #: Its services' class (`module:Class`): `start(containers)`, `available()`, `own()`.
    stack: str | None = None

    def adapter(self, mode: str) -> Any:
        """The adapter class of `mode` ("live" or "sim")."""
        where = self.live if mode == "live" else self.sim
        if where is None:
            raise LookupError(f"system {self.name} does not run in {mode} mode")
        return _imported(where)

    def stack_class(self) -> Any:
        """The class of its live services."""
        if self.stack is None:
            raise LookupError(f"system {self.name} does not run in live mode")
        return _imported(self.stack)

    def live_refusal(self, loaded: LoadedScenario, own: set[str]) -> str | None:
        """Why its live adapter cannot run the scenario with these services of the run's
        own (the others given, e.g. by AMQP_URL), in one line (None: it can)."""
        module = importlib.import_module(self.adapter("live").__module__)
        return module.refusal(loaded, own)


def _imported(where: str) -> Any:
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(module), name)


#: What the workflow engines (`temporal`, `dbos`) do not have of the engine's machinery,
#: each the reason its invariant is `n/a` there: their own durable histories replace it.
NO_ENGINE_MACHINERY: dict[str, str] = {
    "state_keys_expire": "no keys with TTLs: the workflow engine keeps its histories by a "
    "retention of its own",
    "retries_acked": "a delayed retry is a durable timer, not a message to acknowledge",
    "leases_renewed": "no leases: the workflow engine decides when a call runs again "
    "(Temporal: a heartbeat timeout; DBOS: a recovery)",
    "leases_respected": "no leases: the workflow engine decides when a call runs again "
    "(Temporal: a heartbeat timeout; DBOS: a recovery)",
    "writes_fenced": "no fenced writes: the workflow's own history is its one writer (one "
    "execution of it at a time)",
    "prefetch_respected": "no prefetch: a worker takes tasks up to its own concurrency",
    "started_announced": "no evaluation.started event: the client starts the workflow",
    "metrics_match_history": "no engine metrics: the worker is the workflow engine's",
    "quiet_state": "no running or retries index to leave clean: the workflow engine holds "
    "the timers",
}

SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System(
            name="redis-rabbitmq",
            summary="the first document's engine: leases and results in Redis, work, "
            "delayed retries and events on RabbitMQ (late ACK)",
            services={
                "redis": "the store (a private redis-server, AOF fsync always; behind "
                "Sentinel: the primary)",
                "broker": "the RabbitMQ node (work, delay and event queues)",
            },
            links=("redis", "broker", "replication"),
            settings=("redis", "broker"),
            not_simulated={
                "broker.pause": "a frozen RabbitMQ node (connections held, nothing "
                "delivered or confirmed) has no model in the simulator",
            },
            live="chaos.systems.redis_rabbitmq.live:RedisRabbitLive",
            sim="chaos.systems.redis_rabbitmq.sim:RedisRabbitSim",
            stack="chaos.systems.redis_rabbitmq.services:Services",
        ),
        System(
            name="pg-store",
            summary="the same shell and RabbitMQ, PostgreSQL as the store: one PL/pgSQL "
            "function per store operation, proven equal to the same references",
            services={
                "postgres": "the store (a private PostgreSQL, fsync on; schema eai, row-level "
                "security)",
                "broker": "the RabbitMQ node (work, delay and event queues)",
            },
            links=("postgres", "broker"),
            settings=("broker", "postgres"),
            not_applicable={
                "state_keys_expire": "PostgreSQL keeps a run's rows for 7 days by a "
                "retention column, not by key TTLs",
            },
            not_simulated={
                "broker.pause": "a frozen RabbitMQ node (connections held, nothing "
                "delivered or confirmed) has no model in the simulator",
            },
            resumes=True,
            sim_resumes=True,
            live="chaos.systems.pg_store.live:PgStoreLive",
            sim="chaos.systems.pg_store.sim:PgStoreSim",
            stack="chaos.systems.pg_store.services:PgServices",
        ),
        System(
            name="pg",
            summary="PostgreSQL alone, the second document's default: the same shell; work, "
            "delayed retries, forwards and events as rows (claims with SKIP LOCKED, woken by "
            "NOTIFY, visibility leases for the late ACK), results as checkpoints",
            services={
                "postgres": "the store and the queue (a private PostgreSQL, fsync on; schema "
                "eai, row-level security)",
            },
            links=("postgres", "replication"),
            settings=("postgres",),
            not_applicable={
                "state_keys_expire": "PostgreSQL keeps a run's rows for 7 days by a "
                "retention column, not by key TTLs",
            },
            resumes=True,
            sim_resumes=True,
            standby=True,
            store_of="pg-store",
            brokers=("postgres",),
            live="chaos.systems.pg.live:PgLive",
            sim="chaos.systems.pg.sim:PgSim",
            stack="chaos.systems.pg.services:PgAloneServices",
        ),
        System(
            name="temporal",
            summary="the second document's optional backend: an evaluation as a Temporal "
            "workflow whose body is the engine's core, an activity per agent call with a "
            "heartbeat, the delay tiers as durable timers",
            services={
                "temporal": "the run's own Temporal dev server (its SQLite file in its dir): "
                "workflow histories, task queues, timers",
            },
            links=("temporal",),
            not_applicable=NO_ENGINE_MACHINERY,
            brokers=("temporal",),
            start_markers=False,
            retries_in_due_order=False,
            stale_copies_act=False,
            engine_worker=False,
            live="chaos.systems.temporal.live:TemporalLive",
            stack="chaos.systems.temporal.services:TemporalServices",
        ),
        System(
            name="dbos",
            summary="the best-known PostgreSQL-only peer: an evaluation as a DBOS workflow "
            "whose body is the engine's core, a step per agent call, the delay tiers as "
            "durable sleeps; no takeover of its own (an operator's recovery of a dead worker)",
            services={
                "postgres": "the run's own PostgreSQL (fsync on): DBOS's system database, "
                "workflows, step outputs, queue, sleeps",
            },
            links=("postgres",),
            not_applicable=NO_ENGINE_MACHINERY,
            brokers=("postgres",),
            start_markers=False,
            retries_in_due_order=False,
            stale_copies_act=False,
            engine_worker=False,
            live="chaos.systems.dbos.live:DbosLive",
            stack="chaos.systems.dbos.services:DbosServices",
        ),
    )
}


def system(name: str) -> System:
    try:
        return SYSTEMS[name]
    except KeyError:
        known = ", ".join(sorted(SYSTEMS))
        raise LookupError(f"unknown system {name!r}; expected one of {known}") from None


def on_system(loaded: LoadedScenario, name: str | None) -> LoadedScenario:
    """The scenario on system `name` (`--system`) instead of its own `system:` (None: as
    it is). The name is one of `SYSTEMS`."""
    import dataclasses

    if name is None or name == loaded.spec.system:
        return loaded
    system(name)
    return dataclasses.replace(loaded, spec=loaded.spec.model_copy(update={"system": name}))


def refusal(loaded: LoadedScenario, name: str, mode: str) -> str | None:
    """Why this scenario cannot run on system `name` in `mode` ("live", "sim"), in one line
    naming the file, the field and the system (None: it can). Said before anything
    starts: a fault on a service the design does not have, a link it has no proxy on, a
    setting it does not read, a fault its simulator has no model of."""
    from chaos.scenario.schema import LINK_ACTIONS, service_action

    sut = system(name)
    spec, path = loaded.spec, loaded.path
    if (sut.live if mode == "live" else sut.sim) is None:
        return f"{path}: system: {name} does not run in {mode} mode"
    for i, fault in enumerate(spec.faults):
        on = service_action(fault)
        if on is not None:
            service, how = on
            field_name = "service" if getattr(fault, "service", None) else "action"
            if service not in sut.services:
                return (
                    f"{path}: faults[{i}].{field_name}: {name} has no service {service!r} "
                    f"(it has {', '.join(sut.services)})"
                )
            why = sut.not_simulated.get(f"{service}.{how}") if mode == "sim" else None
            if why is not None:
                return (
                    f"{path}: faults[{i}].action: {fault.action} is not simulated on {name} "
                    f"({why}); run it with --mode live or --mode containers"
                )
        if getattr(fault, "action", "") in LINK_ACTIONS and fault.link not in sut.links:
            return (
                f"{path}: faults[{i}].link: {name} has no link {fault.link!r} "
                f"(it has {', '.join(sut.links)})"
            )
    for i, fault in enumerate(spec.faults):
        if getattr(fault, "action", "") != "resume":
            continue
        if not sut.resumes:
            return f"{path}: faults[{i}].action: {name} has no resume from a checkpoint"
        if mode == "sim" and not sut.sim_resumes:
            return (
                f"{path}: faults[{i}].action: resume is not simulated on {name}; "
                "run it with --mode live"
            )
    if mode == "sim" and spec.postgres.standby != "none":
        if not sut.standby:
            with_one = " or ".join(s.name for s in SYSTEMS.values() if s.standby)
            return (
                f"{path}: postgres.standby: {name} has no standby; run it with --system {with_one}"
            )
        if not spec.postgres.synchronous_commit:
            return (
                f"{path}: postgres.synchronous_commit: false with a standby is not simulated "
                f"on {name}; run it with --mode live"
            )
    for section in ("redis", "broker", "postgres"):
        if section not in sut.settings and getattr(spec, section).model_fields_set:
            return f"{path}: {section}: {name} does not read it (a setting of another design)"
    return None
