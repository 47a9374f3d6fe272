"""`metrics_match_history`: the counters a stopping worker leaves held to its history."""

from __future__ import annotations

import copy

from chaos.checker import CheckSpec, FinalState, check
from chaos.checker.metrics_match_history import expected_totals
from chaos.insim import run_scenario
from chaos.scenario import load_scenario
from engine.metrics import Metrics
from tests.test_chaos_runs import SCENARIOS

NAME = "metrics_match_history"


def judge(events: list[dict]) -> tuple[str, int, list[str]]:
    result = check(events, FinalState(), CheckSpec(invariants=(NAME,)))
    return result.verdicts[NAME], result.cases[NAME], [v.message for v in result.violations]


def test_totals_name_counters_as_a_scrape_does() -> None:
    m = Metrics()
    m.count("tokens", amount=120)
    m.count("calls", labels=(("outcome", "quota"),))
    m.count("reruns", amount=0)
    assert m.totals() == {
        "engine_tokens_total": 120,
        'engine_agent_calls_total{outcome="quota"}': 1,
    }


def test_each_stopped_worker_is_judged_and_a_wrong_counter_named() -> None:
    history = run_scenario(load_scenario(SCENARIOS / "transient_llm_errors.yaml")).history
    verdict, cases, _ = judge(history)
    stops = [e for e in history if e["ev"] == "worker_stopped"]
    assert verdict == "pass" and cases >= sum(len(e["metrics"]) for e in stops) > 0
    events = copy.deepcopy(history)
    stop = next(e for e in events if e["ev"] == "worker_stopped" and e["metrics"])
    stop["metrics"]["engine_tokens_total"] += 7
    verdict, _, messages = judge(events)
    want = expected_totals([e for e in events if e["src"] == stop["src"]])["engine_tokens_total"]
    assert verdict == "fail"
    assert messages == [
        f"{stop['src']} stopped with engine_tokens_total {want + 7:g}, but its history "
        f"calls for {want:g}"
    ]


def test_a_killed_worker_is_not_judged() -> None:
    history = run_scenario(load_scenario(SCENARIOS / "crash_after_ack.yaml")).history
    crashed = {e["src"] for e in history if e["ev"] == "crash"}
    stopped = {e["src"] for e in history if e["ev"] == "worker_stopped"}
    assert crashed and not crashed & stopped
    assert judge([e for e in history if e["src"] in crashed])[:2] == ("unknown", 0)
