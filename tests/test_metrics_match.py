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


def test_a_scrape_shows_what_prometheus_own_counters_and_gauge_would() -> None:
    """The plain numbers, exposed by their collectors, read as `Counter`s and a `Gauge`
    moved the same way (their `_created` timestamps aside)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    from engine.metrics import COUNTERS

    ours, theirs = Metrics(), CollectorRegistry()
    made = {
        name: Counter(exposed, doc, labels, registry=theirs)
        for name, (exposed, doc, labels) in COUNTERS.items()
    }
    running = Gauge("engine_evaluations_running", "Evaluations in memory", registry=theirs)
    for metric, labels, amount in [
        ("tokens", (), 120),
        ("calls", (("outcome", "quota"),), 1),
        ("calls", (("outcome", "ok"),), 2),
        ("calls", (("outcome", "quota"),), 1),
        ("retries", (("level", "2"),), 1),
    ]:
        ours.count(metric, labels, amount)
        counter = made[metric].labels(*(v for _, v in labels)) if labels else made[metric]
        counter.inc(amount)
    ours.running.set(3)
    running.set(3)

    def scrape(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return [line for line in text.splitlines() if "_created" not in line]

    assert scrape(ours.registry) == scrape(theirs)


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
