"""The fault-free reference: what the same evaluations give when nothing goes wrong.

Faults may cost a run time and tokens, never a different outcome: the engine owes, for
every evaluation not cancelled on purpose, the final status, the completed, permanently
failed and skipped rules, each rule's verdict and each pass's published result of a run
without faults. `reference_for` computes that run from the two things that decide it: the
engine's pure core (`engine.core.Evaluation`, which makes every decision of the protocol)
and the fake agent's draws, on the same seed, plans, agent profile and retry policy. No
shell, no broker, no Redis, no clock: nothing in between can fail, so the core is fed
each call's answer at once, and each delayed retry as soon as it is scheduled. It costs
well under a millisecond per evaluation, so every run, live or simulated, gets one
(`CheckSpec.reference`, filled by `LoadedScenario.check_spec`), and the checker's
`matches_reference` compares with it.

It is sound because the fake agent draws from (seed, attemptId, ruleId, attempt, try)
only (`engine.agent.FakeAgent.draw`): whichever worker runs a call, after whatever crash,
the call answers as in the reference, and the core's outcome does not depend on the order
answers come in. The one exception is the profile's `drift`: a rerun may give another
verdict, so with drift > 0 verdicts are not the reference's to judge (`Reference.drift`;
`idempotent_results` compares them with the first durable write). Computed without the
shells, the reference is also a check of them: a shell that carried out the core's
decisions wrongly would differ from it even without faults (`tests/test_reference.py`
holds the simulator's fault-free runs to it).

Rule sets come from the final state alone (`outcome_of`), for the run: completed = a
result in Redis; permanently failed = that status and no result (a result beats a status,
as recovery reads it); skipped = every other rule of the plan.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.agent import AgentProfile, Draw, FakeAgent, agent_error
from engine.core import actions as act
from engine.core.evaluation import Evaluation
from engine.core.results import RuleResult
from engine.core.states import PERMANENTLY_FAILED
from engine.plan import Plan
from engine.policy import RetryPolicy

if TYPE_CHECKING:
    from chaos.checker import EvaluationFinal
    from chaos.scenario import LoadedScenario

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
    #: `chaos.checker.cost.figures` splits a run's cost against; not compared either.
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

    The same agent profile (its seed the run's unless the scenario sets one), retry policy
    and engine settings; cached per what it reads of them (`_key`), since shrinking reruns
    one seed many times. `draws`: what the run's agents drew, read where they are the
    reference's own (same profile and retries)."""
    if dict(plans) != loaded.evaluations(seed):
        raise ValueError(
            f"the plans are not the evaluations of {loaded.spec.name} under seed {seed}: a "
            "reference runs the scenario's own submissions"
        )
    spec = loaded.spec
    own = seed == spec.seed  # the loaded scenario's own policy and profile, built for it
    policy = loaded.retry_policy if own else spec.retry.policy(seed)
    key = _key(loaded, seed, policy, plans)
    cached = _cache.get(key)
    if cached is not None:
        return cached
    profile = loaded.agent if own else AgentProfile.from_dict({"seed": seed, **spec.agent})
    agent = FakeAgent(profile, salt=0, immediate_retries=policy.immediate_retries)
    parallel = spec.engine.max_parallel
    known = None
    if draws is not None and draws.profile is profile:
        known = draws.table if draws.immediate_retries == policy.immediate_retries else None
    ref = Reference(
        {
            a: fault_free_outcome(plan, a, policy, agent, parallel, known)
            for a, plan in plans.items()
        },
        profile.drift,
    )
    if len(_cache) >= _CACHE_SIZE:
        _cache.pop(next(iter(_cache)))
    _cache[key] = ref
    return ref


def fault_free_outcome(
    plan: Plan,
    attempt_id: str,
    policy: RetryPolicy,
    agent: FakeAgent,
    max_parallel: int = 4,
    known: Mapping[tuple[str, str, int, int], Draw] | None = None,
) -> Outcome:
    """One evaluation run by its core alone: each action carried out at once, in order
    (`known`: draws of `agent`'s own, already made; see `Draws`)."""
    core = Evaluation(plan, attempt_id, policy, max_parallel=max_parallel)
    results: dict[str, RuleResult] = {}
    failed: set[str] = set()
    passes: dict[str, PassOutcome] = {}
    status: str | None = None
    tokens = 0
    calls: dict[tuple[str, int, int], int] = {}
    todo: deque[act.Action] = deque(core.start())
    while todo:
        action = todo.popleft()
        if isinstance(action, act.RunRule):
            d = None
            if known is not None:
                d = known.get((attempt_id, action.rule_id, action.attempt, action.try_no))
            if d is None:
                d = agent.draw(attempt_id, action.rule_id, action.attempt, action.try_no)
            tokens += d.tokens
            calls[action.rule_id, action.attempt, action.try_no] = d.tokens
            if d.error is None:
                assert d.result is not None
                todo.extend(core.rule_succeeded(action.rule_id, d.result))
            else:
                err = agent_error(d.error, tokens=d.tokens)
                todo.extend(core.rule_failed(action.rule_id, err.kind, retryable=err.retryable))
        elif isinstance(action, act.ScheduleRetry):  # due at once: nothing else is waited for
            todo.extend(core.retry_due(action.rule_id, action.attempt))
        elif isinstance(action, act.PersistResult):
            results[action.rule_id] = action.result
        elif isinstance(action, act.PersistStatus) and action.status == PERMANENTLY_FAILED:
            failed.add(action.rule_id)
        elif isinstance(action, act.PublishPassResult):
            passes.setdefault(action.pass_id, PassOutcome(action.outcome, dict(action.rules)))
        elif isinstance(action, act.Finish):
            status = action.status.value
    completed = frozenset(results)
    lost = frozenset(failed) - completed
    return Outcome(
        status=status,
        completed=completed,
        permanently_failed=lost,
        skipped=frozenset(r for r in plan.order if r not in completed and r not in lost),
        verdicts={r: res.verdict for r, res in results.items()},
        scores={r: round(float(res.score), 6) for r, res in results.items()},
        passes=passes,
        tokens=tokens,
        calls=calls,
    )


def _key(
    loaded: LoadedScenario, seed: int, policy: RetryPolicy, plans: Mapping[str, Plan]
) -> tuple[Any, ...]:
    """What `reference_for` reads of its inputs, and nothing else: the seed, the retry
    policy (a frozen value), the scenario's agent settings (the profile is theirs, with
    the seed), `max_parallel` and the plans. Cheap: every seed explored computes it, and
    the whole scenario as JSON cost a twentieth of the reference."""
    spec = loaded.spec
    agent = repr(spec.agent)  # equal settings give an equal repr, or a miss: never wrong
    plan_keys = tuple((a, p.to_json()) for a, p in plans.items())
    # the policy as its own key (hashed by value), unless a list of tiers makes it unhashable
    policy_key = policy if isinstance(policy.tiers_ms, tuple) else repr(policy)
    return (seed, policy_key, agent, spec.engine.max_parallel, plan_keys)
