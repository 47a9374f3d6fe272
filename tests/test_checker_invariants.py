"""The checker's foundations on hand-built histories: case counts and `unknown`, the
`exercised` minimums, `history_complete`, fault windows from the runner's own records, the
redone `retry_delays_respected`, the checker's own oracle (tiers, prune set) and the
invariants `dag_order` and `retry_budget`. Each has a passing and a failing history.

Every check names the invariants it judges (`invariants=...`), so an invariant added
later cannot change what these tests mean.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from chaos.checker import (
    INVARIANTS,
    REGISTRY,
    CheckResult,
    CheckSpec,
    FinalState,
    RetrySettings,
    check,
    fault_windows,
)
from chaos.checker.context import stall_ends
from chaos.checker.oracle import delay_bounds, dependents_of, is_permanent_error
from chaos.checker.touching import touches
from chaos.journal import format_violation, summary_line
from engine.history import UNREADABLE, FileHistory, read_history
from engine.plan import Plan
from engine.policy import RetryPolicy
from tests.test_checker import PLAN, A, Run, retry_run, unrecorded


def judged(run: Run, *names: str, **spec: Any) -> CheckResult:
    return run.check(invariants=names, **spec)


def fails(result: CheckResult, name: str) -> list[str]:
    """The messages of `name`'s violations; its verdict must be fail, the run not ok."""
    assert result.verdicts[name] == "fail", result.verdicts
    assert not result.ok
    found = [v for v in result.violations if v.invariant == name]
    assert found and all(v.timeline for v in found)
    for v in found:
        assert len(v.timeline) <= 12 and format_violation(v)
    return [v.message for v in found]


def clean(result: CheckResult) -> None:
    assert not result.violations, [format_violation(v) for v in result.violations]


# --- cases, unknown, exercised ------------------------------------------------------------


def test_every_verdict_reports_its_cases_and_zero_is_unknown() -> None:
    result = judged(Run().golden(), "no_completed_rerun", "retry_delays_respected")
    assert result.cases == {"no_completed_rerun": 5, "retry_delays_respected": 0}
    assert result.verdicts == {"no_completed_rerun": "pass", "retry_delays_respected": "unknown"}
    assert result.ok  # unknown alone does not fail a run: only a scenario's minimum does
    assert result.to_dict()["cases"] == result.cases


def test_an_exercised_minimum_fails_the_run_when_unmet_or_unknown() -> None:
    run = Run().golden()
    met = judged(run, "no_completed_rerun", exercised={"no_completed_rerun": 5})
    assert met.ok and met.exercise_failures == []
    short = judged(run, "no_completed_rerun", exercised={"no_completed_rerun": 6})
    assert not short.ok
    assert short.exercise_failures == ["no_completed_rerun judged 5 case(s) < exercised 6"]
    none = judged(run, "retry_delays_respected", exercised={"retry_delays_respected": 1})
    assert none.exercise_failures == [
        "retry_delays_respected unknown (no case judged), exercised needs 1"
    ]
    line = summary_line("s", "sim", none, 1, "in 1 s").plain
    assert "; unknown: retry_delays_respected (0 cases)" in line
    assert "; exercised: retry_delays_respected unknown" in line and "\n" not in line


def test_the_spec_refuses_bad_minimums() -> None:
    with pytest.raises(ValueError, match="unknown invariant"):
        CheckSpec(exercised={"no_such": 1})
    with pytest.raises(ValueError, match="case count >= 1"):
        CheckSpec(exercised={"dag_order": 0})


def test_the_registry_is_one_line_per_invariant() -> None:
    assert [inv.name for inv in REGISTRY] == list(INVARIANTS)
    assert {"history_complete", "dag_order", "retry_budget"} <= set(INVARIANTS)
    assert not next(i for i in REGISTRY if i.name == "state_keys_expire").needs_history


# --- history_complete ------------------------------------------------------------------------


def test_a_complete_history_passes_with_one_case_per_source() -> None:
    run = Run().golden()
    result = judged(run, "history_complete")
    clean(result)
    assert result.cases["history_complete"] == 2  # the runner and w1


def test_a_gap_in_a_source_fails_and_makes_history_verdicts_unknown() -> None:
    run = Run().golden()
    del run.events[4]  # one event of w1 lost in the middle
    names = ("history_complete", "no_completed_rerun", "all_terminal", "state_keys_expire")
    result = judged(run, *names)
    [message] = fails(result, "history_complete")
    assert "w1's history breaks at seq 4: seq 4 is missing" in message
    assert result.verdicts["no_completed_rerun"] == "unknown"  # read the broken history
    assert result.verdicts["all_terminal"] == "pass"  # the final state alone
    assert result.verdicts["state_keys_expire"] == "pass"
    assert result.stats["history_incomplete"] is True
    # a scenario that wanted the history judged fails with the reason
    wanted = judged(run, *names, exercised={"no_completed_rerun": 1})
    assert wanted.exercise_failures == [
        "no_completed_rerun unknown (history incomplete), exercised needs 1"
    ]


def test_what_a_gap_fakes_is_unknown_not_fail() -> None:
    # A lost `result_persisted` makes the dependent's start look premature: dag_order would
    # accuse the engine of what the history lost. Only history_complete fails.
    run = Run().golden()
    lost = next(i for i, e in enumerate(run.events) if e["ev"] == "result_persisted")
    del run.events[lost]
    result = judged(run, "history_complete", "dag_order")
    fails(result, "history_complete")
    assert result.verdicts["dag_order"] == "unknown"
    assert {v.invariant for v in result.violations} == {"history_complete"}
    assert result.stats["violations_unconfirmed"] >= 1
    whole = judged(Run().golden(), "history_complete", "dag_order")
    assert whole.verdicts == {"history_complete": "pass", "dag_order": "pass"}


def test_a_repeated_seq_fails_but_a_source_restarted_under_its_name_passes() -> None:
    run = Run().golden()
    run.events.append({**run.events[3], "t": run.t + 1})  # the same w1 line twice
    [message] = fails(judged(run, "history_complete"), "history_complete")
    assert "seq 3 appears 2 time(s)" in message
    restarted = Run().golden()
    restarted.seq["w1"] = 0  # a second process under the same name numbers from 1
    restarted.ev("worker_started")
    restarted.ev("worker_stopped")
    clean(judged(restarted, "history_complete"))


def test_a_history_without_seq_is_not_judged() -> None:
    run = Run().golden()
    for e in run.events:
        e.pop("seq")
    result = judged(run, "history_complete", "no_completed_rerun")
    assert result.verdicts == {"history_complete": "unknown", "no_completed_rerun": "pass"}


def test_unreadable_lines_only_a_torn_last_one_is_allowed(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    writer = FileHistory(path, "w1")
    for ev in ("worker_started", "delivered", "acked"):
        writer.record(ev)
    writer.close()
    with open(path, "ab") as fh:
        fh.write(b'{"t": 1, "src": "w1", "se')  # SIGKILL mid-write: a torn last line
    events = read_history(path, keep_unreadable=True)
    assert [e["ev"] for e in events] == ["worker_started", "delivered", "acked", UNREADABLE]
    assert events[-1]["last"] is True and events[-1]["line"] == 4
    assert read_history(path) == events[:3]  # the default still skips it
    result = check(events, FinalState(), CheckSpec(invariants=("history_complete",)))
    assert result.verdicts == {"history_complete": "pass"}
    assert result.stats["history_torn_lines"] == 1
    lines = path.read_bytes().splitlines()
    path.write_bytes(b"\n".join([lines[0], b"\xff{not json", *lines[1:3]]) + b"\n")
    middle = read_history(path, keep_unreadable=True)
    result = check(middle, FinalState(), CheckSpec(invariants=("history_complete",)))
    [message] = fails(result, "history_complete")
    assert "history line 2 does not parse and is not the last line" in message


# --- fault windows, from the runner's records ------------------------------------------------


def ev(t: float, name: str, seq: int, **fields: Any) -> dict[str, Any]:
    return {"t": t, "src": "runner", "pid": 1, "seq": seq, "ev": name, **fields}


def test_fault_windows_open_and_heal_by_the_runner_records() -> None:
    events = [
        ev(1.0, "fault_fired", 1, action="kill_worker", fault="f0", fault_id=1),
        ev(1.5, "fault_fired", 2, action="kill_redis", fault="f1", fault_id=2),
        ev(2.0, "fault_healed", 3, fault_id=1),
        ev(3.0, "fault_fired", 4, action="cancel", fault="f2"),  # no id: an instant
        {"t": 4.0, "src": "w2", "pid": 22, "seq": 1, "ev": "crash", "failpoint": "x"},
        ev(4.1, "worker_exited", 5, worker=1, pid=22, fault_id=3),
        ev(5.0, "fault_healed", 6, fault_id=3),
        {"t": 6.0, "src": "w1", "seq": 1, "ev": "failpoint_fired", "failpoint": "x"}
        | {"action": "freeze", "stall_ms": 350},
        {"t": 7.0, "src": "w1", "seq": 2, "ev": "failpoint_fired", "failpoint": "x"}
        | {"action": "raise"},
        ev(9.0, "run_finished", 7),
    ]
    windows = [(w.start, w.end, w.label) for w in fault_windows(events)]
    assert windows == [
        (1.0, 2.0, "f0"),
        (1.5, 9.0, "f1"),  # never healed: open until the run ended, not forever
        (3.0, 3.0, "f2"),
        (4.0, 5.0, "worker 1 exited"),  # from the crash itself
        (6.0, 6.35, "freeze@x"),  # the whole worker stopped for its stall_ms
    ]


def test_a_stall_with_until_ends_at_its_release() -> None:
    """A stall that ended on its event is a window to its `failpoint_released`, not to its
    longest `stall_ms` (the checker would excuse a process for seconds it was running);
    one whose process died before its release lasts its `stall_ms`."""
    stall = {"failpoint": "before_final_write", "action": "stall", "stall_ms": 5000}
    w1 = {"src": "w1", "pid": 11, "rule": None, "attempt_id": "a0"}
    w2 = {"src": "w2", "pid": 12, "rule": None, "attempt_id": "a0"}
    events = [
        {"t": 1.0, "seq": 1, "ev": "failpoint_fired", **w1, **stall, "until": "service_paused"},
        {"t": 1.1, "seq": 2, "ev": "failpoint_fired", **w2, **stall, "until": "service_paused"},
        ev(1.2, "service_paused", 1, service="redis"),
        {"t": 1.25, "seq": 2, "ev": "failpoint_released", **w1}
        | {"failpoint": "before_final_write", "came": True},
        ev(9.0, "run_finished", 2),
    ]
    ends = stall_ends(events)
    assert [ends[id(e)] for e in events[:2]] == [1.25, 6.1]
    windows = [(w.start, w.end) for w in fault_windows(events)]
    assert windows == [(1.0, 1.25), (1.1, 6.1)]
    assert [(w.start, w.end) for w in touches(events) if w.pids == frozenset({11})] == [(1.0, 1.25)]


def late_retry_with(*faults: tuple[float, str, dict[str, Any]]) -> Run:
    """`retry_run` with its retry 2 s late, and runner fault records at times relative to
    the failure of attempt 1."""
    run = retry_run(wait_s=2.0)
    t0 = next(e["t"] for e in run.events if e["ev"] == "status_written")
    for dt, name, fields in faults:
        run.seq["runner"] += 1
        run.events.append(ev(t0 + dt, name, run.seq["runner"], **fields))
    return run


def test_a_late_retry_is_excused_only_by_a_window_open_during_its_wait() -> None:
    spec = {"time_scale": 0.01, "fault_recovery_s": 0.5}
    during = late_retry_with(
        (0.5, "fault_fired", {"fault_id": 1}), (0.9, "fault_healed", {"fault_id": 1})
    )
    result = judged(during, "retry_delays_respected", **spec)
    clean(result)
    assert result.stats["late_retries_excused"] == 1
    before = late_retry_with(
        (-5.0, "fault_fired", {"fault_id": 1}), (-4.0, "fault_healed", {"fault_id": 1})
    )
    [message] = fails(judged(before, "retry_delays_respected", **spec), "retry_delays_respected")
    assert "with no fault open" in message
    healed_just_before = late_retry_with(
        (-1.0, "fault_fired", {"fault_id": 1}), (-0.2, "fault_healed", {"fault_id": 1})
    )
    clean(judged(healed_just_before, "retry_delays_respected", **spec))  # still recovering
    # a fault_fired of any kind used to open a window forever: now only until its heal
    killed = late_retry_with(
        (-5.0, "fault_fired", {"action": "kill_worker", "fault_id": 1}),
        (-4.9, "fault_healed", {"fault_id": 1}),
    )
    fails(judged(killed, "retry_delays_respected", **spec), "retry_delays_respected")


# --- retry_delays_respected, on the checker's own tiers -------------------------------------


def waited_for_a_slot(proven: bool = True, ended: bool = True) -> Run:
    """`b`'s retry delivered on time (0.32 s at 0.01), then 0.3 s waiting for a rule slot
    while `c` and `d` (both slots) run; `d` ends and `b` gets its slot. `proven` False:
    the wait names `e` as running, which never started; `ended` False: no running rule
    ended before the grant."""
    run = Run()
    run.submit()
    run.ok(A, "a")
    run.fail(A, "b", 1)
    run.retry(A, "b", 2, 300)
    run.start(A, "c")
    run.start(A, "d")
    run.wait(0.31)
    run.ev("delivered", attempt_id=A, kind="retry", rule_id="b", attempt=2)
    running = {"c": 1, "d": 1} if proven else {"c": 1, "e": 1}
    run.ev("slot_wait", attempt_id=A, slot="rule", rule_id="b", attempt=2, running=running, slots=2)
    run.wait(0.3)
    if ended:
        run.finished(A, "d")
    run.ev("slot_granted", attempt_id=A, slot="rule", rule_id="b", attempt=2)
    run.ok(A, "b", 2)
    if not ended:
        run.finished(A, "d")
    run.persisted(A, "d")
    run.finished(A, "c")
    run.persisted(A, "c")
    run.ok(A, "e")
    run.finish(A, "completed")
    return run


def test_a_retry_late_by_a_proven_slot_wait_passes_and_its_wait_is_latency() -> None:
    result = judged(waited_for_a_slot(), "retry_delays_respected", time_scale=0.01)
    clean(result)
    assert result.stats["late_retries_explained"] == 1
    assert 0.299 < result.stats["retry_slot_wait_max_s"] < 0.31
    assert result.stats["retry_unexplained_max_s"] < 0.005


def test_a_slot_wait_the_history_does_not_prove_excuses_nothing() -> None:
    for run, why in (
        (waited_for_a_slot(proven=False), "e attempt 1, named running, was not running then"),
        (waited_for_a_slot(ended=False), "no running rule ended before its slot was granted"),
    ):
        [message] = fails(
            judged(run, "retry_delays_respected", time_scale=0.01), "retry_delays_respected"
        )
        assert "unexplained" in message and why in message
    # fewer rules running than the workers' slots (the scenario's max_parallel)
    [message] = fails(
        judged(waited_for_a_slot(), "retry_delays_respected", time_scale=0.01, max_parallel=4),
        "retry_delays_respected",
    )
    assert "2 rule(s) running, 4 slot(s)" in message


def test_a_retry_late_by_its_evaluations_resume_passes() -> None:
    """Delivered on time to a worker that no longer holds the evaluation: its begin and
    recovery (0.2 s here: a replica waited for each write) are proven by the history."""
    run = Run()
    run.submit()
    run.ok(A, "a")
    run.fail(A, "b", 1)
    run.retry(A, "b", 2, 300)
    run.wait(0.31)
    run.ev("delivered", attempt_id=A, kind="retry", rule_id="b", attempt=2)
    run.wait(0.2)
    run.ev("evaluation_started", attempt_id=A, plan="t", resumed=True, kind="retry")
    run.ev("recovered", attempt_id=A, loaded=["a"], retrying={"b": 1}, failed=[], fresh=[])
    run.ok(A, "b", 2)
    for r in ("c", "d", "e"):
        run.ok(A, r)
    run.finish(A, "completed")
    result = judged(run, "retry_delays_respected", time_scale=0.01)
    clean(result)
    assert result.stats["late_retries_explained"] == 1
    assert result.stats["retry_resume_s"] and result.stats["retry_resume_s"][0] > 0.19


def test_a_retry_sent_to_a_longer_tier_than_the_settings_say_is_caught() -> None:
    # failed_attempt_1 goes to tier 1 (30 s); the engine published it to tier 2 (2 min) and
    # it duly arrived after 1.2 s at this scale: once accepted, because the checker took
    # the engine's own delay as the expectation
    run = retry_run(delay_ms=1200, wait_s=1.25)
    next(e for e in run.events if e["ev"] == "retry_published")["tier"] = 2
    [published, *_] = fails(
        judged(run, "retry_delays_respected", time_scale=0.01), "retry_delays_respected"
    )
    assert "published to tier 2, but failed_attempt_1 goes to tier 1 (30000 ms)" in published
    untagged = retry_run(delay_ms=1200, wait_s=1.25)  # no tier field: the delay says it
    [message, late] = fails(
        judged(untagged, "retry_delays_respected", time_scale=0.01), "retry_delays_respected"
    )
    assert "1200 ms delay, above tier 1's [299, 331] ms" in message
    assert "past its tier 1" in late  # and, no slack left to hide it, late for its tier
    unpublished = retry_run(delay_ms=1200, wait_s=2.5)
    unpublished.events = unrecorded(unpublished.events, "retry_published")
    [late] = fails(
        judged(unpublished, "retry_delays_respected", time_scale=0.01), "retry_delays_respected"
    )
    assert "past its tier 1" in late  # the start alone gives it away


def test_a_retry_on_its_tier_passes_and_zero_retries_is_unknown() -> None:
    result = judged(retry_run(), "retry_delays_respected", time_scale=0.01)
    clean(result)
    assert result.cases["retry_delays_respected"] == 1
    assert result.verdicts["retry_delays_respected"] == "pass"
    idle = judged(Run().golden(), "retry_delays_respected", time_scale=0.01)
    assert idle.verdicts["retry_delays_respected"] == "unknown"


def test_the_checker_ignores_a_wrong_engine_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug shared by the engine and its checker must not be invisible: break the
    engine's tier lookup and transitive closure; the checker still judges correctly."""
    monkeypatch.setattr(RetryPolicy, "tier_for", lambda self, n: len(self.tiers_ms) - 1)
    monkeypatch.setattr(Plan, "transitive_dependents", lambda self, ids: frozenset())
    run = retry_run(delay_ms=6000, wait_s=6.1)  # the (broken) engine's tier 3
    fails(judged(run, "retry_delays_respected", time_scale=0.01), "retry_delays_respected")
    run = Run()
    run.submit()
    run.fail(A, "a", 1, permanent=True)
    run.ok(A, "c")
    run.ok(A, "e")
    run.ok(A, "d")  # a dependent of a (through b) ran: the prune set is the checker's own
    run.finish(A, "partial")
    fails(judged(run, "prune_only_dependents"), "prune_only_dependents")


def test_the_oracle() -> None:
    settings = RetrySettings(tiers_ms=(30_000, 120_000, 600_000), jitter=0.1)
    first, fifth = delay_bounds(settings, 0.01, 1), delay_bounds(settings, 0.01, 5)
    assert (first.tier, first.tier_ms) == (1, 30_000)
    assert first.low_s == pytest.approx(0.299) and first.high_s == pytest.approx(0.331)
    assert (fifth.tier, fifth.tier_ms) == (3, 600_000)  # past the table: the last tier
    assert dependents_of(PLAN, ["a"]) == {"b", "d"} and dependents_of(PLAN, ["e"]) == set()
    assert is_permanent_error("invalid_output") and not is_permanent_error("quota")
    assert RetrySettings.of(RetryPolicy(immediate_retries=1)).immediate_retries == 1


# --- dag_order --------------------------------------------------------------------------------


def test_dag_order_passes_a_run_in_order() -> None:
    result = judged(Run().golden(), "dag_order")
    clean(result)
    assert result.cases["dag_order"] == 3  # b, d and e have dependencies


def test_a_rule_started_before_its_dependency_was_durable() -> None:
    run = Run()
    run.submit()
    run.start(A, "a")
    run.finished(A, "a")
    early = run.start(A, "b")  # on an answer still only in memory
    run.persisted(A, "a")
    for r in ("b", "c", "d", "e"):
        if r != "b":
            run.start(A, r)
        run.finished(A, r)
        run.persisted(A, r)
    run.finish(A, "completed")
    result = judged(run, "dag_order")
    [message] = fails(result, "dag_order")
    assert message == "b started before a durable result of its dependency a"
    [v] = result.violations
    assert early in v.timeline and any(e["ev"] == "result_persisted" for e in v.timeline)


def test_a_rule_started_without_any_durable_dependency() -> None:
    run = Run()
    run.submit()
    run.ok(A, "c")
    run.ok(A, "e")
    run.ok(A, "d")  # neither a nor b ever ran
    [message] = fails(judged(run, "dag_order"), "dag_order")
    assert message == "d started without a durable result of its dependency b"


def test_a_dependency_loaded_by_recovery_counts_as_durable() -> None:
    run = Run()
    run.submit()
    run.start(A, "a")
    run.finished(A, "a")
    run.ev("crash", failpoint="rule_after_write")  # killed before recording its write
    run.ev("recovered", "w2", 12, attempt_id=A, loaded=["a"], retrying={}, failed=[], fresh=[])
    for r in ("b", "c", "d", "e"):
        run.ok(A, r, src="w2", pid=12)
    clean(judged(run, "dag_order"))


# --- retry_budget ------------------------------------------------------------------------------


def failing_attempt(run: Run, r: str, attempt: int, calls: int, kind: str = "timeout") -> None:
    """`calls` calls of one attempt, each failing with `kind`; then, as the engine does,
    failed_attempt_N (or permanently_failed for a permanent error)."""
    for try_no in range(1, calls + 1):
        run.start(A, r, attempt, try_no)
        run.ev("rule_failed", attempt_id=A, rule_id=r, attempt=attempt, try_no=try_no, kind=kind)
    permanent = is_permanent_error(kind)
    run.status(A, r, "permanently_failed" if permanent else f"failed_attempt_{attempt}")


SPEC = {"policy": RetrySettings(immediate_retries=2, max_attempts=3)}


def test_retry_budget_passes_a_rule_that_spent_everything() -> None:
    run = Run()
    run.submit()
    failing_attempt(run, "a", 1, 3)
    failing_attempt(run, "a", 2, 3)
    for try_no in (1, 2, 3):
        run.start(A, "a", 3, try_no)
        run.ev("rule_failed", attempt_id=A, rule_id="a", attempt=3, try_no=try_no, kind="quota")
    run.status(A, "a", "permanently_failed")
    result = judged(run, "retry_budget", **SPEC)
    clean(result)
    assert result.cases["retry_budget"] == 1


def test_an_attempt_with_more_calls_than_level_1_allows() -> None:
    run = Run()
    run.submit()
    failing_attempt(run, "a", 1, 4)
    [message, *_] = fails(judged(run, "retry_budget", **SPEC), "retry_budget")
    assert "made 4 calls in one execution; level 1 allows 3" in message


def _try_made_again(fault: bool) -> Run:
    """Tries 1 and 2 failed, try 2 started again (a Temporal server killed before the first
    one's answer reached it), then try 3: with `fault`, the server's kill between the two."""
    run = Run()
    run.submit()
    for try_no in (1, 2):
        run.start(A, "a", 1, try_no)
        run.ev("rule_failed", attempt_id=A, rule_id="a", attempt=1, try_no=try_no, kind="quota")
    if fault:
        run.ev("fault_fired", "runner", 1, action="kill_service", service="temporal", fault_id=1)
        run.ev("fault_healed", "runner", 1, fault_id=1, dt=0.3)
    for try_no in (2, 3):
        run.start(A, "a", 1, try_no)
        run.ev("rule_failed", attempt_id=A, rule_id="a", attempt=1, try_no=try_no, kind="quota")
    run.status(A, "a", "failed_attempt_1")
    return run


def test_a_try_made_again_is_one_call_only_when_a_fault_came_between() -> None:
    """The repeat is the same call redone when the history shows a fault that touched the
    process in between; without one it is a fourth call."""
    clean(judged(_try_made_again(fault=True), "retry_budget", **SPEC))
    [message, *_] = fails(
        judged(_try_made_again(fault=False), "retry_budget", **SPEC), "retry_budget"
    )
    assert "made 4 calls in one execution; level 1 allows 3" in message


def test_a_delayed_retry_before_level_1_was_spent() -> None:
    run = Run()
    run.submit()
    failing_attempt(run, "a", 1, 2)  # one immediate retry short
    run.ok(A, "a", 2)
    [message] = fails(judged(run, "retry_budget", **SPEC), "retry_budget")
    assert "a attempt 2 (a delayed retry) started although attempt 1 made 2 call(s)" in message


def test_permanently_failed_before_max_attempts_without_a_permanent_error() -> None:
    run = Run()
    run.submit()
    failing_attempt(run, "a", 1, 3)
    run.status(A, "a", "permanently_failed")  # after 1 attempt of 3, all transient
    [message] = fails(judged(run, "retry_budget", **SPEC), "retry_budget")
    assert "permanently_failed after attempt 1 of 3" in message


def test_a_permanent_error_ends_the_rule_at_once_and_is_never_retried() -> None:
    run = Run()
    run.submit()
    failing_attempt(run, "a", 1, 1, kind="invalid_output")
    clean(judged(run, "retry_budget", **SPEC))
    again = Run()
    again.submit()
    again.start(A, "a", 1, 1)
    again.ev("rule_failed", attempt_id=A, rule_id="a", attempt=1, try_no=1, kind="invalid_output")
    again.start(A, "a", 1, 2)  # an immediate retry of an error that cannot change
    [message] = fails(judged(again, "retry_budget", **SPEC), "retry_budget")
    assert "called again after a permanent invalid_output error" in message


def test_a_plan_max_attempts_is_the_rule_budget() -> None:
    from tests.helpers import make_plan

    plan = make_plan({"one": {"a": {"depends_on": [], "max_attempts": 1}}})
    run = Run()
    run.submit()
    failing_attempt(run, "a", 1, 3)
    run.status(A, "a", "permanently_failed")
    clean(judged(run, "retry_budget", plans={A: plan}, **SPEC))


# --- the scenario and the runners ---------------------------------------------------------------


def test_a_scenario_states_what_it_must_exercise() -> None:
    from chaos.scenario import ScenarioError, scenario_from_dict

    base = {"name": "x", "plan": "plans/code_review.yaml"}
    loaded = scenario_from_dict({**base, "exercised": {"dag_order": 8}}, "x.yaml", ".")
    spec = loaded.check_spec(0, loaded.evaluations(0), set(), loaded.agent, reference=False)
    assert spec.exercised == {"dag_order": 8}
    assert isinstance(spec.policy, RetrySettings)  # the scenario's settings, as plain data
    bad = {"invariants": ["all_terminal"], "exercised": {"dag_order": 1}}
    with pytest.raises(ScenarioError, match=r"exercised\.dag_order: not among the invariants"):
        scenario_from_dict({**base, **bad}, "x.yaml", ".")
    with pytest.raises(ScenarioError, match=r"exercised\.dag_order: expected a value >= 1"):
        scenario_from_dict({**base, "exercised": {"dag_order": 0}}, "x.yaml", ".")


def test_the_simulated_runner_heals_every_fault_it_undoes() -> None:
    from chaos.insim import run_scenario
    from chaos.scenario import load_scenario

    outcome = run_scenario(load_scenario("scenarios/worker_kill_storm.yaml"))
    fired = {e["fault_id"] for e in outcome.history if e["ev"] == "fault_fired"}
    healed = {e["fault_id"] for e in outcome.history if e["ev"] == "fault_healed"}
    assert len(fired) == 6 and fired == healed  # every kill restarted, so every one healed
    end = max(e["t"] for e in outcome.history)
    assert all(w.end < end for w in fault_windows(outcome.history))
    assert outcome.result.verdicts["history_complete"] == "pass"


def waited_for_an_evaluation_slot(delivered_first: bool = True) -> Run:
    """`b`'s retry delivered on time to a worker whose one evaluation slot is taken by
    evaluation `att-2`, its begin under way (delivered, not yet started): the wait names it
    `setting_up`; `delivered_first` False: `att-2` was never delivered there."""
    other = "att-2"
    run = Run()
    run.submit()
    run.submit(other)
    run.ok(A, "a")
    run.fail(A, "b", 1)
    run.retry(A, "b", 2, 300)
    run.ev("evaluation_parked", attempt_id=A)
    run.wait(0.3)
    if delivered_first:
        run.ev("delivered", attempt_id=other, kind="execute", reason="submit")
    run.wait(0.01)
    run.ev("delivered", attempt_id=A, kind="retry", rule_id="b", attempt=2)
    run.ev("slot_wait", attempt_id=A, slot="evaluation", kind="retry", held=[],
           setting_up=[other], slots=1)  # fmt: skip
    run.wait(0.2)
    run.ev("evaluation_started", attempt_id=other, plan="t", resumed=False, kind="execute")
    run.ev("evaluation_parked", attempt_id=other)
    run.ev("slot_granted", attempt_id=A, slot="evaluation")
    run.ev("evaluation_started", attempt_id=A, plan="t", resumed=True, kind="retry")
    run.ev("recovered", attempt_id=A, loaded=["a"], retrying={"b": 1}, failed=[], fresh=[])
    run.ok(A, "b", 2)
    run.ok(A, "c")
    run.finish(A, "completed")
    return run


def test_an_evaluation_slot_taken_by_one_being_set_up_is_proven_by_its_delivery() -> None:
    result = judged(waited_for_an_evaluation_slot(), "retry_delays_respected", time_scale=0.01)
    assert not [v for v in result.violations if "slot" in v.message], result.violations
    unproven = judged(
        waited_for_an_evaluation_slot(delivered_first=False),
        "retry_delays_respected",
        time_scale=0.01,
    )
    [message] = fails(unproven, "retry_delays_respected")
    assert "att-2, named being set up, was not delivered to that process" in message
