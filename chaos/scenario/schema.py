"""The scenario file's schema: its pydantic models, their bounds and their checks."""

from __future__ import annotations

import random
import re
from types import SimpleNamespace
from typing import Annotated, Any, Literal, NoReturn, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from chaos.checker import INVARIANTS
from chaos.poison import POISON_KINDS
from chaos.proxy.model import ToxicSpec
from chaos.systems import DEFAULT_SYSTEM, SYSTEMS
from engine.agent import AgentProfile, AgentProfileError
from engine.config import EngineConfig
from engine.failpoints import FAILPOINTS, RULELESS_FAILPOINTS
from engine.plan import ID_PATTERN
from engine.policy import (
    ENGINE_BOUNDS,
    MAX_ATTEMPTS,
    MAX_IMMEDIATE_RETRIES,
    MAX_JITTER_BUCKETS,
    MAX_SEED,
    MAX_TIER_MS,
    MAX_TIERS,
    MAX_TIME_SCALE,
    STATE_TTL_MS,
    RetryPolicy,
    check_engine_settings,
)
from engine.validation import got as _got
from engine.validation import is_finite_number
from reports.history import LINK_ACTIONS, TARGETED_ACTIONS, WORKER_ACTIONS

#: The invariants the checker knows; a scenario checks all of them unless it lists some.
INVARIANT_NAMES: tuple[str, ...] = tuple(INVARIANTS)

#: What a runner fault does.
RUNNER_ACTIONS: tuple[str, ...] = (
    "kill_worker",  # SIGKILL one worker process
    "restart_worker",  # stop one worker gracefully (SIGTERM), start it again
    "pause_worker",  # stop one worker for pause_s (SIGSTOP, then SIGCONT): a long GC pause
    "kill_redis",  # SIGKILL the scenario's throwaway redis-server (behind Sentinel: the primary)
    "pause_redis",  # stop Redis (behind Sentinel: the primary) for pause_s: a frozen VM
    "kill_sentinel",  # SIGKILL one of the three sentinels (target: 0, 1 or 2)
    "kill_broker",  # SIGKILL the scenario's throwaway RabbitMQ node
    "pause_broker",  # stop the RabbitMQ node for pause_s (SIGSTOP; `docker pause`)
    "stop_redis",  # stop Redis cleanly (SIGTERM; `docker stop` in containers mode)
    "stop_broker",  # stop the RabbitMQ node cleanly (SIGTERM; `docker stop`)
    "cancel",  # cancel one submitted evaluation
    "resume",  # resume one from a checkpoint (`checkpoint`; the PostgreSQL designs)
    "add_toxic",  # a Toxiproxy toxic on the workers' link to a service (for_s: removed after)
    "update_toxic",  # change the attributes or toxicity of a toxic added before
    "remove_toxic",  # take a toxic added before away
    "cut_link",  # disable the workers' proxy to a service: connections drop, new ones fail
    "publish_poison",  # put malformed messages on the work queue (chaos.poison), each once
    "kill_service",  # SIGKILL the system's service named by `service` (`chaos list`)
    "stop_service",  # stop it cleanly (SIGTERM; `docker stop`), back restart_after_s later
    "pause_service",  # stop it for pause_s (SIGSTOP of its process group), its sockets open
    "restart_service",  # stop it cleanly and start it again at once
)
#: Runner actions that stop something for `pause_s`.
PAUSE_ACTIONS: frozenset[str] = frozenset(
    {"pause_worker", "pause_redis", "pause_broker", "pause_service"}
)
#: Runner actions on a service: which, and how (kill: SIGKILL, stop: a clean stop, both
#: brought back restart_after_s later; pause: stopped for pause_s, its sockets open).
SERVICE_ACTIONS: dict[str, tuple[str, str]] = {
    "kill_redis": ("redis", "kill"),
    "pause_redis": ("redis", "pause"),
    "stop_redis": ("redis", "stop"),
    "kill_broker": ("broker", "kill"),
    "pause_broker": ("broker", "pause"),
    "stop_broker": ("broker", "stop"),
}
#: The same for any system's services (`chaos.systems`), named by the fault's `service`:
#: the actions above are their aliases for `redis-rabbitmq`'s "redis" and "broker".
GENERIC_SERVICE_ACTIONS: dict[str, str] = {
    "kill_service": "kill",
    "stop_service": "stop",
    "pause_service": "pause",
    "restart_service": "restart",
}


def service_action(fault: Any) -> tuple[str, str] | None:
    """(service, how) of a runner fault on a service: how is kill, stop, pause or restart
    (None: the fault is on no service)."""
    action = getattr(fault, "action", "")
    if action in SERVICE_ACTIONS:
        return SERVICE_ACTIONS[action]
    if action in GENERIC_SERVICE_ACTIONS and getattr(fault, "service", None):
        return fault.service, GENERIC_SERVICE_ACTIONS[action]
    return None


#: Runner actions whose `target` is an index: a worker, an evaluation (cancel), a sentinel.
#: The sentinels of `redis.topology: sentinel` (quorum 2).
SENTINELS = 3
#: Runner actions on the network between the workers and a service (`link`, `workers`).
_LINK_LIST = "add_toxic, update_toxic, remove_toxic, cut_link"
#: The links a network fault acts on: each worker's connections to a service of its system
#: (`chaos.systems`: Redis, RabbitMQ, PostgreSQL), and the link a Redis replica replicates over.
LINKS: tuple[str, ...] = ("redis", "broker", "replication", "postgres", "temporal")


MAX_EVALUATIONS_PER_PLAN = 10_000
MAX_WORKERS = 16
#: Runner times (deadline_s and every time before it, restart delays): a day of wall clock.
MAX_RUN_S = 86_400.0
#: Failpoint hit counts and event counts.
MAX_HITS = 1_000_000
#: A failpoint stall: an hour.
MAX_STALL_MS = 3_600_000
#: Budgets are compared with counts the history records as signed 64-bit integers.
MAX_BUDGET = 2**63 - 1
#: Values (aliases expanded) a scenario document may hold: a YAML alias bomb is refused
#: before anything walks it.
MAX_DOCUMENT_VALUES = 100_000
EVENT_PATTERN = r"^[a-z][a-z0-9_]{0,63}$"

InvariantName = Literal[INVARIANT_NAMES]  # type: ignore[valid-type]
FailpointName = Literal[tuple(FAILPOINTS)]  # type: ignore[valid-type]
RunnerAction = Literal[RUNNER_ACTIONS]  # type: ignore[valid-type]
PoisonKind = Literal[POISON_KINDS]  # type: ignore[valid-type]


class ScenarioError(ValueError):
    """A scenario that cannot be run; the message is one line meant for a human."""

    def __init__(self, message: str) -> None:
        # paths, keys and values come from the file: escape line breaks and control
        # characters so that the message stays one line
        super().__init__(
            "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in message)
        )


# --- validation helpers ----------------------------------------------------------------------

T = TypeVar("T")


def _fail(path: str, detail: str) -> NoReturn:
    """A validation error at `path` below the model that raises it (empty: the model)."""
    raise PydanticCustomError("scenario_rule", "{path}: {detail}", {"path": path, "detail": detail})


def _as_tuple(value: Any) -> Any:
    # lists arrive from YAML; the models keep tuples so that a scenario is immutable, and
    # strict validation refuses sets and mappings that a lax tuple would take
    return tuple(value) if isinstance(value, list) else value


#: A YAML list, kept as a tuple.
ListOf = Annotated[tuple[T, ...], BeforeValidator(_as_tuple)]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_index_or_random(value: Any) -> Any:
    """`target`: an index >= 0 or 'random' (one message, not one per union member)."""
    if value == "random" or (_is_int(value) and value >= 0):
        return value
    raise PydanticCustomError(
        "scenario_value",
        "{detail}",
        {"detail": f"expected an index >= 0 or 'random'; got {_got(value)}"},
    )


def _check_worker_list(value: Any) -> Any:
    """`workers` of a failpoint fault: 'all' or a non-empty list of distinct indices."""
    if value == "all":
        return value
    if not isinstance(value, list | tuple) or not value:
        raise PydanticCustomError(
            "scenario_value",
            "{detail}",
            {"detail": f"expected 'all' or a non-empty list of worker indices; got {_got(value)}"},
        )
    seen: set[int] = set()
    for i, item in enumerate(value):
        if not (_is_int(item) and item >= 0):
            _fail(f"[{i}]", f"expected a worker index >= 0; got {_got(item)}")
        if item in seen:
            _fail(f"[{i}]", f"worker {_got(item)} is listed twice")
        seen.add(item)
    return tuple(value)


def _check_window(value: Any) -> Any:
    """`random_at_s`: [lo, hi] with 0 <= lo <= hi, both finite."""
    if value is None:
        return value
    return _check_range(value, "[lo, hi], two numbers of seconds")


def _check_pause(value: Any) -> Any:
    """`pause_s`: seconds, or [lo, hi] drawn from the seed at each firing (event-loop lag)."""
    if value is None or is_finite_number(value):
        return value
    return _check_range(value, "a number of seconds, or [lo, hi] to draw it from the seed")


def _check_range(value: Any, expected: str) -> Any:
    if not (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(is_finite_number(v) for v in value)
    ):
        raise PydanticCustomError(
            "scenario_value",
            "{detail}",
            {"detail": f"expected {expected}; got {_got(value)}"},
        )
    lo, hi = value
    if not 0 <= lo <= hi:
        raise PydanticCustomError(
            "scenario_value",
            "{detail}",
            {"detail": f"expected 0 <= lo <= hi; got {_got(value)}"},
        )
    return (float(lo), float(hi))


class _Model(BaseModel):
    # strict: YAML `"3"` is not 3 and `yes` is not an integer; frozen: a loaded scenario is
    # shared by the runner, the simulator and the reports, and nobody edits it
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


# --- the schema ------------------------------------------------------------------------------


class PlanRef(_Model):
    """One plan and how many evaluations of it the run submits."""

    path: str = Field(min_length=1, description="relative to the scenario file, then the cwd")
    evaluations: int = Field(default=1, ge=1, le=MAX_EVALUATIONS_PER_PLAN)


class RetrySpec(_Model):
    """The engine's retry policy (engine.policy.RetryPolicy), seeded by the scenario seed."""

    immediate_retries: int = Field(default=2, ge=0, le=MAX_IMMEDIATE_RETRIES)
    max_attempts: int = Field(default=3, ge=1, le=MAX_ATTEMPTS)
    tiers_ms: ListOf[Annotated[int, Field(gt=0, le=MAX_TIER_MS)]] = Field(
        default=(30_000, 120_000, 600_000), min_length=1, max_length=MAX_TIERS
    )
    jitter: float = Field(default=0.1, ge=0.0, le=1.0)
    jitter_buckets: int = Field(
        default=4,
        ge=1,
        le=MAX_JITTER_BUCKETS,
        description="delay queues per tier: a retry waits tier x (1 + jitter x b / "
        "(jitter_buckets - 1)) for a bucket b drawn from the seed and the rule attempt",
    )

    def policy(self, seed: int) -> RetryPolicy:
        return RetryPolicy(
            immediate_retries=self.immediate_retries,
            max_attempts=self.max_attempts,
            tiers_ms=tuple(self.tiers_ms),
            jitter=self.jitter,
            jitter_buckets=self.jitter_buckets,
            seed=seed,
        )


def _bounds(name: str) -> dict[str, int]:
    least, most = ENGINE_BOUNDS[name]
    return {"ge": least, "le": most}


class EngineSpec(_Model):
    """Worker settings (engine.config.EngineConfig), in engine milliseconds."""

    # the bounds are the worker's own (engine.policy.ENGINE_BOUNDS): a lease may not outlive
    # the 7-day state keys, the RabbitMQ prefetch is 4 x max_evaluations (16 bits)
    max_evaluations: int = Field(default=8, **_bounds("max_evaluations"))
    max_parallel: int = Field(default=4, **_bounds("max_parallel"))
    heartbeat_ms: int = Field(default=100, **_bounds("heartbeat_ms"))
    stale_ms: int = Field(default=600, **_bounds("stale_ms"))
    sweep_ms: int = Field(default=100, **_bounds("sweep_ms"))
    retry_grace_ms: int | None = Field(default=None, **_bounds("retry_grace_ms"))
    sweeper: bool = True
    connect_timeout_s: float = Field(
        default=5.0, gt=0, le=600, description="a worker's connection to Redis or RabbitMQ"
    )
    read_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=600,
        description="a worker's Redis command or broker call: a reply lost on the network "
        "is noticed this late",
    )
    wait_replicas: int = Field(
        default=0,
        ge=0,
        le=1,
        description="replicas that must hold each batch of the store's writes before it "
        "counts (Redis WAIT after each batch): behind Sentinel, a failover then loses "
        "nothing the engine took as written",
    )
    wait_timeout_ms: int = Field(default=1000, ge=1, le=60_000, description="WAIT's timeout")
    amqp_heartbeat_s: int | None = Field(
        default=None,
        ge=1,
        le=600,
        description="the workers' AMQP heartbeat (the URL's heartbeat=): a silent broker "
        "link is given up after about two of them; null: the broker's (60 s)",
    )

    @model_validator(mode="after")
    def _stale_after_heartbeat(self) -> EngineSpec:
        # a lease that goes stale before its next heartbeat would be taken over from a
        # healthy worker
        if self.stale_ms <= self.heartbeat_ms:
            _fail(
                "stale_ms",
                f"expected more than heartbeat_ms ({self.heartbeat_ms}); got {self.stale_ms}",
            )
        return self


#: What the retry latency budgets bound (`reports.latency.RetryLatency.production_s`).
_ESTIMATE = (
    "production estimate in seconds: the tier waits and the agent's calls scaled back by "
    "time_scale, fault windows and the rest as they happened"
)


class BudgetsSpec(_Model):
    """Limits a run must stay within, on top of the invariants; None: not checked. The cost
    budgets bound the figures `reports.cost` defines (the summary line, the journal
    and the report show the same numbers); the latency budgets those of
    `reports.latency`."""

    max_duplicated_tokens: int | None = Field(
        default=None,
        ge=0,
        le=MAX_BUDGET,
        description="tokens paid beyond the fault-free reference's bill (duplicated_tokens)",
    )
    max_reruns: int | None = Field(
        default=None,
        ge=0,
        le=MAX_BUDGET,
        description="executions of a rule's attempt started again, every cause (reruns)",
    )
    max_retry_latency_s: float | None = Field(
        default=None,
        gt=0,
        le=STATE_TTL_MS / 1000,
        description="the longest wait from a failed attempt's status write to its next "
        "attempt's start (retry_delays_respected's retry_latency_max_s), engine time, before "
        "time_scale",
    )
    max_duplicated_ratio: float | None = Field(
        default=None,
        ge=0,
        le=MAX_BUDGET,
        description="the duplicated tokens / the fault-free reference's bill",
    )
    max_duplicated_usd: float | None = Field(
        default=None,
        ge=0,
        le=MAX_BUDGET,
        description="the duplicated tokens at price_per_1k_tokens",
    )
    price_per_1k_tokens: float = Field(
        default=0.01, ge=0, le=MAX_BUDGET, description="USD per 1,000 tokens (reports too)"
    )
    max_p99_retry_l1_s: float | None = Field(
        default=None, gt=0, le=MAX_BUDGET, description=f"level 1 (immediate), {_ESTIMATE}"
    )
    max_p99_retry_l2_s: float | None = Field(
        default=None, gt=0, le=MAX_BUDGET, description=f"level 2 (delayed), {_ESTIMATE}"
    )
    max_p99_retry_l3_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_BUDGET,
        description=f"level 3 (permanent failure), {_ESTIMATE}",
    )
    max_p99_recovery_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_BUDGET,
        description="scenario seconds, as they happened (leases do not scale), from a fault "
        "that stops work to the next rule start",
    )
    max_regression_ratio: float | None = Field(
        default=None,
        ge=0,
        le=MAX_BUDGET,
        description="with `chaos run --baseline DIR`: how much any of this scenario's cost, "
        "recovery and retry latency figures may grow over the baseline's, as a ratio of it "
        "(0.1: 10 %) (reports.baseline)",
    )


#: Writes a Redis restart may lose (`redis.lose_last_writes`).
MAX_LOST_WRITES = 100_000


class BrokerSpec(_Model):
    """RabbitMQ behaviours that are settings of the broker, not events (both modes)."""

    consumer_timeout_s: float | None = Field(
        default=None,
        ge=0.1,
        le=MAX_RUN_S,
        description="RabbitMQ's consumer_timeout (run seconds): a delivery held unacknowledged "
        "this long closes its channel and is requeued; live, the run's own node is set to it",
    )
    dead_letter_loss: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="share of delayed retries lost on their way from the delay queue to the "
        "work queue (dead-lettering is not confirmed); live, the runner takes them off "
        "their delay queue",
    )

    def loses(self, seed: int, message_id: str | None) -> bool:
        """Whether the retry message `message_id` (`{attemptId}:{ruleId}:{attempt}`, the
        seed's ids) is lost: one draw of the seed and the id, so that the simulator and the
        live runner lose the same retries."""
        if not self.dead_letter_loss or message_id is None:
            return False
        return random.Random(f"{seed}:dead_letter:{message_id}").random() < self.dead_letter_loss


class PostgresSpec(_Model):
    """The scenario's PostgreSQL (`system: pg-store`): how durable a commit is."""

    synchronous_commit: bool = Field(
        default=True,
        description="false: synchronous_commit = off, a commit acknowledged before its WAL "
        "is flushed; a postgres kill then loses the commits of the last wal_writer_delay_ms "
        "(lost commits, the analogue of redis.lose_last_writes)",
    )
    wal_writer_delay_ms: int = Field(
        default=200,
        ge=1,
        le=10_000,
        description="how often the WAL writer flushes (PostgreSQL's wal_writer_delay): what "
        "a kill may lose with synchronous_commit false",
    )
    standby: Literal["none", "async", "sync"] = Field(
        default="none",
        description="system pg, live and in sim: a streaming standby of the run's own "
        "(pg_basebackup); kill_service postgres then kills the primary and fails over to it "
        "(promoted, the workers' proxies moved to it; cut_link on the link replication cuts "
        "it off first). async: PostgreSQL's default replication, which may lose the last "
        "commits; sync: synchronous_standby_names with synchronous_commit = remote_apply, the "
        "mitigation",
    )


class RedisSpec(_Model):
    """The scenario's Redis: one server, or the seed's Sentinel deployment; and how it
    fails beyond a kill (both modes)."""

    topology: Literal["single", "sentinel"] = Field(
        default="single",
        description="single: one redis-server; sentinel: a primary, a replica and three "
        "sentinels, the workers connecting through Sentinel: kill_redis kills the primary and "
        "the sentinels promote the replica (restart_after_s brings the old primary back as a "
        "replica)",
    )
    down_after_ms: int = Field(
        default=2000,
        # below, a new primary looks down before its first ping (redis_rabbitmq/sentinel.py)
        ge=1500,
        le=60_000,
        description="sentinel: how long the primary stays silent before the sentinels "
        "declare it down (their down-after-milliseconds); real time, not scaled; at least "
        "1500, or Sentinel's 1 s ping period makes every new primary look down at once",
    )

    min_replicas_to_write: int = Field(
        default=0,
        ge=0,
        le=1,  # one replica in the topology
        description="sentinel: the servers' min-replicas-to-write; 1: a primary refuses "
        "writes while no replica has acknowledged it within min_replicas_max_lag_s (a "
        "mitigation of lost writes on the server's side, next to the engine's "
        "wait_replicas)",
    )
    min_replicas_max_lag_s: int = Field(
        default=1,
        ge=1,
        le=60,
        description="sentinel: the servers' min-replicas-max-lag (a replica counts while its "
        "last acknowledgement, sent every second, is at most this old)",
    )

    lose_last_writes: int = Field(
        default=0,
        ge=0,
        le=MAX_LOST_WRITES,
        description="each kill_redis comes back without its last N acknowledged writes (a "
        "failover to a replica that lacked them); live, the append-only file is cut back "
        "by N writes before the restart",
    )

    @model_validator(mode="after")
    def _one_way_to_lose(self) -> RedisSpec:
        if self.topology != "sentinel" and self.min_replicas_to_write:
            _fail(
                "min_replicas_to_write",
                "only with topology sentinel (a single Redis has no replica)",
            )
        if self.topology == "sentinel" and self.lose_last_writes:
            _fail(
                "lose_last_writes",
                "only with topology single (behind Sentinel, what a failover loses is what "
                "the replica had not received)",
            )
        return self


class FailpointFault(_Model):
    """A failpoint armed inside worker processes (engine.failpoints)."""

    failpoint: FailpointName
    action: Literal["crash", "raise", "stall", "freeze"] = "crash"
    stall_ms: int | None = Field(
        default=None,
        ge=1,
        le=MAX_STALL_MS,
        description="required iff action is stall or freeze (the whole worker stops)",
    )
    until: str | None = Field(
        default=None,
        pattern=EVENT_PATTERN,
        description="stall only: the stall ends once the history records this event after "
        "the firing (e.g. service_paused: the runner's fault it waits for), stall_ms at most",
    )
    hit: int = Field(default=1, ge=1, le=MAX_HITS, description="fire on the Nth matching hit")
    times: int = Field(
        default=1,
        ge=0,
        le=MAX_HITS,
        description="fire this many times; 0: every later hit",
    )
    rule: str | None = Field(default=None, pattern=ID_PATTERN)
    evaluation: int | None = Field(
        default=None, ge=0, description="index into the submitted evaluations"
    )
    workers: Annotated[
        Annotated[tuple[Annotated[int, Field(ge=0)], ...], Field(min_length=1)] | Literal["all"],
        BeforeValidator(_check_worker_list),
    ] = Field(default=(0,), description="worker indices, or all")
    name: str | None = Field(default=None, pattern=ID_PATTERN)

    @model_validator(mode="after")
    def _check(self) -> FailpointFault:
        timed = self.action in ("stall", "freeze")
        if timed and self.stall_ms is None:
            _fail("stall_ms", f"required field is missing (action is {self.action})")
        if not timed and self.stall_ms is not None:
            _fail("stall_ms", f"only with action stall or freeze; action is {self.action}")
        if self.until is not None and self.action != "stall":
            _fail("until", f"only with action stall (a stall ends on it); action is {self.action}")
        if self.rule is not None and self.failpoint in RULELESS_FAILPOINTS:
            _fail(
                "rule",
                f"failpoint {self.failpoint} is not hit for a rule, so a rule filter never "
                "matches; remove it",
            )
        return self

    def to_spec(self, attempt_id: str | None = None) -> str:
        """The engine's spec syntax (`ENGINE_FAILPOINTS`, `--failpoint`) for this fault.

        `attempt_id` narrows it to one evaluation; a fault with `evaluation` needs it.
        """
        if self.evaluation is not None and attempt_id is None:
            raise ValueError(
                f"a failpoint fault on evaluation {self.evaluation} needs its attempt id"
            )
        action = f"{self.action}:{self.stall_ms}" if self.stall_ms is not None else self.action
        spec = f"{self.failpoint}={action},hit={self.hit},times={self.times}"
        if self.rule is not None:
            spec += f",rule={self.rule}"
        if self.until is not None:
            spec += f",until={self.until}"
        if attempt_id is not None:
            if not attempt_id or re.search(r"[\s,;=]", attempt_id):
                raise ValueError(f"attempt id {attempt_id!r} cannot be written in a failpoint spec")
            spec += f",attempt_id={attempt_id}"
        return spec

    def arms(self, worker: int) -> bool:
        """Whether worker `worker` starts with this failpoint armed."""
        return self.workers == "all" or worker in self.workers


class AfterEvent(_Model):
    """A trigger on the recorded history: after the Nth event of a kind."""

    event: str = Field(pattern=EVENT_PATTERN, description="a history event, e.g. rule_finished")
    count: int = Field(default=1, ge=1, le=MAX_HITS)
    rule: str | None = Field(default=None, pattern=ID_PATTERN)


class RunnerFault(_Model):
    """A fault the runner injects from outside: kill, restart, pause, cancel, or a network
    fault on the workers' links (through the Toxiproxy API, `chaos.proxy`)."""

    at_s: float | None = Field(default=None, ge=0, le=MAX_RUN_S)
    random_at_s: Annotated[
        tuple[
            Annotated[float, Field(ge=0, le=MAX_RUN_S)],
            Annotated[float, Field(ge=0, le=MAX_RUN_S)],
        ]
        | None,
        BeforeValidator(_check_window),
    ] = Field(default=None, description="[lo, hi]; the time is drawn from the seed")
    after: AfterEvent | None = None
    action: RunnerAction
    target: Annotated[
        Annotated[int, Field(ge=0)] | Literal["random"],
        BeforeValidator(_check_index_or_random),
    ] = Field(
        default=0,
        description="worker index; evaluation index for cancel and resume; sentinel index "
        "(0 to 2) for kill_sentinel",
    )
    checkpoint: int | None = Field(
        default=None,
        ge=1,
        le=MAX_HITS,
        description="resume: keep the evaluation's checkpoints up to this one (chk_NNNN, "
        "numbered in the order they became durable); null: up to its last",
    )
    restart_after_s: float | None = Field(
        default=0.5, ge=0, le=MAX_RUN_S, description="null: never restart"
    )
    pause_s: Annotated[
        Annotated[float, Field(gt=0, le=MAX_RUN_S)]
        | tuple[
            Annotated[float, Field(gt=0, le=MAX_RUN_S)],
            Annotated[float, Field(gt=0, le=MAX_RUN_S)],
        ]
        | None,
        BeforeValidator(_check_pause),
    ] = Field(
        default=None,
        description="pause_worker, pause_redis, pause_broker: how long it stays stopped; "
        "[lo, hi]: drawn from the seed at each firing, so many short pauses make a lagging "
        "event loop",
    )
    link: Literal[LINKS] | None = Field(  # type: ignore[valid-type]
        default=None,
        description="add_toxic, update_toxic, remove_toxic, cut_link: the workers' link to "
        "a service of the system (redis, broker, postgres: each worker has its own proxy to "
        "each); replication (redis.topology sentinel or postgres.standby, cut_link only): the "
        "replica's or the standby's link to the primary",
    )
    workers: Annotated[
        Annotated[tuple[Annotated[int, Field(ge=0)], ...], Field(min_length=1)] | Literal["all"],
        BeforeValidator(_check_worker_list),
    ] = Field(default="all", description="network faults: worker indices, or all")
    toxic: ToxicSpec | None = Field(
        default=None,
        description="add_toxic, update_toxic, remove_toxic: the toxic, as Toxiproxy's API "
        "takes it (type, stream, toxicity, attributes; name defaults to <type>_<stream>)",
    )
    for_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_RUN_S,
        description="add_toxic, cut_link: undone this long after (null: left until a "
        "remove_toxic, or the end of the run)",
    )
    poison: Annotated[ListOf[PoisonKind], Field(min_length=1)] | None = Field(
        default=None,
        description="publish_poison: the kinds of malformed message to publish, each once "
        "(null: every kind, " + ", ".join(POISON_KINDS) + ")",
    )
    count: int = Field(default=1, ge=1, le=100)
    every_s: float | None = Field(default=None, gt=0, le=MAX_RUN_S)
    name: str | None = Field(default=None, pattern=ID_PATTERN)
    service: str | None = Field(
        default=None,
        pattern=ID_PATTERN,
        description="kill_service, stop_service, pause_service, restart_service: which of "
        "the system's services (`python -m chaos list`)",
    )

    @property
    def poison_kinds(self) -> tuple[str, ...]:
        return POISON_KINDS if self.poison is None else self.poison

    @model_validator(mode="after")
    def _check_link(self) -> RunnerFault:
        on_link = self.action in LINK_ACTIONS
        if on_link and self.link is None:
            _fail("link", f"required field is missing (action is {self.action})")
        for field in ("link", "workers"):
            if not on_link and field in self.model_fields_set:
                _fail(field, f"only with a network action ({_LINK_LIST}); action is {self.action}")
        needs_toxic = self.action in ("add_toxic", "update_toxic", "remove_toxic")
        if needs_toxic and self.toxic is None:
            _fail("toxic", f"required field is missing (action is {self.action})")
        if not needs_toxic and self.toxic is not None:
            _fail(
                "toxic", f"only with add_toxic, update_toxic, remove_toxic; action is {self.action}"
            )
        if self.for_s is not None and self.action not in ("add_toxic", "cut_link"):
            _fail("for_s", f"only with add_toxic and cut_link; action is {self.action}")
        if on_link and "restart_after_s" in self.model_fields_set:
            _fail(
                "restart_after_s",
                f"not with a network action (use for_s); action is {self.action}",
            )
        generic = self.action in GENERIC_SERVICE_ACTIONS
        if generic and self.service is None:
            _fail("service", f"required field is missing (action is {self.action})")
        if not generic and self.service is not None:
            _fail(
                "service",
                "only with kill_service, stop_service, pause_service, restart_service; "
                f"action is {self.action}",
            )
        if self.action == "restart_service" and "restart_after_s" in self.model_fields_set:
            _fail("restart_after_s", "not with restart_service (it starts again at once)")
        return self

    @model_validator(mode="after")
    def _check(self) -> RunnerFault:
        triggers = [t for t in ("at_s", "random_at_s", "after") if getattr(self, t) is not None]
        if len(triggers) != 1:
            got = " and ".join(triggers) if triggers else "none"
            _fail(
                "",
                f"expected exactly one trigger (at_s, random_at_s or after); got {got}",
            )
        if self.random_at_s is not None and self.every_s is not None:
            _fail("every_s", "not with random_at_s (each repetition draws its own time)")
        if self.count > 1 and self.random_at_s is None and self.every_s is None:
            _fail("every_s", f"required field is missing (count is {self.count})")
        if "target" in self.model_fields_set and self.action not in TARGETED_ACTIONS:
            _fail(
                "target",
                "only for kill_worker, restart_worker, pause_worker, cancel, resume and "
                f"kill_sentinel; action is {self.action}",
            )
        if self.action in PAUSE_ACTIONS and self.pause_s is None:
            _fail("pause_s", f"required field is missing (action is {self.action})")
        if self.action not in PAUSE_ACTIONS and self.pause_s is not None:
            _fail(
                "pause_s",
                f"only with pause_worker, pause_redis and pause_broker; action is {self.action}",
            )
        if self.checkpoint is not None and self.action != "resume":
            _fail("checkpoint", f"only with resume; action is {self.action}")
        if self.poison is not None and self.action != "publish_poison":
            _fail("poison", f"only with publish_poison; action is {self.action}")
        service_pause = self.action in ("pause_redis", "pause_broker")
        if service_pause and "restart_after_s" in self.model_fields_set:
            _fail("restart_after_s", f"not with {self.action} (pause_s says when it resumes)")
        return self

    @property
    def trigger(self) -> str:
        return next(t for t in ("at_s", "random_at_s", "after") if getattr(self, t) is not None)


def _fault_kind(value: Any) -> str:
    if isinstance(value, FailpointFault):
        return "failpoint_fault"
    if isinstance(value, RunnerFault):
        return "runner_fault"
    return "failpoint_fault" if isinstance(value, dict) and "failpoint" in value else "runner_fault"


_FAULT_TAGS = ("failpoint_fault", "runner_fault")

#: A fault: a failpoint fault when it has `failpoint`, a runner fault otherwise.
Fault = Annotated[
    Annotated[FailpointFault, Tag("failpoint_fault")] | Annotated[RunnerFault, Tag("runner_fault")],
    Discriminator(_fault_kind),
]


def _schema_extra(schema: dict[str, Any]) -> None:
    """Publish the `plan` + `evaluations` shorthand, which the model folds into `plans`."""
    props = schema["properties"]
    props["plan"] = {
        "type": "string",
        "minLength": 1,
        "description": "shorthand for plans: [{path: PLAN, evaluations: N}]",
    }
    props["evaluations"] = {
        "type": "integer",
        "minimum": 1,
        "maximum": MAX_EVALUATIONS_PER_PLAN,
        "default": 1,
        "description": "with plan: how many evaluations of it",
    }
    schema["required"] = [r for r in schema.get("required", []) if r != "plans"]
    schema["oneOf"] = [{"required": ["plans"]}, {"required": ["plan"]}]
    schema["dependentRequired"] = {"evaluations": ["plan"]}


class Scenario(_Model):
    """A whole scenario file, validated; `load_scenario` also loads its plans."""

    model_config = ConfigDict(json_schema_extra=_schema_extra, title="Scenario")

    name: str = Field(pattern=ID_PATTERN)
    description: str = ""
    system: Literal[tuple(SYSTEMS)] = Field(  # type: ignore[valid-type]
        default=DEFAULT_SYSTEM,
        description="the durable design under test (`python -m chaos list`); --system overrides it",
    )
    seed: int = Field(
        default=0,
        ge=0,
        le=MAX_SEED,
        description="every random draw of a run comes from it",
    )
    plans: ListOf[PlanRef] = Field(min_length=1)
    agent: dict[str, Any] = Field(
        default_factory=dict,
        description="engine.agent.AgentProfile.from_dict; seed defaults to seed",
        # the loader checks the whole profile; the schema publishes the fields it bounds
        json_schema_extra={
            "properties": {
                "drift": {
                    "type": "number",
                    "minimum": 0,
                    "maximum": 1,
                    "default": 0,
                    "description": "probability that a rerun draws its verdict afresh",
                }
            }
        },
    )
    retry: RetrySpec = RetrySpec()
    time_scale: float = Field(default=0.001, gt=0, le=MAX_TIME_SCALE)
    engine: EngineSpec = EngineSpec()
    broker: BrokerSpec = BrokerSpec()
    redis: RedisSpec = RedisSpec()
    postgres: PostgresSpec = PostgresSpec()
    workers: int = Field(default=1, ge=1, le=MAX_WORKERS)
    restart_crashed_workers: bool = True
    restart_delay_s: float = Field(default=0.2, ge=0, le=MAX_RUN_S)
    deadline_s: float = Field(
        default=30.0,
        gt=0,
        le=MAX_RUN_S,
        description=(
            "every evaluation must be terminal by then (from the first submit; later by "
            "the time the harness took to restart killed services, each restart's took_s)"
        ),
    )
    faults: ListOf[Fault] = ()
    invariants: ListOf[InvariantName] = INVARIANT_NAMES
    not_checked: ListOf[InvariantName] = Field(
        default=(),
        description="invariants this scenario cannot exercise (a run without delayed retries "
        "judges no retry delay): every other one is checked, those added later included",
    )
    budgets: BudgetsSpec = BudgetsSpec()
    exercised: dict[InvariantName, Annotated[int, Field(ge=1, le=MAX_HITS)]] = Field(
        default_factory=dict,
        description="invariant -> the fewest cases it must judge: fewer, or an unknown "
        "verdict, fails the run (a scenario proves only what it exercised)",
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        """`plan: PATH` + `evaluations: N` means `plans: [{path: PATH, evaluations: N}]`."""
        if not isinstance(data, dict) or ("plan" not in data and "evaluations" not in data):
            return data
        if "plans" in data:
            key = "plan" if "plan" in data else "evaluations"
            _fail(key, "give either plan (with evaluations) or plans, not both")
        if "plan" not in data:
            _fail("evaluations", "only with the plan shorthand; use plans[].evaluations")
        data = dict(data)
        path = data.pop("plan")
        ref: dict[str, Any] = {"path": path}
        if "evaluations" in data:
            ref["evaluations"] = data.pop("evaluations")
        if not isinstance(path, str):
            _fail("plan", f"expected a string; got {_got(path)}")
        try:
            PlanRef.model_validate(ref)
        except ValidationError as exc:
            from chaos.scenario.messages import (
                _message,  # it names these models' fields
            )

            err = exc.errors()[0]
            field = "plan" if err["loc"] == ("path",) else "evaluations"
            _fail(field, _message(err))
        data["plans"] = [ref]
        return data

    @model_validator(mode="before")
    @classmethod
    def _the_engine_judges(cls, data: Any) -> Any:
        """The engine's own checks (`RetryPolicy`, `check_engine_settings`) judge the retry
        and worker settings first, in its words: a scenario refuses what a worker refuses,
        as a worker would say it. The models' bounds are the schema's, and a backstop."""
        if not isinstance(data, dict):
            return data
        retry, engine = data.get("retry", {}), data.get("engine", {})
        if isinstance(retry, dict):
            values = {k: retry.get(k, f.default) for k, f in RetrySpec.model_fields.items()}
            values["tiers_ms"] = _as_tuple(values["tiers_ms"])
            seed = data.get("seed", 0)
            try:
                RetryPolicy(**values, seed=seed)
            except (ValueError, TypeError) as exc:
                field, _, why = str(exc).partition(": ")
                _fail(field if field == "seed" else f"retry.{field}", why)
        if isinstance(engine, dict):
            fields = EngineSpec.model_fields
            values = {k: engine.get(k, fields[k].default) for k in ENGINE_BOUNDS}
            scale = data.get("time_scale", cls.model_fields["time_scale"].default)
            try:
                check_engine_settings(SimpleNamespace(**values, time_scale=scale))
            except (ValueError, TypeError) as exc:
                field, _, why = str(exc).partition(": ")
                _fail(field if field == "time_scale" else f"engine.{field}", why)
        return data

    @field_validator("agent")
    @classmethod
    def _agent_profile(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            AgentProfile.from_dict(value)
        except AgentProfileError as exc:
            raise PydanticCustomError("agent_profile", "{detail}", {"detail": str(exc)}) from None
        except (
            ValueError,
            TypeError,
            OverflowError,
        ) as exc:  # its checks, on odd values
            raise PydanticCustomError(
                "agent_profile",
                "{detail}",
                {"detail": f"(top): invalid profile: {exc}"},
            ) from None
        return value

    @model_validator(mode="before")
    @classmethod
    def _without_not_checked(cls, data: Any) -> Any:
        """`not_checked` names what `invariants` leaves out: the checked ones are the rest (a
        name already left out stays out, so a loaded scenario dumped and read again is the
        same)."""
        if not isinstance(data, dict) or not isinstance(data.get("not_checked"), list | tuple):
            return data
        listed = data.get("invariants", INVARIANT_NAMES)
        if not isinstance(listed, list | tuple):
            return data
        data = dict(data)
        data["invariants"] = [n for n in listed if n not in data["not_checked"]]
        return data

    @field_validator("invariants", "not_checked")
    @classmethod
    def _distinct_invariants(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for i, name in enumerate(value):
            if name in value[:i]:
                _fail(f"[{i}]", f"{name} is listed twice")
        return value

    @model_validator(mode="after")
    def _exercised_are_checked(self) -> Scenario:
        for name in self.exercised:
            if name not in self.invariants:
                _fail(f"exercised.{name}", "not among the invariants this scenario checks")
        return self

    @model_validator(mode="after")
    def _check_faults(self) -> Scenario:
        if self.engine.wait_replicas and self.redis.topology != "sentinel":
            _fail(
                "engine.wait_replicas",
                "only with redis.topology sentinel (a single Redis has no replica to wait for)",
            )
        total = self.total_evaluations
        names: dict[str, int] = {}
        for i, fault in enumerate(self.faults):
            where = f"faults[{i}]"
            if fault.name is not None:
                if fault.name in names:
                    _fail(
                        f"{where}.name",
                        f"duplicate fault name {fault.name!r} (faults[{names[fault.name]}])",
                    )
                names[fault.name] = i
            if isinstance(fault, FailpointFault):
                if fault.workers != "all":
                    for j, w in enumerate(fault.workers):
                        if w >= self.workers:
                            _fail(
                                f"{where}.workers[{j}]",
                                _index_message("worker", w, self.workers),
                            )
                if fault.evaluation is not None and fault.evaluation >= total:
                    _fail(
                        f"{where}.evaluation",
                        _index_message("evaluation", fault.evaluation, total),
                    )
                continue
            if fault.link == "replication":
                if self.redis.topology != "sentinel" and self.postgres.standby == "none":
                    _fail(
                        f"{where}.link",
                        "replication only with redis.topology sentinel or postgres.standby",
                    )
                if fault.action != "cut_link":
                    _fail(
                        f"{where}.action",
                        "only cut_link on the replication link (a partition between the "
                        f"primary and its replica or standby); got {fault.action}",
                    )
                if fault.workers != "all":
                    _fail(f"{where}.workers", "not with the replication link (there is one)")
            if fault.action == "stop_redis" and self.redis.topology == "sentinel":
                _fail(
                    f"{where}.action",
                    "stop_redis only with redis.topology single (behind Sentinel: kill_redis)",
                )
            if fault.action == "kill_sentinel":
                if self.redis.topology != "sentinel":
                    _fail(f"{where}.action", "kill_sentinel only with redis.topology sentinel")
                if fault.target != "random" and fault.target >= SENTINELS:
                    _fail(f"{where}.target", _index_message("sentinel", fault.target, SENTINELS))
            if fault.link == "redis" and self.redis.topology == "sentinel":
                _fail(
                    f"{where}.link",
                    "redis only with redis.topology single (behind Sentinel the workers "
                    "reach the primary they are told of, not a proxy)",
                )
            if fault.workers != "all":
                for j, w in enumerate(fault.workers):
                    if w >= self.workers:
                        _fail(f"{where}.workers[{j}]", _index_message("worker", w, self.workers))
            if fault.target != "random":
                if fault.action in WORKER_ACTIONS and fault.target >= self.workers:
                    _fail(
                        f"{where}.target",
                        _index_message("worker", fault.target, self.workers),
                    )
                if fault.action in ("cancel", "resume") and fault.target >= total:
                    _fail(
                        f"{where}.target",
                        _index_message("evaluation", fault.target, total),
                    )
            repeat = (fault.count - 1) * (fault.every_s or 0.0)
            last, field = {
                "at_s": ((fault.at_s or 0.0) + repeat, "at_s"),
                "random_at_s": (
                    fault.random_at_s[1] if fault.random_at_s else 0.0,
                    "random_at_s",
                ),
                "after": (repeat, "every_s"),
            }[fault.trigger]
            if not last < self.deadline_s:
                _fail(
                    f"{where}.{field}",
                    f"expected the fault to fire before deadline_s ({self.deadline_s:g} s); "
                    f"its last time is {last:g} s",
                )
        return self

    # --- what the runner builds from it ---------------------------------------------------------

    @property
    def total_evaluations(self) -> int:
        return sum(p.evaluations for p in self.plans)

    def retry_policy(self) -> RetryPolicy:
        return self.retry.policy(self.seed)

    def agent_profile(self) -> AgentProfile:
        """The fake agent's profile; its seed is the scenario seed unless `agent` sets one."""
        return AgentProfile.from_dict({"seed": self.seed, **self.agent})

    def settings(self) -> dict[str, Any]:
        """The timings a report reads back from a run's journal: the time scale (scenario
        time to production time), the retry levels, and what bounds recovery."""
        e, r = self.engine, self.retry
        return {
            "time_scale": self.time_scale,
            "immediate_retries": r.immediate_retries,
            "max_attempts": r.max_attempts,
            "tiers_ms": list(r.tiers_ms),
            "heartbeat_ms": e.heartbeat_ms,
            "stale_ms": e.stale_ms,
            "sweep_ms": e.sweep_ms,
            "sweeper": e.sweeper,
            "price_per_1k_tokens": self.budgets.price_per_1k_tokens,
        }

    def engine_config(self, **overrides: Any) -> EngineConfig:
        """Worker settings for this scenario; pass URLs and the namespace as overrides."""
        values: dict[str, Any] = {
            "time_scale": self.time_scale,
            # not built (and validated) again when given: the simulator gives it each seed
            "policy": overrides["policy"] if "policy" in overrides else self.retry_policy(),
            **self.engine.model_dump(exclude={"amqp_heartbeat_s"}),  # the URL carries it
        }
        values.update(overrides)
        return EngineConfig(**values)

    @property
    def failpoint_faults(self) -> list[tuple[int, FailpointFault]]:
        return [(i, f) for i, f in enumerate(self.faults) if isinstance(f, FailpointFault)]

    @property
    def runner_faults(self) -> list[tuple[int, RunnerFault]]:
        return [(i, f) for i, f in enumerate(self.faults) if isinstance(f, RunnerFault)]


def _index_message(what: str, index: int, size: int) -> str:
    if size == 1:
        return f"expected {what} index 0 (the scenario has 1 {what}); got {_got(index)}"
    return f"expected an index below {size} (the scenario has {size} {what}s); got {_got(index)}"
