"""The fault-free reference and `matches_reference`; the drifting agent.

The reference of a run is the simulator run on the same seed, plans and profile with the
faults stripped, so it must replay exactly and say what a fault-free run says. The check
compares final states with it field by field. The agent's draws depend on (seed,
attemptId, ruleId, attempt, try) only, and `drift` changes the verdict of reruns alone.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest

import chaos.reference as reference_module
from chaos.checker import CheckSpec, EvaluationFinal, FinalState, check
from chaos.insim import run_scenario
from chaos.insim.run import SimRun
from chaos.reference import (
    Draws,
    Outcome,
    Reference,
    fault_free,
    outcome_of,
    reference_for,
)
from chaos.scenario import load_scenario, schema_text
from engine.agent import PERMANENT_KINDS, AgentProfile, AgentProfileError, Draw, FakeAgent
from engine.core.results import RuleResult
from engine.core.states import PERMANENTLY_FAILED
from engine.plan import PlanError, plan_from_dict
from tests.helpers import make_plan, reversed_chain, sweep_order

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "scenarios"

#: a -> b, and c alone: `a` failing for good skips b and leaves c complete.
PLAN = make_plan({"one": {"a": [], "c": []}, "two": {"b": ["a"]}})
A = "att-1"


# --- the reference of a shipped scenario ---------------------------------------------------


@pytest.mark.parametrize("name", ["crash_in_write_window", "worker_kill_storm"])
def test_the_reference_replays_and_is_the_fault_free_run(name: str) -> None:
    loaded = load_scenario(SCENARIOS / f"{name}.yaml")
    seed = loaded.spec.seed
    plans = loaded.evaluations(seed)
    first = reference_for(loaded, seed, plans)
    reference_module._cache.clear()  # computed again, not read back
    again = reference_for(loaded, seed, plans)
    assert first is not again and first.to_dict() == again.to_dict()

    stripped = fault_free(loaded)
    assert stripped.spec.faults == () and loaded.spec.faults  # the file keeps its faults
    clean = run_scenario(stripped, seed)
    assert not [e for e in clean.history if e["ev"] in ("crash", "fault_fired")]
    assert set(first.evaluations) == set(plans)
    for a, plan in plans.items():
        expected = outcome_of(plan, clean.final.evaluations[a], clean.history)
        assert first.of(a) == expected
        assert expected.status in ("completed", "partial", "failed")
        assert expected.passes and set(expected.passes) == {p.id for p in plan.passes}
    assert first.drift == loaded.agent.drift


def test_the_reference_reads_a_runs_draws_only_where_they_are_its_own() -> None:
    """A simulated run keeps its agents' draws for its reference (`chaos.reference.Draws`):
    the reference is the same with them, reads them where the profile (the same object)
    and the level-1 retries are its own, and ignores them otherwise."""
    loaded = load_scenario(SCENARIOS / "crash_after_ack.yaml")
    seed = loaded.spec.seed
    plans = loaded.evaluations(seed)
    run = SimRun(loaded, seed)
    run.run()
    assert run.draws is not None and run.draws.profile is loaded.agent and run.draws.table
    reference_module._cache.clear()
    plain = reference_for(loaded, seed, plans)
    reference_module._cache.clear()
    assert reference_for(loaded, seed, plans, run.draws).to_dict() == plain.to_dict()

    # every call fails for good in this table: read, it changes the reference
    lost = Draw(0.0, PERMANENT_KINDS[0], None, 0)
    poisoned = {k: lost for k in run.draws.table}
    retries = loaded.retry_policy.immediate_retries
    for draws, read in (
        (Draws(loaded.agent, retries, poisoned), True),
        (Draws(loaded.agent, retries + 1, poisoned), False),  # numbers calls otherwise
        (Draws(dataclasses.replace(loaded.agent), retries, poisoned), False),  # another one
    ):
        reference_module._cache.clear()
        got = reference_for(loaded, seed, plans, draws)
        assert (got.to_dict() != plain.to_dict()) is read
    reference_module._cache.clear()
    assert SimRun(loaded, seed, "nondeterministic_agent").draws is None  # a mutant's agent


SHIPPED = sorted(SCENARIOS.glob("*.yaml")) + sorted((SCENARIOS / "regressions").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_the_simulated_shell_ends_every_shipped_scenario_like_the_core_alone(path: Path) -> None:
    """The reference is the core fed at once, without a shell; the simulator runs the shell
    that ships. Without faults they must end alike, evaluation by evaluation, pass by pass:
    a shell that carries out the core's decisions wrongly fails here first."""
    stripped = fault_free(load_scenario(path))
    for seed in range(3):
        plans = stripped.evaluations(seed)
        clean = run_scenario(stripped, seed)
        ref = reference_for(stripped, seed, plans)
        for a, plan in plans.items():
            assert outcome_of(plan, clean.final.evaluations[a], clean.history) == ref.of(a), a


def test_a_shell_that_gives_up_too_soon_differs_from_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shell bug that shows without any fault and stays consistent with itself (every
    failed call handed to the core as not retryable: rules fail for good at once, their
    dependents pruned exactly) is caught by the reference, computed without the shell.
    A reference simulated through the same shell ended the same way and passed it."""
    from engine.shell.orchestrator import PassExecutionOrchestrator

    real = PassExecutionOrchestrator._feed

    def gives_up(self: PassExecutionOrchestrator, fn: Any, *args: Any, **kw: Any) -> Any:
        if getattr(fn, "__name__", "") == "rule_failed":
            kw["retryable"] = False
        return real(self, fn, *args, **kw)

    monkeypatch.setattr(PassExecutionOrchestrator, "_feed", gives_up)
    stripped = fault_free(load_scenario(SCENARIOS / "transient_llm_errors.yaml"))
    result = run_scenario(stripped).result
    assert result.verdicts["matches_reference"] == "fail"
    assert "permanently_failed also has" in result.violations[0].message


def test_a_core_bug_planted_in_the_checkers_process_does_not_move_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug planted in the engine's code (not a mutant confined to the workers) is in the
    checker's process too. The reference is the checker's own computation, so a core that
    ignores the plan's per-rule `max_attempts` cannot move it: the run differs from it.
    (A reference that ran `engine.core.Evaluation` ended like the bug and passed.)"""
    from engine.core.evaluation import Evaluation

    monkeypatch.setattr(Evaluation, "max_attempts", lambda self, rule_id: self.policy.max_attempts)
    reference_module._cache.clear()
    loaded = load_scenario(SCENARIOS / "rule_max_attempts.yaml")
    ref = reference_for(loaded, loaded.spec.seed, loaded.evaluations(loaded.spec.seed))
    for outcome in ref.evaluations.values():  # the plan's numbers, whatever the core says
        assert "test_run" in outcome.completed
        assert outcome.permanently_failed == {"license_header"}
        assert outcome.skipped == {"docs_feedback"}
    result = run_scenario(loaded).result
    reference_module._cache.clear()
    assert result.verdicts["matches_reference"] == "fail"
    assert result.verdicts["retry_budget"] == "fail"


def test_permanent_failure_prunes_has_every_kind_of_rule_in_its_reference() -> None:
    loaded = load_scenario(SCENARIOS / "permanent_failure_prunes.yaml")
    ref = reference_for(loaded, loaded.spec.seed, loaded.evaluations(loaded.spec.seed))
    for outcome in ref.evaluations.values():
        assert outcome.status == "partial"
        assert outcome.permanently_failed == {"static_analysis"}
        assert outcome.skipped and outcome.completed
        assert set(outcome.verdicts) == outcome.completed
        assert any(p.outcome == "partial" for p in outcome.passes.values())


def test_a_reference_needs_the_scenarios_own_evaluations() -> None:
    loaded = load_scenario(SCENARIOS / "crash_in_write_window.yaml")
    plans = loaded.evaluations(loaded.spec.seed)
    with pytest.raises(ValueError, match="not the evaluations"):
        reference_for(loaded, loaded.spec.seed + 1, plans)


def test_both_modes_get_a_reference_from_the_scenario() -> None:
    loaded = load_scenario(SCENARIOS / "crash_in_write_window.yaml")
    seed = loaded.spec.seed
    spec = loaded.check_spec(seed, loaded.evaluations(seed), set(), loaded.agent)
    assert spec.reference is not None and set(spec.reference.evaluations) == set(
        loaded.evaluations(seed)
    )
    assert loaded.check_spec(seed, {}, set(), loaded.agent, reference=False).reference is None
    outcome = run_scenario(loaded)
    assert outcome.result.verdicts["matches_reference"] == "pass"
    # each evaluation compared, and each call of them the reference makes too
    calls = outcome.result.stats["reference_calls_compared"]
    assert calls > 0
    assert outcome.result.cases["matches_reference"] == len(loaded.evaluations(seed)) + calls


# --- matches_reference on hand-built final states --------------------------------------------


def _result(rule_id: str, verdict: str = "pass") -> RuleResult:
    return RuleResult(rule_id, verdict, 0.9, 100)


def _final(
    state: str = "partial", results: dict[str, RuleResult] | None = None, failed: bool = True
) -> FinalState:
    if results is None:
        results = {"c": _result("c")}
    statuses = {"a": PERMANENTLY_FAILED} if failed else {}
    return FinalState({A: EvaluationFinal(A, state, dict(results), statuses)})


RIGHT = Reference(
    {
        A: Outcome(
            status="partial",
            completed=frozenset({"c"}),
            permanently_failed=frozenset({"a"}),
            skipped=frozenset({"b"}),
            verdicts={"c": "pass"},
            scores={"c": 0.9},
        )
    }
)


def _judge(final: FinalState, reference: Reference | None = RIGHT, **spec: object):
    result = check(
        [],
        final,
        CheckSpec(plans={A: PLAN}, reference=reference, invariants=("matches_reference",), **spec),
    )
    return result.verdicts["matches_reference"], result.violations


def test_the_right_final_state_matches() -> None:
    assert _judge(_final()) == ("pass", [])


def test_a_wrong_status_is_named() -> None:
    verdict, [v] = _judge(_final(state="failed"))
    assert verdict == "fail" and v.invariant == "matches_reference" and v.attempt_id == A
    assert "status failed, reference partial" in v.message


def test_a_wrong_rule_set_is_named() -> None:
    verdict, [v] = _judge(_final(results={"c": _result("c"), "b": _result("b")}))
    assert verdict == "fail"
    assert "completed also has b" in v.message and "skipped lacks b" in v.message
    assert v.rule_id == "b"
    verdict, [v] = _judge(_final(failed=False))  # a was never marked permanently failed
    assert "permanently_failed lacks a" in v.message and "skipped also has a" in v.message


def test_a_wrong_verdict_is_named_unless_the_agent_drifts() -> None:
    wrong = _final(results={"c": _result("c", "fail")})
    verdict, [v] = _judge(wrong)
    assert verdict == "fail" and v.rule_id == "c"
    assert "verdict of c fail, reference pass" in v.message
    drifting = Reference(RIGHT.evaluations, drift=0.5)
    assert _judge(wrong, drifting) == ("pass", [])  # verdicts are idempotent_results' then


def test_without_a_reference_nothing_is_judged() -> None:
    assert _judge(_final(state="failed"), None) == ("unknown", [])


def test_an_evaluation_cancelled_on_purpose_is_not_held_to_its_reference() -> None:
    assert _judge(_final(state="cancelled"), cancelled={A}) == ("unknown", [])
    verdict, [v] = _judge(_final(state="cancelled"))  # cancelled, but not by the scenario
    assert verdict == "fail" and "status cancelled" in v.message


# --- the agent: draws from (seed, attemptId, ruleId, attempt, try), drift on reruns ----------

CALLS = [
    (f"att-{i}", f"r{j}", attempt, t)
    for i in range(4)
    for j in range(25)
    for attempt in (1, 2)
    for t in (1, 2)
]


def test_a_first_execution_draws_the_same_whatever_the_drift() -> None:
    profile = AgentProfile(seed=5, error_rate=0.2, permanent_error_rate=0.05)
    steady = FakeAgent(profile)
    for drift in (0.0, 0.5, 1.0):
        drifting = FakeAgent(AgentProfile(**{**vars(profile), "drift": drift}))
        assert all(steady.draw(*c, 1) == drifting.draw(*c, 1) for c in CALLS)


def test_a_rerun_may_drift_and_only_in_its_verdict() -> None:
    profile = AgentProfile(seed=5, error_rate=0.2, drift=1.0)
    agent, twin = FakeAgent(profile), FakeAgent(profile)
    changed = 0
    for c in CALLS:
        first, rerun = agent.draw(*c, 1), agent.draw(*c, 2)
        assert rerun == twin.draw(*c, 2)  # deterministic per seed
        assert (rerun.latency_ms, rerun.error, rerun.tokens) == (
            first.latency_ms,
            first.error,
            first.tokens,
        )
        if first.result is not None and rerun.result is not None:
            changed += first.result.verdict != rerun.result.verdict
    assert 0 < changed < len(CALLS)  # sometimes another verdict, sometimes the same
    other_seed = FakeAgent(AgentProfile(seed=6, error_rate=0.2, drift=1.0))
    assert [agent.draw(*c, 2) for c in CALLS] != [other_seed.draw(*c, 2) for c in CALLS]


def test_without_drift_a_rerun_answers_as_the_first_execution() -> None:
    agent = FakeAgent(AgentProfile(seed=5, error_rate=0.2))
    assert all(agent.draw(*c, 1) == agent.draw(*c, 3) for c in CALLS)


def test_forced_failures_count_calls_from_attempt_and_try() -> None:
    """`fail_rules` fails the first N calls of a fault-free run, whoever makes them: a
    worker started after a crash fails the same calls (no per-process counter)."""
    profile = AgentProfile(fail_rules={"r": 4})
    three = FakeAgent(profile)  # 3 tries per attempt: calls (1,1) (1,2) (1,3) (2,1) fail
    assert [three.draw("a", "r", 1, t).error is not None for t in (1, 2, 3)] == [True] * 3
    assert three.draw("a", "r", 2, 1).error is not None
    assert three.draw("a", "r", 2, 2).error is None
    one = FakeAgent(profile, immediate_retries=0)  # one try per attempt
    assert [one.draw("a", "r", n, 1).error is not None for n in (1, 2, 3, 4, 5)] == [
        True,
        True,
        True,
        True,
        False,
    ]
    assert FakeAgent(profile).draw("a", "r", 2, 1) == three.draw("a", "r", 2, 1)


def test_drift_is_a_bounded_profile_field() -> None:
    assert AgentProfile.from_dict({"drift": 0.5}).drift == 0.5
    assert AgentProfile.from_dict({}).to_dict()["drift"] == 0.0
    for bad in (-0.1, 1.5):
        with pytest.raises(AgentProfileError, match="drift"):
            AgentProfile.from_dict({"drift": bad})
    schema = json.loads(schema_text())["properties"]["agent"]["properties"]["drift"]
    assert (schema["minimum"], schema["maximum"]) == (0, 1)


def test_the_engine_tells_the_agent_a_rerun_is_one() -> None:
    """In the simulator (the live orchestrator does the same): the start marker's count is
    the execution the agent draws for, and what is written is that draw."""
    loaded = load_scenario(SCENARIOS / "crash_in_write_window.yaml")
    outcome = run_scenario(loaded)
    assert outcome.result.ok, outcome.result.violations
    agent = FakeAgent(AgentProfile.from_dict({"seed": loaded.spec.seed, **loaded.spec.agent}))
    reruns = [e for e in outcome.history if e["ev"] == "rule_started" and e["execution"] > 1]
    assert {e["rule_id"] for e in reruns} == {"test_run"} and len(reruns) == 2
    assert all(e["rerun"] for e in reruns)
    for e in reruns:
        [written] = [
            x
            for x in outcome.history
            if x["ev"] == "result_persisted"
            and x["won"]
            and (x["attempt_id"], x["rule_id"]) == (e["attempt_id"], e["rule_id"])
        ]
        drawn = agent.draw(e["attempt_id"], e["rule_id"], e["attempt"], e["try_no"], 2).result
        assert drawn is not None and written["verdict"] == drawn.verdict
        first = agent.draw(e["attempt_id"], e["rule_id"], e["attempt"], e["try_no"], 1).result
        assert first is not None and first.verdict != drawn.verdict  # drifted, as described


def test_the_reference_orders_rules_as_sweeps_over_the_file_would() -> None:
    """`_topological` (linear) gives the sweeps' order on random plans, rules listed in any
    order, over up to three passes; and a reversed 3,000-rule chain comes out reversed."""
    from chaos.reference import _topological

    rng = random.Random(7)
    compared = 0
    for _ in range(1500):
        n = rng.randint(1, 14)
        deps = {i: sorted(rng.sample(range(i), rng.randint(0, min(i, 3)))) for i in range(n)}
        filed = rng.sample(range(n), n)
        cuts = sorted(rng.sample(range(1, n), min(rng.randint(0, 2), n - 1)))
        chunks = [filed[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
        doc = {
            "plan": "p",
            "passes": [
                {
                    "id": f"p{k}",
                    "rules": [
                        {"id": f"r{i}", "depends_on": [f"r{d}" for d in deps[i]]} for i in chunk
                    ],
                }
                for k, chunk in enumerate(chunks)
            ],
        }
        try:
            plan = plan_from_dict(doc)
        except PlanError:  # a dependency on a later pass: not a plan
            continue
        listed = [r for p in plan.passes for r in p.rule_ids]
        assert _topological(plan) == sweep_order(listed, plan.rules), doc
        compared += 1
    assert compared > 500
    n = 3000
    chain = plan_from_dict(reversed_chain(n))
    assert _topological(chain) == [f"r{i}" for i in reversed(range(n))]
