"""Issue 25's held-out bugs 8 and 9, each shown on its scenario in the simulator and on
the engine's own code: what the fix changes, and that the scenario fails without it.

8. A re-announced evaluation carries the body of the first announcement: its permanently
   failed rule and the skipped chain under it included (`Evaluation.stored_verdicts`).
9. A stopping worker stops consuming before it hands its evaluations back, so nothing it
   requeues comes back to it; `reruns_explained` explains a graceful stop's hand-over from
   the stop's start and fails a process that takes work on after it.
"""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from chaos.insim import run_scenario
from chaos.mutants import MUTANTS
from chaos.scenario import LoadedScenario, load_scenario
from engine.core import Evaluation, Finish
from engine.core.states import EvaluationStatus
from engine.plan import Plan
from tests.helpers import PERMANENT, agent, example_plan, hashed_agent, run_plan
from tests.test_checker_more import H, completed_body, failing, passing, rerun
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


def test_a_copy_without_the_failed_rule_and_its_skipped_dependent_is_a_violation() -> None:
    # a fails for good, b (after a) is skipped, c passes: the first copy names all three,
    # a re-announcement built from the stored results only names c alone.
    h = H().submit().begin()
    h.failed("a")
    h.ok("c")
    full = {"a": "permanently_failed", "b": "skipped", "c": "needs_review"}
    h.finish("partial", full)
    h.received(completed_body("partial", full))
    passing(h.check("completed_delivered"), "completed_delivered")
    h.received(completed_body("partial", {"c": "needs_review"}))
    violations = failing(h.check("completed_delivered"), "completed_delivered")
    assert any("2 copies of evaluation.completed carry 2 bodies" in v.message for v in violations)
    assert any("a=-, b=-" in v.message and "a=permanently_failed" in v.message for v in violations)


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


# --- 9. a graceful stop ----------------------------------------------------------------------


def test_a_rerun_handed_back_before_the_stopped_process_ended_is_explained() -> None:
    # w1 abandons c's evaluation as it stops; w2 takes it over and reruns c before w1 has
    # closed its connections (its `worker_stopped` comes last).
    h = rerun(
        [
            ("worker_stopping", "w1", 11, {}),
            (
                "evaluation_abandoned",
                "w1",
                11,
                {"attempt_id": "att-1", "reason": "worker stopping"},
            ),
        ]
    )
    h.ev("worker_stopped", "w1", 11)
    result = h.check("reruns_explained")
    passing(result, "reruns_explained")
    assert result.stats["reruns_explained_by"] == {"worker_stopping": 1}
    assert result.cases["reruns_explained"] == 5  # four rounds and one stop


def test_a_stop_is_known_by_its_abandons_when_no_worker_stopping_was_recorded() -> None:
    abandon = {"attempt_id": "att-1", "reason": "worker stopping"}
    h = rerun([("evaluation_abandoned", "w1", 11, abandon)])
    h.ev("worker_stopped", "w1", 11)
    result = h.check("reruns_explained")
    passing(result, "reruns_explained")
    assert result.stats["reruns_explained_by"] == {"worker_stopping": 1}


def test_without_the_stop_the_same_rerun_is_a_violation() -> None:
    h = rerun([("evaluation_abandoned", "w1", 11, {"attempt_id": "att-1", "reason": "lost"})])
    h.ev("worker_stopped", "w1", 11)
    (v,) = failing(h.check("reruns_explained"), "reruns_explained")
    assert "with no crash, kill, stall or service fault" in v.message


def test_a_stopping_process_that_takes_work_on_again_is_a_violation() -> None:
    abandon = {"attempt_id": "att-1", "reason": "worker stopping"}
    h = rerun([("worker_stopping", "w1", 11, {}), ("evaluation_abandoned", "w1", 11, abandon)])
    h.begin(src="w1", pid=11, kind="retry")  # the requeued retry came back to w1
    h.ev("worker_stopped", "w1", 11)
    violations = failing(h.check("reruns_explained"), "reruns_explained")
    assert [v.message.split(" att-1 ")[0] for v in violations] == [
        "w1 took a delivery of",
        "w1 began evaluation",
    ]
    assert all("after it started stopping" in v.message for v in violations)
    assert all(violations[0].timeline[0]["ev"] == "worker_stopping" for v in violations)


def test_a_graceful_stop_hands_back_without_taking_anything_on_again() -> None:
    outcome = run_scenario(scenario("graceful_stop_hands_back"))
    assert outcome.result.ok, (outcome.result.verdicts, outcome.result.violations[:2])
    history = outcome.history
    stopping = of(history, "worker_stopping")[0]  # the restart's (the run's end stops all)
    proc = (stopping["src"], stopping["pid"])
    mine = [e for e in history if (e["src"], e["pid"]) == proc and e["t"] > stopping["t"]]
    handed = [e for e in mine if e["ev"] == "evaluation_abandoned"]
    assert handed and all(e["reason"] == "worker stopping" for e in handed)
    assert not [e for e in mine if e["ev"] in ("delivered", "evaluation_started")]
    why = outcome.result.stats["reruns_explained_by"]
    assert set(why) <= {"worker_stopped", "worker_stopping"} and sum(why.values()) > 0


def test_the_scenario_fails_with_the_old_close_order() -> None:
    assert MUTANTS["old_close_order"].breaks == "reruns_explained"
    outcome = run_scenario(scenario("graceful_stop_hands_back"), mutant="old_close_order")
    assert outcome.result.verdicts["reruns_explained"] == "fail"
    assert any("after it started stopping" in v.message for v in outcome.result.violations)
