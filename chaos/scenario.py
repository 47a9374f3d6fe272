"""Scenario files: what `python -m chaos run|validate` reads.

A scenario names the plans to submit, how the fake agent and the engine behave, the faults
to inject, the invariants to check and the budgets a run must stay within. It is YAML (read
with `yaml.safe_load` only), validated whole before anything starts, and every way a file
can be wrong ends in one `ScenarioError` line naming the file, the field path and what was
expected, ready for the CLI to print:

    scenarios/x.yaml: faults[2].action: expected one of kill_worker, ...; got 'explode'

A small example (every field but `name` and the plans has a default; `scenarios/schema.json`
is the JSON Schema, generated from the models below by `write_schema`):

    name: crash_after_ack
    seed: 7                       # every random draw of the run comes from it
    plan: plans/tiny.yaml         # shorthand for plans: [{path: ..., evaluations: ...}]
    evaluations: 3
    agent: {error_rate: 0.2}      # engine.agent.AgentProfile.from_dict; seed defaults to 7
    workers: 2
    faults:
      - failpoint: after_ack      # armed inside the worker processes
        action: crash
        workers: all
      - at_s: 1.5                 # a runner fault: SIGKILL worker 1 at 1.5 s, restart 0.5 s later
        action: kill_worker
        target: 1
    invariants: [no_completed_rerun, all_terminal]
    budgets: {max_reruns: 4}

Plan paths are resolved against the scenario file's directory first, then the current
directory. Runner times (`at_s`, `random_at_s`, `every_s`, `restart_after_s`,
`deadline_s`) are seconds of the run's wall clock: `time_scale` scales the engine's own
delays (retry tiers, agent latency), not them. `budgets.max_retry_latency_s` is in engine
time (before `time_scale`), so it reads like the retry tiers whatever the scale.

What `validate` accepts, `run` runs: every number is bounded by what the engine holds (the
bounds of engine.policy, which the worker's flags meet too: 64-bit seeds, no lease or
retry wait that outlives the 7-day state keys, finite floats), a key given twice in one
mapping is an error (engine.yamlfile), and each plan file is listed once with a plan id
of its own, since a run's attemptIds are made of plan ids.
"""

from __future__ import annotations

import difflib
import json
import math
import random
import re
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
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

from chaos.checker import INVARIANTS, CheckSpec, RetrySettings
from engine.agent import AgentProfile, AgentProfileError
from engine.config import EngineConfig
from engine.failpoints import FAILPOINTS, RULELESS_FAILPOINTS
from engine.plan import ID_PATTERN, Plan, PlanError, load_plan
from engine.policy import (
    ENGINE_BOUNDS,
    MAX_ATTEMPTS,
    MAX_IMMEDIATE_RETRIES,
    MAX_SEED,
    MAX_TIER_MS,
    MAX_TIERS,
    MAX_TIME_SCALE,
    STATE_TTL_MS,
    RetryPolicy,
)
from engine.yamlfile import read_yaml

#: The invariants the checker knows; a scenario checks all of them unless it lists some.
INVARIANT_NAMES: tuple[str, ...] = tuple(INVARIANTS)

#: What a runner fault does.
RUNNER_ACTIONS: tuple[str, ...] = (
    "kill_worker",  # SIGKILL one worker process
    "restart_worker",  # stop one worker gracefully (SIGTERM), start it again
    "pause_worker",  # stop one worker for pause_s (SIGSTOP, then SIGCONT): a long GC pause
    "kill_redis",  # SIGKILL the scenario's throwaway redis-server
    "kill_broker",  # SIGKILL the scenario's throwaway RabbitMQ node
    "cancel",  # cancel one submitted evaluation
)
WORKER_ACTIONS: frozenset[str] = frozenset({"kill_worker", "restart_worker", "pause_worker"})


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

_short_repr = reprlib.Repr()
_short_repr.maxlevel = 2
_short_repr.maxstring = 40
_short_repr.maxother = 40
_short_repr.maxlist = _short_repr.maxtuple = _short_repr.maxset = 4
_short_repr.maxdict = 3
_short_repr.maxlong = 40


def _got(value: Any) -> str:
    """A value as the message shows it: YAML spelling for null and booleans, ~60 chars."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    try:
        text = _short_repr.repr(value)
    except Exception:  # a value whose repr fails (a huge int) still gets a message
        text = f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


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


def _is_finite_number(value: Any) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


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
    if value is None or _is_finite_number(value):
        return value
    return _check_range(value, "a number of seconds, or [lo, hi] to draw it from the seed")


def _check_range(value: Any, expected: str) -> Any:
    if not (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(_is_finite_number(v) for v in value)
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

    def policy(self, seed: int) -> RetryPolicy:
        return RetryPolicy(
            immediate_retries=self.immediate_retries,
            max_attempts=self.max_attempts,
            tiers_ms=tuple(self.tiers_ms),
            jitter=self.jitter,
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


class BudgetsSpec(_Model):
    """Limits a run must stay within, on top of the invariants; None: not checked."""

    max_duplicated_tokens: int | None = Field(default=None, ge=0, le=MAX_BUDGET)
    max_reruns: int | None = Field(default=None, ge=0, le=MAX_BUDGET)
    max_retry_latency_s: float | None = Field(
        default=None,
        gt=0,
        le=STATE_TTL_MS / 1000,
        description="engine time, before time_scale",
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


class RedisSpec(_Model):
    """How the scenario's Redis fails beyond a kill (both modes)."""

    lose_last_writes: int = Field(
        default=0,
        ge=0,
        le=MAX_LOST_WRITES,
        description="each kill_redis comes back without its last N acknowledged writes (a "
        "failover to a replica that lacked them); live, the append-only file is cut back "
        "by N writes before the restart",
    )


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
    hit: int = Field(default=1, ge=1, le=MAX_HITS, description="fire on the Nth matching hit")
    times: int = Field(
        default=1, ge=0, le=MAX_HITS, description="fire this many times; 0: every later hit"
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
    """A fault the runner injects from outside: kill, restart or cancel."""

    at_s: float | None = Field(default=None, ge=0, le=MAX_RUN_S)
    random_at_s: Annotated[
        tuple[
            Annotated[float, Field(ge=0, le=MAX_RUN_S)], Annotated[float, Field(ge=0, le=MAX_RUN_S)]
        ]
        | None,
        BeforeValidator(_check_window),
    ] = Field(default=None, description="[lo, hi]; the time is drawn from the seed")
    after: AfterEvent | None = None
    action: RunnerAction
    target: Annotated[
        Annotated[int, Field(ge=0)] | Literal["random"], BeforeValidator(_check_index_or_random)
    ] = Field(default=0, description="worker index, or evaluation index for cancel")
    restart_after_s: float | None = Field(
        default=0.5, ge=0, le=MAX_RUN_S, description="null: never restart"
    )
    pause_s: Annotated[
        Annotated[float, Field(gt=0, le=MAX_RUN_S)]
        | tuple[
            Annotated[float, Field(gt=0, le=MAX_RUN_S)], Annotated[float, Field(gt=0, le=MAX_RUN_S)]
        ]
        | None,
        BeforeValidator(_check_pause),
    ] = Field(
        default=None,
        description="pause_worker: how long it stays stopped; [lo, hi]: drawn from the seed "
        "at each firing, so many short pauses make a lagging event loop",
    )
    count: int = Field(default=1, ge=1, le=100)
    every_s: float | None = Field(default=None, gt=0, le=MAX_RUN_S)
    name: str | None = Field(default=None, pattern=ID_PATTERN)

    @model_validator(mode="after")
    def _check(self) -> RunnerFault:
        triggers = [t for t in ("at_s", "random_at_s", "after") if getattr(self, t) is not None]
        if len(triggers) != 1:
            got = " and ".join(triggers) if triggers else "none"
            _fail("", f"expected exactly one trigger (at_s, random_at_s or after); got {got}")
        if self.random_at_s is not None and self.every_s is not None:
            _fail("every_s", "not with random_at_s (each repetition draws its own time)")
        if self.count > 1 and self.random_at_s is None and self.every_s is None:
            _fail("every_s", f"required field is missing (count is {self.count})")
        if "target" in self.model_fields_set and self.action not in (*WORKER_ACTIONS, "cancel"):
            _fail(
                "target",
                "only for kill_worker, restart_worker, pause_worker and cancel; "
                f"action is {self.action}",
            )
        if self.action == "pause_worker" and self.pause_s is None:
            _fail("pause_s", "required field is missing (action is pause_worker)")
        if self.action != "pause_worker" and self.pause_s is not None:
            _fail("pause_s", f"only with action pause_worker; action is {self.action}")
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
    seed: int = Field(
        default=0, ge=0, le=MAX_SEED, description="every random draw of a run comes from it"
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
    workers: int = Field(default=1, ge=1, le=MAX_WORKERS)
    restart_crashed_workers: bool = True
    restart_delay_s: float = Field(default=0.2, ge=0, le=MAX_RUN_S)
    deadline_s: float = Field(
        default=30.0, gt=0, le=MAX_RUN_S, description="every evaluation must be terminal by then"
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
            err = exc.errors()[0]
            field = "plan" if err["loc"] == ("path",) else "evaluations"
            _fail(field, _message(err))
        data["plans"] = [ref]
        return data

    @field_validator("agent")
    @classmethod
    def _agent_profile(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            AgentProfile.from_dict(value)
        except AgentProfileError as exc:
            raise PydanticCustomError("agent_profile", "{detail}", {"detail": str(exc)}) from None
        except (ValueError, TypeError, OverflowError) as exc:  # its checks, on odd values
            raise PydanticCustomError(
                "agent_profile", "{detail}", {"detail": f"(top): invalid profile: {exc}"}
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
                                f"{where}.workers[{j}]", _index_message("worker", w, self.workers)
                            )
                if fault.evaluation is not None and fault.evaluation >= total:
                    _fail(
                        f"{where}.evaluation", _index_message("evaluation", fault.evaluation, total)
                    )
                continue
            if fault.target != "random":
                if fault.action in WORKER_ACTIONS and fault.target >= self.workers:
                    _fail(f"{where}.target", _index_message("worker", fault.target, self.workers))
                if fault.action == "cancel" and fault.target >= total:
                    _fail(f"{where}.target", _index_message("evaluation", fault.target, total))
            repeat = (fault.count - 1) * (fault.every_s or 0.0)
            last, field = {
                "at_s": ((fault.at_s or 0.0) + repeat, "at_s"),
                "random_at_s": (fault.random_at_s[1] if fault.random_at_s else 0.0, "random_at_s"),
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

    def engine_config(self, **overrides: Any) -> EngineConfig:
        """Worker settings for this scenario; pass URLs and the namespace as overrides."""
        values: dict[str, Any] = {
            "time_scale": self.time_scale,
            "policy": self.retry_policy(),
            **self.engine.model_dump(),
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


# --- the loaded scenario ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Submission:
    """One evaluation the run submits; `index` is what `evaluation` and cancel `target`
    refer to (plan order, then number)."""

    index: int
    plan_index: int
    number: int  # 0-based, within its plan's evaluations
    plan: Plan


@dataclass(frozen=True)
class LoadedScenario:
    """A validated scenario with its plans loaded and its profiles built."""

    spec: Scenario
    source: str
    plans: tuple[tuple[Plan, int], ...]  # (plan, evaluations), in file order
    plan_paths: tuple[Path, ...]  # where each plan was found
    agent: AgentProfile
    retry_policy: RetryPolicy

    @property
    def path(self) -> Path:
        return Path(self.source)

    @staticmethod
    def id_prefix(seed: int) -> str:
        return f"s{seed}-"

    def evaluations(self, seed: int) -> dict[str, Plan]:
        """The attemptIds of a run under `seed`, in submission order, with their plans.

        They come from the seed and the plans, not from the run: the fake agent draws from
        them, so the same seed replays the same calls, live and simulated alike.
        """
        prefix = self.id_prefix(seed)
        return {f"{prefix}{plan.id}-{k}": plan for plan, count in self.plans for k in range(count)}

    def check_spec(
        self,
        seed: int,
        plans: dict[str, Plan],
        cancelled: set[str],
        agent: AgentProfile,
        *,
        reference: bool = True,
    ) -> CheckSpec:
        """What the checker needs of this scenario, for a run under `seed` (live or sim),
        with the fault-free reference of the same evaluations (`chaos.reference`; a few
        milliseconds of simulation) unless `reference` is False (the reference run's own)."""
        from chaos.reference import reference_for

        budgets = self.spec.budgets
        latency = budgets.max_retry_latency_s
        return CheckSpec(
            reference=reference_for(self, seed, plans) if reference else None,
            plans=plans,
            agent=agent,
            # the scenario's settings as plain data: the checker computes the tiers itself
            policy=RetrySettings.of(self.spec.retry),
            time_scale=self.spec.time_scale,
            invariants=tuple(self.spec.invariants),
            exercised=dict(self.spec.exercised),
            cancelled=set(cancelled),
            budgets={
                "max_duplicated_tokens": budgets.max_duplicated_tokens,
                "max_reruns": budgets.max_reruns,
                # the scenario states it in engine time; the checker measures run time
                "max_retry_latency_s": None if latency is None else latency * self.spec.time_scale,
            },
        )

    @cached_property
    def submissions(self) -> tuple[Submission, ...]:
        out: list[Submission] = []
        for pi, (plan, count) in enumerate(self.plans):
            out += [Submission(len(out) + n, pi, n, plan) for n in range(count)]
        return tuple(out)

    def failpoint_specs(self, worker: int, attempt_ids: Sequence[str]) -> str:
        """`ENGINE_FAILPOINTS` for worker `worker`; `attempt_ids[i]` is submission i's id."""
        if len(attempt_ids) != self.spec.total_evaluations:
            raise ValueError(
                f"expected {self.spec.total_evaluations} attempt ids; got {len(attempt_ids)}"
            )
        return ";".join(
            f.to_spec(None if f.evaluation is None else attempt_ids[f.evaluation])
            for _, f in self.spec.failpoint_faults
            if f.arms(worker)
        )

    def schedule(self, rng: random.Random | None = None) -> list[PlannedFault]:
        return fault_schedule(self, rng)


# --- the fault schedule ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlannedFault:
    """One concrete firing of a runner fault.

    Time-triggered: `at_s` seconds after the run starts. Event-triggered: `delay_s` seconds
    after the `after` event (then `at_s` is None). `target` is resolved (never 'random').
    """

    fault: int  # index in Scenario.faults
    repetition: int  # 0-based, up to count - 1
    name: str
    action: str
    target: int
    at_s: float | None
    after: AfterEvent | None
    delay_s: float
    restart_after_s: float | None
    pause_s: float | None = None

    @property
    def label(self) -> str:
        """How the history names this firing: the fault's name, `#N` for repetition N > 0."""
        return self.name if self.repetition == 0 else f"{self.name}#{self.repetition}"


def fault_schedule(
    scenario: Scenario | LoadedScenario, rng: random.Random | None = None
) -> list[PlannedFault]:
    """Expand the runner faults into firings: timed ones by time, then event-triggered ones.

    Deterministic for a given `rng` state (default `random.Random(scenario.seed)`): faults
    are drawn in file order, each repetition drawing its time, then its target.
    """
    spec = scenario.spec if isinstance(scenario, LoadedScenario) else scenario
    rng = random.Random(spec.seed) if rng is None else rng
    total = spec.total_evaluations
    out: list[PlannedFault] = []
    for i, fault in spec.runner_faults:
        for rep in range(fault.count):
            at: float | None = None
            delay = 0.0
            if fault.at_s is not None:
                at = fault.at_s + rep * (fault.every_s or 0.0)
            elif fault.random_at_s is not None:
                at = rng.uniform(*fault.random_at_s)
            else:
                delay = rep * (fault.every_s or 0.0)
            target = fault.target
            if target == "random":  # only worker actions and cancel take a target
                target = rng.randrange(spec.workers if fault.action in WORKER_ACTIONS else total)
            pause = fault.pause_s
            if isinstance(pause, tuple):
                pause = rng.uniform(*pause)
            out.append(
                PlannedFault(
                    fault=i,
                    repetition=rep,
                    name=fault.name or f"faults[{i}]",
                    action=fault.action,
                    target=target,
                    at_s=at,
                    after=fault.after,
                    delay_s=delay,
                    restart_after_s=None if fault.action == "cancel" else fault.restart_after_s,
                    pause_s=pause,
                )
            )
    out.sort(key=lambda p: (p.at_s is None, p.at_s or 0.0, p.fault, p.repetition))
    return out


class EventTriggers:
    """Which `after`-triggered faults of a schedule fire, fed the history one event at a time.

    Pure, so the live runner (tailing the history file) and the simulator (reading its
    event list) fire exactly the same faults on the same events.
    """

    def __init__(self, schedule: Sequence[PlannedFault]) -> None:
        self._waiting = [f for f in schedule if f.after is not None]
        self._counts = [0] * len(self._waiting)
        self._done = [False] * len(self._waiting)

    @property
    def done(self) -> bool:
        return all(self._done)

    def feed(self, event: Mapping[str, Any]) -> list[PlannedFault]:
        """The faults whose trigger this event completes (each fires once)."""
        fired = []
        for i, fault in enumerate(self._waiting):
            trig = fault.after
            if self._done[i] or trig is None or event.get("ev") != trig.event:
                continue
            if trig.rule is not None and event.get("rule_id") != trig.rule:
                continue
            self._counts[i] += 1
            if self._counts[i] >= trig.count:
                self._done[i] = True
                fired.append(fault)
        return fired


# --- loading ---------------------------------------------------------------------------------


def load_scenario(path: str | Path) -> LoadedScenario:
    """Read, validate and load a scenario file and its plans."""
    path = Path(path)
    data = read_yaml(path, "scenario", ScenarioError)
    return scenario_from_dict(data, source=str(path), base_dir=path.parent)


def scenario_from_dict(
    data: Any, source: str = "<scenario>", base_dir: str | Path | None = None
) -> LoadedScenario:
    """Validate a decoded scenario document and load its plans.

    Relative plan paths are tried in `base_dir` (default: the directory of `source` when
    it names a file), then in the current directory.
    """
    if isinstance(data, Mapping) and not isinstance(data, dict):
        data = dict(data)
    if not isinstance(data, dict):
        raise ScenarioError(
            f"{source}: expected a mapping with 'name' and 'plans' (or 'plan') at the top; "
            f"got {_got(data)}"
        )
    _check_size(data, source)
    try:
        spec = Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(f"{source}: {_describe(exc, data)}") from None
    except RecursionError:
        raise ScenarioError(f"{source}: nested too deeply") from None
    if base_dir is None:
        base_dir = None if source.startswith("<") else Path(source).parent
    shorthand = "plan" in data
    plans: list[tuple[Plan, int]] = []
    paths: list[Path] = []
    files: dict[Any, int] = {}  # file identity -> index in plans
    for i, ref in enumerate(spec.plans):
        field = "plan" if shorthand else f"plans[{i}].path"
        found = _find_plan(ref.path, base_dir)
        if found is None:
            where = f"{base_dir} and the current directory" if base_dir else "the current directory"
            raise ScenarioError(
                f"{source}: {field}: no plan file {_got(ref.path)} (looked in {where})"
            )
        same = files.setdefault(_identity(found), i)
        if same != i:
            raise ScenarioError(
                f"{source}: {field}: the same plan file as plans[{same}]; expected each plan "
                f"once (set plans[{same}].evaluations for more evaluations of it)"
            )
        try:
            plan = load_plan(found)
        except PlanError as exc:
            raise ScenarioError(f"{source}: {field}: {exc}") from None
        for j, (other, _) in enumerate(plans):
            if other.id == plan.id:
                # the attemptIds of a run are made of plan ids: two plans would share them
                raise ScenarioError(
                    f"{source}: {field}: plan id {plan.id!r} is also the id of plans[{j}] "
                    f"({_got(str(paths[j]))}); expected distinct plan ids"
                )
        plans.append((plan, ref.evaluations))
        paths.append(found)
    loaded = LoadedScenario(
        spec=spec,
        source=source,
        plans=tuple(plans),
        plan_paths=tuple(paths),
        agent=spec.agent_profile(),
        retry_policy=spec.retry_policy(),
    )
    _check_rules(loaded, source)
    return loaded


def _find_plan(raw: str, base_dir: str | Path | None) -> Path | None:
    """The first candidate that is a file; else one that exists but is not a directory
    (a FIFO, a device), for `load_plan` to refuse in its own words; else None."""
    candidates = [Path(raw)] if Path(raw).is_absolute() else []
    if not candidates:
        if base_dir is not None:
            candidates.append(Path(base_dir) / raw)
        candidates.append(Path(raw))
    odd: Path | None = None
    for candidate in candidates:
        try:  # stat only: opening a FIFO would wait for a writer
            if candidate.is_file():
                return candidate
            if odd is None and candidate.exists() and not candidate.is_dir():
                odd = candidate
        except (OSError, ValueError):  # a name too long, an embedded NUL
            continue
    return odd


def _identity(path: Path) -> Any:
    """What makes two paths the same file (a link, `a/../b`): its device and inode."""
    try:
        info = path.stat()
    except OSError:
        return path.resolve()
    return (info.st_dev, info.st_ino)


def _check_size(data: Any, source: str) -> None:
    """Refuse a document that is huge once its aliases are expanded (or cyclic)."""
    seen = 0
    stack = [data]
    while stack:
        node = stack.pop()
        seen += 1
        if seen > MAX_DOCUMENT_VALUES:
            raise ScenarioError(
                f"{source}: too large: more than {MAX_DOCUMENT_VALUES} values once YAML "
                "aliases are expanded"
            )
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list | tuple | set | frozenset):
            stack.extend(node)


def _check_rules(loaded: LoadedScenario, source: str) -> None:
    """Rule ids a scenario names must exist: a filter on a missing rule never fires."""
    every: set[str] = {rid for plan, _ in loaded.plans for rid in plan.rules}

    def known(rule: str, path: str, plan: Plan | None = None) -> None:
        rules = plan.rules if plan is not None else every
        if rule not in rules:
            where = f"plan {plan.id}" if plan is not None else "any plan of the scenario"
            hint = difflib.get_close_matches(rule, sorted(rules), n=1)
            tip = f"; did you mean {hint[0]!r}?" if hint else ""
            raise ScenarioError(f"{source}: {path}: no rule {_got(rule)} in {where}{tip}")

    for i, fault in enumerate(loaded.spec.faults):
        if isinstance(fault, FailpointFault) and fault.rule is not None:
            plan = None if fault.evaluation is None else loaded.submissions[fault.evaluation].plan
            known(fault.rule, f"faults[{i}].rule", plan)
        elif isinstance(fault, RunnerFault) and fault.after and fault.after.rule is not None:
            known(fault.after.rule, f"faults[{i}].after.rule")
    for key in ("fail_rules", "always_fail_rules"):
        value = loaded.spec.agent.get(key) or ()
        for rule in value:
            short = key == "fail_rules" and len(rule) <= 64
            known(rule, f"agent.{key}.{rule}" if short else f"agent.{key}")


# --- pydantic errors as one line -------------------------------------------------------------

_PATTERNS = {
    ID_PATTERN: "an id (letters, digits, '_', '.', '-'; up to 64, not starting with a symbol)",
    EVENT_PATTERN: "an event name (lower case letters, digits, '_')",
}


def _describe(exc: ValidationError, data: Any) -> str:
    """`field.path[i].sub: what was expected; got what` for the first error."""
    err = exc.errors(include_url=False)[0]
    loc = tuple(
        part
        for k, part in enumerate(err["loc"])
        if not (k == 2 and err["loc"][0] == "faults" and part in _FAULT_TAGS)
    )
    path = _render(loc, data)
    ctx = err.get("ctx") or {}
    if err["type"] == "scenario_rule":
        return f"{_join(path, str(ctx['path']))}: {ctx['detail']}"
    if err["type"] == "agent_profile":
        detail = str(ctx["detail"])
        return (
            f"agent: {detail[len('(top): ') :]}"
            if detail.startswith("(top)")
            else f"agent.{detail}"
        )
    if err["type"] == "extra_forbidden":
        return f"{path}: {_unknown_field(loc, data)}"
    if err["type"] == "missing" and loc == ("plans",):
        return "plans: required field is missing (or the plan shorthand)"
    return f"{path or '(top)'}: {_message(err)}"


def _message(err: Mapping[str, Any]) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    got = _got(err.get("input"))
    bounds = {
        "greater_than_equal": (">=", "ge"),
        "greater_than": (">", "gt"),
        "less_than_equal": ("<=", "le"),
        "less_than": ("<", "lt"),
    }
    simple = {
        "int_type": "an integer",
        "float_type": "a number",
        "string_type": "a string",
        "bool_type": "true or false",
        "list_type": "a list",
        "tuple_type": "a list",
        "dict_type": "a mapping",
        "model_type": "a mapping",
        "model_attributes_type": "a mapping",
        "finite_number": "a finite number",
        "string_too_short": "a non-empty string",
    }
    if kind == "missing":
        return "required field is missing"
    if kind == "scenario_value":
        return str(ctx["detail"])
    if kind == "scenario_rule":
        return _join(str(ctx["path"]), str(ctx["detail"]))
    if kind in simple:
        return f"expected {simple[kind]}; got {got}"
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        return f"expected one of {', '.join(choices)}; got {got}"
    if kind in bounds:
        op, key = bounds[kind]
        bound = ctx.get(key)
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)
        return f"expected a value {op} {bound}; got {got}"
    if kind == "too_short":
        return f"expected at least {ctx.get('min_length')} item(s); got {ctx.get('actual_length')}"
    if kind == "too_long":
        return f"expected at most {ctx.get('max_length')} items; got {ctx.get('actual_length')}"
    if kind == "string_pattern_mismatch":
        pattern = str(ctx.get("pattern", ""))
        return f"expected {_PATTERNS.get(pattern, f'a string matching {pattern}')}; got {got}"
    msg = str(err.get("msg", kind))
    return f"{msg[:1].lower()}{msg[1:]}; got {got}"


def _join(path: str, sub: str) -> str:
    if not sub:
        return path or "(top)"
    if not path:
        return sub
    return f"{path}{sub}" if sub.startswith("[") else f"{path}.{sub}"


def _render(loc: Sequence[Any], data: Any) -> str:
    """`faults[2].after.count`: lists get brackets, mappings dots (whatever the key type)."""
    out = ""
    node: Any = data
    for part in loc:
        in_list = isinstance(node, list | tuple) or (node is None and isinstance(part, int))
        if in_list and isinstance(part, int):
            out += f"[{part}]"
        else:  # a key from the file: an unknown field may be long
            key = str(part)
            out = _join(out, key if len(key) <= 60 else key[:57] + "...")
        node = _child(node, part)
    return out


def _child(node: Any, key: Any) -> Any:
    if isinstance(node, dict):
        return node.get(key)
    if isinstance(node, list | tuple) and isinstance(key, int) and 0 <= key < len(node):
        return node[key]
    return None


def _unknown_field(loc: Sequence[Any], data: Any) -> str:
    """'unknown field', with the nearest known name and the known names of that mapping."""
    parent = loc[:-1]
    model: type[BaseModel] | None = {
        (): Scenario,
        ("retry",): RetrySpec,
        ("engine",): EngineSpec,
        ("budgets",): BudgetsSpec,
        ("broker",): BrokerSpec,
        ("redis",): RedisSpec,
    }.get(tuple(parent))
    if len(parent) == 2 and parent[0] == "plans":
        model = PlanRef
    elif len(parent) >= 2 and parent[0] == "faults":
        node = _child(_child(data, "faults"), parent[1])
        is_fp = isinstance(node, dict) and "failpoint" in node
        model = AfterEvent if parent[2:] == ("after",) else FailpointFault if is_fp else RunnerFault
    if model is None:
        return "unknown field"
    known = list(model.model_fields)
    if model is Scenario:
        known += ["plan", "evaluations"]
    hint = difflib.get_close_matches(str(loc[-1]), known, n=1)
    tip = f" (did you mean {hint[0]}?)" if hint else ""
    return f"unknown field{tip}; expected one of {', '.join(known)}"


# --- the published JSON Schema ---------------------------------------------------------------

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "scenarios" / "schema.json"


def schema_text() -> str:
    """The JSON Schema of a scenario file, as `scenarios/schema.json` holds it."""
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **Scenario.model_json_schema(),
    }
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def write_schema(path: str | Path = SCHEMA_PATH) -> Path:
    """(Re)write the published schema; a test fails when the committed file is stale."""
    path = Path(path)
    path.write_text(schema_text(), encoding="utf-8")
    return path


if __name__ == "__main__":  # python -m chaos.scenario: refresh scenarios/schema.json
    print(write_schema())
