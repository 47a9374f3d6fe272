"""The fault-free reference: what the same evaluations give when nothing goes wrong.

Faults may cost a run time and tokens, never a different outcome: the engine owes, for
every evaluation not cancelled on purpose, the final status, the completed, permanently
failed and skipped rules and each rule's verdict of a run without faults. `reference_for`
computes that run with the simulator (`chaos.insim.run.SimRun.simulate`: the engine's own core and
the fake agent's own draws) on the same seed, plans, agent profile, retry policy and time
scale with every fault stripped: no failpoints, no kills, no cancels. It costs
milliseconds, so every run, live or simulated, gets one (`CheckSpec.reference`, filled by
`LoadedScenario.check_spec`), and the checker's `matches_reference` compares with it.

It is sound because the fake agent draws from (seed, attemptId, ruleId, attempt, try)
only (`engine.agent.FakeAgent.draw`): whichever worker runs a call, after whatever crash,
the call answers as in the reference. The one exception is the profile's `drift`: a rerun
may give another verdict, so with drift > 0 verdicts are not the reference's to judge
(`Reference.drift`; `idempotent_results` compares them with the first durable write).

Rule sets come from the final state alone (`outcome_of`), for the reference and the run
alike: completed = a result in Redis; permanently failed = that status and no result (a
result beats a status, as recovery reads it); skipped = every other rule of the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.core.states import PERMANENTLY_FAILED
from engine.plan import Plan

if TYPE_CHECKING:
    from chaos.checker import EvaluationFinal, FinalState
    from chaos.scenario import LoadedScenario

#: Terminal states of an evaluation that ran to its end (cancelled is not one of them).
FINISHED = frozenset({"completed", "partial", "failed"})
#: Scenario fields that do not change what a fault-free run computes (the cache key drops
#: them; the faults themselves are stripped).
_NOT_OUTCOME = {"name", "description", "faults", "invariants", "budgets"}
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
    """Per attemptId, the fault-free `Outcome` (only evaluations the reference run
    finished: one it could not finish by the deadline is in `unfinished`, not judged).
    `drift` is the agent's: above 0, a rerun may legitimately answer another verdict."""

    evaluations: dict[str, Outcome] = field(default_factory=dict)
    drift: float = 0.0
    unfinished: tuple[str, ...] = ()

    def of(self, attempt_id: str) -> Outcome | None:
        return self.evaluations.get(attempt_id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "drift": self.drift,
            "unfinished": list(self.unfinished),
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


_cache: dict[tuple[Any, ...], Reference] = {}


def reference_for(loaded: LoadedScenario, seed: int, plans: Mapping[str, Plan]) -> Reference:
    """The fault-free reference of a run of `loaded` under `seed` on `plans` (attemptId ->
    plan, as the run submitted them): the simulator on the same scenario without faults.

    The same agent profile (its seed the run's unless the scenario sets one), retry policy,
    time scale, engine settings and workers; cached per (scenario without faults, seed,
    plans), since shrinking and exploring rerun one seed many times."""
    if dict(plans) != loaded.evaluations(seed):
        raise ValueError(
            f"the plans are not the evaluations of {loaded.spec.name} under seed {seed}: a "
            "reference runs the scenario's own submissions"
        )
    key = _key(loaded, seed, plans)
    cached = _cache.get(key)
    if cached is not None:
        return cached
    from chaos.insim.run import SimRun  # the simulator imports the checker: imported late

    run = SimRun(fault_free(loaded), seed, reference=False)
    final = run.simulate()  # `run_scenario` without its check: only the outcome is needed
    return _remember(key, loaded, plans, final, run.events)


def remember(
    loaded: LoadedScenario,
    seed: int,
    plans: Mapping[str, Plan],
    final: FinalState,
    events: list[dict[str, Any]],
) -> None:
    """A simulated run of the clean engine on a scenario without faults is its own
    reference: kept, so that `reference_for` does not simulate it a second time (half
    the explorer's swarm variants of a one-fault scenario draw no fault at all)."""
    if loaded.spec.faults:
        raise ValueError(f"{loaded.spec.name}: a run with faults is no reference")
    _remember(_key(loaded, seed, plans), loaded, plans, final, events)


def _remember(
    key: tuple[Any, ...],
    loaded: LoadedScenario,
    plans: Mapping[str, Plan],
    final: FinalState,
    events: list[dict[str, Any]],
) -> Reference:
    evaluations: dict[str, Outcome] = {}
    unfinished: list[str] = []
    for a, plan in plans.items():
        fin = final.evaluations.get(a)
        if fin is None or fin.state not in FINISHED:
            unfinished.append(a)
            continue
        evaluations[a] = outcome_of(plan, fin, events)
    ref = Reference(evaluations, loaded.spec.agent_profile().drift, tuple(unfinished))
    if len(_cache) >= _CACHE_SIZE:
        _cache.pop(next(iter(_cache)))
    _cache[key] = ref
    return ref


def _key(loaded: LoadedScenario, seed: int, plans: Mapping[str, Plan]) -> tuple[Any, ...]:
    spec = loaded.spec.model_dump_json(exclude=_NOT_OUTCOME)
    return (spec, seed, tuple((a, p.to_json()) for a, p in plans.items()))
