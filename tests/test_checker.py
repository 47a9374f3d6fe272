"""The history checker, on synthetic histories: each invariant passes a correct run and
names the anomaly a broken one shows, with the events that prove it.

Three layers: hand-built histories (one passing and one failing case per invariant, and
the stats and budgets); a real history recorded by the live write-window test, embedded
verbatim; and a property test that drives the pure core through random crashes with the
toy shell of `tests/helpers.py`, turns what it did into a history, and requires the
checker to find nothing (a correct engine must never be accused).
"""

from __future__ import annotations

import dataclasses
import json
import random
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chaos.checker import (
    INVARIANTS,
    CheckResult,
    CheckSpec,
    EvaluationFinal,
    FinalState,
    Violation,
    check,
)
from chaos.journal import format_violation, junit_cases, write_junit, write_outputs
from chaos.reference import Reference, outcome_of
from engine.agent import AgentProfile, FakeAgent
from engine.config import STATE_TTL_SECONDS
from engine.core import (
    AckRetry,
    Finish,
    Park,
    PersistResult,
    PersistStatus,
    RuleResult,
    RunRule,
    ScheduleRetry,
    SkipRules,
)
from engine.plan import Plan
from engine.policy import RetryPolicy
from tests.helpers import OK, PERMANENT, Shell, example_plan, feed, hashed_agent, make_plan

#: a -> b -> d, and c -> e: failing `a` must skip b and d, and leave c and e alone.
PLAN = make_plan(
    {"one": {"a": [], "c": []}, "two": {"b": ["a"]}, "three": {"d": ["b"], "e": ["c"]}}
)
PROFILE = AgentProfile(seed=7)
REF = FakeAgent(PROFILE)
A = "att-1"
#: Every invariant but the vocabulary's and the fault plan's: a hand-built history records
#: only the fields its test reads, and crashes no scenario planned; the vocabulary and the
#: plan are judged on whole runs (tests/test_well_formed.py, tests/test_mutants.py, and
#: every simulated run).
ABRIDGED = tuple(n for n in INVARIANTS if n not in ("history_well_formed", "faults_fired"))

#: The invariants a clean hand-built run must pass (others may have nothing to judge).
CORE = (
    "history_complete",
    "no_completed_rerun",
    "prune_only_dependents",
    "idempotent_results",
    "all_terminal",
    "attempts_monotonic",
    "retry_delays_respected",
    "single_final_result",
    "state_keys_expire",
    "dag_order",
    "retry_budget",
)


def ref(attempt_id: str, rule_id: str) -> RuleResult:
    result = REF.draw(attempt_id, rule_id, 1, 1, 0).result
    assert result is not None
    return result


def reference_of(final: FinalState, plans: dict[str, Plan], agent: FakeAgent = REF) -> Reference:
    """A synthetic run's fault-free reference: each evaluation's own outcome (a test makes
    its faults by hand and says how it ends), with the agent's verdicts and scores, which a
    run without faults keeps."""
    out = {}
    for a, fin in final.evaluations.items():
        if a in plans:
            own = outcome_of(plans[a], fin)
            drawn = {r: agent.draw(a, r, 1, 1).result for r in own.completed}
            verdicts = {r: res.verdict for r, res in drawn.items() if res is not None}
            scores = {r: round(res.score, 6) for r, res in drawn.items() if res is not None}
            out[a] = dataclasses.replace(own, verdicts=verdicts, scores=scores)
    return Reference(out)


def unrecorded(events: list[dict], *kinds: str) -> list[dict]:
    """`events` as if `kinds` had never been recorded: gone, and each source's sequence
    numbers without a gap (a gap would make the history incomplete, every verdict that reads
    it unknown)."""
    kept = [dict(e) for e in events if e["ev"] not in kinds]
    seq: Counter[str] = Counter()
    for e in kept:
        seq[e["src"]] += 1
        e["seq"] = seq[e["src"]]
    return kept


class Run:
    """A synthetic run: events with increasing time and per-source sequence numbers, and
    the final Redis state they leave."""

    def __init__(self, t0: float = 1000.0) -> None:
        self.events: list[dict[str, Any]] = []
        self.t = t0
        self.seq: Counter[str] = Counter()
        self.evals: dict[str, EvaluationFinal] = {}
        self.ttls: dict[str, int] = {}

    def ev(self, ev: str, src: str = "w1", pid: int = 11, dt: float = 0.001, **fields: Any):
        self.t += dt
        self.seq[src] += 1
        e = {"t": self.t, "src": src, "pid": pid, "seq": self.seq[src], "ev": ev, **fields}
        self.events.append(e)
        return e

    def wait(self, seconds: float) -> Run:
        self.t += seconds
        return self

    def final_of(self, a: str) -> EvaluationFinal:
        return self.evals.setdefault(a, EvaluationFinal(a, None))

    def submit(self, a: str = A) -> None:
        self.ev("submitted", "runner", 1, attempt_id=a, plan=PLAN.id)
        self.final_of(a)

    def start(self, a: str, r: str, attempt: int = 1, try_no: int = 1, **w: Any) -> dict:
        return self.ev("rule_started", attempt_id=a, rule_id=r, attempt=attempt, try_no=try_no, **w)

    def finished(self, a: str, r: str, attempt: int = 1, verdict: str | None = None, **w: Any):
        res = ref(a, r)
        return self.ev(
            "rule_finished",
            attempt_id=a,
            rule_id=r,
            attempt=attempt,
            try_no=1,
            verdict=verdict or res.verdict,
            score=res.score,
            tokens=1000,
            **w,
        )

    def persisted(self, a: str, r: str, attempt: int = 1, verdict: str | None = None, **w: Any):
        res = ref(a, r)
        verdict = verdict or res.verdict
        self.final_of(a).results[r] = RuleResult(r, verdict, res.score, 1000, attempt)
        return self.ev(
            "result_persisted",
            attempt_id=a,
            rule_id=r,
            attempt=attempt,
            verdict=verdict,
            score=res.score,
            won=True,
            kept_verdict=None,
            **w,
        )

    def ok(self, a: str, r: str, attempt: int = 1, **w: Any) -> None:
        self.start(a, r, attempt, **w)
        self.finished(a, r, attempt, **w)
        self.persisted(a, r, attempt, **w)

    def status(self, a: str, r: str, status: str, kept: str | None = None, **w: Any) -> dict:
        if kept is None:
            self.final_of(a).statuses[r] = status
        return self.ev("status_written", attempt_id=a, rule_id=r, status=status, kept=kept, **w)

    def fail(self, a: str, r: str, attempt: int, permanent: bool = False, **w: Any) -> dict:
        self.start(a, r, attempt, **w)
        kind = "invalid_output" if permanent else "timeout"  # what retry_budget reads
        self.ev(
            "rule_failed",
            attempt_id=a,
            rule_id=r,
            attempt=attempt,
            try_no=1,
            kind=kind,
            tokens=0,
            **w,
        )
        status = "permanently_failed" if permanent else f"failed_attempt_{attempt}"
        return self.status(a, r, status, **w)

    def retry(self, a: str, r: str, attempt: int, delay_ms: int, **w: Any) -> dict:
        return self.ev(
            "retry_published", attempt_id=a, rule_id=r, attempt=attempt, delay_ms=delay_ms, **w
        )

    def finish(self, a: str, status: str, **w: Any) -> None:
        self.ev("evaluation_terminal", attempt_id=a, status=status, won=True, **w)
        self.ev("final_published", attempt_id=a, status=status, **w)
        self.final_of(a).state = status

    def golden(self, a: str = A, plan: Plan = PLAN) -> Run:
        self.submit(a)
        for r in plan.order:
            self.ok(a, r)
        self.finish(a, "completed")
        return self

    def final(self) -> FinalState:
        ttls = dict(self.ttls)
        for a, ef in self.evals.items():
            for r in ef.results:
                ttls.setdefault(f"attempt:{a}:rule:{r}:result", STATE_TTL_SECONDS - 5)
            for r in ef.statuses:
                ttls.setdefault(f"attempt:{a}:rule:{r}:status", STATE_TTL_SECONDS - 5)
            ttls.setdefault(f"attempt:{a}:state", STATE_TTL_SECONDS - 5)
        return FinalState(dict(self.evals), ttls)

    def check(self, **spec: Any) -> CheckResult:
        spec.setdefault("plans", dict.fromkeys(self.evals, PLAN))
        spec.setdefault("agent", PROFILE)
        spec.setdefault("reference", reference_of(self.final(), spec["plans"]))
        # one call per attempt: `fail` spends level 1 in a single call
        spec.setdefault("policy", RetryPolicy(immediate_retries=0))
        spec.setdefault("invariants", ABRIDGED)
        return check(self.events, self.final(), CheckSpec(**spec))


def only(result: CheckResult, invariant: str) -> list[Violation]:
    """The violations, which must all be of `invariant`; its verdict is fail."""
    assert {v.invariant for v in result.violations} == {invariant}, result.violations
    assert result.verdicts[invariant] == "fail"
    assert not result.ok
    assert all(v.timeline for v in result.violations if v.invariant != "state_keys_expire")
    for v in result.violations:
        ts = [e["t"] for e in v.timeline]
        assert ts == sorted(ts) and len(ts) <= 12
    return result.violations


def passes(result: CheckResult) -> None:
    assert not result.violations, [format_violation(v) for v in result.violations]
    assert result.ok


# --- a clean run -----------------------------------------------------------------------------


def test_golden_run_passes_every_invariant() -> None:
    result = Run().golden().check()
    passes(result)
    assert result.verdicts["retry_delays_respected"] == "unknown"  # no retry to time
    assert result.cases["retry_delays_respected"] == 0
    judged = set(INVARIANTS) - {"retry_delays_respected", "matches_reference"}
    assert {result.verdicts[k] for k in judged if k in CORE} == {"pass"}
    assert "fail" not in result.verdicts.values()
    assert result.stats["reruns"] == 0 and result.stats["duplicated_tokens"] == 0
    assert result.stats["retries_checked"] == 0
    assert result.stats["calls"] == len(PLAN.order)


# --- no_completed_rerun ----------------------------------------------------------------------


def test_a_start_after_the_persisted_result_is_a_completed_rerun() -> None:
    run = Run().golden()
    won = next(e for e in run.events if e["ev"] == "result_persisted" and e["rule_id"] == "b")
    run.ev("crash", "w1", 11)
    late = run.start(A, "b", src="w2", pid=12, rerun=True)
    [v] = only(run.check(), "no_completed_rerun")
    assert (v.attempt_id, v.rule_id) == (A, "b")
    assert won in v.timeline and late in v.timeline
    assert "after its result" in v.message


def _resumed_while_a_write_was_answered(late_fence: str) -> CheckResult:
    """w1 owns the evaluation (token 1:w1) and writes b's result while the runner resumes
    the run from a checkpoint that deletes it; the write's answer is recorded after the
    resume's, under `late_fence`; then w2 begins (token 3:w2) and runs b again."""
    run = Run()
    run.submit()
    run.ev("evaluation_started", attempt_id=A, fence="1:w1")
    run.start(A, "b")
    run.ev("resume_requested", "runner", 1, attempt_id=A, checkpoint=1)
    run.ev("resume_written", "runner", 1, attempt_id=A, discarded=["b"])
    run.persisted(A, "b", fence=late_fence)
    run.ev("evaluation_started", "w2", 12, attempt_id=A, fence="3:w2")
    run.start(A, "b", src="w2", pid=12, rerun=True)
    return run.check(invariants=("no_completed_rerun",))


def test_a_write_answered_after_a_resume_that_deleted_it_is_the_life_before() -> None:
    """Under a token current before the resume was asked for, a landed write committed
    before the resume (which moved the fence), so the resume deleted it: b is unfinished
    again and its start on w2 is no rerun of finished work. Under a later token the same
    records are a start after b's result."""
    assert _resumed_while_a_write_was_answered("1:w1").verdicts["no_completed_rerun"] == "pass"
    [v] = only(_resumed_while_a_write_was_answered("3:w2"), "no_completed_rerun")
    assert v.rule_id == "b"


def test_a_write_window_rerun_is_counted_not_a_violation() -> None:
    run = Run()
    run.submit()
    run.ok(A, "a")
    run.start(A, "b")
    run.finished(A, "b")  # the answer is in hand ...
    run.ev("crash", failpoint="rule_after_call_before_write")  # ... and never written
    run.wait(0.5)
    run.start(A, "b", src="w2", pid=12, rerun=True)
    run.finished(A, "b", src="w2", pid=12)
    run.persisted(A, "b", src="w2", pid=12)
    for r in ("c", "d", "e"):
        run.ok(A, r, src="w2", pid=12)
    run.finish(A, "completed", src="w2", pid=12)
    result = run.check()
    passes(result)
    stats = result.stats
    assert stats["reruns"] == 1 and stats["reruns_by_cause"]["write_window"] == 1
    assert stats["duplicated_tokens"] == 1000 == stats["duplicated_by_cause"]["write_window"]


def test_a_crash_mid_call_rerun_is_not_a_write_window_rerun() -> None:
    run = Run()
    run.submit()
    run.start(A, "a")
    run.ev("crash", failpoint="rule_before_call")
    for r in PLAN.order:
        run.ok(A, r, src="w2", pid=12)
    run.finish(A, "completed", src="w2", pid=12)
    result = run.check()
    passes(result)
    assert result.stats["reruns"] == 1 and result.stats["reruns_by_cause"]["write_window"] == 0
    assert result.stats["duplicated_tokens"] == 0


# --- prune_only_dependents -----------------------------------------------------------------


def partial_run() -> Run:
    """`a` fails for good at attempt 1 (a non-retryable error): b and d are skipped."""
    run = Run()
    run.submit()
    run.fail(A, "a", 1, permanent=True)
    run.ev("rules_skipped", attempt_id=A, rule_ids=["b", "d"], because_of="a")
    run.ok(A, "c")
    run.ok(A, "e")
    run.finish(A, "partial")
    return run


def test_skipping_exactly_the_dependents_passes() -> None:
    passes(partial_run().check())


def test_an_independent_rule_left_without_a_result_is_an_extra_skip() -> None:
    run = Run()
    run.submit()
    run.fail(A, "a", 1, permanent=True)
    run.ev("rules_skipped", attempt_id=A, rule_ids=["b", "d"], because_of="a")
    run.ok(A, "c")  # e never runs
    run.finish(A, "partial")
    [v] = only(run.check(), "prune_only_dependents")
    assert v.rule_id == "e" and "never completed" in v.message


def test_a_dependent_of_a_permanent_failure_must_not_run() -> None:
    run = partial_run()
    run.ok(A, "d")  # also before any result of b: dag_order has its own test
    [v] = only(run.check(invariants=("prune_only_dependents",)), "prune_only_dependents")
    assert v.rule_id == "d" and "a failed permanently" in v.message


def test_skipping_a_rule_that_does_not_depend_on_the_failure() -> None:
    run = Run()
    run.submit()
    run.fail(A, "a", 1, permanent=True)
    run.ev("rules_skipped", attempt_id=A, rule_ids=["b", "d", "e"], because_of="a")
    run.ok(A, "c")
    run.finish(A, "partial")
    found = only(run.check(), "prune_only_dependents")
    assert {v.rule_id for v in found} == {"e"}  # announced wrongly, and never completed


def test_a_completed_state_with_a_missing_result_is_flagged() -> None:
    run = partial_run()
    run.final_of(A).state = "completed"
    found = only(run.check(invariants=("prune_only_dependents",)), "prune_only_dependents")
    assert any("expected partial" in v.message for v in found)


def test_cancelled_evaluations_are_not_held_to_completion() -> None:
    run = Run()
    run.submit()
    run.ok(A, "a")
    run.ev("cancel_requested", "runner", 1, attempt_id=A)
    run.final_of(A).state = "cancelled"
    passes(run.check())


# --- idempotent_results ----------------------------------------------------------------------


def test_a_flipped_verdict_between_executions() -> None:
    run = Run()
    run.submit()
    run.start(A, "a")
    truth = ref(A, "a").verdict
    other = "fail" if truth != "fail" else "pass"
    run.finished(A, "a", verdict=other)
    run.ev("crash")
    run.ok(A, "a", src="w2", pid=12)
    for r in ("b", "c", "d", "e"):
        run.ok(A, r, src="w2", pid=12)
    run.finish(A, "completed", src="w2", pid=12)
    [v] = only(run.check(), "idempotent_results")
    assert v.rule_id == "a" and "disagree" in v.message and other in v.message


def test_a_final_result_that_differs_from_the_reference() -> None:
    run = Run().golden()
    kept = run.final_of(A).results["c"]
    wrong = "fail" if kept.verdict != "fail" else "pass"
    for e in run.events:
        if e.get("rule_id") == "c" and "verdict" in e:
            e["verdict"] = wrong  # every execution agrees, on the wrong verdict
    run.final_of(A).results["c"] = RuleResult("c", wrong, kept.score, kept.tokens, 1)
    [v] = only(run.check(invariants=("idempotent_results",)), "idempotent_results")
    assert "reference" in v.message
    [v] = only(run.check(invariants=("matches_reference",)), "matches_reference")
    assert v.rule_id == "c" and "verdict of c" in v.message
    passes(run.check(reference=None))  # no reference to compare with


def test_the_reference_ignores_injected_errors() -> None:
    run = Run().golden()
    noisy = AgentProfile(seed=PROFILE.seed, error_rate=0.9, always_fail_rules=frozenset({"a"}))
    passes(run.check(agent=noisy))


# --- all_terminal ------------------------------------------------------------------------------


def test_an_evaluation_left_running_is_not_terminal() -> None:
    run = Run().golden()
    run.submit("att-2")
    run.ok("att-2", "a")
    run.final_of("att-2").state = "parked"
    [v] = only(run.check(invariants=("all_terminal",)), "all_terminal")
    assert v.attempt_id == "att-2" and "parked" in v.message


def test_submitted_events_name_the_evaluations_to_wait_for() -> None:
    run = Run().golden()
    # a plan for an evaluation nobody submitted is not waited for when submits are recorded
    result = run.check(invariants=("all_terminal",), plans={A: PLAN, "ghost": PLAN})
    assert result.verdicts == {"all_terminal": "pass"}
    run.submit("never-seen")
    del run.evals["never-seen"]
    [v] = only(run.check(invariants=("all_terminal",)), "all_terminal")
    assert "no state" in v.message


# --- attempts_monotonic ---------------------------------------------------------------------


def retry_run(delay_ms: int = 300, wait_s: float = 0.31, **w: Any) -> Run:
    """`b` fails attempt 1, waits its tier (300 ms at time scale 0.01), succeeds attempt 2."""
    run = Run()
    run.submit()
    run.ok(A, "a")
    run.fail(A, "b", 1)
    run.retry(A, "b", 2, delay_ms)
    run.wait(wait_s)
    run.ev("delivered", attempt_id=A, kind="retry", rule_id="b", attempt=2, **w)
    run.ok(A, "b", 2)
    for r in ("c", "d", "e"):
        run.ok(A, r)
    run.finish(A, "completed")
    return run


def test_a_retried_rule_passes_attempts_monotonic() -> None:
    result = retry_run().check(time_scale=0.01)
    passes(result)
    assert result.stats["retries_checked"] == 1


def test_an_attempt_that_goes_back() -> None:
    run = retry_run()
    run.start(A, "b", 1)
    found = only(
        run.check(time_scale=0.01, invariants=("attempts_monotonic",)), "attempts_monotonic"
    )
    assert any("attempt 1 after attempt 2" in v.message for v in found)


def test_a_status_written_backwards() -> None:
    run = Run()
    run.submit()
    run.fail(A, "a", 1)
    run.fail(A, "a", 2)
    run.status(A, "a", "failed_attempt_1")  # a plain SET, not the monotonic script
    [v, *_] = only(run.check(invariants=("attempts_monotonic",)), "attempts_monotonic")
    assert "went back" in v.message


def test_a_refused_backward_status_write_is_no_violation() -> None:
    run = Run()
    run.submit()
    run.fail(A, "a", 1)
    run.fail(A, "a", 2)
    run.status(A, "a", "failed_attempt_1", kept="failed_attempt_2")  # the script said no
    result = run.check(invariants=("attempts_monotonic",))
    assert result.verdicts == {"attempts_monotonic": "pass"}
    assert result.stats["status_writes_refused"] == 1


def test_a_final_status_behind_the_attempts_started() -> None:
    run = Run()
    run.submit()
    run.fail(A, "a", 1)
    run.fail(A, "a", 2)
    run.start(A, "a", 3)
    run.final_of(A).statuses["a"] = "failed_attempt_1"  # Redis lost a status write
    found = only(run.check(invariants=("attempts_monotonic",)), "attempts_monotonic")
    assert any("highest attempt started is 3" in v.message for v in found)


def test_no_final_state_read_means_no_comparison_with_it() -> None:
    run = Run()
    run.submit()
    run.fail(A, "a", 1)
    run.start(A, "a", 2)
    del run.evals[A]  # the runner read nothing back for this evaluation
    result = run.check(invariants=("attempts_monotonic",))
    assert result.verdicts == {"attempts_monotonic": "pass"}


def test_an_attempt_beyond_max_attempts() -> None:
    run = Run()
    run.submit()
    run.fail(A, "a", 1)
    run.fail(A, "a", 2)
    run.start(A, "a", 3)
    result = run.check(invariants=("attempts_monotonic",), policy=RetryPolicy(max_attempts=2))
    [v] = only(result, "attempts_monotonic")
    assert "beyond max_attempts 2" in v.message


# --- retry_delays_respected ---------------------------------------------------------------------


def test_a_retry_started_before_its_tier() -> None:
    run = retry_run(wait_s=0.010)
    [v] = only(run.check(time_scale=0.01), "retry_delays_respected")
    assert v.rule_id == "b" and "before its tier 1 (30000 ms x 0.01 = 0.3 s)" in v.message
    assert [e["ev"] for e in v.timeline][:2] == ["status_written", "retry_published"]


def test_a_retry_published_below_its_tier() -> None:
    run = retry_run(delay_ms=5, wait_s=0.31)  # waited long enough, but asked for 5 ms
    [v] = only(run.check(time_scale=0.01), "retry_delays_respected")
    assert "below tier 1's [299, 331] ms" in v.message


def test_a_late_retry_without_a_fault_is_a_violation() -> None:
    run = retry_run(wait_s=2.0)
    [v] = only(run.check(time_scale=0.01), "retry_delays_respected")
    assert "past its tier 1" in v.message and "with no fault open" in v.message
    assert "unexplained" in v.message and "tolerance 5.0 ms" in v.message


def test_a_late_retry_after_a_fault_or_through_the_sweeper_is_excused() -> None:
    run = retry_run(wait_s=2.0)
    status = next(e for e in run.events if e["ev"] == "status_written")
    run.seq["w1"] += 1  # numbered like any other event of w1: the history stays complete
    crash = {
        **status,
        "ev": "crash",
        "t": status["t"] + 0.1,
        "seq": run.seq["w1"],
        "failpoint": "x",
    }
    for k in ("attempt_id", "rule_id", "status", "kept"):
        crash.pop(k)
    run.events.append(crash)
    result = run.check(time_scale=0.01)
    passes(result)
    assert result.stats["late_retries_excused"] == 1
    swept = retry_run(wait_s=2.0, reason="lost_retry")
    passes(swept.check(time_scale=0.01))
    killed = retry_run(wait_s=2.0)
    killed.seq["runner"] += 1
    seq = killed.seq["runner"]
    killed.events.append(
        {"t": 1000.0, "src": "runner", "pid": 1, "seq": seq, "ev": "fault_fired", "fault_id": 1}
    )
    passes(killed.check(time_scale=0.01))  # never healed: still open when the retry was due


def test_retry_latencies_are_recorded_for_the_budget() -> None:
    result = retry_run(wait_s=0.32).check(time_scale=0.01, budgets={"max_retry_latency_s": 0.2})
    assert result.verdicts["retry_delays_respected"] == "pass"  # on its tier (0.331 s at most)
    assert 0.32 <= result.stats["retry_latency_max_s"] < 0.331
    assert result.stats["retry_latency_s"] == [result.stats["retry_latency_max_s"]]
    assert result.budget_failures and "retry_latency_max_s" in result.budget_failures[0]
    assert not result.ok


# --- single_final_result ------------------------------------------------------------------------


def test_two_final_results_without_a_crash() -> None:
    run = Run().golden()
    run.ev("final_published", "w2", 12, attempt_id=A, status="completed")
    [v] = only(run.check(), "single_final_result")
    assert "published again" in v.message
    assert [e["ev"] for e in v.timeline].count("final_published") == 2


def test_a_second_final_result_after_the_publisher_crashed_is_allowed() -> None:
    run = Run().golden()
    run.ev("crash", "w1", 11, failpoint="after_final_publish")
    run.ev("final_published", "w2", 12, attempt_id=A, status="completed")
    passes(run.check())
    other = Run().golden()
    # the runner's `pid` field is the killed worker's (it overrides the envelope's)
    other.ev("worker_killed", "runner", 11, worker="worker0")
    other.ev("final_published", "w2", 12, attempt_id=A, status="completed")
    passes(other.check())
    bystander = Run().golden()
    bystander.ev("worker_killed", "runner", 99, worker="worker9")  # not the publisher
    bystander.ev("final_published", "w2", 12, attempt_id=A, status="completed")
    only(bystander.check(), "single_final_result")


def test_a_second_final_result_after_the_publisher_paused_is_allowed() -> None:
    # w1 sent evaluation.completed, then stopped before flagging it (its `final_published`
    # comes last, after its pause); a sweeper's resume announced it again meanwhile.
    for pause in (
        {"ev": "worker_paused", "src": "runner", "pid": 11, "worker": 0},
        {"ev": "failpoint_fired", "src": "w1", "pid": 11, "action": "freeze", "stall_ms": 900},
    ):
        run = Run().golden()
        [mine] = [e for e in run.events if e["ev"] == "final_published"]
        run.ev(pause.pop("ev"), pause.pop("src"), pause.pop("pid"), **pause)
        run.ev("final_published", "w2", 12, attempt_id=A, status="completed")
        mine["t"] = run.events[-1]["t"] + 0.1  # recorded once flagged, after the pause
        passes(run.check())
    # Paused with its state write in flight: even `evaluation_terminal` is recorded late.
    late = Run().golden()
    moved = [e for e in late.events if e["ev"] in ("evaluation_terminal", "final_published")]
    late.ev("worker_paused", "runner", 11, worker=0)
    late.ev("final_published", "w2", 12, attempt_id=A, status="completed")
    for i, e in enumerate(moved):
        e["t"] = late.events[-1]["t"] + 0.1 * (i + 1)
    passes(late.check())
    unpaused = Run().golden()
    unpaused.ev("failpoint_fired", "w1", 11, action="stall", stall_ms=900)  # one task only
    unpaused.ev("final_published", "w2", 12, attempt_id=A, status="completed")
    only(unpaused.check(), "single_final_result")


def test_final_results_that_disagree_with_the_state() -> None:
    run = Run().golden()
    run.ev("evaluation_terminal", "w2", 12, attempt_id=A, status="partial", won=True)
    found = only(run.check(), "single_final_result")
    assert any("won the terminal state" in v.message for v in found)
    cancelled = Run().golden()
    cancelled.final_of(A).state = "cancelled"
    found = only(cancelled.check(cancelled={A}), "single_final_result")
    assert any("Redis ends with cancelled" in v.message for v in found)


# --- state_keys_expire ------------------------------------------------------------------------


def test_a_key_without_ttl() -> None:
    run = Run().golden()
    run.ttls[f"attempt:{A}:rule:a:result"] = -1
    run.ttls["ns.engine:running"] = -1  # an index, not a state key
    run.ttls[f"attempt:{A}:owner"] = -2  # gone between SCAN and TTL
    run.ttls[f"attempt:{A}:lease"] = 0  # a lease under a second from expiry: a TTL
    # quiet_state reports every key without a TTL too, indexes included (test_checker_more)
    result = run.check(invariants=tuple(n for n in ABRIDGED if n != "quiet_state"))
    [v] = only(result, "state_keys_expire")
    assert v.attempt_id == A and f"attempt:{A}:rule:a:result (no TTL)" in v.message
    assert result.stats["keys_exempt"] == 1


def test_a_ttl_beyond_seven_days() -> None:
    run = Run().golden()
    run.ttls[f"attempt:{A}:plan"] = STATE_TTL_SECONDS * 2
    [v] = only(run.check(), "state_keys_expire")
    assert "TTL" in v.message


# --- verdicts, budgets, spec ---------------------------------------------------------------------


def test_nothing_to_judge_is_unknown_and_unselected_invariants_are_omitted() -> None:
    result = check([], FinalState(), CheckSpec())
    assert result.verdicts == dict.fromkeys(INVARIANTS, "unknown")
    assert result.ok  # unknown is not a failure
    picked = Run().golden().check(invariants=("no_completed_rerun", "state_keys_expire"))
    assert set(picked.verdicts) == {"no_completed_rerun", "state_keys_expire"}


def test_violations_of_unselected_invariants_are_not_reported() -> None:
    run = Run().golden()
    run.ttls[f"attempt:{A}:state"] = -1
    result = run.check(invariants=("no_completed_rerun",))
    assert result.ok and not result.violations


def test_budgets() -> None:
    run = Run()
    run.submit()
    run.start(A, "a")
    run.finished(A, "a")
    run.ev("crash")
    for r in PLAN.order:
        run.ok(A, r, src="w2", pid=12)
    run.finish(A, "completed", src="w2", pid=12)
    tight = run.check(budgets={"max_reruns": 0, "max_duplicated_tokens": 500})
    assert all(v != "fail" for v in tight.verdicts.values())
    assert len(tight.budget_failures) == 2 and not tight.ok
    assert "reruns 1 > max_reruns 0" in tight.budget_failures
    loose = run.check(budgets={"max_reruns": None, "max_duplicated_tokens": 1000})
    assert loose.ok and loose.stats["budgets"] == {"max_duplicated_tokens": 1000}


def test_the_spec_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown invariant"):
        CheckSpec(invariants=("no_such_thing",))
    with pytest.raises(ValueError, match="unknown budget"):
        CheckSpec(budgets={"max_money": 1})


def test_the_plan_can_come_from_the_submitted_event() -> None:
    run = partial_run()
    run.events[0]["plan"] = PLAN.to_dict()
    run.ok(A, "d")
    found = only(
        run.check(plans={}, invariants=("prune_only_dependents",)), "prune_only_dependents"
    )
    assert found[0].rule_id == "d"


# --- a real history ------------------------------------------------------------------------------

#: Recorded by tests/live (test_crash_in_the_write_window_reruns_only_that_rule, plan tiny):
#: w1 dies holding unit_tests' answer; w2, started by the sweeper, reruns the two rules
#: in flight. Times are relative; everything else is as recorded.
REAL_WRITE_WINDOW = """
{"t":0.0,"src":"w1","pid":28617,"seq":1,"ev":"worker_started","sweeper":true}
{"t":0.019688,"src":"w1","pid":28617,"seq":2,"ev":"delivered","attempt_id":"t8126b6b5.att-0","kind":"execute","rule_id":null,"attempt":null,"redelivered":false,"reason":"submit","published_ms":1795946464911,"delay_ms":null}
{"t":0.022049,"src":"w1","pid":28617,"seq":3,"ev":"evaluation_started","attempt_id":"t8126b6b5.att-0","plan":"tiny","resumed":false,"kind":"execute"}
{"t":0.022233,"src":"w1","pid":28617,"seq":4,"ev":"acked","attempt_id":"t8126b6b5.att-0"}
{"t":0.022955,"src":"w1","pid":28617,"seq":5,"ev":"rule_started","attempt_id":"t8126b6b5.att-0","rule_id":"compiles","attempt":1,"try_no":1,"rerun":false}
{"t":0.02314,"src":"w1","pid":28617,"seq":6,"ev":"rule_finished","attempt_id":"t8126b6b5.att-0","rule_id":"compiles","attempt":1,"try_no":1,"verdict":"pass","score":0.812,"tokens":1465}
{"t":0.023262,"src":"w1","pid":28617,"seq":7,"ev":"rule_started","attempt_id":"t8126b6b5.att-0","rule_id":"style_check","attempt":1,"try_no":1,"rerun":false}
{"t":0.023324,"src":"w1","pid":28617,"seq":8,"ev":"rule_finished","attempt_id":"t8126b6b5.att-0","rule_id":"style_check","attempt":1,"try_no":1,"verdict":"needs_review","score":0.2493,"tokens":1358}
{"t":0.023684,"src":"w1","pid":28617,"seq":9,"ev":"result_persisted","attempt_id":"t8126b6b5.att-0","rule_id":"compiles","attempt":1,"verdict":"pass","score":0.812,"won":true,"kept_verdict":null}
{"t":0.023719,"src":"w1","pid":28617,"seq":10,"ev":"rule_started","attempt_id":"t8126b6b5.att-0","rule_id":"unit_tests","attempt":1,"try_no":1,"rerun":false}
{"t":0.023778,"src":"w1","pid":28617,"seq":11,"ev":"rule_finished","attempt_id":"t8126b6b5.att-0","rule_id":"unit_tests","attempt":1,"try_no":1,"verdict":"needs_review","score":0.2827,"tokens":1344}
{"t":0.023792,"src":"w1","pid":28617,"seq":12,"ev":"crash","failpoint":"rule_after_call_before_write"}
{"t":0.414212,"src":"w2","pid":28618,"seq":1,"ev":"worker_started","sweeper":true}
{"t":0.720227,"src":"w2","pid":28618,"seq":2,"ev":"delivered","attempt_id":"t8126b6b5.att-0","kind":"execute","rule_id":null,"attempt":null,"redelivered":false,"reason":"stale_heartbeat","published_ms":1795946465612,"delay_ms":null}
{"t":0.720973,"src":"w2","pid":28618,"seq":3,"ev":"sweeper_resumed","attempt_id":"t8126b6b5.att-0"}
{"t":0.72473,"src":"w2","pid":28618,"seq":4,"ev":"evaluation_started","attempt_id":"t8126b6b5.att-0","plan":"tiny","resumed":true,"kind":"execute"}
{"t":0.725049,"src":"w2","pid":28618,"seq":5,"ev":"acked","attempt_id":"t8126b6b5.att-0"}
{"t":0.725165,"src":"w2","pid":28618,"seq":6,"ev":"recovered","attempt_id":"t8126b6b5.att-0","loaded":["compiles"],"retrying":{},"failed":[],"fresh":["style_check","unit_tests","feedback"]}
{"t":0.725459,"src":"w2","pid":28618,"seq":7,"ev":"rule_started","attempt_id":"t8126b6b5.att-0","rule_id":"style_check","attempt":1,"try_no":1,"rerun":true}
{"t":0.725639,"src":"w2","pid":28618,"seq":8,"ev":"rule_finished","attempt_id":"t8126b6b5.att-0","rule_id":"style_check","attempt":1,"try_no":1,"verdict":"needs_review","score":0.2493,"tokens":1358}
{"t":0.725749,"src":"w2","pid":28618,"seq":9,"ev":"rule_started","attempt_id":"t8126b6b5.att-0","rule_id":"unit_tests","attempt":1,"try_no":1,"rerun":true}
{"t":0.725821,"src":"w2","pid":28618,"seq":10,"ev":"rule_finished","attempt_id":"t8126b6b5.att-0","rule_id":"unit_tests","attempt":1,"try_no":1,"verdict":"needs_review","score":0.2827,"tokens":1344}
{"t":0.72616,"src":"w2","pid":28618,"seq":11,"ev":"result_persisted","attempt_id":"t8126b6b5.att-0","rule_id":"style_check","attempt":1,"verdict":"needs_review","score":0.2493,"won":true,"kept_verdict":null}
{"t":0.727058,"src":"w2","pid":28618,"seq":12,"ev":"pass_published","attempt_id":"t8126b6b5.att-0","pass_id":"quick","outcome":"complete"}
{"t":0.72737,"src":"w2","pid":28618,"seq":13,"ev":"result_persisted","attempt_id":"t8126b6b5.att-0","rule_id":"unit_tests","attempt":1,"verdict":"needs_review","score":0.2827,"won":true,"kept_verdict":null}
{"t":0.727393,"src":"w2","pid":28618,"seq":14,"ev":"rule_started","attempt_id":"t8126b6b5.att-0","rule_id":"feedback","attempt":1,"try_no":1,"rerun":false}
{"t":0.727454,"src":"w2","pid":28618,"seq":15,"ev":"rule_finished","attempt_id":"t8126b6b5.att-0","rule_id":"feedback","attempt":1,"try_no":1,"verdict":"needs_review","score":0.2933,"tokens":1029}
{"t":0.727666,"src":"w2","pid":28618,"seq":16,"ev":"result_persisted","attempt_id":"t8126b6b5.att-0","rule_id":"feedback","attempt":1,"verdict":"needs_review","score":0.2933,"won":true,"kept_verdict":null}
{"t":0.728291,"src":"w2","pid":28618,"seq":17,"ev":"pass_published","attempt_id":"t8126b6b5.att-0","pass_id":"deep","outcome":"complete"}
{"t":0.728441,"src":"w2","pid":28618,"seq":18,"ev":"evaluation_terminal","attempt_id":"t8126b6b5.att-0","status":"completed","won":true,"verdicts":{"compiles":"pass","style_check":"needs_review","unit_tests":"needs_review","feedback":"needs_review"}}
{"t":0.72901,"src":"w2","pid":28618,"seq":19,"ev":"final_published","attempt_id":"t8126b6b5.att-0","status":"completed"}
"""


def real_write_window() -> tuple[list[dict], FinalState, CheckSpec]:
    history = [json.loads(line) for line in REAL_WRITE_WINDOW.split("\n") if line]
    a = "t8126b6b5.att-0"
    results = {
        e["rule_id"]: RuleResult(e["rule_id"], e["verdict"], e["score"], 0, e["attempt"])
        for e in history
        if e["ev"] == "result_persisted"
    }
    keys = [f"attempt:{a}:rule:{r}:{k}" for r in results for k in ("result", "runs")]
    keys += [f"attempt:{a}:{k}" for k in ("plan", "state", "passes", "final_published")]
    final = FinalState(
        {a: EvaluationFinal(a, "completed", results, {})},
        dict.fromkeys(keys, STATE_TTL_SECONDS - 1),
    )
    plans = {a: example_plan("tiny")}
    spec = CheckSpec(
        plans=plans,
        agent=AgentProfile(),
        policy=RetryPolicy(),
        time_scale=0.001,
        reference=reference_of(final, plans, FakeAgent(AgentProfile())),
        invariants=ABRIDGED,
    )
    return history, final, spec


def test_a_real_write_window_history_passes_and_counts_its_reruns() -> None:
    result = check(*real_write_window())
    passes(result)
    assert result.verdicts["retry_delays_respected"] == "unknown"  # no retry in it
    assert {result.verdicts[k] for k in CORE if k != "retry_delays_respected"} == {"pass"}
    stats = result.stats
    assert stats["reruns"] == 2 and stats["reruns_by_cause"]["write_window"] == 2  # answered
    assert stats["duplicated_tokens"] == 1358 + 1344 == stats["duplicated_by_cause"]["write_window"]


def test_a_real_history_with_a_rule_rerun_after_its_write() -> None:
    history, final, spec = real_write_window()
    # w2 starts compiles although w1 wrote its result before dying
    history.append(
        {
            "t": 0.7262,
            "src": "w2",
            "pid": 28618,
            "seq": 20,
            "ev": "rule_started",
            "attempt_id": "t8126b6b5.att-0",
            "rule_id": "compiles",
            "attempt": 1,
            "try_no": 1,
            "rerun": True,
        }
    )
    [v] = only(check(history, final, spec), "no_completed_rerun")
    assert v.rule_id == "compiles"
    text = format_violation(v)
    assert "result_persisted" in text and "+   0.000s  w1" in text.splitlines()[1]


# --- the pure core under random crashes: never a false accusation -------------------------------


class RecordingShell(Shell):
    """The toy shell of tests/helpers.py, writing the history a live worker would: one
    event per action carried out, a clock that advances 1 ms a step and jumps to a delayed
    retry's due time when its message is delivered, one worker id per generation."""

    time_scale: float = 0.001

    def __post_init__(self) -> None:
        super().__post_init__()
        self.history: list[dict[str, Any]] = []
        self.now = 0.0
        self.seqs: Counter[str] = Counter()
        self.due: dict[tuple[str, int], float] = {}

    def rec(self, ev: str, **fields: Any) -> None:
        self.now += 0.001
        src = f"w{self.generation}"
        self.seqs[src] += 1
        self.history.append(
            {
                "t": self.now,
                "src": src,
                "pid": 100 + self.generation,
                "seq": self.seqs[src],
                "ev": ev,
                "attempt_id": self.attempt_id,
                **fields,
            }
        )

    def _complete_call(self) -> None:
        run = self._pick(self.inflight)
        outcome = self.agent(run)
        self.outcomes.append((run, outcome))
        where = {"rule_id": run.rule_id, "attempt": run.attempt, "try_no": run.try_no}
        if outcome == OK:
            res = ref_for(self.attempt_id, run.rule_id)
            self.rec("rule_finished", verdict=res.verdict, score=res.score, tokens=10, **where)
        else:
            kind = "invalid_output" if outcome == PERMANENT else "timeout"
            self.rec("rule_failed", kind=kind, tokens=5, **where)
        assert self.evaluation is not None
        self._execute(feed(self.evaluation, run, outcome))

    def _deliver_message(self) -> None:  # as Shell's, with the clock and the event
        msg = self._pick(self.queued)
        self.now = max(self.now, self.due.get(msg, self.now))
        self.rec("delivered", kind="retry", rule_id=msg[0], attempt=msg[1])
        self.delivered.append(msg)
        if self.evaluation is None and self.final is None:
            self._boot(due={msg[0]: msg[1]})
        elif self.evaluation is None:
            self._execute([AckRetry(*msg)])
        else:
            self._execute(self.evaluation.retry_due(*msg))

    def _recover(self) -> None:
        self.rec("crash", failpoint="anywhere")
        super()._recover()

    def _apply(self, action: Any) -> None:
        super()._apply(action)
        match action:
            case RunRule(rule_id=rid, attempt=attempt, try_no=try_no):
                self.rec("rule_started", rule_id=rid, attempt=attempt, try_no=try_no)
            case PersistResult(rule_id=rid, result=result):
                res = ref_for(self.attempt_id, rid)
                self.results[rid] = RuleResult(rid, res.verdict, res.score, 10, result.attempt)
                self.rec("result_persisted", rule_id=rid, attempt=result.attempt, won=True)
                self.history[-1].update(verdict=res.verdict, score=res.score)
            case PersistStatus(rule_id=rid, status=status, retry_due_in_ms=due_ms):
                self.rec("status_written", rule_id=rid, status=status, kept=None)
                if due_ms is not None:
                    n = int(status.rsplit("_", 1)[1])
                    self.due[(rid, n + 1)] = self.now + due_ms * self.time_scale / 1000
            case ScheduleRetry(rule_id=rid, attempt=attempt, delay_ms=delay):
                delay_ms = round(delay * self.time_scale)
                self.rec("retry_published", rule_id=rid, attempt=attempt, delay_ms=delay_ms)
            case SkipRules(rule_ids=rids, because_of=because):
                self.rec("rules_skipped", rule_ids=list(rids), because_of=because)
            case AckRetry(rule_id=rid, attempt=attempt):
                self.rec("retry_acked", rule_id=rid, attempt=attempt)
            case Park():
                self.rec("parked")
            case Finish(status=status):
                self.rec("evaluation_terminal", status=status.value, won=True)
                self.rec("final_published", status=status.value)


def ref_for(attempt_id: str, rule_id: str) -> RuleResult:
    result = FakeAgent(AgentProfile()).draw(attempt_id, rule_id, 1, 1, 0).result
    assert result is not None
    return result


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan_name=st.sampled_from(["tiny", "code_review"]),
    seed=st.integers(0, 10_000),
    crashes=st.lists(st.integers(0, 60), max_size=3),
    p_transient=st.sampled_from([0.0, 0.3, 0.6]),
    cancel_after=st.one_of(st.none(), st.integers(1, 40)),
)
def test_histories_of_the_core_under_crashes_never_violate(
    plan_name: str, seed: int, crashes: list[int], p_transient: float, cancel_after: int | None
) -> None:
    plan = example_plan(plan_name)
    shell = RecordingShell(
        plan,
        hashed_agent(seed, p_transient=p_transient, p_permanent=0.03),
        policy=RetryPolicy(),
        crash_at=crashes,
        rng=random.Random(seed),
        evict_on_park=bool(seed % 2),
        cancel_after=cancel_after,
        attempt_id=f"sim-{seed}",
    ).run()
    a = shell.attempt_id
    state = shell.final.status.value if shell.final else "running"
    final = FinalState(
        {a: EvaluationFinal(a, state, dict(shell.results), dict(shell.statuses))},
        {f"attempt:{a}:state": STATE_TTL_SECONDS},
    )
    spec = CheckSpec(
        plans={a: plan},
        agent=AgentProfile(),
        time_scale=0.001,
        cancelled={a} if shell.cancelled_at is not None else set(),
        # the toy shell has no timing model beyond "not before due": its delays prove nothing
        invariants=tuple(n for n in ABRIDGED if n != "retry_delays_respected"),
    )
    result = check(shell.history, final, spec)
    assert not result.violations, "\n".join(format_violation(v) for v in result.violations)
    assert result.verdicts["all_terminal"] == "pass"


# --- journal and JUnit ----------------------------------------------------------------------------


def failing_result() -> tuple[list[dict], CheckResult]:
    run = Run().golden()
    run.ev("final_published", "w2", 12, attempt_id=A, status="completed")
    run.ttls[f"attempt:{A}:state"] = -1
    return run.events, run.check(budgets={"max_reruns": 5})


def test_write_outputs(tmp_path: Path) -> None:
    events, result = failing_result()
    shuffled = list(reversed(events))
    write_outputs(tmp_path / "out", "s1", shuffled, result, {"seed": 3, "mode": "live"})
    lines = (tmp_path / "out" / "history.jsonl").read_text().splitlines()
    merged = [json.loads(line) for line in lines]
    assert len(merged) == len(events) and [e["t"] for e in merged] == sorted(e["t"] for e in events)
    journal = json.loads((tmp_path / "out" / "journal.json").read_text())
    assert journal["scenario"] == "s1" and journal["ok"] is False
    assert journal["verdicts"]["single_final_result"] == "fail"
    assert journal["extra"] == {"seed": 3, "mode": "live"}
    [v] = [v for v in journal["violations"] if v["invariant"] == "single_final_result"]
    assert v["timeline"] and v["attempt_id"] == A
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["history.jsonl", "journal.json"]


def test_junit_report(tmp_path: Path) -> None:
    _, bad = failing_result()
    good = Run().golden().check()
    unknown = check([], FinalState(), CheckSpec(invariants=("all_terminal",)))
    path = tmp_path / "junit.xml"
    write_junit(path, [("bad", bad, 1.5), ("good", good, 0.25), ("empty", unknown, 0.0)])
    root = ET.parse(path).getroot()
    # bad fails single_final_result, and its key without a TTL both state_keys_expire (for
    # an attempt:* key) and quiet_state (for any key the engine wrote)
    assert root.tag == "testsuites" and root.get("failures") == "3"
    suites = {s.get("name"): s for s in root.findall("testsuite")}
    cases = {c.get("name"): c for c in suites["bad"].findall("testcase")}
    assert set(cases) == {*ABRIDGED, "budgets", "exercised"}  # budgets were set for "bad"
    assert all(c.get("classname") == "bad" for c in cases.values())
    failure = cases["single_final_result"].find("failure")
    assert failure is not None and "final_published" in (failure.text or "")
    assert cases["state_keys_expire"].find("failure") is not None
    assert cases["budgets"].find("failure") is None  # within budget
    assert len(suites["good"].findall("testcase")) == len(ABRIDGED) + 1
    assert suites["empty"].find("testcase/skipped") is not None
    assert len(junit_cases("bad", bad, 1.5)) == len(ABRIDGED) + 2
    assert [p.name for p in tmp_path.iterdir()] == ["junit.xml"]  # no temporary left


def test_format_violation_shows_a_relative_timeline() -> None:
    _, result = failing_result()
    [v] = [v for v in result.violations if v.invariant == "single_final_result"]
    lines = format_violation(v).splitlines()
    assert lines[0].startswith(f"single_final_result  {A}: final result published again")
    assert lines[1].lstrip().startswith("+   0.000s")
    assert any("final_published" in line and "status=completed" in line for line in lines)
