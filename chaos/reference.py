"""The fault-free reference: what the same evaluations give when nothing goes wrong.

Faults may cost a run time and tokens, never a different outcome: the engine owes, for
every evaluation not cancelled on purpose, the final status, the completed, permanently
failed and skipped rules, each rule's verdict and each pass's published result of a run
without faults. `reference_for` computes that run from the two things that decide it: the
fake agent's draws and the scenario's own retry numbers (immediate retries, `max_attempts`
and each rule's own `max_attempts` in the plan), on the same seed, plans and agent profile.

It is computed by the checker's own code, never by the engine's: nothing here imports
`engine.core` (but the stored result's data type) or `engine.policy`
(`tests/test_style.py` holds it to that). A bug of the engine's core or policy (a plan's
per-rule `max_attempts` ignored, a wrong prune) would otherwise move the expected outcome
with the engine's, and `matches_reference` would agree with the bug. A rule runs once
every rule it depends on has a result; each attempt makes up to `1 + immediate_retries`
calls; an error the checker's table calls permanent (`oracle.PERMANENT_ERRORS`) ends it
for good at once, and so does the last transient failure of attempt `max_attempts`
(`oracle.max_attempts_of`); the rules it prunes are its transitive dependents
(`oracle.dependents_of`, from the plan's `depends_on` edges). No shell, no broker, no
Redis, no clock, no core: well under a millisecond per evaluation, so every run, live or
simulated, gets one (`CheckSpec.reference`, filled by `LoadedScenario.check_spec`), and
the checker's `matches_reference` compares with it.

It is sound because the fake agent draws from (seed, attemptId, ruleId, attempt, try)
only (`engine.agent.FakeAgent.draw`): whichever worker runs a call, after whatever crash,
the call answers as in the reference, and the outcome does not depend on the order
answers come in. The one exception is the profile's `drift`: a rerun may give another
verdict, so with drift > 0 verdicts are not the reference's to judge (`Reference.drift`;
`idempotent_results` compares them with the first durable write). Computed without the
engine, the reference is also a check of it: an engine that decided wrongly would differ
from it even without faults (`tests/test_reference.py` holds the simulator's fault-free
runs to it).

Rule sets come from the final state alone (`outcome_of`), for the run: completed = a
result in Redis; permanently failed = that status and no result (a result beats a status,
as recovery reads it); skipped = every other rule of the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.agent import AgentProfile, Draw, FakeAgent
from engine.core.results import RuleResult
from engine.plan import Plan

if TYPE_CHECKING:
    from chaos.checker import EvaluationFinal
    from chaos.checker.records import RetrySettings
    from chaos.scenario import LoadedScenario

#: The stored status of a rule given up on, as the seed spells it (the checker's own copy).
PERMANENTLY_FAILED = "permanently_failed"
SUCCEEDED = "succeeded"
SKIPPED = "skipped"

_CACHE_SIZE = 64


@dataclass(frozen=True)
class PassOutcome:
    """One published pass result: complete or partial, and each rule's verdict or state."""

    outcome: str
    rules: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    """What one evaluation ends with, in the terms the reference is compared in."""

    status: str | None
    completed: frozenset[str]
    permanently_failed: frozenset[str]
    skipped: frozenset[str]
    verdicts: dict[str, str] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)
    passes: dict[str, PassOutcome] = field(default_factory=dict)
    #: What its calls cost without faults (tokens); not part of the outcome compared.
    tokens: int = field(default=0, compare=False)
    #: Each call it makes, (ruleId, attempt, try) -> tokens: the bill call by call, which
    #: `reports.cost.figures` splits a run's cost against; not compared either.
    calls: dict[tuple[str, int, int], int] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain data, sorted, for a journal or a test's comparison."""
        return {
            "status": self.status,
            "completed": sorted(self.completed),
            "permanently_failed": sorted(self.permanently_failed),
            "skipped": sorted(self.skipped),
            "verdicts": dict(sorted(self.verdicts.items())),
            "scores": dict(sorted(self.scores.items())),
            "passes": {
                p: {"outcome": o.outcome, "rules": dict(sorted(o.rules.items()))}
                for p, o in sorted(self.passes.items())
            },
        }


@dataclass(frozen=True)
class Reference:
    """Per attemptId, the fault-free `Outcome`. `drift` is the agent's: above 0, a rerun
    may legitimately answer another verdict."""

    evaluations: dict[str, Outcome] = field(default_factory=dict)
    drift: float = 0.0

    def of(self, attempt_id: str) -> Outcome | None:
        return self.evaluations.get(attempt_id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "drift": self.drift,
            "evaluations": {a: o.to_dict() for a, o in sorted(self.evaluations.items())},
        }


def outcome_of(
    plan: Plan, final: EvaluationFinal, history: Iterable[Mapping[str, Any]] = ()
) -> Outcome:
    """One evaluation's `Outcome` from its final Redis state (and, for the passes, the
    first `pass_published` of each pass in `history`)."""
    results = {r: res for r, res in final.results.items() if r in plan.rules}
    failed = frozenset(
        r
        for r, status in final.statuses.items()
        if status == PERMANENTLY_FAILED and r in plan.rules and r not in results
    )
    completed = frozenset(results)
    skipped = frozenset(r for r in plan.order if r not in completed and r not in failed)
    passes: dict[str, PassOutcome] = {}
    for e in history:
        if e.get("ev") != "pass_published" or e.get("attempt_id") != final.attempt_id:
            continue
        pass_id = str(e.get("pass_id"))
        rules = e.get("rules")
        if pass_id not in passes:
            shown = {str(k): str(v) for k, v in rules.items()} if isinstance(rules, Mapping) else {}
            passes[pass_id] = PassOutcome(str(e.get("outcome")), shown)
    return Outcome(
        status=final.state,
        completed=completed,
        permanently_failed=failed,
        skipped=skipped,
        verdicts={r: res.verdict for r, res in results.items()},
        scores={r: round(float(res.score), 6) for r, res in results.items()},
        passes=passes,
    )


def fault_free(loaded: LoadedScenario) -> LoadedScenario:
    """The same scenario with every fault stripped: no failpoint, no kill, no cancel."""
    spec = loaded.spec.model_copy(update={"faults": ()})
    return dataclasses.replace(loaded, spec=spec)


@dataclass(frozen=True)
class Draws:
    """The calls a run has drawn (first executions, by (attemptId, ruleId, attempt, try)),
    for its reference to read instead of drawing them again: `FakeAgent.draw` is pure, so
    an agent of the same profile (the same object) and the same level-1 retry count draws
    the same. Never filled by a mutant's agent (`chaos.insim.run.SimRun`)."""

    profile: AgentProfile
    immediate_retries: int
    table: dict[tuple[str, str, int, int], Draw] = field(default_factory=dict)


_cache: dict[tuple[Any, ...], Reference] = {}


def reference_for(
    loaded: LoadedScenario,
    seed: int,
    plans: Mapping[str, Plan],
    draws: Draws | None = None,
) -> Reference:
    """The fault-free reference of a run of `loaded` under `seed` on `plans` (attemptId ->
    plan, as the run submitted them).

    The same agent profile (its seed the run's unless the scenario sets one) and the
    scenario's retry numbers, as plain data (`RetrySettings`); cached per what it reads of
    them (`_key`), since shrinking reruns one seed many times. `draws`: what the run's
    agents drew, read where they are the reference's own (same profile and retries)."""
    from chaos.checker.records import RetrySettings

    if dict(plans) != loaded.evaluations(seed):
        raise ValueError(
            f"the plans are not the evaluations of {loaded.spec.name} under seed {seed}: a "
            "reference runs the scenario's own submissions"
        )
    spec = loaded.spec
    own = seed == spec.seed  # the loaded scenario's own profile, built for it
    settings = RetrySettings.of(spec.retry)
    key = _key(loaded, seed, settings, plans)
    cached = _cache.get(key)
    if cached is not None:
        return cached
    profile = loaded.agent if own else AgentProfile.from_dict({"seed": seed, **spec.agent})
    agent = FakeAgent(profile, salt=0, immediate_retries=settings.immediate_retries)
    known = None
    if draws is not None and draws.profile is profile:
        known = draws.table if draws.immediate_retries == settings.immediate_retries else None
    ref = Reference(
        {a: fault_free_outcome(plan, a, settings, agent, known) for a, plan in plans.items()},
        profile.drift,
    )
    if len(_cache) >= _CACHE_SIZE:
        _cache.pop(next(iter(_cache)))
    _cache[key] = ref
    return ref


def _topological(plan: Plan) -> list[str]:
    """The plan's rules, each after every rule it depends on (file order otherwise), from
    the `depends_on` edges alone: the checker's own order, not the plan's. The order of
    sweeps over the file that each place every rule whose dependencies are placed (a rule
    can follow one placed earlier in the same sweep), worked out without sweeping: a
    rule's sweep is its latest dependency's, one later if that one is listed after it."""
    rules = plan.rules
    listed = [r for p in plan.passes for r in p.rule_ids]
    at = {rid: i for i, rid in enumerate(listed)}
    sweep: dict[str, int] = {}
    pending = {rid: len(rules[rid].depends_on) for rid in listed}
    dependents: dict[str, list[str]] = {rid: [] for rid in listed}
    for rid in listed:
        for d in rules[rid].depends_on:
            dependents[d].append(rid)
    ready = [rid for rid in listed if not pending[rid]]
    while ready:  # each rule once its dependencies are all swept (Kahn's order)
        rid = ready.pop()
        deps = rules[rid].depends_on
        sweep[rid] = max((sweep[d] + (at[d] > at[rid]) for d in deps), default=0)
        for x in dependents[rid]:
            pending[x] -= 1
            if not pending[x]:
                ready.append(x)
    if len(sweep) < len(listed):  # a cycle: a validated plan has none
        raise ValueError(f"plan {plan.id}: its dependencies form a cycle")
    return sorted(listed, key=lambda rid: (sweep[rid], at[rid]))


def fault_free_outcome(
    plan: Plan,
    attempt_id: str,
    settings: RetrySettings,
    agent: FakeAgent,
    known: Mapping[tuple[str, str, int, int], Draw] | None = None,
) -> Outcome:
    """One evaluation without faults, rule by rule from the agent's draws and the retry
    numbers, by the checker's own rules (`known`: draws of `agent`'s own, already made;
    see `Draws`). The engine's core is never asked."""
    from chaos.checker.oracle import dependents_of, is_permanent_error, max_attempts_of

    tries = 1 + settings.immediate_retries  # level 1: the first call and its retries
    results: dict[str, RuleResult] = {}
    failed: set[str] = set()
    tokens = 0
    paid: dict[tuple[str, int, int], int] = {}  # each call's tokens, by (rule, attempt, try)
    for rid in _topological(plan):
        if any(d not in results for d in plan.rules[rid].depends_on):
            continue  # a dependency failed for good, or was pruned: pruned below
        result: RuleResult | None = None
        gave_up = False
        for attempt in range(1, max_attempts_of(plan, rid, settings) + 1):  # levels 2 and 3
            for try_no in range(1, tries + 1):
                d = known.get((attempt_id, rid, attempt, try_no)) if known is not None else None
                if d is None:
                    d = agent.draw(attempt_id, rid, attempt, try_no)
                tokens += d.tokens
                paid[rid, attempt, try_no] = d.tokens
                if d.error is None:
                    result = d.result
                    break
                if is_permanent_error(d.error):
                    gave_up = True
                    break
            if result is not None or gave_up:
                break
        if result is not None:
            results[rid] = result
        else:
            failed.add(rid)
    completed = frozenset(results)
    lost = frozenset(failed)
    skipped = dependents_of(plan, lost) - lost
    state = {r: SUCCEEDED for r in completed} | {r: PERMANENTLY_FAILED for r in lost}
    passes: dict[str, PassOutcome] = {}
    for p in plan.passes:
        shown = {
            r: results[r].verdict if r in results else state.get(r, SKIPPED) for r in p.rule_ids
        }
        whole = all(r in results for r in p.rule_ids)
        passes[p.id] = PassOutcome("complete" if whole else "partial", shown)
    if len(completed) == len(plan.rules):
        status = "completed"
    else:
        status = "partial" if completed else "failed"
    return Outcome(
        status=status,
        completed=completed,
        permanently_failed=lost,
        skipped=frozenset(r for r in plan.rules if r in skipped),
        verdicts={r: res.verdict for r, res in results.items()},
        scores={r: round(float(res.score), 6) for r, res in results.items()},
        passes=passes,
        tokens=tokens,
        calls=paid,
    )


def _key(
    loaded: LoadedScenario, seed: int, settings: RetrySettings, plans: Mapping[str, Plan]
) -> tuple[Any, ...]:
    """What `reference_for` reads of its inputs, and nothing else: the seed, the retry
    settings (a frozen value, its tiers a tuple), the scenario's agent settings (the
    profile is theirs, with the seed) and the plans. Cheap: every seed explored computes
    it, and the whole scenario as JSON cost a twentieth of the reference."""
    spec = loaded.spec
    agent = repr(spec.agent)  # equal settings give an equal repr, or a miss: never wrong
    plan_keys = tuple((a, p.to_json()) for a, p in plans.items())
    return (seed, settings, agent, plan_keys)
