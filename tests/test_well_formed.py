"""`history_well_formed`: each engine event held to `chaos.checker.vocabulary`, on a whole
simulated history (which passes) and on that history with one thing wrong (which fails,
naming what)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from chaos.checker import CheckSpec, FinalState, check
from chaos.checker.vocabulary import EVENTS, MESSAGES, describe, fits
from chaos.insim import run_scenario
from chaos.scenario import load_scenario
from tests.test_chaos_runs import SCENARIOS

NAME = "history_well_formed"


@pytest.fixture(scope="module")
def history() -> list[dict[str, Any]]:
    """A whole history of the engine in the simulator: a blackholed broker, retries, leases
    renewed (29 kinds of event)."""
    return run_scenario(load_scenario(SCENARIOS / "amqp_blackhole.yaml")).history


def judge(events: list[dict[str, Any]], **spec: Any) -> tuple[str, int, list[str]]:
    result = check(events, FinalState(), CheckSpec(invariants=(NAME,), **spec))
    return result.verdicts[NAME], result.cases[NAME], [v.message for v in result.violations]


def first(events: list[dict], ev: str) -> dict:
    return next(e for e in events if e["ev"] == ev)


def test_a_whole_history_is_well_formed(history: list[dict]) -> None:
    verdict, cases, _ = judge(history)
    engine = [e for e in history if e["src"] != "runner"]
    received = [e for e in history if e["ev"] in MESSAGES]
    assert verdict == "pass" and cases == len(engine) + len(received) > 100
    assert {e["ev"] for e in engine} <= set(EVENTS) and received


def test_the_runners_own_events_are_not_judged(history: list[dict]) -> None:
    runner = [e for e in history if e["src"] == "runner" and e["ev"] not in MESSAGES]
    assert runner and judge(runner)[:2] == ("unknown", 0)


@pytest.mark.parametrize(
    ("ev", "edit", "expected"),
    [
        ("started_received", lambda e: e["body"].pop("plan"), "whose body has no `plan`"),
        ("started_received", lambda e: e["body"].update(resumed=None), "`resumed` is None"),
        ("completed_received", lambda e: e["body"].update(state="x"), "has a field `state`"),
        ("completed_received", lambda e: e.update(message_id=None), "with message id None"),
        ("delivered", lambda e: e.update(kind="retry", rule_id=None), "`rule_id`, `attempt`"),
        (
            "delivered",
            lambda e: e.update(ev="evaluation_abandoned", reason="worker stoping"),
            "`evaluation_abandoned`'s `reason` is 'worker stoping', expected matching",
        ),
    ],
)
def test_a_message_the_engine_published_is_judged_as_received(
    history: list[dict], ev: str, edit: Any, expected: str
) -> None:
    events = copy.deepcopy(history)
    edit(first(events, ev))
    verdict, _, messages = judge(events)
    assert verdict == "fail" and any(expected in m for m in messages), messages


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda e: e.update(ev="rule_begun"), "an event of unknown kind 'rule_begun'"),
        (lambda e: e.pop("attempt"), "`rule_started` without its field `attempt`"),
        (lambda e: e.update(attempt=None), "`rule_started`'s `attempt` is None, expected int"),
        (lambda e: e.update(attempt=True), "`rule_started`'s `attempt` is True, expected int"),
        (lambda e: e.update(attempts=1), "`rule_started` with a field `attempts` it does not have"),
        (lambda e: e.update(rerun="no"), "`rule_started`'s `rerun` is 'no', expected bool"),
    ],
)
def test_a_wrong_rule_started(history: list[dict], edit: Any, expected: str) -> None:
    events = copy.deepcopy(history)
    edit(first(events, "rule_started"))
    verdict, _, messages = judge(events)
    assert verdict == "fail" and len(messages) == 1 and expected in messages[0]


@pytest.mark.parametrize(
    ("ev", "field", "value", "expected"),
    [
        ("status_written", "status", "failed_attempt_0", "expected matching"),
        ("status_written", "status", "PERMANENTLY_FAILED", "expected matching"),
        ("evaluation_terminal", "status", "done", "one of cancelled, completed, failed, partial"),
        ("evaluation_started", "fence", "sim-w0-1", "expected matching"),
        ("rule_finished", "verdict", "ok", "one of fail, needs_review, pass"),
        ("delivered", "kind", "cancel", "one of execute, retry"),
        ("lease_renewed", "held", True, "one of 0, 1, 2"),
        ("delivered", "kind", ["retry"], "one of execute, retry"),
        ("status_written", "error", "", "'', expected one of"),
        ("rule_failed", "retryable", False, "`retryable` False for a"),
        ("status_written", "landed", False, "`landed` is False, expected one of True"),
        ("lease_renewed", "expires_ms", None, "`held` 1 and `expires_ms` None"),
        ("delivered", "published_ms", None, "`published_ms` is None, expected int"),
    ],
)
def test_a_value_the_protocol_does_not_allow(
    history: list[dict], ev: str, field: str, value: Any, expected: str
) -> None:
    events = copy.deepcopy(history)
    first(events, ev)[field] = value
    verdict, _, messages = judge(events)
    assert verdict == "fail" and any(expected in m for m in messages), messages


def test_an_optional_field_may_be_absent_but_not_wrong(history: list[dict]) -> None:
    events = copy.deepcopy(history)
    e = first(events, "rule_started")
    e["loop_lag_ms"] = 0.25  # live adds it to the events whose lateness is weighed
    assert judge(events)[0] == "pass"
    e["loop_lag_ms"] = "slow"
    assert judge(events)[0] == "fail"


def test_many_of_one_problem_are_shown_once_each_then_counted(history: list[dict]) -> None:
    events = copy.deepcopy(history)
    started = [e for e in events if e["ev"] == "rule_started"]
    for e in started:
        del e["execution"]
    _, _, messages = judge(events)
    assert len(messages) == 4 and messages[-1].startswith(f"and {len(started) - 3} more")


def test_specs_read_as_a_reader_writes_them() -> None:
    assert describe((int, None)) == "int or null"
    assert describe(frozenset({"b", "a", None})) == "one of a, b, null"
    assert fits(3, (int, float)) and not fits(True, (int, float)) and fits(0.5, (int, float))
    assert not fits(1, (float,)) and fits(None, frozenset({None, "x"}))


# --- what holds across events: executions counted, start markers written ------------------


def test_a_rerun_told_it_is_a_first_run_is_caught() -> None:
    history = run_scenario(load_scenario(SCENARIOS / "crash_after_ack.yaml")).history
    assert judge(history)[0] == "pass"
    events = copy.deepcopy(history)
    rerun = next(e for e in events if e["ev"] == "rule_started" and e["rerun"])
    rerun.update(execution=1, rerun=False)  # each field agrees with the other: only the count
    verdict, _, messages = judge(events)
    assert verdict == "fail" and len(messages) == 1
    assert "`rule_started` of execution 1, told to an earlier start of its attempt" in messages[0]


def test_a_restart_that_lost_writes_may_count_again() -> None:
    history = run_scenario(load_scenario(SCENARIOS / "crash_after_ack.yaml")).history
    events = copy.deepcopy(history)
    rerun = next(e for e in events if e["ev"] == "rule_started" and e["rerun"])
    rerun.update(execution=1, rerun=False)
    runner = next(e for e in events if e["src"] == "runner")
    lost = {**runner, "t": rerun["t"] - 1e-6, "ev": "service_restarted", "service": "redis"}
    events.insert(events.index(rerun), {**lost, "lost_writes": 3})
    for seq, e in enumerate(e for e in events if e["src"] == "runner"):  # the runner's own
        e["seq"] = seq + runner["seq"]
    assert judge(events)[0] == "pass"


def _marked(events: list[dict]) -> tuple[dict, dict]:
    """A delayed retry's `start_marked` and the first start it is followed by."""
    marked = first(events, "start_marked")
    start = next(
        e
        for e in events[events.index(marked) :]
        if e["ev"] == "rule_started"
        and (e["rule_id"], e["attempt"]) == (marked["rule_id"], marked["attempt"])
    )
    return marked, start


def test_a_delayed_retry_started_without_its_marker_is_caught(history: list[dict]) -> None:
    events = copy.deepcopy(history)
    marked, _ = _marked(events)
    others = (e["rule_id"] for e in events if e.get("rule_id") not in (None, marked["rule_id"]))
    marked["rule_id"] = next(others)  # a marker, but not its own
    verdict, _, messages = judge(events)
    assert verdict == "fail" and "with no write of its start marker before it" in messages[0]
    # a design whose server counts the executions (a workflow engine's) writes no marker
    assert judge(events, start_markers=False)[0] == "pass"


def test_a_copy_delivered_between_a_resumed_retrys_marker_and_its_start_is_no_gap() -> None:
    """A parked evaluation is begun again by its retry's delivery; a redelivered copy of
    that retry may be recorded between the marker's write and the start (the consumer
    records as it goes): the marker was written after the first delivery all the same.
    Seen live, broker_restart_holding_retries under CI's load."""
    history = run_scenario(load_scenario(SCENARIOS / "broker_restart_holding_retries.yaml"))
    events = copy.deepcopy(history.history)
    marked, start = _marked(events)
    key = (marked["rule_id"], marked["attempt"])
    mine = [e for e in events if e["src"] == marked["src"]]
    delivered = next(
        e for e in mine if e["ev"] == "delivered" and (e.get("rule_id"), e.get("attempt")) == key
    )
    begun = max(
        i for i, e in enumerate(mine[: mine.index(marked)]) if e["ev"] == "evaluation_started"
    )
    assert mine.index(delivered) < begun  # the retry's delivery began the evaluation again
    events.insert(events.index(start), {**delivered, "t": start["t"]})
    for seq, e in enumerate(e for e in events if e["src"] == marked["src"]):
        e["seq"] = seq + mine[0]["seq"]
    assert judge(events)[0] == "pass"
    others = (e["rule_id"] for e in events if e.get("rule_id") not in (None, key[0]))
    marked["rule_id"] = next(others)  # the same with a marker not its own: still caught
    verdict, _, messages = judge(events)
    assert verdict == "fail" and "with no write of its start marker before it" in messages[0]


def test_a_marker_write_longer_than_its_retry_was_there_is_caught(history: list[dict]) -> None:
    events = copy.deepcopy(history)
    marked, _ = _marked(events)
    marked["write_ms"] = 1000.0 * (marked["t"] - events[0]["t"]) + 10.0
    verdict, _, messages = judge(events)
    assert verdict == "fail" and "sent after the retry's delivery" in messages[0]


def test_a_marker_of_no_time_is_caught(history: list[dict]) -> None:
    events = copy.deepcopy(history)
    _marked(events)[0]["write_ms"] = 0.0
    verdict, _, messages = judge(events)
    assert verdict == "fail" and "a write to Redis takes time" in messages[0]


def test_a_marker_followed_by_another_start_is_caught(history: list[dict]) -> None:
    events = copy.deepcopy(history)
    marked, start = _marked(events)
    assert events[events.index(marked) + 1] is start
    start["try_no"] = 2
    verdict, _, messages = judge(events)
    assert verdict == "fail" and any("followed by try 2" in m for m in messages)


def test_a_write_sent_outside_its_session_is_caught(history: list[dict]) -> None:
    events = copy.deepcopy(history)
    first(events, "status_written")["sent_ms"] = 0  # before its process began the evaluation
    verdict, _, messages = judge(events)
    assert verdict == "fail" and "before its process began the evaluation" in messages[0]
    events = copy.deepcopy(history)
    late = first(events, "result_persisted")
    late["sent_ms"] = round(late["t"] * 1000) + 5  # after its reply was recorded
    verdict, _, messages = judge(events)
    assert verdict == "fail" and "after it was recorded" in messages[0]


def test_restores_are_recorded_on_their_side_of_the_final_write() -> None:
    history = run_scenario(load_scenario(SCENARIOS / "redis_data_loss.yaml")).history
    assert judge(history)[0] == "pass"
    restored = [e for e in history if e["ev"] == "results_restored"]
    assert restored
    events = copy.deepcopy(history)
    first(events, "results_restored")["ev"] = "final_state_restored"
    verdict, _, messages = judge(events)
    assert verdict == "fail" and "before its process's evaluation_terminal" in messages[0]
    events = copy.deepcopy(history)
    first(events, "results_restored")["rule_ids"] = []
    verdict, _, messages = judge(events)
    assert verdict == "fail" and "with nothing restored" in messages[0]


def test_the_quick_answer_agrees_with_the_field_by_field_one(history: list[dict]) -> None:
    """`WELL_FORMED` (the quick yes) says well formed exactly where `each_problem` finds
    nothing: on every event of the history, and on each with one field dropped, added, or
    given a value of each wrong type."""
    from chaos.checker.vocabulary import WELL_FORMED
    from chaos.checker.well_formed import each_problem

    wrong = (None, 0, 1.5, True, "x", "failed_attempt_2", [], {}, "1:w")
    judged = 0
    for e in history:
        if e["src"] == "runner":
            continue
        variants = [e, {**e, "extra": 1}]
        for key in e:
            variants.append({k: v for k, v in e.items() if k != key})
            variants += [{**e, key: value} for value in wrong]
        for v in variants:
            quick = WELL_FORMED.get(v["ev"]) if type(v.get("ev")) is str else None
            assert (quick is not None and quick(v)) == (each_problem(v) == []), v
            judged += 1
    assert judged > 10_000
