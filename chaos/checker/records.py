"""The checker's records: what a run left (`FinalState`), what it was meant to do
(`CheckSpec`), and what the checker concluded (`Violation`, `CheckResult`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from engine.agent import AgentProfile
from engine.core.results import RuleResult
from engine.plan import Plan
from reports.measure import BUDGETS as BUDGETS
from reports.measure import COST_BUDGETS as COST_BUDGETS

if TYPE_CHECKING:
    from chaos.reference import Reference

#: "n/a": the invariant does not apply to the system under test (`CheckSpec.not_applicable`
#: says why); neither passed nor judged.
Verdict = Literal["pass", "fail", "unknown", "n/a"]

#: How long after a fault heals a client may take to notice: aio-pika's (and the
#: simulator's) reconnect interval is 0.5 s; twice that.
DEFAULT_FAULT_RECOVERY_S = 1.0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _all_invariants() -> tuple[str, ...]:
    """Every registered invariant (imported late: the registry imports the records)."""
    from chaos.checker.invariants import INVARIANTS

    return tuple(INVARIANTS)


@dataclass
class EvaluationFinal:
    """What Redis holds of one evaluation at the end of a run. `published`: its
    `final_published` flag; `passes`: its `passes` hash, pass id -> outcome of each pass
    result marked announced (None, for either: not read)."""

    attempt_id: str
    state: str | None
    results: dict[str, RuleResult] = field(default_factory=dict)
    statuses: dict[str, str] = field(default_factory=dict)
    published: bool | None = None
    passes: dict[str, str] | None = None


@dataclass
class FinalState:
    """Every evaluation's final keys, and every Redis key of the run with its `TTL`
    (seconds; -1: no TTL; -2: gone): the `attempt:*` keys and the engine's own, named
    without the run's namespace (`engine:running`...). `indexes`: the engine's index keys
    (same names) -> member -> score, as the run left them (None: not read)."""

    evaluations: dict[str, EvaluationFinal] = field(default_factory=dict)
    key_ttls: dict[str, int] = field(default_factory=dict)
    indexes: dict[str, dict[str, float]] | None = None


@dataclass(frozen=True)
class RetrySettings:
    """The scenario's retry settings as plain data: the checker computes what the engine
    should have done from these, with its own code (`chaos.checker.oracle`), so a bug
    shared by the engine's policy and its checker cannot hide. Anything with these
    attributes (a scenario's `retry`, an `engine.policy.RetryPolicy`) converts with `of`."""

    immediate_retries: int = 2
    max_attempts: int = 3
    tiers_ms: tuple[int, ...] = (30_000, 120_000, 600_000)
    jitter: float = 0.1
    jitter_buckets: int = 4

    @classmethod
    def of(cls, value: Any) -> RetrySettings:
        if isinstance(value, RetrySettings):
            return value
        return cls(
            immediate_retries=int(value.immediate_retries),
            max_attempts=int(value.max_attempts),
            tiers_ms=tuple(int(t) for t in value.tiers_ms),
            jitter=float(value.jitter),
            jitter_buckets=int(getattr(value, "jitter_buckets", 4)),
        )


@dataclass
class CheckSpec:
    """What the run was meant to do, and how strictly to judge it.

    `agent`: the fake agent's profile for the reference comparison (None: no reference).
    `policy` and `time_scale`: the retry settings and time scale (delay tiers are
    milliseconds times `time_scale`); any object with a `RetrySettings`' fields is read as
    plain data. `cancelled`: evaluations the scenario cancelled (runner `cancel_requested`
    events are added). `budgets`: `BUDGETS` keys, None = unlimited. `exercised`: invariant
    -> the fewest cases it must judge (fewer, or "unknown", fails the run).
    `max_parallel`, `max_evaluations`: the workers' slots (None: as each `slot_wait`
    records them), against which `retry_delays_respected` verifies a recorded wait for a
    slot. `fault_recovery_s`: how long after a fault heals its
    effects may still delay a retry (run seconds: the clients' reconnect interval, not
    engine time). `delay_tolerance_s`: timer granularity; a retry may
    look this much early, or late beyond what the history proves (no other slack).
    `reference`: the same evaluations run without faults
    (`chaos.reference`), for `matches_reference` and `idempotent_results`; None: no
    reference (those comparisons are then "unknown" or skipped).
    """

    plans: dict[str, Plan] = field(default_factory=dict)
    agent: AgentProfile | None = None
    policy: RetrySettings | Any = field(default_factory=RetrySettings)
    time_scale: float = 1.0
    invariants: tuple[str, ...] = field(default_factory=_all_invariants)
    cancelled: set[str] = field(default_factory=set)
    budgets: dict[str, float | int | None] = field(default_factory=dict)
    price_per_1k_tokens: float = 0.01
    exercised: dict[str, int] = field(default_factory=dict)
    max_parallel: int | None = None
    max_evaluations: int | None = None
    fault_recovery_s: float = DEFAULT_FAULT_RECOVERY_S
    delay_tolerance_s: float = 0.005
    reference: Reference | None = None
    #: The failpoints the scenario arms, each (name, rule, attempt id), None where it does
    #: not filter, and the labels of the runner faults' firings it plans: each must fire
    #: (`faults_fired`).
    failpoints: tuple[tuple[str, str | None, str | None], ...] = ()
    faults_planned: tuple[str, ...] = ()
    #: Invariant -> why it does not apply to the system under test (`chaos.systems`).
    not_applicable: dict[str, str] = field(default_factory=dict)
    #: The services that hold its work queue and delayed retries (RabbitMQ, or PostgreSQL's
    #: job rows in `pg`): a kill of one must lose none of them.
    brokers: tuple[str, ...] = ("broker",)
    #: Its workers write a start marker before a delayed retry's first try, the count of the
    #: attempt's executions (False: the workflow engine's server counts them, the
    #: activity's or step's attempt; `history_well_formed` looks for no marker then).
    start_markers: bool = True
    #: Its delayed retries come out in the order they fall due (one queue per delay, or
    #: claims ordered by due time), so one held behind a later one is the broker's doing
    #: (False: each retry is its own timer, delivered through its own workflow's tasks).
    retries_in_due_order: bool = True

    def __post_init__(self) -> None:
        from chaos.checker.invariants import INVARIANTS  # the registry imports this module

        self.policy = RetrySettings.of(self.policy)
        named = (*self.invariants, *self.exercised, *self.not_applicable)
        unknown = [n for n in named if n not in INVARIANTS]
        if unknown:
            raise ValueError(f"unknown invariant(s) {unknown}; expected some of {list(INVARIANTS)}")
        bad = [b for b in self.budgets if b not in BUDGETS]
        if bad:
            raise ValueError(f"unknown budget(s) {bad}; expected some of {list(BUDGETS)}")
        low = [n for n, least in self.exercised.items() if not (_is_int(least) and least >= 1)]
        if low:
            raise ValueError(f"exercised {low}: expected a case count >= 1")
        if not (math.isfinite(self.time_scale) and self.time_scale >= 0):
            raise ValueError("time_scale must be a finite number >= 0")
        if min(self.fault_recovery_s, self.delay_tolerance_s) < 0:
            raise ValueError("fault_recovery_s and delay_tolerance_s must be >= 0")


@dataclass
class Violation:
    """One named anomaly, with the few events (sorted by time) that prove it."""

    invariant: str
    attempt_id: str
    rule_id: str | None
    message: str
    timeline: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class CheckResult:
    """The verdicts, their evidence and the run's statistics. `cases` is how many cases
    each judged invariant looked at (zero: "unknown"). `exercise_failures` are the
    scenario's `exercised` minimums not met, one line each (they fail the run, like
    budgets). `durations_s` is how long each invariant's check took (seconds, by name):
    JUnit reports each test case's own time. It is kept out of `stats` and `to_dict` so
    that one seed still gives one result."""

    verdicts: dict[str, Verdict]
    violations: list[Violation]
    stats: dict[str, Any]
    budget_failures: list[str]
    durations_s: dict[str, float] = field(default_factory=dict)
    cases: dict[str, int] = field(default_factory=dict)
    exercise_failures: list[str] = field(default_factory=list)
    #: Invariant -> why its verdict is "n/a" (the system under test has no such guarantee).
    not_applicable: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (
            not self.budget_failures
            and not self.exercise_failures
            and all(v != "fail" for v in self.verdicts.values())
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "verdicts": dict(self.verdicts),
            "cases": dict(self.cases),
            "violations": [v.to_dict() for v in self.violations],
            "stats": dict(self.stats),
            "budget_failures": list(self.budget_failures),
            "exercise_failures": list(self.exercise_failures),
            **({"not_applicable": dict(self.not_applicable)} if self.not_applicable else {}),
        }
