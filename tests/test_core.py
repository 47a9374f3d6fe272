"""The pure decision core: every action, every rule, recovery, and properties of whole runs.

Unit tests feed an `Evaluation` by hand and compare the exact actions it returns. The
property tests drive it through `tests.helpers.Shell` (random plans, random agent
outcomes, random interleavings, crashes) and check the guarantees of DESIGN.md on the
recorded history.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core import (
    PERMANENTLY_FAILED,
    AckRetry,
    Action,
    Evaluation,
    EvaluationStatus,
    Finish,
    Park,
    PersistResult,
    PersistStatus,
    ProtocolError,
    PublishPassResult,
    Recovered,
    RuleResult,
    RuleState,
    RunRule,
    ScheduleRetry,
    SkipRules,
    Snapshot,
    failed_attempt,
    parse_status,
    status_rank,
)
from engine.plan import Plan, plan_from_dict
from engine.policy import RetryPolicy
from tests.helpers import (
    OK,
    PERMANENT,
    TRANSIENT,
    Shell,
    agent,
    example_plan,
    hashed_agent,
    make_plan,
    result_for,
    reversed_chain,
    run_plan,
)

TINY = example_plan("tiny")  # compiles -> unit_tests -> feedback; style_check alone
REVIEW = example_plan("code_review")
NO_JITTER = RetryPolicy(jitter=0.0)
ATTEMPT = "attempt-1"

CODE_BRANCH = (
    "static_analysis",
    "test_run",
    "security_review",
    "correctness_review",
    "code_feedback",
)


def ok(ev: Evaluation, rule_id: str) -> list[Action]:
    return ev.rule_succeeded(rule_id, result_for(rule_id, ev.attempt[rule_id]))


def fail_attempt(ev: Evaluation, rule_id: str, error: str = "timeout") -> list[Action]:
    """Fail every call of the current attempt (level 1 exhausted); the last call's actions."""
    while True:
        actions = ev.rule_failed(rule_id, error)
        if actions[:1] != [RunRule(rule_id, ev.attempt[rule_id], ev.tries[rule_id])]:
            return actions


def kinds(actions: list[Action]) -> list[str]:
    return [type(a).__name__ for a in actions]


def single(plan_rules: dict[str, Any] | None = None) -> Plan:
    return make_plan({"p1": plan_rules or {"a": []}})


# --- starting, RunRule, PersistResult -----------------------------------------------------------


def test_fresh_start_runs_every_ready_rule_and_nothing_else() -> None:
    ev = Evaluation(TINY, ATTEMPT)
    assert ev.start() == [RunRule("compiles", 1, 1), RunRule("style_check", 1, 1)]
    assert ev.state["unit_tests"] is RuleState.PENDING


def test_result_is_persisted_before_the_dependent_runs() -> None:
    ev = Evaluation(TINY, ATTEMPT)
    ev.start()
    assert ok(ev, "compiles") == [
        PersistResult("compiles", result_for("compiles")),
        RunRule("unit_tests", 1, 1),
    ]


def test_dependent_waits_for_every_dependency() -> None:
    ev = Evaluation(REVIEW, ATTEMPT, max_parallel=20)
    ev.start()
    assert ok(ev, "compiles")[1:] == [RunRule("static_analysis", 1, 1)]
    assert ev.state["test_run"] is RuleState.PENDING  # tests_present is still running
    assert ok(ev, "tests_present")[1:] == [RunRule("test_run", 1, 1)]
    assert ok(ev, "static_analysis")[1:] == [RunRule("security_review", 1, 1)]
    assert ok(ev, "test_run")[1:] == [RunRule("correctness_review", 1, 1)]


# --- level 1: immediate retries -------------------------------------------------------------------


def test_default_policy_makes_three_calls_per_attempt() -> None:
    assert RetryPolicy().immediate_retries == 2
    ev = Evaluation(single(), ATTEMPT)
    assert ev.start() == [RunRule("a", 1, 1)]
    assert ev.rule_failed("a", "timeout") == [RunRule("a", 1, 2)]
    assert ev.rule_failed("a", "429") == [RunRule("a", 1, 3)]
    assert kinds(ev.rule_failed("a", "tool unavailable"))[:2] == ["PersistStatus", "ScheduleRetry"]


@pytest.mark.parametrize("immediate", [0, 1, 3])
def test_immediate_retries_count(immediate: int) -> None:
    shell = run_plan(single(), agent(a=TRANSIENT), policy=RetryPolicy(immediate_retries=immediate))
    per_attempt = [[c.try_no for c in shell.calls if c.attempt == n] for n in (1, 2, 3)]
    assert per_attempt == [list(range(1, immediate + 2))] * 3


def test_success_on_an_immediate_retry_leaves_no_trace() -> None:
    ev = Evaluation(TINY, ATTEMPT)
    ev.start()
    ev.rule_failed("compiles", "timeout")
    actions = ok(ev, "compiles")
    assert actions == [
        PersistResult("compiles", result_for("compiles")),
        RunRule("unit_tests", 1, 1),
    ]
    assert ev.attempt["compiles"] == 1


# --- level 2: failed_attempt_N and delayed retries ------------------------------------------------


def test_level2_persists_failed_attempt_and_schedules_tiered_retries() -> None:
    policy = RetryPolicy(max_attempts=5)
    ev = Evaluation(single(), ATTEMPT, policy)
    ev.start()
    for n, base in [(1, 30_000), (2, 120_000), (3, 600_000), (4, 600_000)]:
        actions = fail_attempt(ev, "a", f"timeout #{n}")
        tier = min(n, 3) - 1
        bucket = policy.bucket_for(ATTEMPT, "a", n)
        delay = policy.delay_ms(tier, bucket)
        assert base <= delay <= base * 1.1
        expected: list[Action] = [
            PersistStatus("a", f"failed_attempt_{n}", f"timeout #{n}", delay),
            ScheduleRetry("a", n + 1, tier, bucket, delay),
        ]
        if n > 1:
            expected.append(AckRetry("a", n))  # the message that asked for attempt n
        expected.append(Park({"a": n + 1}))
        assert actions == expected
        assert ev.state["a"] is RuleState.WAITING_RETRY
        assert ev.retry_due("a", n + 1) == [RunRule("a", n + 1, 1)]


def test_retry_delays_are_deterministic() -> None:
    def delays() -> list[int]:
        ev = Evaluation(REVIEW, ATTEMPT, max_parallel=20)
        ev.start()
        out = []
        for rid in ("compiles", "tests_present", "readme_present", "style_consistency"):
            out += [a.delay_ms for a in fail_attempt(ev, rid) if isinstance(a, ScheduleRetry)]
        return out

    assert delays() == delays()
    assert len(delays()) == 4


def test_jitter_is_positive_only_and_spreads_retries() -> None:
    policy = RetryPolicy()
    plan = make_plan({"p1": {f"r{i}": [] for i in range(40)}})
    ev = Evaluation(plan, ATTEMPT, policy, max_parallel=40)
    ev.start()
    retries = [
        a for rid in plan.order for a in fail_attempt(ev, rid) if isinstance(a, ScheduleRetry)
    ]
    assert len(retries) == 40
    assert all(30_000 <= r.delay_ms <= 33_000 for r in retries)
    assert len({r.delay_ms for r in retries}) > 1, "jitter spreads the retries"


def test_no_jitter_means_exact_tiers() -> None:
    ev = Evaluation(single(), ATTEMPT, NO_JITTER)
    ev.start()
    (retry,) = [a for a in fail_attempt(ev, "a") if isinstance(a, ScheduleRetry)]
    assert retry == ScheduleRetry("a", 2, 0, 0, 30_000)


# --- level 3: permanently_failed ------------------------------------------------------------------


def test_level3_after_max_attempts() -> None:
    shell = run_plan(single(), agent(a=TRANSIENT))
    assert len(shell.calls) == 9  # 3 attempts x 3 calls
    statuses = [a.status for a in shell.of_type(PersistStatus)]
    assert statuses == ["failed_attempt_1", "failed_attempt_2", PERMANENTLY_FAILED]
    assert [r.attempt for r in shell.of_type(ScheduleRetry)] == [2, 3]
    assert shell.final == Finish(EvaluationStatus.FAILED, {"a": "permanently_failed"})


def test_per_rule_max_attempts_overrides_the_policy() -> None:
    shell = run_plan(REVIEW, agent(license_header=TRANSIENT, test_run=TRANSIENT))
    retries = shell.of_type(ScheduleRetry)
    assert not [r for r in retries if r.rule_id == "license_header"]  # max_attempts: 1
    assert [r.attempt for r in retries if r.rule_id == "test_run"] == [2, 3, 4, 5]  # max 5
    assert len([c for c in shell.calls if c.rule_id == "test_run"]) == 15
    assert shell.statuses["license_header"] == shell.statuses["test_run"] == PERMANENTLY_FAILED


def test_last_attempt_failing_is_permanent_and_skips_dependents() -> None:
    ev = Evaluation(TINY, ATTEMPT, RetryPolicy(max_attempts=2))
    ev.start()
    fail_attempt(ev, "compiles")
    ev.retry_due("compiles", 2)
    assert fail_attempt(ev, "compiles", "quota") == [
        PersistStatus("compiles", PERMANENTLY_FAILED, "quota"),
        AckRetry("compiles", 2),
        SkipRules(("unit_tests", "feedback"), because_of="compiles"),
        PublishPassResult("deep", "partial", {"unit_tests": "skipped", "feedback": "skipped"}),
    ]


def test_non_retryable_error_is_permanent_at_once() -> None:
    ev = Evaluation(TINY, ATTEMPT)
    ev.start()
    assert ev.rule_failed("compiles", "invalid submission", retryable=False) == [
        PersistStatus("compiles", PERMANENTLY_FAILED, "invalid submission"),
        SkipRules(("unit_tests", "feedback"), because_of="compiles"),
        PublishPassResult("deep", "partial", {"unit_tests": "skipped", "feedback": "skipped"}),
    ]
    shell = run_plan(TINY, agent(unit_tests=PERMANENT))
    assert [c.rule_id for c in shell.calls].count("unit_tests") == 1


def test_non_retryable_error_during_a_retried_attempt() -> None:
    ev = Evaluation(single(), ATTEMPT)
    ev.start()
    fail_attempt(ev, "a")
    ev.retry_due("a", 2)
    assert ev.rule_failed("a", "bad input", retryable=False)[:2] == [
        PersistStatus("a", PERMANENTLY_FAILED, "bad input"),
        AckRetry("a", 2),
    ]


# --- SkipRules: exactly the transitive dependents -------------------------------------------------


def test_permanent_failure_skips_exactly_its_transitive_dependents() -> None:
    shell = run_plan(REVIEW, agent(compiles=TRANSIENT))
    assert shell.of_type(SkipRules) == [SkipRules(CODE_BRANCH, because_of="compiles")]
    ran = {c.rule_id for c in shell.calls}
    assert not ran & set(CODE_BRANCH)
    assert set(shell.results) == set(REVIEW.rules) - set(CODE_BRANCH) - {"compiles"}
    assert shell.final is not None and shell.final.status is EvaluationStatus.PARTIAL
    verdicts = shell.final.verdicts
    assert verdicts["compiles"] == "permanently_failed"
    assert all(verdicts[r] == "skipped" for r in CODE_BRANCH)
    assert verdicts["docs_feedback"] == result_for("docs_feedback").verdict


def test_one_side_of_the_diamond_failing() -> None:
    shell = run_plan(REVIEW, agent(test_run=PERMANENT))
    assert shell.of_type(SkipRules) == [
        SkipRules(("correctness_review", "code_feedback"), because_of="test_run")
    ]
    assert "security_review" in shell.results and "static_analysis" in shell.results


def test_failures_in_two_branches() -> None:
    shell = run_plan(REVIEW, agent(compiles=PERMANENT, readme_present=PERMANENT))
    skipped = {r for s in shell.of_type(SkipRules) for r in s.rule_ids}
    assert skipped == REVIEW.transitive_dependents(["compiles", "readme_present"])
    assert set(shell.results) == {"tests_present", "license_header", "style_consistency"}


# --- PublishPassResult and Finish -----------------------------------------------------------------


def test_pass_published_once_as_soon_as_its_rules_are_terminal() -> None:
    ev = Evaluation(TINY, ATTEMPT)
    ev.start()
    assert not any(isinstance(a, PublishPassResult) for a in ok(ev, "compiles"))
    assert ok(ev, "style_check")[-1] == PublishPassResult(
        "quick",
        "complete",
        {
            "compiles": result_for("compiles").verdict,
            "style_check": result_for("style_check").verdict,
        },
    )
    ok(ev, "unit_tests")
    actions = ok(ev, "feedback")
    assert kinds(actions) == ["PersistResult", "PublishPassResult", "Finish"]
    assert actions[1] == PublishPassResult(
        "deep",
        "complete",
        {
            "unit_tests": result_for("unit_tests").verdict,
            "feedback": result_for("feedback").verdict,
        },
    )


def test_every_pass_published_once_with_its_outcome() -> None:
    shell = run_plan(REVIEW, agent(test_run=PERMANENT))
    published = {p.pass_id: p for p in shell.of_type(PublishPassResult)}
    assert len(shell.of_type(PublishPassResult)) == len(published) == 4
    assert {pid: p.outcome for pid, p in published.items()} == {
        "intake": "complete",
        "analysis": "partial",
        "review": "partial",
        "synthesis": "partial",
    }
    assert published["analysis"].rules["test_run"] == "permanently_failed"
    assert published["review"].rules["correctness_review"] == "skipped"


@pytest.mark.parametrize(
    ("outcomes", "status"),
    [
        ({}, EvaluationStatus.COMPLETED),
        ({"feedback": PERMANENT}, EvaluationStatus.PARTIAL),
        ({"compiles": TRANSIENT}, EvaluationStatus.PARTIAL),
        ({"compiles": PERMANENT, "style_check": TRANSIENT}, EvaluationStatus.FAILED),
    ],
    ids=["completed", "partial_leaf", "partial_root", "failed"],
)
def test_finish_once_with_status(outcomes: dict[str, str], status: EvaluationStatus) -> None:
    shell = run_plan(TINY, agent(**outcomes))
    finishes = shell.of_type(Finish)
    assert len(finishes) == 1 and shell.actions[-1] == finishes[0]
    assert finishes[0].status is status
    assert set(finishes[0].verdicts) == set(TINY.rules)


def test_finished_evaluation_refuses_further_agent_results() -> None:
    ev = Evaluation(single(), ATTEMPT)
    ev.start()
    assert kinds(ok(ev, "a")) == ["PersistResult", "PublishPassResult", "Finish"]
    assert ev.finished and ev.status is EvaluationStatus.COMPLETED
    with pytest.raises(ProtocolError):
        ok(ev, "a")


# --- max_parallel -------------------------------------------------------------------------------


def test_max_parallel_bound() -> None:
    plan = make_plan({"p1": {f"r{i}": [] for i in range(6)}, "p2": {"z": ["r0", "r5"]}})
    ev = Evaluation(plan, ATTEMPT, max_parallel=2)
    assert ev.start() == [RunRule("r0", 1, 1), RunRule("r1", 1, 1)]
    assert ok(ev, "r0")[1:] == [RunRule("r2", 1, 1)]
    assert ev.rule_failed("r1", "timeout") == [
        RunRule("r1", 1, 2)
    ]  # a level-1 retry keeps its slot
    assert len(ev.rules_in(RuleState.RUNNING)) == 2
    shell = run_plan(plan, agent(r3=TRANSIENT), max_parallel=2, rng=random.Random(7))
    assert shell.max_inflight == 2
    with pytest.raises(ValueError):
        Evaluation(plan, ATTEMPT, max_parallel=0)


# --- Park -----------------------------------------------------------------------------------------


def test_park_when_only_delayed_retries_are_left() -> None:
    ev = Evaluation(TINY, ATTEMPT, NO_JITTER)
    ev.start()
    ok(ev, "style_check")
    actions = fail_attempt(ev, "compiles")
    # unit_tests and feedback are pending on compiles: nothing can run until the retry
    assert actions[-1] == Park({"compiles": 2})
    assert ev.parked
    assert ev.retry_due("compiles", 1) == [AckRetry("compiles", 1)]  # stale: still parked
    assert ev.parked
    assert ev.retry_due("compiles", 2) == [RunRule("compiles", 2, 1)]
    assert not ev.parked


def test_no_park_while_a_call_is_in_flight() -> None:
    ev = Evaluation(TINY, ATTEMPT)
    ev.start()
    assert not any(isinstance(a, Park) for a in fail_attempt(ev, "compiles"))
    assert ok(ev, "style_check")[-1] == Park({"compiles": 2})


# --- recovery from a snapshot ---------------------------------------------------------------------

STORED = RuleResult("compiles", "fail", 0.25, 321, attempt=2, rationale="from redis")


def test_loaded_results_are_never_rerun() -> None:
    snap = Snapshot(results={"compiles": STORED, "style_check": result_for("style_check")})
    ev = Evaluation(TINY, ATTEMPT, snapshot=snap)
    assert ev.start() == [
        Recovered(
            loaded=("compiles", "style_check"),
            retrying={},
            failed=(),
            fresh=("unit_tests", "feedback"),
        ),
        RunRule("unit_tests", 1, 1),
        PublishPassResult(
            "quick",
            "complete",
            {"compiles": "fail", "style_check": snap.results["style_check"].verdict},
        ),
    ]
    shell = run_plan(TINY, agent(), results=dict(snap.results))
    assert {c.rule_id for c in shell.calls} == {"unit_tests", "feedback"}
    assert shell.final is not None and shell.final.verdicts["compiles"] == "fail"


def test_everything_loaded_finishes_at_start() -> None:
    snap = Snapshot(
        results={r: result_for(r) for r in TINY.rules}, published_passes=frozenset({"quick"})
    )
    actions = Evaluation(TINY, ATTEMPT, snapshot=snap).start()
    assert kinds(actions) == ["Recovered", "PublishPassResult", "Finish"]
    assert actions[1].pass_id == "deep"  # quick was published before the crash
    assert actions[2].status is EvaluationStatus.COMPLETED


def test_published_passes_are_not_republished() -> None:
    results = {r: result_for(r) for r in ("compiles", "style_check")}
    shell = run_plan(TINY, agent(), results=results, published={"quick"})
    assert [p.pass_id for p in shell.of_type(PublishPassResult)] == ["deep"]


def test_result_beats_status() -> None:
    snap = Snapshot(results={"compiles": STORED}, statuses={"compiles": "failed_attempt_1"})
    ev = Evaluation(TINY, ATTEMPT, snapshot=snap)
    assert ev.start()[0] == Recovered(
        ("compiles",), {}, (), ("style_check", "unit_tests", "feedback")
    )
    assert ev.state["compiles"] is RuleState.SUCCEEDED


def test_failed_attempt_resumes_at_next_attempt_when_due() -> None:
    snap = Snapshot(statuses={"compiles": "failed_attempt_2"})
    ev = Evaluation(TINY, ATTEMPT, snapshot=snap, due={"compiles": 3})
    assert ev.start() == [
        Recovered(
            loaded=(),
            retrying={"compiles": 2},
            failed=(),
            fresh=("style_check", "unit_tests", "feedback"),
        ),
        RunRule("compiles", 3, 1),
        RunRule("style_check", 1, 1),
    ]
    assert ok(ev, "compiles") == [
        PersistResult("compiles", result_for("compiles", 3)),
        AckRetry("compiles", 3),
        RunRule("unit_tests", 1, 1),
    ]


def test_failed_attempt_resumes_with_its_count() -> None:
    snap = Snapshot(statuses={"compiles": "failed_attempt_2"})
    ev = Evaluation(TINY, ATTEMPT, snapshot=snap, due={"compiles": 3})
    ev.start()
    assert fail_attempt(ev, "compiles")[:2] == [  # attempt 3 of 3: level 3
        PersistStatus("compiles", PERMANENTLY_FAILED, "timeout"),
        AckRetry("compiles", 3),
    ]


def test_failed_attempt_waits_for_its_retry_without_due() -> None:
    snap = Snapshot(statuses={"compiles": "failed_attempt_1"})
    ev = Evaluation(TINY, ATTEMPT, snapshot=snap)
    assert ev.start()[1:] == [RunRule("style_check", 1, 1)]
    assert ev.state["compiles"] is RuleState.WAITING_RETRY
    assert ok(ev, "style_check") == [
        PersistResult("style_check", result_for("style_check")),
        Park({"compiles": 2}),
    ]
    assert ev.retry_due("compiles", 2) == [RunRule("compiles", 2, 1)]


@pytest.mark.parametrize(
    ("statuses", "due"),
    [
        ({"compiles": "failed_attempt_1"}, {"compiles": 1}),  # older attempt
        ({"compiles": "failed_attempt_1"}, {"compiles": 3}),  # an attempt never scheduled
        ({}, {"compiles": 2}),  # no failed attempt at all
    ],
    ids=["older", "future", "fresh_rule"],
)
def test_stale_due_is_acked_at_start_and_does_not_run(
    statuses: dict[str, str], due: dict[str, int]
) -> None:
    ev = Evaluation(TINY, ATTEMPT, snapshot=Snapshot(statuses=statuses), due=due)
    actions = ev.start()
    [(rid, attempt)] = due.items()
    assert [a for a in actions if isinstance(a, AckRetry)] == [AckRetry(rid, attempt)]
    first_run = next(i for i, a in enumerate(actions) if isinstance(a, RunRule))
    assert actions.index(AckRetry(rid, attempt)) < first_run
    assert RunRule(rid, attempt, 1) not in actions
    assert ev.attempt[rid] == (2 if statuses else 1)


def test_due_for_a_loaded_rule_is_acked() -> None:
    ev = Evaluation(
        TINY, ATTEMPT, snapshot=Snapshot(results={"compiles": STORED}), due={"compiles": 2}
    )
    actions = ev.start()
    assert AckRetry("compiles", 2) in actions
    assert not [a for a in actions if isinstance(a, RunRule) and a.rule_id == "compiles"]


def test_permanently_failed_skips_dependents_on_start() -> None:
    snap = Snapshot(
        results={"style_check": result_for("style_check")},
        statuses={"compiles": PERMANENTLY_FAILED},
    )
    ev = Evaluation(TINY, ATTEMPT, snapshot=snap)
    actions = ev.start()
    assert actions[:2] == [
        Recovered(
            loaded=("style_check",),
            retrying={},
            failed=("compiles",),
            fresh=("unit_tests", "feedback"),
        ),
        SkipRules(("unit_tests", "feedback"), because_of="compiles"),
    ]
    assert kinds(actions)[2:] == ["PublishPassResult", "PublishPassResult", "Finish"]
    assert [a.outcome for a in actions[2:4]] == ["partial", "partial"]
    assert actions[-1] == Finish(
        EvaluationStatus.PARTIAL,
        {
            "compiles": "permanently_failed",
            "style_check": result_for("style_check").verdict,
            "unit_tests": "skipped",
            "feedback": "skipped",
        },
    )


def test_retry_due_before_start_runs_at_start() -> None:
    """A retry message can reach the shell between building the evaluation and start()."""
    snap = Snapshot(statuses={"compiles": "failed_attempt_1"})
    ev = Evaluation(TINY, ATTEMPT, snapshot=snap)
    assert ev.retry_due("compiles", 1) == [AckRetry("compiles", 1)]
    assert ev.retry_due("compiles", 2) == []
    actions = ev.start()
    assert isinstance(actions[0], Recovered)
    assert actions[1:] == [RunRule("compiles", 2, 1), RunRule("style_check", 1, 1)]
    assert ok(ev, "compiles")[:2] == [
        PersistResult("compiles", result_for("compiles", 2)),
        AckRetry("compiles", 2),
    ]


def test_empty_snapshot_emits_no_recovered() -> None:
    assert not any(
        isinstance(a, Recovered) for a in Evaluation(TINY, ATTEMPT, snapshot=Snapshot()).start()
    )


def test_corrupt_status_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown rule status"):
        Evaluation(TINY, ATTEMPT, snapshot=Snapshot(statuses={"compiles": "failed_attempt_0"}))


def test_status_strings() -> None:
    assert failed_attempt(3) == "failed_attempt_3" and parse_status("failed_attempt_3") == 3
    assert parse_status(PERMANENTLY_FAILED) is None
    assert status_rank(None) < status_rank("failed_attempt_1") < status_rank("failed_attempt_12")
    assert status_rank("failed_attempt_12") < status_rank(PERMANENTLY_FAILED)
    with pytest.raises(ValueError):
        failed_attempt(0)
    with pytest.raises(ValueError):
        parse_status("failed")


# --- retry_due freshness and AckRetry -----------------------------------------------------------


def _waiting_on_attempt_2() -> Evaluation:
    ev = Evaluation(TINY, ATTEMPT)
    ev.start()
    fail_attempt(ev, "compiles")
    return ev


@pytest.mark.parametrize(
    ("rule_id", "attempt"),
    [("compiles", 1), ("compiles", 3), ("style_check", 2), ("unit_tests", 1)],
    ids=["older", "future", "running_rule", "pending_rule"],
)
def test_stale_retry_is_only_acked(rule_id: str, attempt: int) -> None:
    ev = _waiting_on_attempt_2()
    before = dict(ev.state)
    assert ev.retry_due(rule_id, attempt) == [AckRetry(rule_id, attempt)]
    assert ev.state == before and ev.attempt["compiles"] == 2


def test_duplicate_retry_is_only_acked() -> None:
    ev = _waiting_on_attempt_2()
    assert ev.retry_due("compiles", 2) == [RunRule("compiles", 2, 1)]
    assert ev.retry_due("compiles", 2) == [AckRetry("compiles", 2)]
    assert ev.state["compiles"] is RuleState.RUNNING and ev.tries["compiles"] == 1


def test_retry_after_finish_is_only_acked() -> None:
    ev = Evaluation(single(), ATTEMPT)
    ev.start()
    ok(ev, "a")
    assert ev.retry_due("a", 2) == [AckRetry("a", 2)]


def test_retry_ack_follows_the_durable_outcome() -> None:
    ev = _waiting_on_attempt_2()
    ev.retry_due("compiles", 2)
    assert ev.rule_failed("compiles", "timeout") == [RunRule("compiles", 2, 2)]  # no ack yet
    ev.rule_failed("compiles", "timeout")
    actions = ev.rule_failed("compiles", "timeout")
    assert kinds(actions)[:3] == ["PersistStatus", "ScheduleRetry", "AckRetry"]
    assert actions[2] == AckRetry("compiles", 2) and actions[1].attempt == 3
    ev.retry_due("compiles", 3)
    assert ok(ev, "compiles")[:3] == [
        PersistResult("compiles", result_for("compiles", 3)),
        AckRetry("compiles", 3),
        RunRule("unit_tests", 1, 1),
    ]


# --- cancel ---------------------------------------------------------------------------------------


def test_cancel_finishes_and_nothing_starts_after() -> None:
    ev = Evaluation(TINY, ATTEMPT)
    ev.start()
    assert ev.cancel() == [
        Finish(
            EvaluationStatus.CANCELLED,
            {
                "compiles": "running",
                "style_check": "running",
                "unit_tests": "pending",
                "feedback": "pending",
            },
        )
    ]
    assert ev.finished and ev.status is EvaluationStatus.CANCELLED
    # the calls in flight still end: a result is persisted, nothing runs after it
    assert ok(ev, "compiles") == [PersistResult("compiles", result_for("compiles"))]
    assert ev.rule_failed("style_check", "timeout") == []
    assert ev.cancel() == []


def test_cancel_acks_the_retry_in_flight_and_drops_later_retries() -> None:
    plan = make_plan({"p1": {"a": [], "b": []}})
    ev = Evaluation(plan, ATTEMPT, max_parallel=2)
    ev.start()
    fail_attempt(ev, "a")
    fail_attempt(ev, "b")
    assert ev.retry_due("a", 2) == [RunRule("a", 2, 1)]
    assert kinds(ev.cancel()) == ["AckRetry", "Finish"]
    assert ok(ev, "a") == [PersistResult("a", result_for("a", 2))]  # no second ack
    assert ev.retry_due("b", 2) == [AckRetry("b", 2)]


def test_cancel_before_start_acks_a_stale_due() -> None:
    ev = Evaluation(TINY, ATTEMPT, due={"compiles": 4})
    assert kinds(ev.cancel()) == ["AckRetry", "Finish"]


def test_cancel_after_finish_does_nothing() -> None:
    ev = Evaluation(single(), ATTEMPT)
    ev.start()
    ok(ev, "a")
    assert ev.cancel() == [] and ev.status is EvaluationStatus.COMPLETED


# --- ProtocolError --------------------------------------------------------------------------------


def test_protocol_errors() -> None:
    ev = Evaluation(TINY, ATTEMPT)
    with pytest.raises(ProtocolError, match="pending, expected running"):
        ok(ev, "compiles")  # before start()
    ev.start()
    with pytest.raises(ProtocolError, match="twice"):
        ev.start()
    with pytest.raises(ProtocolError, match="unknown rule"):
        ev.rule_succeeded("nope", result_for("nope"))
    with pytest.raises(ProtocolError, match="unknown rule"):
        ev.rule_failed("nope", "x")
    with pytest.raises(ProtocolError, match="unknown rule"):
        ev.retry_due("nope", 2)
    with pytest.raises(ProtocolError, match="pending, expected running"):
        ok(ev, "unit_tests")
    ok(ev, "compiles")
    with pytest.raises(ProtocolError, match="succeeded, expected running"):
        ev.rule_failed("compiles", "x")
    fail_attempt(ev, "style_check")
    with pytest.raises(ProtocolError, match="waiting_retry, expected running"):
        ok(ev, "style_check")
    with pytest.raises(ProtocolError, match="unknown rule"):
        Evaluation(TINY, ATTEMPT, due={"nope": 2})


# --- whole runs: properties -----------------------------------------------------------------------


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    """A random rule DAG: each rule depends on some earlier rules, passes in order."""
    n = draw(st.integers(1, 8))
    pass_of = sorted(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))
    passes: dict[int, list[dict[str, Any]]] = {}
    for i in range(n):
        deps = draw(st.lists(st.integers(0, i - 1), unique=True, max_size=3)) if i else []
        rule: dict[str, Any] = {"id": f"r{i}", "depends_on": [f"r{d}" for d in deps]}
        if draw(st.integers(0, 4)) == 0:
            rule["max_attempts"] = draw(st.integers(1, 4))
        passes.setdefault(pass_of[i], []).append(rule)
    return plan_from_dict(
        {
            "plan": "random",
            "passes": [{"id": f"p{k}", "rules": v} for k, v in sorted(passes.items())],
        }
    )


policies = st.builds(
    RetryPolicy,
    immediate_retries=st.integers(0, 2),
    max_attempts=st.integers(1, 4),
    seed=st.integers(0, 3),
)


def check_history(shell: Shell) -> list[str]:
    """The guarantees of DESIGN.md on a recorded run; one line per violation."""
    plan = shell.plan
    policy = shell.policy or RetryPolicy()
    bad: list[str] = []
    persisted: set[str] = set()
    last_attempt: dict[str, int] = {}
    for i, (_, action) in enumerate(shell.executed):
        match action:
            case PersistResult(rule_id=rid):
                persisted.add(rid)
            case RunRule(rule_id=rid, attempt=n, try_no=t):
                if rid in persisted:
                    bad.append(
                        f"no_completed_rerun: {rid} runs at #{i} after its result was written"
                    )
                if n < last_attempt.get(rid, 0):
                    bad.append(f"attempts_monotonic: {rid} attempt {n} after {last_attempt[rid]}")
                last_attempt[rid] = n
                missing = [d for d in plan.rules[rid].depends_on if d not in persisted]
                if missing:
                    bad.append(f"order: {rid} runs at #{i} before the results of {missing}")
                limit = plan.rules[rid].max_attempts or policy.max_attempts
                if n > limit or t > policy.immediate_retries + 1:
                    bad.append(f"retry_budget: {action}")
                if shell.cancelled_at is not None and i >= shell.cancelled_at:
                    bad.append(f"cancel: {rid} runs at #{i} after the cancel")
            case ScheduleRetry(attempt=n, tier=tier, delay_ms=delay):
                if tier != policy.tier_for(n - 1) or delay < policy.tiers_ms[tier]:
                    bad.append(f"retry_delays_respected: {action}")
    finishes = shell.of_type(Finish)
    if len(finishes) != 1:
        bad.append(f"single_final_result: {len(finishes)} Finish")
    if shell.queued or shell.delivered:
        bad.append(f"retry messages left: {shell.queued} {shell.delivered}")
    if shell.max_inflight > shell.max_parallel:
        bad.append(f"max_parallel: {shell.max_inflight} calls at once")
    if shell.cancelled_at is not None:
        return bad
    failed = {r for r, s in shell.statuses.items() if s == PERMANENTLY_FAILED}
    skipped = {r for s in shell.of_type(SkipRules) for r in s.rule_ids}
    if skipped != plan.transitive_dependents(failed):
        bad.append(f"prune_only_dependents: skipped {sorted(skipped)}, failed {sorted(failed)}")
    if set(shell.results) | failed | skipped != set(plan.rules) or failed & set(shell.results):
        bad.append("all_terminal: some rule is neither succeeded, failed nor skipped")
    published = shell.of_type(PublishPassResult)
    if sorted(p.pass_id for p in published) != sorted(p.id for p in plan.passes):
        bad.append(f"passes published: {[p.pass_id for p in published]}")
    rules_of = {q.id: q.rule_ids for q in plan.passes}
    for p in published:
        complete = all(r in shell.results for r in rules_of[p.pass_id])
        if p.outcome != ("complete" if complete else "partial"):
            bad.append(f"pass outcome: {p}")
    if finishes:
        expected = (
            EvaluationStatus.COMPLETED
            if len(shell.results) == len(plan.rules)
            else EvaluationStatus.PARTIAL
            if shell.results
            else EvaluationStatus.FAILED
        )
        if finishes[0].status is not expected:
            bad.append(f"finish status {finishes[0].status}, expected {expected}")
    return bad


@settings(max_examples=150, deadline=None)
@given(
    plan=plans(),
    policy=policies,
    seed=st.integers(0, 2**16),
    p_transient=st.sampled_from([0.0, 0.3, 0.6, 0.9]),
    p_permanent=st.sampled_from([0.0, 0.05, 0.3]),
    max_parallel=st.integers(1, 4),
    evict_on_park=st.booleans(),
    cancel_after=st.none() | st.integers(1, 30),
)
def test_random_runs_keep_the_invariants(
    plan: Plan,
    policy: RetryPolicy,
    seed: int,
    p_transient: float,
    p_permanent: float,
    max_parallel: int,
    evict_on_park: bool,
    cancel_after: int | None,
) -> None:
    shell = Shell(
        plan,
        hashed_agent(seed, p_transient, p_permanent),
        policy,
        max_parallel=max_parallel,
        evict_on_park=evict_on_park,
        cancel_after=cancel_after,
        rng=random.Random(seed),
    ).run()
    assert check_history(shell) == []
    assert shell.final is not None
    if shell.cancelled_at is not None:
        assert shell.final.status is EvaluationStatus.CANCELLED


@settings(max_examples=100, deadline=None)
@given(plan=plans(), policy=policies, choices=st.lists(st.integers(0, 99), max_size=200))
def test_driven_by_hand_never_reruns_a_success(
    plan: Plan, policy: RetryPolicy, choices: list[int]
) -> None:
    """Drive the core directly with arbitrary outcomes and retry arrivals (stale ones too)."""
    ev = Evaluation(plan, ATTEMPT, policy, max_parallel=3)
    running: list[RunRule] = []
    messages: list[tuple[str, int]] = []
    finishes = 0
    attempts: dict[str, int] = {}
    succeeded: set[str] = set()

    def carry_out(actions: list[Action]) -> None:
        nonlocal finishes
        for a in actions:
            if isinstance(a, RunRule):
                assert a.rule_id not in succeeded
                assert a.attempt >= attempts.get(a.rule_id, 0)
                running.append(a)
            elif isinstance(a, ScheduleRetry):
                messages.append((a.rule_id, a.attempt))
            elif isinstance(a, Finish):
                finishes += 1
            elif isinstance(a, PersistResult):
                succeeded.add(a.rule_id)
        for rid in plan.rules:
            assert ev.attempt[rid] >= attempts.get(rid, 0), "attempts never decrease"
            attempts[rid] = ev.attempt[rid]

    carry_out(ev.start())
    stream = iter(choices)
    while running or messages:
        c = next(stream, 0)
        if messages and (c % 4 == 3 or not running):
            rid, n = messages.pop(c % len(messages))
            if c % 8 == 7:
                messages.append((rid, n))  # delivered twice
            carry_out(ev.retry_due(rid, n if c % 16 != 15 else n - 1))
            continue
        run = running.pop(c % len(running))
        kind = (OK, TRANSIENT, PERMANENT)[c % 3]
        if kind == OK:
            carry_out(ev.rule_succeeded(run.rule_id, result_for(run.rule_id, run.attempt)))
        else:
            carry_out(ev.rule_failed(run.rule_id, kind, retryable=kind == TRANSIENT))
    assert ev.finished and finishes == 1
    assert all(
        ev.state[r] in (RuleState.SUCCEEDED, RuleState.PERMANENTLY_FAILED, RuleState.SKIPPED)
        for r in plan.rules
    )
    failed = set(ev.rules_in(RuleState.PERMANENTLY_FAILED))
    assert set(ev.rules_in(RuleState.SKIPPED)) == plan.transitive_dependents(failed)
    assert set(ev.rules_in(RuleState.SUCCEEDED)) == succeeded


@settings(max_examples=100, deadline=None)
@given(
    plan=plans(),
    max_parallel=st.integers(1, 4),
    choices=st.lists(st.integers(0, 99), max_size=200),
)
def test_each_decision_starts_the_first_ready_rules_in_plan_order(
    plan: Plan, max_parallel: int, choices: list[int]
) -> None:
    """What the core starts after any input is what a scan of the whole plan in order
    would start: the pending rules whose dependencies all succeeded, first in plan order,
    until `max_parallel` run; none ready is left waiting while a place is free. (The core
    looks only at rules whose dependencies moved: this proves it misses none.)"""
    ev = Evaluation(plan, ATTEMPT, RetryPolicy(immediate_retries=0), max_parallel=max_parallel)
    running: list[RunRule] = []
    messages: list[tuple[str, int]] = []

    def decided(actions: list[Action], before: dict[str, RuleState]) -> None:
        started = [a.rule_id for a in actions if isinstance(a, RunRule) and a.try_no == 1]
        room = max_parallel - sum(1 for s in before.values() if s is RuleState.RUNNING)
        scan = [
            r
            for r in plan.order
            if before[r] is RuleState.PENDING
            and all(before[d] is RuleState.SUCCEEDED for d in plan.rules[r].depends_on)
        ]
        if not ev.finished:
            assert started == scan[: max(room, 0)], (started, scan, room)
        running.extend(a for a in actions if isinstance(a, RunRule))
        messages.extend((a.rule_id, a.attempt) for a in actions if isinstance(a, ScheduleRetry))

    def fed(step: Any) -> None:
        """`step()` an input; what the core decided judged on the states it left."""
        actions = step()
        after = dict(ev.state)
        for a in actions:  # the rules it started were pending and ready before them
            if isinstance(a, RunRule) and a.try_no == 1:
                after[a.rule_id] = RuleState.PENDING
        decided(actions, after)

    fed(ev.start)
    stream = iter(choices)
    while running or messages:
        c = next(stream, 0)
        if messages and (c % 4 == 3 or not running):
            rid, n = messages.pop(c % len(messages))
            fed(lambda rid=rid, n=n: ev.retry_due(rid, n))
            continue
        run = running.pop(c % len(running))
        if c % 3 == 0:
            fed(
                lambda run=run: ev.rule_succeeded(run.rule_id, result_for(run.rule_id, run.attempt))
            )
        else:
            fed(lambda run=run, c=c: ev.rule_failed(run.rule_id, TRANSIENT, retryable=c % 3 == 1))
    assert ev.finished


def test_a_long_reversed_chain_is_decided_in_linear_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 3,000-rule chain listed last rule first: each decision asks `dag.ready` of a few
    rules, not of every pending one (it was quadratic: 4.5 million questions)."""
    from engine.core import dag

    n = 3000
    plan = plan_from_dict(reversed_chain(n))
    asked = 0
    ready = dag.ready

    def counted(plan: Plan, state: Any, rule_id: str) -> bool:
        nonlocal asked
        asked += 1
        return ready(plan, state, rule_id)

    monkeypatch.setattr(dag, "ready", counted)
    ev = Evaluation(plan, ATTEMPT)
    actions = ev.start()
    done = 0
    while runs := [a for a in actions if isinstance(a, RunRule)]:
        actions = [x for a in runs for x in ok(ev, a.rule_id)]
        done += len(runs)
    assert ev.finished and done == n
    assert asked <= 3 * n, asked


# --- crash and recovery: two evaluations back to back ---------------------------------------------


def _verdicts(shell: Shell) -> tuple[EvaluationStatus, dict[str, str]]:
    assert shell.final is not None
    return shell.final.status, dict(shell.final.verdicts)


@pytest.mark.parametrize("seed", [1, 2, 5])
def test_every_crash_point_recovers_to_the_same_verdicts(seed: int) -> None:
    """Crash before each action of a run in turn (the simulator's exhaustive mode): the
    recovered run ends with the fault-free run's verdicts, and no finished rule reruns."""
    policy = RetryPolicy(immediate_retries=0, seed=seed)
    reference = run_plan(REVIEW, hashed_agent(seed, 0.4, 0.03), policy=policy)
    assert reference.of_type(ScheduleRetry), "the reference run exercises level 2"
    for crash in range(len(reference.executed)):
        shell = run_plan(REVIEW, hashed_agent(seed, 0.4, 0.03), policy=policy, crash_at=[crash])
        assert shell.crashes == 1
        assert _verdicts(shell) == _verdicts(reference), f"crash before action #{crash}"
        assert check_history(shell) == [], f"crash before action #{crash}"
        assert {r: v.verdict for r, v in shell.results.items()} == {
            r: v.verdict for r, v in reference.results.items()
        }


def test_crash_in_the_write_window_reruns_the_rule_once() -> None:
    reference = run_plan(TINY)
    first_write = next(i for i, a in enumerate(reference.actions) if isinstance(a, PersistResult))
    shell = run_plan(TINY, crash_at=[first_write])
    rule = reference.actions[first_write].rule_id
    assert [c.rule_id for c in shell.calls].count(rule) == 2  # at-least-once: rerun, allowed
    assert _verdicts(shell) == _verdicts(reference)
    assert not shell.of_type(Recovered)  # nothing reached Redis: a fresh start


def test_crash_after_a_write_does_not_rerun() -> None:
    reference = run_plan(TINY)
    after_write = (
        next(i for i, a in enumerate(reference.actions) if isinstance(a, PersistResult)) + 1
    )
    shell = run_plan(TINY, crash_at=[after_write])
    rule = reference.actions[after_write - 1].rule_id
    assert [c.rule_id for c in shell.calls].count(rule) == 1
    assert rule in shell.of_type(Recovered)[0].loaded


@settings(max_examples=60, deadline=None)
@given(
    plan=plans(),
    seed=st.integers(0, 2**16),
    crash_points=st.lists(st.integers(0, 80), min_size=1, max_size=3),
    evict_on_park=st.booleans(),
)
def test_random_crashes_recover_to_the_same_verdicts(
    plan: Plan, seed: int, crash_points: list[int], evict_on_park: bool
) -> None:
    outcome = hashed_agent(seed, 0.4, 0.1)
    reference = run_plan(plan, outcome)
    shell = run_plan(
        plan, outcome, crash_at=crash_points, evict_on_park=evict_on_park, rng=random.Random(seed)
    )
    assert _verdicts(shell) == _verdicts(reference)
    assert check_history(shell) == []


def test_crash_between_status_and_retry_publish_needs_the_sweeper() -> None:
    """The hole the seeds leave: failed_attempt_1 is in Redis, its retry message is not."""
    outcome = agent(compiles=lambda attempt, _try: TRANSIENT if attempt == 1 else OK)
    reference = run_plan(TINY, outcome)
    publish = next(i for i, a in enumerate(reference.actions) if isinstance(a, ScheduleRetry))
    stuck = run_plan(TINY, outcome, crash_at=[publish], sweeper=False)
    assert stuck.final is None and stuck.statuses == {"compiles": "failed_attempt_1"}
    assert stuck.of_type(Park)[-1] == Park({"compiles": 2})
    swept = run_plan(TINY, outcome, crash_at=[publish], sweeper=True)
    assert _verdicts(swept) == _verdicts(reference)


class _NoRedis(Shell):
    """A broken engine: recovery reads nothing from Redis (RabbitMQ without Redis)."""

    def snapshot(self) -> Snapshot:
        return Snapshot()


def test_the_history_check_catches_a_rerun() -> None:
    reference = run_plan(TINY)
    after_write = (
        next(i for i, a in enumerate(reference.actions) if isinstance(a, PersistResult)) + 1
    )
    assert check_history(run_plan(TINY, crash_at=[after_write])) == []
    broken = _NoRedis(TINY, agent(), crash_at=[after_write]).run()
    assert check_history(broken) == [
        f"no_completed_rerun: compiles runs at #{after_write} after its result was written"
    ]


def test_a_retry_message_is_fresh_only_for_the_attempt_after_the_stored_failure() -> None:
    from engine.core.recovery import retry_is_fresh

    failed = Snapshot(statuses={"compiles": "failed_attempt_1"})
    assert retry_is_fresh(TINY, failed, "compiles", 2)
    assert not retry_is_fresh(TINY, failed, "compiles", 3)  # a later attempt's copy
    assert not retry_is_fresh(TINY, failed, "compiles", 1)
    assert not retry_is_fresh(TINY, failed, "nope", 2)  # not a rule of the plan
    assert not retry_is_fresh(TINY, Snapshot(), "compiles", 2)  # no failure stored
    again = Snapshot(statuses={"compiles": "failed_attempt_2"})
    assert not retry_is_fresh(TINY, again, "compiles", 2)  # a duplicate: attempt 3 is next
    done = Snapshot(
        results={"compiles": RuleResult("compiles", "pass", 0.9, 10)},
        statuses={"compiles": "failed_attempt_1"},
    )
    assert not retry_is_fresh(TINY, done, "compiles", 2)  # the retry already succeeded


def test_a_terminal_evaluation_is_announced_again_only_when_never_flagged_announced() -> None:
    from engine.core.recovery import announce_again

    assert announce_again(published=False, plan=TINY)  # its announcer died before the flag
    assert not announce_again(published=True, plan=TINY)  # consumers heard it already
    assert not announce_again(published=False, plan=None)  # no plan to read verdicts with


def test_a_result_kept_by_the_store_replaces_the_one_computed() -> None:
    ev = Evaluation(TINY, ATTEMPT)
    ev.start()
    mine = RuleResult("compiles", "fail", 0.1, 10)
    ev.rule_succeeded("compiles", mine)
    kept = RuleResult("compiles", "pass", 0.9, 10)
    ev.result_kept("compiles", kept)
    assert ev.results["compiles"] == kept
    # announcements computed with the losing write carry the kept verdict from now on
    assert ev.announced({"compiles": "fail", "other": "skipped"}) == {
        "compiles": "pass",
        "other": "skipped",
    }
    with pytest.raises(ProtocolError):
        ev.result_kept("nope", kept)


@given(
    rule_id=st.text(),
    verdict=st.text(),
    score=st.floats(allow_nan=True, allow_infinity=True) | st.integers(),
    tokens=st.integers(),
    attempt=st.integers(),
    rationale=st.text(),
)
def test_a_result_is_written_as_json_writes_it(
    rule_id: str, verdict: str, score: float, tokens: int, attempt: int, rationale: str
) -> None:
    """`RuleResult.to_json` writes the usual types out by hand: the same text as `json`'s
    compact encoder, whatever the strings (escapes, non-ASCII) and numbers (special floats,
    an int score, large ints)."""
    import json

    result = RuleResult(rule_id, verdict, score, tokens, attempt, rationale)
    fields = ("attempt", "rationale", "rule_id", "score", "tokens", "verdict")
    expected = json.dumps({k: getattr(result, k) for k in fields}, separators=(",", ":"))
    assert result.to_json() == expected
    assert RuleResult.from_json(expected) == result or score != score  # NaN is not NaN


def test_a_result_is_encoded_once() -> None:
    """`to_json` keeps its text (a rule's result is written, then checked by the final
    state's write): the same text each time, and the kept text is no part of the value."""
    result = RuleResult("compiles", "pass", 0.9, 10, 2, "ok")
    text = result.to_json()
    assert result.to_json() is text
    twin = RuleResult("compiles", "pass", 0.9, 10, 2, "ok")
    assert twin == result and hash(twin) == hash(result)
    assert repr(twin) == repr(result) and "_json" not in repr(result)
    assert RuleResult.from_json(text) == result
    assert RuleResult.__match_args__ == (
        "rule_id",
        "verdict",
        "score",
        "tokens",
        "attempt",
        "rationale",
    )


# --- the message contract (engine.core.messages) ------------------------------------------


@pytest.mark.parametrize(
    ("body", "wrong"),
    [
        (None, "not a JSON object"),
        (["execute"], "not a JSON object"),
        ({"attempt_id": "a"}, "type: expected a string"),
        ({"type": "execute", "attempt_id": ""}, "attempt_id: expected a non-empty string"),
        ({"type": "execute", "attempt_id": "a"}, "published_ms: expected an integer"),
        ({"type": "execute", "attempt_id": "a", "published_ms": True}, "published_ms"),
        ({"type": "execute", "attempt_id": "a", "published_ms": 1, "reason": "x"}, "reason"),
        ({"type": "retry", "attempt_id": "a", "published_ms": 1, "delay_ms": 1.5}, "delay_ms"),
        ({"type": "retry", "attempt_id": "a", "published_ms": 1, "attempt": 2}, "rule_id"),
        (
            {"type": "retry", "attempt_id": "a", "published_ms": 1, "rule_id": "r", "attempt": 1},
            "attempt: a retry is of attempt 2 or later",
        ),
        (
            {"type": "execute", "attempt_id": "a", "published_ms": 1, "attempt": 2},
            "an execute names no rule and no attempt",
        ),
    ],
)
def test_a_message_that_breaks_the_contract_is_named(body: object, wrong: str) -> None:
    from engine.core.messages import problem

    found = problem(body)
    assert found is not None and found.startswith(wrong)


def test_the_engine_s_own_messages_fit_the_contract() -> None:
    from engine.core.messages import decode, problem

    assert decode(b"\xff") is None and decode(b'{"a": 1}') == {"a": 1}
    execute = {"type": "execute", "attempt_id": "a", "published_ms": 0, "reason": "submit"}
    retry = {
        "type": "retry",
        "attempt_id": "a",
        "rule_id": "r",
        "attempt": 2,
        "published_ms": 5,
        "delay_ms": 0,
        "reason": "lost_retry",
    }
    assert problem(execute) is None and problem(retry) is None
    assert problem({"type": "cancel", "attempt_id": "a"}) is None
    assert problem({"type": "explode", "attempt_id": "a"}) is None  # refused later, by type
