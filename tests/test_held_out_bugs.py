"""Issue 25's held-out bugs 8 and 9, each shown on its scenario in the simulator and on
the engine's own code: what the fix changes, and that the scenario fails without it.

8. A re-announced evaluation carries the body of the first announcement: its permanently
   failed rule and the skipped chain under it included (`Evaluation.stored_verdicts`).
"""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from chaos.insim import run_scenario
from chaos.scenario import LoadedScenario, load_scenario
from engine.core import Evaluation, Finish
from engine.core.states import EvaluationStatus
from engine.plan import Plan
from tests.helpers import PERMANENT, agent, example_plan, hashed_agent, run_plan
from tests.test_core import plans, policies

ROOT = Path(__file__).resolve().parents[1]
REVIEW = example_plan("code_review")


def scenario(name: str) -> LoadedScenario:
    return load_scenario(ROOT / "scenarios" / f"{name}.yaml")


def of(history: list[dict], ev: str) -> list[dict]:
    return [e for e in history if e["ev"] == ev]


# --- 8. the re-announcement --------------------------------------------------------------------


def test_stored_verdicts_name_the_failed_rule_and_its_skipped_chain() -> None:
    shell = run_plan(REVIEW, agent(static_analysis=PERMANENT), max_parallel=1)
    assert shell.final is not None and shell.final.status is EvaluationStatus.PARTIAL
    again = Evaluation(REVIEW, shell.attempt_id, snapshot=shell.snapshot()).stored_verdicts()
    assert again == shell.final.verdicts
    assert again["static_analysis"] == "permanently_failed"
    skipped = sorted(r for r, v in again.items() if v == "skipped")
    assert skipped == sorted(REVIEW.transitive_dependents(["static_analysis"]))


@settings(max_examples=150, deadline=None)
@given(plans(), policies, st.integers(0, 10_000))
def test_stored_verdicts_are_the_finish_verdicts(plan: Plan, policy: object, seed: int) -> None:
    """Whatever the plan and the agent's answers, a finished evaluation read back from what
    it stored announces what its `Finish` announced."""
    shell = run_plan(plan, hashed_agent(seed), policy=policy, rng=random.Random(seed))
    final = shell.final
    assert isinstance(final, Finish)
    again = Evaluation(plan, shell.attempt_id, snapshot=shell.snapshot()).stored_verdicts()
    assert again == dict(final.verdicts)


def test_a_dead_announcer_is_announced_again_with_the_same_body() -> None:
    outcome = run_scenario(scenario("announcer_dies_after_a_permanent_failure"))
    assert outcome.result.ok, (outcome.result.verdicts, outcome.result.violations[:2])
    assert outcome.result.cases["completed_delivered"] == 2
    crashes = [e for e in of(outcome.history, "crash") if e["failpoint"] == "before_final_publish"]
    assert len(crashes) == 2  # each owner died between its final write and the publish
    for e in of(outcome.history, "completed_received"):
        verdicts = e["body"]["verdicts"]
        assert verdicts["static_analysis"] == "permanently_failed"
        assert {r for r, v in verdicts.items() if v == "skipped"} == set(
            REVIEW.transitive_dependents(["static_analysis"])
        )


def test_the_scenario_fails_with_the_results_only_reannouncement() -> None:
    outcome = run_scenario(
        scenario("announcer_dies_after_a_permanent_failure"), mutant="results_only_reannounced"
    )
    assert outcome.result.verdicts["completed_delivered"] == "fail"
    assert any("permanently_failed" in v.message for v in outcome.result.violations)
