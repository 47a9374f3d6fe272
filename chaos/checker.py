"""The history checker: named anomalies, each proved by a short timeline of recorded events.

Theory. A run leaves two records: the *history* (one event per protocol step, appended by
every worker before the step's effect can be observed, plus the runner's submits, kills
and cancels) and the *final state* (what Redis holds at the end: results, statuses,
evaluation states, key TTLs). Each invariant is a property of these two records alone,
checked without trusting the engine's own bookkeeping (its `rerun` flags, its counters):

- `no_completed_rerun`: once a result of (attemptId, ruleId) is durably written (the first
  `result_persisted` with `won: true`, recorded after the `SET NX` returned), no
  `rule_started` of that pair may follow. A start recorded later on any clock of this
  machine began after the write, so the engine ran finished work. Repeated starts of one
  attempt *before* the write (a crash mid-call, the write window) are allowed and counted.
- `prune_only_dependents`: with F the rules `permanently_failed` in Redis (without a
  result: a result beats a status, as recovery reads it), the rules left without a result
  must be exactly the transitive dependents of F, outside F. A dependent with a result ran
  although a dependency never succeeded; an independent rule without one was pruned or
  abandoned. The final evaluation state must match (completed: every rule has a result,
  failed: none has, partial: in between).
- `idempotent_results`: every successful call of a rule (`rule_finished`), every write of
  it (`result_persisted`) and the final Redis result carry one (verdict, score), and with a
  fake-agent profile that value is the fault-free reference (it depends on (seed,
  attemptId, ruleId) only).
- `all_terminal`: every submitted evaluation ends completed, partial, failed or cancelled.
- `attempts_monotonic`: per rule, attempts started and statuses durably held never go
  back, no attempt exceeds `max_attempts`, and the final status and result agree with the
  highest attempt started: attempt k >= 2 starts only after `failed_attempt_{k-1}` is
  written, and statuses are only ever replaced by higher ones, so Redis must still hold
  `failed_attempt_{M-1}` or `failed_attempt_M` (or a result of attempt status + 1).
- `retry_delays_respected`: attempt k >= 2 starts no earlier than its delay after the
  write of `failed_attempt_{k-1}` (the retry message is published after that write and
  the queue TTL starts at the broker, so the measured wait over-estimates the broker's),
  with the delay at least the policy tier; and, unless a fault or the sweeper's lost-retry
  path intervened, no later than the delay plus `retry_slack_s`.
- `single_final_result`: one winning `evaluation_terminal`, equal to the final state; every
  `final_published` carries that state, and a second one only follows a crash or kill of
  the process that published the first.
- `state_keys_expire`: every `attempt:*` key carries a TTL of at most 7 days (`TTL` -1 is
  none): a plain SET would have dropped it and the key would live forever.

Verdicts follow Jepsen: "pass", "fail" (at least one violation, each with its evidence), or
"unknown" when the records hold nothing to judge (no events, no final state, no keys). Safety
checks are judged at every moment of the history; the liveness parts (every independent
rule completed, every evaluation terminal) only on evaluations the final state calls
terminal. The module is pure: plain data in, a `CheckResult` out, no I/O and no clock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.agent import AgentProfile, FakeAgent
from engine.config import STATE_TTL_SECONDS
from engine.core.results import RuleResult
from engine.core.states import PERMANENTLY_FAILED, parse_status, status_rank
from engine.plan import Plan, PlanError, plan_from_dict
from engine.policy import RetryPolicy

#: The fixed list of anomalies the checker names (Elle-style): name -> one-line meaning.
INVARIANTS: dict[str, str] = {
    "no_completed_rerun": "no rule starts again after its result was durably written",
    "prune_only_dependents": "the rules left without a result are exactly the transitive "
    "dependents of the permanently failed ones",
    "idempotent_results": "every successful execution of a rule, and its final result, give "
    "one verdict: the fault-free reference's",
    "all_terminal": "every submitted evaluation ends completed, partial, failed or cancelled",
    "attempts_monotonic": "attempt numbers and persisted statuses never go back, and the final "
    "status agrees with the attempts started",
    "retry_delays_respected": "a delayed retry never starts before its tier, nor long after it "
    "without a fault",
    "single_final_result": "one terminal state per evaluation, and one final result published",
    "state_keys_expire": "every attempt:* key in Redis carries a TTL of at most 7 days",
}

Verdict = Literal["pass", "fail", "unknown"]

#: Budget name -> the stat it bounds.
BUDGETS: dict[str, str] = {
    "max_duplicated_tokens": "duplicated_tokens",
    "max_reruns": "reruns",
    "max_retry_latency_s": "retry_latency_max_s",
}

TERMINAL_STATES = frozenset({"completed", "partial", "failed", "cancelled"})
FINISHED_STATES = frozenset({"completed", "partial", "failed"})  # terminal, not cancelled
TIMELINE_LIMIT = 12
TTL_SLACK_S = 60
STATE_KEY_PREFIX = "attempt:"
#: Runner and worker events that may delay anything happening around them.
FAULT_EVENTS = frozenset(
    {
        "crash",
        "worker_killed",
        "worker_restarted",
        "service_killed",
        "service_restarted",
        "fault_fired",
    }
)
#: `fault_fired` actions that end a fault rather than start one.
_HEALING = ("heal", "remove", "clear", "stop", "off", "restore", "delete")


# --- the records ------------------------------------------------------------------------


@dataclass
class EvaluationFinal:
    """What Redis holds of one evaluation at the end of a run."""

    attempt_id: str
    state: str | None
    results: dict[str, RuleResult] = field(default_factory=dict)
    statuses: dict[str, str] = field(default_factory=dict)


@dataclass
class FinalState:
    """Every evaluation's final keys, and every Redis key of the run with its `TTL`
    (seconds; -1: no TTL; -2: gone)."""

    evaluations: dict[str, EvaluationFinal] = field(default_factory=dict)
    key_ttls: dict[str, int] = field(default_factory=dict)


@dataclass
class CheckSpec:
    """What the run was meant to do, and how strictly to judge it.

    `agent`: the fake agent's profile for the reference comparison (None: no reference).
    `policy` and `time_scale`: the workers' retry policy and time scale (delay tiers are
    policy milliseconds times `time_scale`). `cancelled`: evaluations the scenario cancelled
    (runner `cancel_requested` events are added). `budgets`: `BUDGETS` keys, None =
    unlimited. `retry_slack_s`: how late a retry may start beyond its delay when no fault
    intervened. `delay_tolerance_s`: timer granularity; a retry may look this much early.
    """

    plans: dict[str, Plan] = field(default_factory=dict)
    agent: AgentProfile | None = None
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    time_scale: float = 1.0
    invariants: tuple[str, ...] = tuple(INVARIANTS)
    cancelled: set[str] = field(default_factory=set)
    budgets: dict[str, float | int | None] = field(default_factory=dict)
    retry_slack_s: float = 1.0
    delay_tolerance_s: float = 0.005

    def __post_init__(self) -> None:
        unknown = [n for n in self.invariants if n not in INVARIANTS]
        if unknown:
            raise ValueError(f"unknown invariant(s) {unknown}; expected some of {list(INVARIANTS)}")
        bad = [b for b in self.budgets if b not in BUDGETS]
        if bad:
            raise ValueError(f"unknown budget(s) {bad}; expected some of {list(BUDGETS)}")
        if not (math.isfinite(self.time_scale) and self.time_scale >= 0):
            raise ValueError("time_scale must be a finite number >= 0")
        if self.retry_slack_s < 0 or self.delay_tolerance_s < 0:
            raise ValueError("retry_slack_s and delay_tolerance_s must be >= 0")


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
    verdicts: dict[str, Verdict]
    violations: list[Violation]
    stats: dict[str, Any]
    budget_failures: list[str]

    @property
    def ok(self) -> bool:
        return not self.budget_failures and all(v != "fail" for v in self.verdicts.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "verdicts": dict(self.verdicts),
            "violations": [v.to_dict() for v in self.violations],
            "stats": dict(self.stats),
            "budget_failures": list(self.budget_failures),
        }


# --- the entry point --------------------------------------------------------------------


def check(history: list[dict], final: FinalState, spec: CheckSpec) -> CheckResult:
    """Judge one run. Every invariant is computed (their stats feed the budgets); only
    those in `spec.invariants` get a verdict and report their violations."""
    cx = _Context(history, final, spec)
    verdicts: dict[str, Verdict] = {}
    violations: list[Violation] = []
    for name, fn in _CHECKS.items():
        judged, found = fn(cx)
        if name not in spec.invariants:
            continue
        verdicts[name] = "fail" if found else ("pass" if judged else "unknown")
        violations.extend(found)
    budget_failures = []
    limits = {b: limit for b, limit in spec.budgets.items() if limit is not None}
    if limits:
        cx.stats["budgets"] = limits
    for budget, limit in spec.budgets.items():
        stat = BUDGETS[budget]
        value = cx.stats.get(stat)
        if limit is not None and value is not None and value > limit:
            budget_failures.append(f"{stat} {_num(value)} > {budget} {_num(limit)}")
    return CheckResult(verdicts, violations, cx.stats, budget_failures)


# --- indexing the history ----------------------------------------------------------------


def _t(e: Mapping[str, Any]) -> float:
    t = e.get("t")
    return float(t) if isinstance(t, int | float) else 0.0


def sort_key(e: Mapping[str, Any]) -> tuple[float, str, int]:
    """Wall time, then source and per-source sequence (exact order within a process)."""
    seq = e.get("seq")
    return (_t(e), str(e.get("src", "")), seq if isinstance(seq, int) else 0)


def _proc(e: Mapping[str, Any]) -> tuple[str, Any]:
    return (str(e.get("src", "")), e.get("pid"))


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


class _Context:
    """The history indexed once: by evaluation, by (evaluation, rule), faults apart."""

    def __init__(self, history: list[dict], final: FinalState, spec: CheckSpec) -> None:
        self.final = final
        self.spec = spec
        self.events = sorted((e for e in history if isinstance(e, Mapping)), key=sort_key)
        self.by_eval: dict[str, list[dict]] = defaultdict(list)
        self.by_pair: dict[tuple[str, str], list[dict]] = defaultdict(list)
        self.faults: list[dict] = []
        self.submitted: dict[str, dict] = {}
        self.cancelled = set(spec.cancelled)
        for e in self.events:
            ev = e.get("ev")
            a = e.get("attempt_id")
            if isinstance(a, str):
                self.by_eval[a].append(e)
                r = e.get("rule_id")
                if isinstance(r, str):
                    self.by_pair[(a, r)].append(e)
            if ev in FAULT_EVENTS:
                self.faults.append(e)
            if ev == "submitted" and isinstance(a, str):
                self.submitted.setdefault(a, e)
            if ev == "cancel_requested" and isinstance(a, str):
                self.cancelled.add(a)
        self.plans: dict[str, Plan] = dict(spec.plans)
        for a, e in self.submitted.items():
            raw = e.get("plan")
            if a not in self.plans and isinstance(raw, Mapping):
                with contextlib.suppress(PlanError):  # a bad plan: nothing to judge it by
                    self.plans[a] = plan_from_dict(dict(raw), source=f"plan of {a}")
        self.evaluations = sorted(
            set(self.plans) | set(final.evaluations) | set(self.submitted) | set(self.by_eval)
        )
        self.fault_windows = _fault_windows(self.faults)
        self.stats: dict[str, Any] = {
            "events": len(self.events),
            "evaluations": len(self.evaluations),
            "faults": len(self.faults),
            "crashes": sum(1 for e in self.faults if e.get("ev") == "crash"),
        }

    def final_of(self, a: str) -> EvaluationFinal | None:
        return self.final.evaluations.get(a)

    def result_of(self, a: str, r: str) -> RuleResult | None:
        fin = self.final_of(a)
        return None if fin is None else _as_result(fin.results.get(r), r)

    def max_attempts(self, a: str, r: str) -> int:
        plan = self.plans.get(a)
        rule = plan.rules.get(r) if plan else None
        return (rule.max_attempts if rule else None) or self.spec.policy.max_attempts

    def fault_between(self, t0: float, t1: float) -> bool:
        return any(start <= t1 and end >= t0 for start, end in self.fault_windows)


def _as_result(value: Any, rule_id: str) -> RuleResult | None:
    if value is None or isinstance(value, RuleResult):
        return value
    if isinstance(value, str | bytes):
        return RuleResult.from_json(value)
    if isinstance(value, Mapping):
        data = {"rule_id": rule_id, "tokens": 0, **value}
        fields = {f.name for f in dataclasses.fields(RuleResult)}
        return RuleResult(**{k: v for k, v in data.items() if k in fields})
    raise TypeError(f"result of {rule_id!r}: expected a RuleResult, got {type(value).__name__}")


def _fault_windows(faults: list[dict]) -> list[tuple[float, float]]:
    """Intervals during which something was broken: a kill lasts until its restart, a
    fired fault until it is healed, a crash is an instant (the process stays dead, but
    whatever it held is picked up by others, and that is what the window must cover)."""
    out: list[tuple[float, float]] = []
    open_: dict[tuple[str, str], float] = {}
    for e in faults:
        ev, t = e.get("ev"), _t(e)
        out.append((t, t))
        if ev in ("worker_killed", "service_killed"):
            kind = ev.split("_")[0]
            name = e.get("worker") if kind == "worker" else e.get("service")
            open_.setdefault((kind, str(name)), t)
        elif ev in ("worker_restarted", "service_restarted"):
            kind = ev.split("_")[0]
            name = e.get("worker") if kind == "worker" else e.get("service")
            start = open_.pop((kind, str(name)), None)
            if start is not None:
                out.append((start, t))
        elif ev == "fault_fired":
            key = ("fault", f"{e.get('fault')}@{e.get('target')}")
            action = str(e.get("action", "")).lower()
            if any(h in action for h in _HEALING):
                start = open_.pop(key, None)
                if start is not None:
                    out.append((start, t))
            else:
                open_.setdefault(key, t)
    out.extend((start, math.inf) for start in open_.values())
    return out


def _timeline(
    key: Iterable[Mapping[str, Any]],
    context: Iterable[Mapping[str, Any]] = (),
    limit: int = TIMELINE_LIMIT,
) -> list[dict[str, Any]]:
    """The proof: every key event (up to `limit`), then the context events nearest in time
    to them, sorted by time."""
    seen: set[int] = set()
    keep: list[Mapping[str, Any]] = []
    for e in key:
        if id(e) not in seen:
            seen.add(id(e))
            keep.append(e)
    keep.sort(key=sort_key)
    if len(keep) > limit:  # the first and the last matter most
        keep = keep[: limit // 2] + keep[len(keep) - (limit - limit // 2) :]
    anchors = [_t(e) for e in keep]
    rest = [e for e in context if id(e) not in seen]
    if anchors and rest and len(keep) < limit:
        rest.sort(key=lambda e: min(abs(_t(e) - t) for t in anchors))
        keep += rest[: limit - len(keep)]
    elif not anchors:
        keep = sorted(rest, key=sort_key)[-limit:]
    return [dict(e) for e in sorted(keep, key=sort_key)]


def _num(value: float | int) -> str:
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if value != int(value) else str(int(value))
    return str(value)


def _listed(items: Iterable[str], most: int = 5) -> str:
    items = list(items)
    head = ", ".join(items[:most])
    return head if len(items) <= most else f"{head} and {len(items) - most} more"


def _of(events: Iterable[dict], *kinds: str) -> list[dict]:
    return [e for e in events if e.get("ev") in kinds]


_Outcome = tuple[bool, list["Violation"]]  # (something was judged, violations)


# --- no_completed_rerun ---------------------------------------------------------------------


@dataclass
class _Round:
    """One execution of one attempt of a rule in one process: a `rule_started` with try 1,
    its level-1 retries, their outcomes, and whether it wrote the result."""

    start: dict
    attempt: int
    proc: tuple[str, Any]
    outcomes: list[dict] = field(default_factory=list)
    persisted: bool = False

    @property
    def finished(self) -> bool:
        return any(e.get("ev") == "rule_finished" for e in self.outcomes)

    @property
    def tokens(self) -> int:
        return sum(_int(e.get("tokens")) for e in self.outcomes)


def _rounds(events: list[dict]) -> list[_Round]:
    rounds: list[_Round] = []
    current: dict[tuple[str, Any], _Round] = {}
    for e in events:
        ev, proc = e.get("ev"), _proc(e)
        attempt = _int(e.get("attempt"), 1)
        rnd = current.get(proc)
        if ev == "rule_started":
            if _int(e.get("try_no"), 1) == 1 or rnd is None or rnd.attempt != attempt:
                rnd = current[proc] = _Round(e, attempt, proc)
                rounds.append(rnd)
        elif ev in ("rule_finished", "rule_failed"):
            if rnd is not None and rnd.attempt == attempt:
                rnd.outcomes.append(e)
        elif ev == "result_persisted" and rnd is not None:
            rnd.persisted = True
    return rounds


def _check_no_completed_rerun(cx: _Context) -> _Outcome:
    """For each (attemptId, ruleId), T = the first `result_persisted` with `won: true`.
    A `rule_started` after T is a violation. A second start of the same attempt before T
    is a rerun: allowed, counted (`reruns`, `rerun_tokens`: tokens of its calls), and a
    write-window rerun when the start before it had finished without writing. Every
    `rule_finished` of a pair but the first is duplicated cost (`duplicated_tokens`)."""
    out: list[Violation] = []
    reruns = rerun_tokens = window = duplicated = completed_reruns = 0
    calls = tokens = 0
    for (a, r), evs in sorted(cx.by_pair.items()):
        starts = _of(evs, "rule_started")
        calls += len(starts)
        tokens += sum(_int(e.get("tokens")) for e in _of(evs, "rule_finished", "rule_failed"))
        finished = _of(evs, "rule_finished")
        duplicated += sum(_int(e.get("tokens")) for e in finished[1:])
        won = next((e for e in _of(evs, "result_persisted") if e.get("won") is True), None)
        late = [e for e in starts if won is not None and _t(e) > _t(won)]
        if won is not None and late:
            completed_reruns += len({id(e) for e in late if _int(e.get("try_no"), 1) == 1})
            out.append(
                Violation(
                    "no_completed_rerun",
                    a,
                    r,
                    f"{r} started {len(late)} time(s) after its result (attempt "
                    f"{won.get('attempt')}) was persisted; first "
                    f"{_t(late[0]) - _t(won):.3f} s after, by {late[0].get('src')}",
                    _timeline(
                        [won, *late[:3]],
                        _of(evs, "rule_finished", "result_persisted")
                        + _of(cx.by_eval[a], "recovered", "delivered", "evaluation_started"),
                    ),
                )
            )
        by_attempt: dict[int, list[_Round]] = defaultdict(list)
        for rnd in _rounds(evs):
            by_attempt[rnd.attempt].append(rnd)
        for rounds in by_attempt.values():
            for prev, rnd in itertools.pairwise(rounds):
                if won is not None and _t(rnd.start) > _t(won):
                    continue  # a violation above, not a rerun
                reruns += 1
                rerun_tokens += rnd.tokens
                if prev.finished and not prev.persisted:
                    window += 1
    cx.stats.update(
        calls=calls,
        tokens_total=tokens,
        reruns=reruns,
        rerun_tokens=rerun_tokens,
        write_window_reruns=window,
        duplicated_tokens=duplicated,
        completed_reruns=completed_reruns,
    )
    judged = any(_of(evs, "rule_started") for evs in cx.by_pair.values())
    return judged, out


# --- prune_only_dependents --------------------------------------------------------------


def _check_prune_only_dependents(cx: _Context) -> _Outcome:
    """F = rules `permanently_failed` without a result, D = their transitive dependents.
    At any time: no rule of D has a result or failed permanently (it ran), and every
    `rules_skipped` names dependents of a rule in F. On evaluations that finished
    (completed / partial / failed, not cancelled): every rule outside F and D has a
    result, and the state matches (completed: all results; failed: none)."""
    out: list[Violation] = []
    judged = 0
    for a in cx.evaluations:
        plan, fin = cx.plans.get(a), cx.final_of(a)
        if plan is None or fin is None:
            continue
        judged += 1
        evs = cx.by_eval[a]
        results = {r for r in fin.results if r in plan.rules}
        failed = {
            r
            for r, s in fin.statuses.items()
            if s == PERMANENTLY_FAILED and r not in results and r in plan.rules
        }
        doomed = plan.transitive_dependents(failed)

        for r in plan.order:
            if r in doomed and (r in results or r in failed):
                root = _root_cause(plan, failed, r)
                what = "has a result" if r in results else "failed permanently"
                out.append(
                    Violation(
                        "prune_only_dependents",
                        a,
                        r,
                        f"{r} {what} although its dependency {root} failed permanently: it "
                        "ran instead of being skipped",
                        _prune_evidence(evs, r, root),
                    )
                )
        for e in _of(evs, "rules_skipped"):
            because = str(e.get("because_of"))
            named = [str(x) for x in e.get("rule_ids") or []]
            wrong = [x for x in named if x not in _deps(plan, because)]
            if wrong or because not in failed:
                why = (
                    f"{_listed(wrong)} do(es) not depend on {because}"
                    if wrong
                    else f"{because} is not permanently failed in Redis"
                )
                out.append(
                    Violation(
                        "prune_only_dependents",
                        a,
                        wrong[0] if len(wrong) == 1 else None,
                        f"skipped {_listed(named)} because of {because}, but {why}",
                        _timeline([e], [x for x in evs if x.get("rule_id") == because]),
                    )
                )
        if fin.state not in FINISHED_STATES or a in cx.cancelled:
            continue
        missing = [r for r in plan.order if r not in results and r not in failed | doomed]
        if missing:
            context = [e for e in evs if e.get("rule_id") in missing]
            out.append(
                Violation(
                    "prune_only_dependents",
                    a,
                    missing[0] if len(missing) == 1 else None,
                    f"evaluation {fin.state}, but {_listed(missing)} never completed although "
                    "no dependency failed permanently"
                    + (f" (permanently failed: {_listed(sorted(failed))})" if failed else ""),
                    _timeline(
                        _of(evs, "evaluation_terminal", "rules_skipped")
                        + _of(context, "status_written"),
                        context,
                    ),
                )
            )
        expected = (
            "completed"
            if len(results) == len(plan.rules)
            else ("failed" if not results else "partial")
        )
        if fin.state != expected:
            out.append(
                Violation(
                    "prune_only_dependents",
                    a,
                    None,
                    f"evaluation is {fin.state} but {len(results)} of {len(plan.rules)} rules "
                    f"have a result: expected {expected}",
                    _timeline(_of(evs, "evaluation_terminal", "rules_skipped", "final_published")),
                )
            )
    return judged > 0, out


def _deps(plan: Plan, rule_id: str) -> frozenset[str]:
    return plan.transitive_dependents([rule_id]) if rule_id in plan.rules else frozenset()


def _root_cause(plan: Plan, failed: set[str], rule_id: str) -> str:
    """The first permanently failed rule (in plan order) that `rule_id` depends on."""
    return next(f for f in plan.order if f in failed and rule_id in _deps(plan, f))


def _prune_evidence(evs: list[dict], rule_id: str, root: str) -> list[dict[str, Any]]:
    root_evs = [
        e
        for e in evs
        if e.get("rule_id") == root
        and e.get("ev") == "status_written"
        and e.get("status") == PERMANENTLY_FAILED
    ]
    mine = [e for e in evs if e.get("rule_id") == rule_id]
    key = root_evs + _of(mine, "rule_started", "result_persisted", "status_written")
    return _timeline(key, _of(evs, "rules_skipped", "recovered"))


# --- idempotent_results -------------------------------------------------------------------


def _reference_agent(profile: AgentProfile) -> FakeAgent:
    """The profile without its errors: `draw` then always answers, with the verdict and
    score of (seed, attemptId, ruleId), which no error knob changes."""
    clean = dataclasses.replace(
        profile,
        error_rate=0.0,
        permanent_error_rate=0.0,
        fail_rules={},
        always_fail_rules=frozenset(),
    )
    return FakeAgent(clean)


def _key(verdict: Any, score: Any) -> tuple[str, float | None]:
    s = round(float(score), 6) if isinstance(score, int | float) else None
    return (str(verdict), s)


def _show(value: tuple[str, float | None]) -> str:
    return value[0] if value[1] is None else f"{value[0]} ({value[1]:g})"


def _check_idempotent_results(cx: _Context) -> _Outcome:
    """Per (attemptId, ruleId): the (verdict, score) of every `rule_finished`, of every
    `result_persisted` (and the `kept_verdict` a losing write saw) and of the final
    result agree; with `spec.agent`, they equal the reference draw."""
    out: list[Violation] = []
    agent = _reference_agent(cx.spec.agent) if cx.spec.agent is not None else None
    pairs = set(cx.by_pair)
    for a, fin in cx.final.evaluations.items():
        pairs |= {(a, r) for r in fin.results}
    judged = False
    for a, r in sorted(pairs):
        evs = cx.by_pair.get((a, r), [])
        seen: list[tuple[tuple[str, float | None], dict | None]] = []
        for e in _of(evs, "rule_finished", "result_persisted"):
            seen.append((_key(e.get("verdict"), e.get("score")), e))
        final = cx.result_of(a, r)
        if final is not None:
            seen.append((_key(final.verdict, final.score), None))
        kept = [e for e in _of(evs, "result_persisted") if e.get("kept_verdict") is not None]
        if not seen:
            continue
        judged = True
        values = {v for v, _ in seen}
        verdicts = {v[0] for v in values} | {str(e["kept_verdict"]) for e in kept}
        if len(values) > 1 or len(verdicts) > 1:
            counts: dict[tuple[str, float | None], int] = defaultdict(int)
            for v, e in seen:
                if e is not None:
                    counts[v] += 1
            shown = ", ".join(f"{_show(v)} x{n}" for v, n in sorted(counts.items()))
            if final is not None:
                shown += f"; final result {_show(_key(final.verdict, final.score))}"
            out.append(
                Violation(
                    "idempotent_results",
                    a,
                    r,
                    f"executions of {r} disagree: {shown}",
                    _timeline([e for _, e in seen if e is not None] + kept),
                )
            )
            continue
        if agent is not None:
            ref = agent.draw(a, r, 1, 1, 0).result
            assert ref is not None  # the clean profile never errs
            want = _key(ref.verdict, ref.score)
            (got,) = values
            if got != want:
                where = "final result" if final is not None else "every execution"
                out.append(
                    Violation(
                        "idempotent_results",
                        a,
                        r,
                        f"{where} of {r} is {_show(got)}; the fault-free reference is "
                        f"{_show(want)}",
                        _timeline([e for _, e in seen if e is not None]),
                    )
                )
    return judged, out


# --- all_terminal -----------------------------------------------------------------------


def _check_all_terminal(cx: _Context) -> _Outcome:
    """Every submitted evaluation (runner `submitted` events, else `spec.plans`) has a
    final state in completed / partial / failed / cancelled."""
    out: list[Violation] = []
    wanted = sorted(cx.submitted) if cx.submitted else sorted(cx.spec.plans)
    for a in wanted:
        fin = cx.final_of(a)
        state = fin.state if fin else None
        if state in TERMINAL_STATES:
            continue
        evs = cx.by_eval[a]
        last = evs[-1] if evs else None
        tail = (
            f"; last event {last.get('ev')} by {last.get('src')}" if last else "; no event at all"
        )
        out.append(
            Violation(
                "all_terminal",
                a,
                None,
                f"evaluation ended {state or 'with no state'}, not terminal{tail}",
                _timeline(
                    _of(evs, "submitted") + evs[-6:],
                    _of(evs, "parked", "crash", "evaluation_abandoned") + cx.faults,
                ),
            )
        )
    cx.stats["evaluations_submitted"] = len(wanted)
    return bool(wanted), out


# --- attempts_monotonic ---------------------------------------------------------------------


def _rank(status: str | None) -> int | None:
    try:
        return status_rank(status)
    except ValueError:
        return None


def _check_attempts_monotonic(cx: _Context) -> _Outcome:
    """Per (attemptId, ruleId), in time order:
    - the attempt of each `rule_started` is >= every earlier one, and <= `max_attempts`;
    - the status Redis holds after each `status_written` (the one written, or the `kept`
      one when the script refused to go back) ranks >= every earlier one, and the final
      status ranks >= all of them (failed_attempt_N ranks N, permanently_failed above all);
    - with M the highest attempt started, the final status `failed_attempt_N` needs
      N <= M <= N + 1; no status at all needs M = 1 unless a result says otherwise;
    - a final result of attempt k needs status `failed_attempt_{k-1}` (none for k = 1)."""
    out: list[Violation] = []
    refused = 0
    judged = False
    pairs = set(cx.by_pair)
    for a, fin in cx.final.evaluations.items():
        pairs |= {(a, r) for r in fin.statuses}
    for a, r in sorted(pairs):
        evs = cx.by_pair.get((a, r), [])
        starts = _of(evs, "rule_started")
        writes = _of(evs, "status_written")
        fin = cx.final_of(a)
        final_status = fin.statuses.get(r) if fin else None
        if starts or writes or final_status:
            judged = True

        def flag(message: str, key: list[dict], a: str = a, r: str = r) -> None:
            out.append(Violation("attempts_monotonic", a, r, message, _timeline(key)))

        top: dict | None = None
        for e in starts:
            n = _int(e.get("attempt"), 1)
            if top is not None and n < _int(top.get("attempt"), 1):
                flag(f"{r} started attempt {n} after attempt {top.get('attempt')}", [top, e])
                break
            if top is None or n > _int(top.get("attempt"), 1):
                top = e
        m = _int(top.get("attempt"), 1) if top is not None else None
        limit = cx.max_attempts(a, r)
        if m is not None and m > limit:
            flag(f"{r} started attempt {m}, beyond max_attempts {limit}", [top, *writes[-3:]])
        held: dict | None = None
        held_rank = 0
        for e in writes:
            effective = e.get("kept") or e.get("status")
            rank = _rank(effective)
            if e.get("kept"):
                refused += 1
            if rank is None:
                flag(f"{r}: status {effective!r} is not one the engine writes", [e])
                continue
            if held is not None and rank < held_rank:
                flag(f"{r}: status went back from {held.get('status')} to {effective}", [held, e])
            if rank >= held_rank:
                held, held_rank = e, rank
        if fin is None:
            continue  # the runner read no final state for this evaluation: nothing to compare
        final_rank = _rank(final_status)
        if final_status is not None and final_rank is None:
            flag(f"{r}: final status {final_status!r} is not one the engine writes", writes[-3:])
            continue
        if held is not None and final_rank is not None and final_rank < held_rank:
            flag(
                f"{r}: Redis ends with {final_status or 'no status'} although "
                f"{held.get('kept') or held.get('status')} was written",
                [held],
            )
        result = cx.result_of(a, r)
        n_failed = None
        if final_status is not None and final_status != PERMANENTLY_FAILED:
            n_failed = parse_status(final_status)
        if m is not None:
            if n_failed is not None and not n_failed <= m <= n_failed + 1:
                flag(
                    f"{r} ends with {final_status} but its highest attempt started is {m}",
                    [top, *writes[-3:]],
                )
            elif final_status is None and m >= 2:
                flag(
                    f"{r} started attempt {m} but Redis holds no failed_attempt status",
                    [top, *writes[-3:]],
                )
        if result is not None and final_status != PERMANENTLY_FAILED:
            expected = 1 if n_failed is None else n_failed + 1
            if result.attempt != expected:
                flag(
                    f"{r}'s result is from attempt {result.attempt} but its status is "
                    f"{final_status or 'absent'}: expected attempt {expected}",
                    _of(evs, "result_persisted") + writes[-3:],
                )
    cx.stats["status_writes_refused"] = refused
    return judged, out


# --- retry_delays_respected ---------------------------------------------------------------


def _check_retry_delays_respected(cx: _Context) -> _Outcome:
    """For the first `rule_started` of each attempt k >= 2 of a rule: base = the latest
    `status_written` of `failed_attempt_{k-1}` before it (else the `retry_published` of
    attempt k). The delay is the `retry_published` `delay_ms` (which must be at least the
    policy tier times `time_scale`), else the tier itself (a retry re-published by the
    sweeper). Starting earlier than delay - `delay_tolerance_s` is a violation; later
    than delay + `retry_slack_s` is one unless a fault window overlaps the wait or the
    retry came through the sweeper (`delivered` with reason `lost_retry`)."""
    spec, policy = cx.spec, cx.spec.policy
    out: list[Violation] = []
    latencies: list[float] = []
    lateness: list[float] = []
    excused = unchecked = 0
    for (a, r), evs in sorted(cx.by_pair.items()):
        firsts: dict[int, dict] = {}
        for e in _of(evs, "rule_started"):
            k = _int(e.get("attempt"), 1)
            if k >= 2 and k not in firsts:
                firsts[k] = e
        for k, start in sorted(firsts.items()):
            ts = _t(start)
            before = [e for e in evs if _t(e) <= ts]
            status = next(
                (
                    e
                    for e in reversed(_of(before, "status_written"))
                    if e.get("status") == f"failed_attempt_{k - 1}"
                ),
                None,
            )
            pub = next(
                (e for e in reversed(_of(before, "retry_published")) if e.get("attempt") == k),
                None,
            )
            base = status or pub
            if base is None:
                unchecked += 1
                continue
            tier = policy.tier_for(k - 1)
            tier_ms = policy.tiers_ms[tier] * spec.time_scale
            delay_ms = float(tier_ms)
            if pub is not None and isinstance(pub.get("delay_ms"), int | float):
                published = float(pub["delay_ms"])
                if published < tier_ms - 0.5 - 1e-9:  # the engine rounds scaled delays
                    out.append(
                        Violation(
                            "retry_delays_respected",
                            a,
                            r,
                            f"retry of {r} attempt {k} published with {_num(published)} ms, "
                            f"below its tier {tier + 1} ({_num(tier_ms)} ms)",
                            _timeline([x for x in (status, pub, start) if x is not None]),
                        )
                    )
                delay_ms = max(published, tier_ms)
            latency = ts - _t(base)
            delay_s = delay_ms / 1000.0
            latencies.append(latency)
            lateness.append(latency - delay_s)
            key = [x for x in (status, pub, start) if x is not None]
            deliveries = [
                e
                for e in _of(before, "delivered", "sweeper_retried")
                if e.get("attempt") == k and _t(e) >= _t(base)
            ]
            if latency < delay_s - spec.delay_tolerance_s:
                out.append(
                    Violation(
                        "retry_delays_respected",
                        a,
                        r,
                        f"{r} attempt {k} started {latency * 1000:.1f} ms after "
                        f"failed_attempt_{k - 1}, before its {_num(delay_ms)} ms delay",
                        _timeline(key, deliveries),
                    )
                )
            elif latency > delay_s + spec.retry_slack_s:
                swept = any(
                    e.get("reason") == "lost_retry" or e.get("ev") == "sweeper_retried"
                    for e in deliveries
                )
                if swept or cx.fault_between(_t(base), ts):
                    excused += 1
                else:
                    out.append(
                        Violation(
                            "retry_delays_respected",
                            a,
                            r,
                            f"{r} attempt {k} started {latency:.3f} s after failed_attempt_"
                            f"{k - 1}: {latency - delay_s:.3f} s past its {_num(delay_ms)} ms "
                            f"delay (slack {_num(spec.retry_slack_s)} s), with no fault",
                            _timeline(key, deliveries),
                        )
                    )
    cx.stats.update(
        retries_checked=len(latencies),
        retries_unchecked=unchecked,
        retry_latency_s=[round(x, 6) for x in latencies],
        retry_latency_max_s=round(max(latencies), 6) if latencies else 0.0,
        retry_lateness_max_s=round(max(lateness), 6) if lateness else 0.0,
        late_retries_excused=excused,
    )
    return bool(cx.events), out


# --- single_final_result -----------------------------------------------------------------


def _killed(cx: _Context, publisher: dict, t0: float, t1: float) -> bool:
    """Whether the process that recorded `publisher` crashed or was killed in (t0, t1]."""
    src, pid = publisher.get("src"), publisher.get("pid")
    for e in cx.faults:
        if not t0 < _t(e) <= t1:
            continue
        if e.get("ev") == "crash" and (e.get("src"), e.get("pid")) == (src, pid):
            return True
        if e.get("ev") == "worker_killed" and (
            (pid is not None and e.get("pid") == pid) or (src and e.get("worker") == src)
        ):
            return True
    return False


def _check_single_final_result(cx: _Context) -> _Outcome:
    """Per evaluation: at most one `evaluation_terminal` with `won: true`, with the final
    state's status; every `final_published` carries the final state; and each
    `final_published` after the first follows a crash or kill of the process that
    published the one before it (a cancelled evaluation may have none: the canceller
    publishes)."""
    out: list[Violation] = []
    judged = False
    published = 0
    for a in cx.evaluations:
        evs = cx.by_eval[a]
        fin = cx.final_of(a)
        state = fin.state if fin else None
        won = [e for e in _of(evs, "evaluation_terminal") if e.get("won") is True]
        pubs = _of(evs, "final_published")
        published += len(pubs)
        if won or pubs or state in TERMINAL_STATES:
            judged = True
        if len(won) > 1:
            out.append(
                Violation(
                    "single_final_result",
                    a,
                    None,
                    f"{len(won)} workers won the terminal state: "
                    f"{_listed([str(e.get('status')) for e in won])}",
                    _timeline(won + pubs),
                )
            )
        for e in won:
            if state is not None and e.get("status") != state:
                out.append(
                    Violation(
                        "single_final_result",
                        a,
                        None,
                        f"terminal state {e.get('status')} was won, but Redis ends with {state}",
                        _timeline([e, *pubs]),
                    )
                )
        statuses = sorted({str(e.get("status")) for e in pubs})
        wrong = [e for e in pubs if state is not None and e.get("status") != state]
        if len(statuses) > 1 or wrong:
            out.append(
                Violation(
                    "single_final_result",
                    a,
                    None,
                    f"final results published with status {_listed(statuses)}; "
                    f"Redis ends with {state}",
                    _timeline(pubs + won),
                )
            )
        for prev, nxt in itertools.pairwise(pubs):
            if not _killed(cx, prev, _t(prev), _t(nxt)):
                out.append(
                    Violation(
                        "single_final_result",
                        a,
                        None,
                        f"final result published again by {nxt.get('src')} "
                        f"{_t(nxt) - _t(prev):.3f} s after {prev.get('src')} published it, "
                        "with no crash of the first publisher in between",
                        _timeline([prev, nxt], won + cx.faults),
                    )
                )
    cx.stats["final_published"] = published
    return judged, out


# --- state_keys_expire ---------------------------------------------------------------------


def _attempt_of(key: str) -> str:
    body = key[len(STATE_KEY_PREFIX) :]
    if ":rule:" in body:
        return body.split(":rule:", 1)[0]
    return body.rsplit(":", 1)[0] if ":" in body else body


def _check_state_keys_expire(cx: _Context) -> _Outcome:
    """Every `attempt:*` key has a TTL (`TTL` >= 0) of at most 7 days (+ a minute). TTL 0
    is a lease (`owner`, PX) under a second from expiry; -2 (the key went away between
    listing and reading) is ignored; keys outside `attempt:*` (the engine's
    indexes) are not state keys and only counted."""
    out: list[Violation] = []
    bad: dict[str, list[str]] = defaultdict(list)
    checked = exempt = 0
    limit = STATE_TTL_SECONDS + TTL_SLACK_S
    for key, ttl in sorted(cx.final.key_ttls.items()):
        if not key.startswith(STATE_KEY_PREFIX):
            exempt += 1
            continue
        if ttl == -2:
            continue
        checked += 1
        if ttl == -1 or ttl > limit:  # 0: a short lease about to expire, still a TTL
            shown = "no TTL" if ttl == -1 else f"TTL {ttl} s"
            bad[_attempt_of(key)].append(f"{key} ({shown})")
    for a, keys in sorted(bad.items()):
        out.append(
            Violation(
                "state_keys_expire",
                a,
                None,
                f"{len(keys)} key(s) would outlive the 7-day TTL: {_listed(keys, 3)}",
                _timeline(_of(cx.by_eval.get(a, []), "evaluation_terminal", "final_published")),
            )
        )
    cx.stats.update(keys_checked=checked, keys_exempt=exempt)
    return checked > 0, out


#: The checks, in the order of `INVARIANTS` (a table: the code, the tests and the journal
#: read the same names).
_CHECKS: dict[str, Callable[[_Context], _Outcome]] = {
    "no_completed_rerun": _check_no_completed_rerun,
    "prune_only_dependents": _check_prune_only_dependents,
    "idempotent_results": _check_idempotent_results,
    "all_terminal": _check_all_terminal,
    "attempts_monotonic": _check_attempts_monotonic,
    "retry_delays_respected": _check_retry_delays_respected,
    "single_final_result": _check_single_final_result,
    "state_keys_expire": _check_state_keys_expire,
}
assert list(_CHECKS) == list(INVARIANTS)
