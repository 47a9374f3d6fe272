"""Scenario files: the full example loads with every value right, the defaults are the
documented ones, and every way a file can be wrong is one ScenarioError line naming the file
and the field."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chaos.scenario as scenario_module
from chaos.checker.records import COST_BUDGETS
from chaos.proxy.model import TOXIC_TYPES
from chaos.scenario import (
    INVARIANT_NAMES,
    RULELESS_FAILPOINTS,
    FailpointFault,
    LoadedScenario,
    PlannedFault,
    RunnerFault,
    Scenario,
    ScenarioError,
    fault_schedule,
    load_scenario,
    scenario_from_dict,
    schema_text,
    write_schema,
)
from chaos.scenario.schema import EngineSpec
from engine.failpoints import FAILPOINTS, FailpointError, parse_specs
from engine.plan import load_plan
from engine.policy import ENGINE_BOUNDS, MAX_SEED, RetryPolicy, check_engine_settings
from tests.helpers import containers

ROOT = Path(__file__).resolve().parents[1]
TINY = "plans/tiny.yaml"
CODE_REVIEW = "plans/code_review.yaml"
FULL = ROOT / "scenarios" / "examples" / "valid_full.yaml"


def minimal(**extra: Any) -> dict[str, Any]:
    """The smallest valid scenario (plan paths absolute, so the cwd does not matter)."""
    return {"name": "t", "plans": [{"path": str(ROOT / TINY)}], **extra}


def load(data: dict[str, Any], source: str = "s.yaml") -> LoadedScenario:
    return scenario_from_dict(data, source=source, base_dir=ROOT)


def _assert_one_line(err: ScenarioError, source: str | Path) -> str:
    msg = str(err)
    assert "\n" not in msg and len(msg.splitlines()) == 1, f"more than one line: {msg!r}"
    assert msg.startswith(f"{source}: "), msg
    chained = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    assert chained is None, "no traceback chain for the CLI"
    assert len(msg) - len(str(source)) < 500, f"values are shortened: {msg!r}"
    return msg


# --- the full example and the defaults --------------------------------------------------------


def test_full_example_loads_with_every_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # its second plan is found from the cwd, not next to the file
    loaded = load_scenario(FULL)
    s = loaded.spec
    assert loaded.source == str(FULL) and loaded.path == FULL
    assert (s.name, s.seed) == ("valid_full", 42)
    assert s.description.startswith("Every field")
    assert [(p.path, p.evaluations) for p in s.plans] == [
        ("../../plans/tiny.yaml", 2),
        (CODE_REVIEW, 1),
    ]
    assert [(plan.id, n) for plan, n in loaded.plans] == [("tiny", 2), ("code_review", 1)]
    assert loaded.plans[0][0] == load_plan(ROOT / TINY)
    assert loaded.plan_paths[0].resolve() == (ROOT / TINY).resolve()
    assert [(x.index, x.plan_index, x.number, x.plan.id) for x in loaded.submissions] == [
        (0, 0, 0, "tiny"),
        (1, 0, 1, "tiny"),
        (2, 1, 0, "code_review"),
    ]
    # the agent: its own fields, and the scenario seed because it sets none
    assert loaded.agent.seed == 42
    assert loaded.agent.error_rate == 0.1
    assert loaded.agent.latency_ms.kind == "uniform" and loaded.agent.latency_ms.high_ms == 20
    assert loaded.agent.fail_rules == {"compiles": 1}
    assert loaded.agent.always_fail_rules == frozenset({"license_header"})
    assert loaded.retry_policy == RetryPolicy(1, 4, (100, 200), 0.0, seed=42)
    assert s.retry_policy() == loaded.retry_policy
    assert s.time_scale == 0.01
    assert s.engine.model_dump() == {
        "max_evaluations": 4,
        "max_parallel": 2,
        "heartbeat_ms": 50,
        "stale_ms": 300,
        "sweep_ms": 50,
        "retry_grace_ms": 1000,
        "sweeper": False,
        "connect_timeout_s": 3.0,
        "read_timeout_s": 10.0,
        "wait_replicas": 0,
        "wait_timeout_ms": 1000,
        "amqp_heartbeat_s": 5,
    }
    config = s.engine_config(namespace="ns-")
    assert (config.namespace, config.time_scale, config.stale_ms) == ("ns-", 0.01, 300)
    assert config.policy == loaded.retry_policy and config.sweeper is False
    assert (s.workers, s.restart_crashed_workers, s.restart_delay_s, s.deadline_s) == (
        3,
        False,
        0.5,
        60.0,
    )
    assert s.invariants == ("no_completed_rerun", "all_terminal", "single_final_result")
    assert s.budgets.model_dump() == {
        "max_duplicated_tokens": 5000,
        "max_reruns": 3,
        "max_retry_latency_s": 900.0,
        "max_duplicated_ratio": None,
        "max_duplicated_usd": None,
        "price_per_1k_tokens": 0.01,
        "max_p99_retry_l1_s": None,
        "max_p99_retry_l2_s": None,
        "max_p99_retry_l3_s": None,
        "max_p99_recovery_s": None,
        "max_regression_ratio": None,
    }
    fp, fp_all, kill, restart, redis, cancel, toxic, cut = s.faults
    assert isinstance(fp, FailpointFault) and isinstance(fp_all, FailpointFault)
    assert (fp.failpoint, fp.action, fp.stall_ms, fp.hit, fp.times) == (
        "rule_after_call_before_write",
        "stall",
        250,
        2,
        0,
    )
    assert (fp.rule, fp.evaluation, fp.workers, fp.name) == (
        "unit_tests",
        1,
        (0, 2),
        "write_window_stall",
    )
    assert (fp_all.failpoint, fp_all.action, fp_all.workers, fp_all.hit) == (
        "after_ack",
        "crash",
        "all",
        1,
    )
    assert all(isinstance(f, RunnerFault) for f in (kill, restart, redis, cancel))
    assert (kill.at_s, kill.action, kill.target, kill.restart_after_s, kill.count) == (
        1.5,
        "kill_worker",
        2,
        None,
        3,
    )
    assert (kill.every_s, kill.name, kill.trigger) == (2.0, "kill_late_worker", "at_s")
    assert (restart.random_at_s, restart.target, restart.restart_after_s) == (
        (0.5, 5.0),
        "random",
        0.5,
    )
    assert redis.after is not None and redis.trigger == "after"
    assert (redis.after.event, redis.after.count, redis.after.rule) == (
        "rule_finished",
        3,
        "compiles",
    )
    assert (redis.action, redis.restart_after_s, cancel.action, cancel.target) == (
        "kill_redis",
        1.0,
        "cancel",
        2,
    )
    assert isinstance(toxic, RunnerFault) and isinstance(cut, RunnerFault)
    assert (toxic.action, toxic.link, toxic.workers, toxic.for_s, toxic.trigger) == (
        "add_toxic",
        "redis",
        (1,),
        2.0,
        "after",
    )
    assert toxic.toxic is not None and toxic.toxic.wire() == {
        "attributes": {"latency": 100, "jitter": 0},
        "name": "latency_upstream",
        "type": "latency",
        "stream": "upstream",
        "toxicity": 0.5,
    }
    assert (cut.action, cut.link, cut.workers, cut.for_s, cut.toxic) == (
        "cut_link",
        "broker",
        "all",
        None,
        None,
    )
    assert [i for i, _ in s.failpoint_faults] == [0, 1]
    assert [i for i, _ in s.runner_faults] == [2, 3, 4, 5, 6, 7]


def test_defaults_are_the_documented_ones() -> None:
    loaded = load(minimal())
    s = loaded.spec
    assert (s.description, s.seed, s.time_scale, s.workers) == ("", 0, 0.001, 1)
    assert [(p.path, p.evaluations) for p in s.plans] == [(str(ROOT / TINY), 1)]
    assert s.agent == {} and loaded.agent.seed == 0
    assert s.retry.model_dump() == {
        "immediate_retries": 2,
        "max_attempts": 3,
        "tiers_ms": (30_000, 120_000, 600_000),
        "jitter": 0.1,
        "jitter_buckets": 4,
    }
    assert loaded.retry_policy == RetryPolicy(seed=0)
    assert s.engine.model_dump() == {
        "max_evaluations": 8,
        "max_parallel": 4,
        "heartbeat_ms": 100,
        "stale_ms": 600,
        "sweep_ms": 100,
        "retry_grace_ms": None,
        "sweeper": True,
        "connect_timeout_s": 5.0,
        "read_timeout_s": 30.0,
        "wait_replicas": 0,
        "wait_timeout_ms": 1000,
        "amqp_heartbeat_s": None,
    }
    assert (s.restart_crashed_workers, s.restart_delay_s, s.deadline_s) == (True, 0.2, 30.0)
    assert s.faults == () and s.invariants == INVARIANT_NAMES
    limits = s.budgets.model_dump()
    assert limits.pop("price_per_1k_tokens") == 0.01
    assert limits == dict.fromkeys(
        [
            "max_duplicated_tokens",
            "max_reruns",
            "max_retry_latency_s",
            *COST_BUDGETS,
            "max_regression_ratio",
        ]
    )
    fp = load(minimal(faults=[{"failpoint": "after_ack"}])).spec.faults[0]
    assert isinstance(fp, FailpointFault)
    assert (fp.action, fp.stall_ms, fp.hit, fp.times, fp.rule, fp.evaluation, fp.workers) == (
        "crash",
        None,
        1,
        1,
        None,
        None,
        (0,),
    )
    rf = load(minimal(faults=[{"at_s": 1, "action": "kill_worker"}])).spec.faults[0]
    assert isinstance(rf, RunnerFault)
    assert (rf.target, rf.restart_after_s, rf.count, rf.every_s, rf.name) == (0, 0.5, 1, None, None)
    after = load(minimal(faults=[{"after": {"event": "acked"}, "action": "kill_redis"}]))
    assert after.spec.faults[0].after.count == 1  # type: ignore[union-attr]


def test_agent_seed_defaults_to_the_scenario_seed_unless_set() -> None:
    assert load(minimal(seed=9)).agent.seed == 9
    assert load(minimal(seed=9, agent={"seed": 3})).agent.seed == 3
    assert load(minimal(seed=9)).retry_policy.seed == 9


def test_the_scenario_is_frozen() -> None:
    s = load(minimal()).spec
    with pytest.raises(ValueError, match="frozen"):
        s.seed = 3  # type: ignore[misc]
    assert isinstance(s.plans, tuple) and isinstance(s.invariants, tuple)


def test_plan_shorthand(tmp_path: Path) -> None:
    short = load({"name": "t", "plan": TINY, "evaluations": 3})
    assert [(p.path, p.evaluations) for p in short.spec.plans] == [(TINY, 3)]
    assert [(p.id, n) for p, n in short.plans] == [("tiny", 3)]
    assert short.spec == load({"name": "t", "plans": [{"path": TINY, "evaluations": 3}]}).spec
    assert load({"name": "t", "plan": TINY}).spec.plans[0].evaluations == 1
    # from a file: the plan is next to the scenario
    (tmp_path / "p.yaml").write_text((ROOT / TINY).read_text())
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nplan: p.yaml\nevaluations: 2\n")
    assert load_scenario(path).plan_paths == (tmp_path / "p.yaml",)
    # and the round trip through model_dump keeps the normalised form
    assert Scenario.model_validate(short.spec.model_dump()) == short.spec


def test_plan_found_next_to_the_scenario_before_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans" / "tiny.yaml").write_text(
        (ROOT / TINY).read_text().replace("plan: tiny", "plan: local_tiny")
    )
    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\nplan: {TINY}\n")
    monkeypatch.chdir(ROOT)  # plans/tiny.yaml exists here too
    assert load_scenario(path).plans[0][0].id == "local_tiny"
    (tmp_path / "plans" / "tiny.yaml").unlink()
    assert load_scenario(path).plans[0][0].id == "tiny"  # then the cwd


def test_module_docstring_example_loads() -> None:
    doc = scenario_module.__doc__ or ""
    start = doc.index("    name: crash_after_ack")
    block = doc[start : doc.index("\n\n", start)]
    text = "\n".join(line[4:] for line in block.splitlines())
    data = yaml.safe_load(text)
    loaded = load(data)
    assert loaded.spec.name == "crash_after_ack" and loaded.agent.seed == 7
    assert len(loaded.spec.faults) == 2


# --- one ScenarioError line for every way a file can be wrong ---------------------------------

BASE: dict[str, Any] = {
    "name": "base",
    "seed": 1,
    "plans": [{"path": TINY, "evaluations": 2}, {"path": CODE_REVIEW}],
    "workers": 2,
    "faults": [
        {"failpoint": "rule_before_call", "rule": "compiles"},
        {"at_s": 1, "action": "kill_worker", "target": 1},
        {"random_at_s": [0, 2], "action": "cancel", "target": "random"},
    ],
}

Mutation = Callable[[dict[str, Any]], None]


def _fault(i: int, **values: Any) -> Mutation:
    return lambda d: d["faults"][i].update(values)


def _net(**values: Any) -> Mutation:
    """Fault 1 replaced by a network fault at 1 s with these fields."""
    return lambda d: d["faults"].__setitem__(1, {"at_s": 1, **values})


def _drop(i: int, key: str) -> Mutation:
    return lambda d: d["faults"][i].pop(key)


BROKEN: list[tuple[str, Mutation, str]] = [
    # pydantic errors: missing, unknown, type, literal, bounds, pattern
    ("missing_name", lambda d: d.pop("name"), "name: required field is missing"),
    ("bad_name", lambda d: d.update(name="has space"), "name: expected an id"),
    (
        "unknown_field",
        lambda d: d.update(retires=3),
        "retires: unknown field (did you mean retry?)",
    ),
    ("unknown_nested", lambda d: d.update(engine={"stale": 1}), "engine.stale: unknown field"),
    (
        "seed_not_int",
        lambda d: d.update(seed="7"),
        "seed: expected an integer within [0, 9223372036854775807]; got '7'",
    ),
    ("bool_is_not_int", lambda d: d.update(workers=True), "workers: expected an integer; got true"),
    ("float_not_int", lambda d: d.update(workers=1.5), "workers: expected an integer; got 1.5"),
    ("too_many_workers", lambda d: d.update(workers=17), "workers: expected a value <= 16; got 17"),
    ("no_workers", lambda d: d.update(workers=0), "workers: expected a value >= 1; got 0"),
    (
        "time_scale_zero",
        lambda d: d.update(time_scale=0),
        "time_scale: expected a number within (0, 1]; got 0",
    ),
    (
        "time_scale_big",
        lambda d: d.update(time_scale=2),
        "time_scale: expected a number within (0, 1]; got 2",
    ),
    ("deadline_inf", lambda d: d.update(deadline_s=float("inf")), "deadline_s: expected a finite"),
    (
        "deadline_null",
        lambda d: d.update(deadline_s=None),
        "deadline_s: expected a number; got null",
    ),
    (
        "restart_delay",
        lambda d: d.update(restart_delay_s=-1),
        "restart_delay_s: expected a value >= 0",
    ),
    ("retry_not_mapping", lambda d: d.update(retry=[1]), "retry: expected a mapping; got [1]"),
    (
        "tiers_empty",
        lambda d: d.update(retry={"tiers_ms": []}),
        "retry.tiers_ms: expected 1 to 16 delays; got ()",
    ),
    (
        "tiers_negative",
        lambda d: d.update(retry={"tiers_ms": [5, -1]}),
        "retry.tiers_ms[1]: expected an integer within [1, 86400000]; got -1",
    ),
    (
        "tiers_set",
        lambda d: d.update(retry={"tiers_ms": {5}}),
        "retry.tiers_ms: expected 1 to 16 delays; got {5}",
    ),
    (
        "jitter",
        lambda d: d.update(retry={"jitter": 1.5}),
        "retry.jitter: expected a number within [0, 1]; got 1.5",
    ),
    (
        "max_attempts",
        lambda d: d.update(retry={"max_attempts": 0}),
        "retry.max_attempts: expected an integer within [1, 20]; got 0",
    ),
    (
        "immediate",
        lambda d: d.update(retry={"immediate_retries": -1}),
        "retry.immediate_retries: expected an integer within [0, 20]; got -1",
    ),
    (
        "heartbeat",
        lambda d: d.update(engine={"heartbeat_ms": 5}),
        "engine.heartbeat_ms: expected an integer within [10, 604800000]; got 5",
    ),
    (
        "stale_before_heartbeat",
        lambda d: d.update(engine={"heartbeat_ms": 600, "stale_ms": 600}),
        "engine.stale_ms: expected more than heartbeat_ms (600); got 600",
    ),
    (
        "sweeper_string",
        lambda d: d.update(engine={"sweeper": "no"}),
        "engine.sweeper: expected true or false; got 'no'",
    ),
    (
        "budget",
        lambda d: d.update(budgets={"max_reruns": -1}),
        "budgets.max_reruns: expected a value >= 0",
    ),
    (
        "budget_latency",
        lambda d: d.update(budgets={"max_retry_latency_s": 0}),
        "budgets.max_retry_latency_s: expected a value > 0",
    ),
    (
        "budget_unknown",
        lambda d: d.update(budgets={"max_rerun": 1}),
        "budgets.max_rerun: unknown field (did you mean max_reruns?)",
    ),
    # plans
    (
        "plans_missing",
        lambda d: d.pop("plans"),
        "plans: required field is missing (or the plan shorthand)",
    ),
    ("plans_empty", lambda d: d.update(plans=[]), "plans: expected at least 1 item(s); got 0"),
    (
        "plans_not_list",
        lambda d: d.update(plans=TINY),
        "plans: expected a list; got 'plans/tiny.yaml'",
    ),
    (
        "plan_path_missing",
        lambda d: d["plans"][1].pop("path"),
        "plans[1].path: required field is missing",
    ),
    (
        "plan_evaluations",
        lambda d: d["plans"][0].update(evaluations=0),
        "plans[0].evaluations: expected a value >= 1; got 0",
    ),
    (
        "plan_evaluations_cap",
        lambda d: d["plans"][0].update(evaluations=10**6),
        "plans[0].evaluations: expected a value <= 10000",
    ),
    (
        "plan_extra",
        lambda d: d["plans"][0].update(count=3),
        "plans[0].count: unknown field; expected one of path, evaluations",
    ),
    (
        "plan_not_found",
        lambda d: d["plans"][1].update(path="plans/nope.yaml"),
        "plans[1].path: no plan file 'plans/nope.yaml'",
    ),
    (
        "plan_and_plans",
        lambda d: d.update(plan=TINY),
        "plan: give either plan (with evaluations) or plans, not both",
    ),
    ("evaluations_alone", lambda d: d.update(evaluations=2), "evaluations: give either plan"),
    (
        "shorthand_evaluations",
        lambda d: (d.pop("plans"), d.update(plan=TINY, evaluations=0)),
        "evaluations: expected a value >= 1; got 0",
    ),
    (
        "shorthand_not_string",
        lambda d: (d.pop("plans"), d.update(plan=3)),
        "plan: expected a string; got 3",
    ),
    (
        "shorthand_only_evaluations",
        lambda d: (d.pop("plans"), d.update(evaluations=2)),
        "evaluations: only with the plan shorthand",
    ),
    (
        "shorthand_not_found",
        lambda d: (d.pop("plans"), d.update(plan="x.yaml")),
        "plan: no plan file 'x.yaml'",
    ),
    # agent
    ("agent_not_mapping", lambda d: d.update(agent=[1]), "agent: expected a mapping; got [1]"),
    (
        "agent_rate",
        lambda d: d.update(agent={"error_rate": 2}),
        "agent.error_rate: must be a number within [0, 1]",
    ),
    ("agent_unknown", lambda d: d.update(agent={"errors": 1}), "agent.errors: unknown field"),
    (
        "agent_latency",
        lambda d: d.update(agent={"latency_ms": {"kind": "gamma"}}),
        "agent.latency_ms.kind:",
    ),
    # an int too large for a float: the engine's own check may name the field or not
    ("agent_huge_latency", lambda d: d.update(agent={"latency_ms": 10**400}), "agent"),
    (
        "agent_fail_rule",
        lambda d: d.update(agent={"fail_rules": {"compile": 2}}),
        "agent.fail_rules.compile: no rule 'compile' in any plan of the scenario; "
        "did you mean 'compiles'?",
    ),
    (
        "agent_always_fail",
        lambda d: d.update(agent={"always_fail_rules": ["nope"]}),
        "agent.always_fail_rules: no rule 'nope'",
    ),
    # invariants
    (
        "invariant_unknown",
        lambda d: d.update(invariants=["all_terminal", "no_rerun"]),
        f"invariants[1]: expected one of {len(INVARIANT_NAMES)} names: "
        + ", ".join(INVARIANT_NAMES[:3])
        + ", ...; got 'no_rerun' (did you mean 'no_completed_rerun'?)",
    ),
    (
        "invariant_twice",
        lambda d: d.update(invariants=["all_terminal", "all_terminal"]),
        "invariants[1]: all_terminal is listed twice",
    ),
    (
        "invariants_string",
        lambda d: d.update(invariants="all_terminal"),
        "invariants: expected a list",
    ),
    # failpoint faults
    (
        "failpoint_unknown",
        _fault(0, failpoint="after_everything"),
        "faults[0].failpoint: expected one of on_delivery, before_ack",
    ),
    (
        "failpoint_typo",
        _fault(0, failpoint="rule_afer_write"),
        "faults[0].failpoint: expected one of " + ", ".join(FAILPOINTS) + "; got "
        "'rule_afer_write' (did you mean 'rule_after_write'?)",
    ),
    (
        "failpoint_action",
        _fault(0, action="explode"),
        "faults[0].action: expected one of crash, raise, stall, freeze; got 'explode'",
    ),
    (
        "stall_without_ms",
        _fault(0, action="stall"),
        "faults[0].stall_ms: required field is missing (action is stall)",
    ),
    ("stall_ms_with_crash", _fault(0, stall_ms=5), "faults[0].stall_ms: only with action stall"),
    (
        "until_with_freeze",
        _fault(0, action="freeze", stall_ms=5, until="service_paused"),
        "faults[0].until: only with action stall (a stall ends on it); action is freeze",
    ),
    (
        "until_not_an_event",
        _fault(0, action="stall", stall_ms=5, until="Service Paused"),
        "faults[0].until: expected",
    ),
    (
        "stall_ms_zero",
        _fault(0, action="stall", stall_ms=0),
        "faults[0].stall_ms: expected a value >= 1",
    ),
    ("hit_zero", _fault(0, hit=0), "faults[0].hit: expected a value >= 1; got 0"),
    ("times_negative", _fault(0, times=-1), "faults[0].times: expected a value >= 0"),
    (
        "fp_worker_index",
        _fault(0, workers=[0, 2]),
        "faults[0].workers[1]: expected an index below 2 (the scenario has 2 workers); got 2",
    ),
    (
        "fp_workers_word",
        _fault(0, workers="some"),
        "faults[0].workers: expected 'all' or a non-empty list of worker indices; got 'some'",
    ),
    (
        "fp_workers_empty",
        _fault(0, workers=[]),
        "faults[0].workers: expected 'all' or a non-empty list",
    ),
    (
        "fp_workers_negative",
        _fault(0, workers=[-1]),
        "faults[0].workers[0]: expected a worker index >= 0; got -1",
    ),
    (
        "fp_workers_twice",
        _fault(0, workers=[1, 1]),
        "faults[0].workers[1]: worker 1 is listed twice",
    ),
    (
        "fp_evaluation",
        _fault(0, evaluation=3),
        "faults[0].evaluation: expected an index below 3 (the scenario has 3 evaluations)",
    ),
    (
        "fp_rule_unknown",
        _fault(0, rule="compile"),
        "faults[0].rule: no rule 'compile' in any plan of the scenario; did you mean 'compiles'?",
    ),
    (
        "fp_rule_not_in_its_plan",
        _fault(0, rule="license_header", evaluation=1),
        "faults[0].rule: no rule 'license_header' in plan tiny",
    ),
    (
        "fp_rule_on_ruleless",
        _fault(0, failpoint="after_ack"),
        "faults[0].rule: failpoint after_ack is not hit for a rule",
    ),
    (
        "fp_unknown_field",
        _fault(0, at_s=1),
        "faults[0].at_s: unknown field; expected one of failpoint, action",
    ),
    (
        "fp_duplicate_name",
        lambda d: (_fault(0, name="x")(d), _fault(1, name="x")(d)),
        "faults[1].name: duplicate fault name 'x' (faults[0])",
    ),
    # runner faults
    (
        "fault_not_mapping",
        lambda d: d["faults"].append("kill"),
        "faults[3]: expected a mapping; got 'kill'",
    ),
    (
        "runner_action",
        _fault(1, action="explode"),
        "faults[1].action: expected one of kill_worker, restart_worker, pause_worker, kill_redis, "
        "pause_redis, kill_sentinel, kill_broker, pause_broker, stop_redis, stop_broker, "
        "cancel, resume, add_toxic, update_toxic, remove_toxic, cut_link, publish_poison, "
        "kill_service, stop_service, pause_service, restart_service; got 'explode'",
    ),
    ("runner_no_action", _drop(1, "action"), "faults[1].action: required field is missing"),
    # network faults: the link, the toxic (Toxiproxy's fields), which workers, for how long
    (
        "toxic_without_link",
        _net(action="add_toxic", toxic={"type": "latency"}),
        "faults[1].link: required field is missing (action is add_toxic)",
    ),
    (
        "link_on_a_kill",
        _fault(1, link="redis"),
        "faults[1].link: only with a network action (add_toxic, update_toxic, remove_toxic, "
        "cut_link); action is kill_worker",
    ),
    (
        "unknown_link",
        _net(action="cut_link", link="mysql"),
        "faults[1].link: expected one of redis, broker, replication, postgres, temporal; "
        "got 'mysql'",
    ),
    (
        "toxic_missing",
        _net(action="add_toxic", link="redis"),
        "faults[1].toxic: required field is missing (action is add_toxic)",
    ),
    (
        "unknown_toxic_type",
        _net(action="add_toxic", link="redis", toxic={"type": "lag"}),
        "faults[1].toxic.type: expected one of latency, bandwidth, slow_close, timeout, "
        "reset_peer, slicer, limit_data; got 'lag'",
    ),
    (
        "toxic_attribute_type",
        _net(
            action="add_toxic",
            link="redis",
            toxic={"type": "latency", "attributes": {"latency": "5"}},
        ),
        "faults[1].toxic.attributes.latency: expected an integer; got '5'",
    ),
    (
        "toxic_attribute_of_another_type",
        _net(
            action="add_toxic", link="redis", toxic={"type": "latency", "attributes": {"rate": 5}}
        ),
        "faults[1].toxic.attributes.rate: unknown attribute for a latency toxic; expected one of "
        "latency, jitter",
    ),
    (
        "toxicity_above_one",
        _net(action="add_toxic", link="redis", toxic={"type": "latency", "toxicity": 2}),
        "faults[1].toxic.toxicity: expected a value <= 1; got 2",
    ),
    (
        "for_s_on_an_update",
        _net(action="update_toxic", link="redis", toxic={"type": "latency"}, for_s=1),
        "faults[1].for_s: only with add_toxic and cut_link; action is update_toxic",
    ),
    (
        "link_of_a_missing_worker",
        _net(action="cut_link", link="redis", workers=[7]),
        "faults[1].workers[0]: expected an index below 2 (the scenario has 2 workers); got 7",
    ),
    (
        "restart_after_s_on_a_cut",
        _net(action="cut_link", link="redis", restart_after_s=1),
        "faults[1].restart_after_s: not with a network action (use for_s); action is cut_link",
    ),
    (
        "wait_replicas_without_sentinel",
        lambda d: d.update(engine={"wait_replicas": 1}),
        "engine.wait_replicas: only with redis.topology sentinel",
    ),
    (
        "sentinel_losing_writes_by_count",
        lambda d: d.update(redis={"topology": "sentinel", "lose_last_writes": 2}),
        "redis.lose_last_writes: only with topology single",
    ),
    (
        "min_replicas_without_sentinel",
        lambda d: d.update(redis={"min_replicas_to_write": 1}),
        "redis.min_replicas_to_write: only with topology sentinel",
    ),
    (
        "min_replicas_two",
        lambda d: d.update(redis={"topology": "sentinel", "min_replicas_to_write": 2}),
        "redis.min_replicas_to_write: expected a value <= 1; got 2",
    ),
    (
        "kill_sentinel_without_sentinel",
        lambda d: d["faults"].__setitem__(1, {"at_s": 1, "action": "kill_sentinel"}),
        "faults[1].action: kill_sentinel only with redis.topology sentinel",
    ),
    (
        "kill_sentinel_fourth",
        lambda d: (
            d.update(redis={"topology": "sentinel"})
            or d["faults"].__setitem__(1, {"at_s": 1, "action": "kill_sentinel", "target": 3})
        ),
        "faults[1].target: expected an index below 3 (the scenario has 3 sentinels)",
    ),
    (
        "pause_redis_without_pause_s",
        lambda d: d["faults"].__setitem__(1, {"at_s": 1, "action": "pause_redis"}),
        "faults[1].pause_s: required field is missing (action is pause_redis)",
    ),
    (
        "pause_redis_restarted",
        lambda d: d["faults"].__setitem__(
            1, {"at_s": 1, "action": "pause_redis", "pause_s": 2, "restart_after_s": 1}
        ),
        "faults[1].restart_after_s: not with pause_redis (pause_s says when it resumes)",
    ),
    (
        "unknown_topology",
        lambda d: d.update(redis={"topology": "cluster"}),
        "redis.topology: expected one of single, sentinel; got 'cluster'",
    ),
    (
        "redis_link_behind_sentinel",
        lambda d: (
            d.update(redis={"topology": "sentinel"})
            or d["faults"].__setitem__(1, {"at_s": 1, "action": "cut_link", "link": "redis"})
        ),
        "faults[1].link: redis only with redis.topology single",
    ),
    (
        "toxic_on_a_cut",
        _net(action="cut_link", link="broker", toxic={"type": "latency"}),
        "faults[1].toxic: only with add_toxic, update_toxic, remove_toxic; action is cut_link",
    ),
    (
        "runner_no_trigger",
        _drop(1, "at_s"),
        "faults[1]: expected exactly one trigger (at_s, random_at_s or after); got none",
    ),
    (
        "runner_two_triggers",
        _fault(1, after={"event": "acked"}),
        "faults[1]: expected exactly one trigger (at_s, random_at_s or after); got at_s and after",
    ),
    (
        "runner_target",
        _fault(1, target=2),
        "faults[1].target: expected an index below 2 (the scenario has 2 workers); got 2",
    ),
    (
        "runner_target_word",
        _fault(1, target="any"),
        "faults[1].target: expected an index >= 0 or 'random'; got 'any'",
    ),
    (
        "runner_target_negative",
        _fault(1, target=-1),
        "faults[1].target: expected an index >= 0 or 'random'; got -1",
    ),
    (
        "cancel_target",
        _fault(2, target=3),
        "faults[2].target: expected an index below 3 (the scenario has 3 evaluations)",
    ),
    (
        "target_on_redis",
        _fault(1, action="kill_redis"),
        "faults[1].target: only for kill_worker, restart_worker, pause_worker, cancel, resume and "
        "kill_sentinel",
    ),
    (
        "window_reversed",
        _fault(2, random_at_s=[3, 1]),
        "faults[2].random_at_s: expected 0 <= lo <= hi; got [3, 1]",
    ),
    (
        "window_huge",
        _fault(2, random_at_s=[0, 10**400]),
        "faults[2].random_at_s: expected [lo, hi], two numbers of seconds; got [0, 1000",
    ),
    (
        "window_shape",
        _fault(2, random_at_s=[1]),
        "faults[2].random_at_s: expected [lo, hi], two numbers of seconds; got [1]",
    ),
    (
        "pause_reversed",
        _fault(1, action="pause_worker", pause_s=[0.5, 0.1]),
        "faults[1].pause_s: expected 0 <= lo <= hi; got [0.5, 0.1]",
    ),
    (
        "pause_word",
        _fault(1, action="pause_worker", pause_s="long"),
        "faults[1].pause_s: expected a number of seconds, or [lo, hi] to draw it from the seed; "
        "got 'long'",
    ),
    (
        "window_after_deadline",
        _fault(2, random_at_s=[1, 31]),
        "faults[2].random_at_s: expected the fault to fire before deadline_s (30 s); "
        "its last time is 31 s",
    ),
    ("at_s_negative", _fault(1, at_s=-1), "faults[1].at_s: expected a value >= 0; got -1"),
    (
        "at_s_after_deadline",
        _fault(1, at_s=30),
        "faults[1].at_s: expected the fault to fire before deadline_s (30 s)",
    ),
    (
        "repeats_after_deadline",
        _fault(1, count=4, every_s=10),
        "faults[1].at_s: expected the fault to fire before deadline_s (30 s); "
        "its last time is 31 s",
    ),
    ("count_zero", _fault(1, count=0), "faults[1].count: expected a value >= 1; got 0"),
    ("count_big", _fault(1, count=101), "faults[1].count: expected a value <= 100; got 101"),
    (
        "every_missing",
        _fault(1, count=2),
        "faults[1].every_s: required field is missing (count is 2)",
    ),
    ("every_with_random", _fault(2, every_s=1), "faults[2].every_s: not with random_at_s"),
    ("every_zero", _fault(1, every_s=0), "faults[1].every_s: expected a value > 0"),
    (
        "restart_after",
        _fault(1, restart_after_s=-1),
        "faults[1].restart_after_s: expected a value >= 0",
    ),
    (
        "null_trigger",
        _fault(1, at_s=None),
        "faults[1]: expected exactly one trigger (at_s, random_at_s or after); got none",
    ),
    (
        "after_no_event",
        lambda d: (_drop(1, "at_s")(d), _fault(1, after={"count": 2})(d)),
        "faults[1].after.event: required field is missing",
    ),
    (
        "after_bad_event",
        lambda d: (_drop(1, "at_s")(d), _fault(1, after={"event": "Rule Finished"})(d)),
        "faults[1].after.event: expected an event name",
    ),
    (
        "after_unknown_field",
        lambda d: (_drop(1, "at_s")(d), _fault(1, after={"event": "acked", "n": 2})(d)),
        "faults[1].after.n: unknown field; expected one of event, count, rule",
    ),
    (
        "after_rule",
        lambda d: (_drop(1, "at_s")(d), _fault(1, after={"event": "acked", "rule": "x"})(d)),
        "faults[1].after.rule: no rule 'x' in any plan",
    ),
    (
        "runner_unknown_field",
        _fault(1, hit=2),
        "faults[1].hit: unknown field; expected one of at_s, random_at_s, after, action",
    ),
]


@pytest.mark.parametrize(("name", "mutate", "expected"), BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_scenario_is_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, mutate: Mutation, expected: str
) -> None:
    monkeypatch.chdir(ROOT)
    data = copy.deepcopy(BASE)
    load(data)  # the base is valid: the mutation is what breaks it
    mutate(data)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    msg = _assert_one_line(info.value, path)
    assert msg.startswith(f"{path}: {expected}"), f"{msg!r} does not start with {expected!r}"
    # the same from a dict, with any source name
    with pytest.raises(ScenarioError) as again:
        scenario_from_dict(data, source="from-dict", base_dir=tmp_path)
    assert str(again.value) == msg.replace(str(path), "from-dict", 1)


def test_broken_plan_names_the_field_and_the_plan_error(tmp_path: Path) -> None:
    (tmp_path / "bad_plan.yaml").write_text("plan: p\npasses: []\n")
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nplans:\n  - path: bad_plan.yaml\n")
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    msg = _assert_one_line(info.value, path)
    assert msg == f"{path}: plans[0].path: {tmp_path / 'bad_plan.yaml'}: passes: " + (
        "expected at least 1 item(s); got 0"
    )
    path.write_text("name: s\nplan: bad_plan.yaml\n")
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert _assert_one_line(info.value, path).startswith(f"{path}: plan: {tmp_path}")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("- name: x\n", "expected a mapping with 'name' and 'plans' (or 'plan') at the top; got"),
        ("just a sentence\n", "expected a mapping with 'name'"),
        ("", "expected a mapping with 'name' and 'plans' (or 'plan') at the top; got null"),
        ("name: [unclosed\n", "not valid YAML (line 2, column 1)"),
        ("name: t\n  plans: : x\n", "not valid YAML (line 2"),
        ("name: t\nplans:\n\t- path: p\n", "not valid YAML (line 3, column 1)"),
        ("[" * 5_000, "not valid YAML"),
        ("name: t\nseed: 2024-13-45\n", "not valid YAML: month must be in 1..12"),
        ("name: t\nseed: " + "9" * 5_000 + "\n", "not valid YAML: Exceeds the limit"),
        ("name: t\nseed: !!binary xyz\n", "not valid YAML (line 2, column 7)"),
        ("{? [a]: 1}\n", "not valid YAML"),
    ],
    ids=[
        "list",
        "scalar",
        "empty",
        "unclosed",
        "bad_indent",
        "tab",
        "nested_too_deeply",
        "bad_date",
        "huge_int",
        "bad_binary",
        "unhashable_key",
    ],
)
def test_not_a_scenario_document(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    msg = _assert_one_line(info.value, path)
    assert msg.startswith(f"{path}: {expected}"), msg


def test_yaml_alias_bomb_is_refused(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    lines.append("name: t\nplans: *a8\n")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines))
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert "too large: more than 100000 values" in _assert_one_line(info.value, path)


def test_cyclic_document_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cycle.yaml"
    path.write_text("name: t\nplans: &p [*p]\n")
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert "too large" in _assert_one_line(info.value, path)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: scénario\n".encode("latin-1"))
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert _assert_one_line(info.value, path) == f"{path}: not UTF-8 text (byte 8)"


def test_missing_file_and_directory(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert "cannot read scenario: No such file" in _assert_one_line(info.value, path)
    with pytest.raises(ScenarioError) as info:
        load_scenario(tmp_path)
    assert "cannot read scenario" in _assert_one_line(info.value, tmp_path)


@pytest.mark.parametrize("data", [None, [], "name", 3, [BASE]], ids=repr)
def test_scenario_from_dict_needs_a_mapping(data: Any) -> None:
    with pytest.raises(ScenarioError, match=r"^src\.yaml: expected a mapping with 'name'"):
        scenario_from_dict(data, source="src.yaml")


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d.update(name="a\nb"), r"got 'a\nb'"),
        (lambda d: d.update({"na\nme": 1}), r"na\nme: unknown field"),
        (lambda d: _fault(1, action="kill\r\nworker")(d), r"got 'kill\r\nworker'"),
        (lambda d: d.update({"seed\u2028": 1}), r"seed\u2028: unknown field"),
        (lambda d: d["plans"][0].update(path="no\x00where"), r"no plan file 'no\x00where'"),
    ],
    ids=["value", "field", "fault_action", "unicode_line_separator", "nul_in_plan_path"],
)
def test_line_breaks_from_the_file_are_escaped(mutate: Mutation, expected: str) -> None:
    data = copy.deepcopy(BASE)
    mutate(data)
    with pytest.raises(ScenarioError) as info:
        load(data, source="s.yaml")
    assert expected in _assert_one_line(info.value, "s.yaml")


def test_long_values_are_shortened() -> None:
    with pytest.raises(ScenarioError) as info:
        load(minimal(seed="x" * 500))
    msg = _assert_one_line(info.value, "s.yaml")
    assert msg.startswith(
        "s.yaml: seed: expected an integer within [0, 9223372036854775807]; got 'xxx"
    )
    assert len(msg) < 160  # the engine's own words, the value cut at 80 characters
    with pytest.raises(ScenarioError) as info:
        load(minimal(**{"y" * 500: 1}))
    msg = _assert_one_line(info.value, "s.yaml")
    assert msg.startswith("s.yaml: yyyyy") and "y" * 61 not in msg
    with pytest.raises(ScenarioError) as info:
        load(minimal(agent={"fail_rules": {"z" * 500: 1}}))
    msg = _assert_one_line(info.value, "s.yaml")
    assert msg.startswith("s.yaml: agent.fail_rules: no rule 'zzz") and "z" * 61 not in msg


# --- failpoint specs ----------------------------------------------------------------------------


def _fp(**values: Any) -> FailpointFault:
    fault = load(minimal(workers=3, faults=[{"failpoint": "rule_after_write", **values}]))
    out = fault.spec.faults[0]
    assert isinstance(out, FailpointFault)
    return out


@pytest.mark.parametrize(
    ("values", "attempt_id", "spec"),
    [
        ({}, None, "rule_after_write=crash,hit=1,times=1"),
        ({"action": "raise", "hit": 3, "times": 0}, None, "rule_after_write=raise,hit=3,times=0"),
        ({"action": "stall", "stall_ms": 250}, None, "rule_after_write=stall:250,hit=1,times=1"),
        ({"rule": "compiles"}, None, "rule_after_write=crash,hit=1,times=1,rule=compiles"),
        (
            {"action": "stall", "stall_ms": 5000, "until": "service_paused"},
            None,
            "rule_after_write=stall:5000,hit=1,times=1,until=service_paused",
        ),
        (
            {"rule": "compiles", "evaluation": 0, "hit": 2},
            "cand-42",
            "rule_after_write=crash,hit=2,times=1,rule=compiles,attempt_id=cand-42",
        ),
    ],
)
def test_failpoint_spec_rendering(
    values: dict[str, Any], attempt_id: str | None, spec: str
) -> None:
    fault = _fp(**values)
    assert fault.to_spec(attempt_id) == spec
    # the engine reads back exactly what the scenario asked for
    (parsed,) = parse_specs(spec)
    assert parsed.spec() == spec
    assert (parsed.name, parsed.action, parsed.hit, parsed.times, parsed.rule) == (
        fault.failpoint,
        fault.action,
        fault.hit,
        fault.times,
        fault.rule,
    )
    assert parsed.stall_ms == (fault.stall_ms or 0)
    assert parsed.until == fault.until
    assert parsed.attempt_id == attempt_id


def test_until_is_a_stall_s_alone_in_a_spec() -> None:
    for action in ("crash", "raise", "freeze:5"):
        with pytest.raises(FailpointError, match="until only with stall"):
            parse_specs(f"after_ack={action},until=service_paused")


def test_failpoint_spec_needs_a_writable_attempt_id() -> None:
    with pytest.raises(ValueError, match="needs its attempt id"):
        _fp(evaluation=0).to_spec(None)
    for bad in ("a,b", "a;b", "a=b", "a b", ""):
        with pytest.raises(ValueError, match="cannot be written"):
            _fp().to_spec(bad)


def test_failpoint_specs_per_worker() -> None:
    loaded = load(
        minimal(
            workers=3,
            plans=[{"path": TINY, "evaluations": 2}],
            faults=[
                {"failpoint": "after_ack", "workers": "all"},
                {"failpoint": "rule_before_call", "workers": [1, 2], "evaluation": 1},
                {"at_s": 1, "action": "kill_worker"},
            ],
        )
    )
    ids = ["e0", "e1"]
    assert loaded.failpoint_specs(0, ids) == "after_ack=crash,hit=1,times=1"
    assert loaded.failpoint_specs(2, ids) == (
        "after_ack=crash,hit=1,times=1;rule_before_call=crash,hit=1,times=1,attempt_id=e1"
    )
    assert [f.name for f in parse_specs(loaded.failpoint_specs(1, ids))] == [
        "after_ack",
        "rule_before_call",
    ]
    with pytest.raises(ValueError, match="expected 2 attempt ids"):
        loaded.failpoint_specs(0, ["e0"])


def test_ruleless_failpoints_are_failpoints() -> None:
    assert RULELESS_FAILPOINTS.issubset(FAILPOINTS)


def test_invariant_names() -> None:
    # the first ones, in report order; later ones are added after them, a line each
    assert INVARIANT_NAMES[:12] == (
        "history_complete",
        "no_completed_rerun",
        "prune_only_dependents",
        "idempotent_results",
        "matches_reference",
        "all_terminal",
        "attempts_monotonic",
        "retry_delays_respected",
        "single_final_result",
        "state_keys_expire",
        "dag_order",
        "retry_budget",
    )
    assert load(minimal(invariants=["state_keys_expire"])).spec.invariants == ("state_keys_expire",)


# --- the fault schedule ------------------------------------------------------------------------


def _schedule_scenario(seed: int) -> Scenario:
    return load(
        minimal(
            seed=seed,
            workers=16,
            plans=[{"path": TINY, "evaluations": 10}],
            faults=[
                {"failpoint": "after_ack"},  # not the runner's: never in the schedule
                {"at_s": 2, "action": "kill_worker", "count": 3, "every_s": 1.5, "name": "k"},
                {
                    "random_at_s": [0, 10],
                    "action": "restart_worker",
                    "target": "random",
                    "count": 5,
                },
                {
                    "after": {"event": "acked", "count": 2},
                    "action": "kill_broker",
                    "count": 2,
                    "every_s": 0.5,
                    "restart_after_s": None,
                },
                {"random_at_s": [1, 9], "action": "cancel", "target": "random", "count": 4},
            ],
        )
    ).spec


def test_fault_schedule_expands_and_sorts() -> None:
    plan = fault_schedule(_schedule_scenario(1), random.Random(1))
    assert len(plan) == 3 + 5 + 2 + 4
    timed = [p for p in plan if p.at_s is not None]
    assert [p.at_s for p in timed] == sorted(p.at_s for p in timed)  # type: ignore[misc]
    assert plan[-2:] == [p for p in plan if p.after is not None], "event triggers come last"
    kills = [p for p in plan if p.fault == 1]
    assert [(p.at_s, p.target, p.repetition, p.name) for p in kills] == [
        (2.0, 0, 0, "k"),
        (3.5, 0, 1, "k"),
        (5.0, 0, 2, "k"),
    ]
    assert all(p.restart_after_s == 0.5 for p in kills)
    assert [p.label for p in kills] == ["k", "k#1", "k#2"]
    broker = [p for p in plan if p.fault == 3]
    assert [(p.at_s, p.delay_s, p.restart_after_s, p.name) for p in broker] == [
        (None, 0.0, None, "faults[3]"),
        (None, 0.5, None, "faults[3]"),
    ]
    assert broker[0].after is not None and broker[0].after.event == "acked"
    restarts = [p for p in plan if p.fault == 2]
    assert all(0 <= p.at_s <= 10 and 0 <= p.target < 16 for p in restarts)  # type: ignore[operator]
    cancels = [p for p in plan if p.fault == 4]
    assert all(1 <= p.at_s <= 9 and 0 <= p.target < 10 for p in cancels)  # type: ignore[operator]
    assert all(p.restart_after_s is None for p in cancels)
    assert all(isinstance(p, PlannedFault) and p.target != "random" for p in plan)


def test_fault_schedule_is_deterministic_per_seed() -> None:
    def draw(seed: int) -> list[tuple[Any, ...]]:
        plan = fault_schedule(_schedule_scenario(seed), random.Random(seed))
        return [(p.fault, p.repetition, p.at_s, p.target) for p in plan]

    state = random.getstate()
    assert draw(1) == draw(1)
    assert random.getstate() == state, "the global random module is never used"
    one, two = draw(1), draw(2)
    assert one != two
    by_fault = {f: ([x for x in one if x[0] == f], [x for x in two if x[0] == f]) for f in (2, 4)}
    for a, b in by_fault.values():
        assert [x[2] for x in a] != [x[2] for x in b], "random_at_s draws differ"
        assert [x[3] for x in a] != [x[3] for x in b], "random targets differ"
    fixed = [x for x in one if x[0] == 1]
    assert fixed == [x for x in two if x[0] == 1], "fixed faults do not depend on the seed"
    # the default rng is the scenario seed, and a LoadedScenario works as well
    loaded = load(minimal(seed=5, faults=[{"random_at_s": [0, 9], "action": "kill_worker"}]))
    assert loaded.schedule() == fault_schedule(loaded.spec, random.Random(5))


def test_a_pause_range_is_drawn_from_the_seed_at_each_firing() -> None:
    """Event-loop lag: many short stops, each as long as the seed says, the same each run."""
    fault = {"random_at_s": [0, 9], "action": "pause_worker", "pause_s": [0.1, 0.4], "count": 20}

    def pauses(seed: int) -> list[float]:
        return [p.pause_s for p in load(minimal(seed=seed, faults=[fault])).schedule()]

    one = pauses(1)
    assert one == pauses(1) and one != pauses(2)
    assert all(0.1 <= p <= 0.4 for p in one) and len(set(one)) == 20
    fixed = load(minimal(faults=[{**fault, "pause_s": 0.3}])).schedule()
    assert {p.pause_s for p in fixed} == {0.3}


# --- nothing accepted that cannot run: every number within what the engine holds ----------------

#: (field, a value at the bound (accepted), the value just past it, the error it gets)
BOUNDS: list[tuple[str, Any, Any, str]] = [
    ("seed", MAX_SEED, MAX_SEED + 1, "seed: expected an integer within [0, 9223372036854775807]; "),
    ("seed", 0, -1, "seed: expected an integer within [0, 9223372036854775807]; got -1"),
    ("retry.tiers_ms", [86_400_000], [86_400_001], "retry.tiers_ms[0]: expected an integer within"),
    ("retry.tiers_ms", [1] * 16, [1] * 17, "retry.tiers_ms: expected 1 to 16 delays; got (1, 1"),
    ("retry.max_attempts", 20, 21, "retry.max_attempts: expected an integer within [1, 20]"),
    ("retry.immediate_retries", 20, 21, "retry.immediate_retries: expected an integer within [0, "),
    ("engine.stale_ms", 604_800_000, 604_800_001, "engine.stale_ms: expected an integer within [5"),
    ("engine.heartbeat_ms", 10, 9, "engine.heartbeat_ms: expected an integer within [10, 60480000"),
    ("engine.sweep_ms", 604_800_000, 10**12, "engine.sweep_ms: expected an integer within [10, 60"),
    ("engine.retry_grace_ms", 604_800_000, 604_800_001, "engine.retry_grace_ms: expected an integ"),
    ("engine.max_evaluations", 1000, 1001, "engine.max_evaluations: expected an integer within [1"),
    ("engine.max_parallel", 1000, 10**30, "engine.max_parallel: expected an integer within [1, 10"),
    ("deadline_s", 86_400, 86_401, "deadline_s: expected a value <= 86400; got 86401"),
    ("restart_delay_s", 86_400, 1e300, "restart_delay_s: expected a value <= 86400; got 1e+300"),
    ("budgets.max_reruns", 2**63 - 1, 2**63, "budgets.max_reruns: expected a value <= 92233"),
    ("budgets.max_retry_latency_s", 604_800, 1e308, "budgets.max_retry_latency_s: expected a val"),
    ("faults.0.stall_ms", 3_600_000, 3_600_001, "faults[0].stall_ms: expected a value <= 3600000"),
    ("faults.0.hit", 1_000_000, 10**400, "faults[0].hit: expected a value <= 1000000; got 1000"),
    ("faults.1.restart_after_s", 86_400, 86_401, "faults[1].restart_after_s: expected a value <="),
    ("agent.seed", MAX_SEED, 2**64, "agent.seed: expected a value <= 9223372036854775807"),
    ("agent.tokens", 1_000_000, 10**30, f"agent.tokens: expected a value <= 1000000; got {10**30}"),
    ("agent.latency_ms", 3_600_000, 10**400, "agent.latency_ms: must be a finite number within"),
    ("agent.latency_ms", 3_600_000, 1e30, "agent.latency_ms.value_ms: must be a finite number"),
    ("agent.fail_rules.compiles", 10_000, 10_001, "agent.fail_rules.compiles: expected a value <="),
]  # fmt: skip


def _with(path: str, value: Any) -> dict[str, Any]:
    """BASE (with a stall fault first) with the field at `path` (dots; digits index lists)."""
    data = copy.deepcopy(BASE)
    data["faults"][0].update(action="stall", stall_ms=5)
    node: Any = data
    *parents, last = path.split(".")
    for key in parents:
        node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
    node[last] = value
    return data


@pytest.mark.parametrize(
    ("path", "ok", "bad", "expected"), BOUNDS, ids=[f"{b[0]}={b[2]!r:.12}" for b in BOUNDS]
)
def test_numbers_are_bounded_by_what_the_engine_holds(
    path: str, ok: Any, bad: Any, expected: str
) -> None:
    load(_with(path, ok))
    with pytest.raises(ScenarioError) as info:
        load(_with(path, bad))
    msg = _assert_one_line(info.value, "s.yaml")
    assert msg.startswith(f"s.yaml: {expected}"), msg
    assert len(msg) < 200, msg


def test_the_engine_bounds_are_the_workers() -> None:
    """The scenario's engine settings and retry policy refuse what the worker refuses: the
    bounds come from engine.policy, which the worker's config goes through."""
    fields = EngineSpec.model_fields
    for name, (least, most) in ENGINE_BOUNDS.items():
        metadata = {type(m).__name__: m for m in fields[name].metadata}
        assert (metadata["Ge"].ge, metadata["Le"].le) == (least, most), name
    loaded = load(minimal(engine={"stale_ms": 604_800_000, "heartbeat_ms": 604_799_999}))
    check_engine_settings(loaded.spec.engine_config())
    with pytest.raises(
        ValueError, match=r"^stale_ms: expected an integer within \[50, 604800000\]"
    ):
        check_engine_settings(dataclasses.replace(loaded.spec.engine_config(), stale_ms=10**12))
    for kwargs in ({"seed": 2**64}, {"tiers_ms": (86_400_001,)}, {"max_attempts": 21}):
        with pytest.raises(ValueError, match=f"^{next(iter(kwargs))}"):
            RetryPolicy(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("spelling", ["same", "dot", "link"])
def test_a_plan_listed_twice_is_refused(tmp_path: Path, spelling: str) -> None:
    """Two entries for one plan would give both the same attemptIds; raise evaluations."""
    plan = ROOT / TINY
    second = {
        "same": str(plan),
        "dot": str(plan.parent / "." / plan.name),
        "link": str(tmp_path / "link.yaml"),
    }[spelling]
    (tmp_path / "link.yaml").symlink_to(plan)
    with pytest.raises(ScenarioError) as info:
        load(minimal(plans=[{"path": str(plan), "evaluations": 2}, {"path": second}]))
    assert _assert_one_line(info.value, "s.yaml") == (
        "s.yaml: plans[1].path: the same plan file as plans[0]; expected each plan once "
        "(set plans[0].evaluations for more evaluations of it)"
    )


def test_two_plans_with_one_id_are_refused(tmp_path: Path) -> None:
    copy_of_tiny = tmp_path / "tiny_again.yaml"
    copy_of_tiny.write_text((ROOT / TINY).read_text())
    data = minimal(plans=[{"path": CODE_REVIEW}, {"path": TINY}, {"path": str(copy_of_tiny)}])
    with pytest.raises(ScenarioError) as info:
        load(data)
    assert _assert_one_line(info.value, "s.yaml").startswith(
        "s.yaml: plans[2].path: plan id 'tiny' is also the id of plans[1] ("
    )
    assert str(info.value).endswith("); expected distinct plan ids")


def test_distinct_plans_get_distinct_attempt_ids() -> None:
    loaded = load(minimal(plans=[{"path": TINY, "evaluations": 3}, {"path": CODE_REVIEW}]))
    ids = list(loaded.evaluations(5))
    assert len(ids) == len(set(ids)) == loaded.spec.total_evaluations == 4
    assert loaded.failpoint_specs(0, ids) == ""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name: a\nseed: 1\nname: b\n", "duplicate key 'name' (line 3, column 1; first at line 1)"),
        (
            "name: a\nplan: plans/tiny.yaml\nengine: {stale_ms: 900, stale_ms: 800}\n",
            "duplicate key 'stale_ms' (line 3, column 25; first at line 3)",
        ),
        ("name: a\n1: x\n1: y\n", "duplicate key 1 (line 3"),
        ("name: a\n" + "k" * 500 + ": 1\n" + "k" * 500 + ": 2\n", "duplicate key 'kkkk"),
    ],
    ids=["top", "nested", "int_key", "long_key"],
)
def test_duplicate_keys_are_refused(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    msg = _assert_one_line(info.value, path)
    assert msg.startswith(f"{path}: not valid YAML: {expected}"), msg
    assert msg.endswith("expected each key once per mapping") and len(msg) < 300


def test_a_yaml_merge_is_not_a_duplicate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    path = tmp_path / "merge.yaml"
    path.write_text(
        "name: m\nplan: plans/tiny.yaml\n"
        "x-engine: &e {stale_ms: 900, heartbeat_ms: 100}\n"
        "engine: {<<: *e, stale_ms: 800}\n"
    )
    with pytest.raises(ScenarioError, match=r"x-engine: unknown field"):
        load_scenario(path)  # the anchor's own key is unknown, but no duplicate is claimed
    path.write_text(
        "name: m\nplans:\n  - &p {path: plans/tiny.yaml, evaluations: 2}\n"
        "faults:\n  - {<<: {at_s: 1, action: kill_worker}, at_s: 2}\n"
    )
    assert load_scenario(path).spec.faults[0].at_s == 2


def test_a_plan_path_that_is_a_device_or_fifo(tmp_path: Path) -> None:
    """Found (it exists), then refused by the plan reader without opening it blocking."""
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    for target, kind in ((fifo, "a FIFO"), (Path("/dev/null"), "a character device")):
        with pytest.raises(ScenarioError) as info:
            load(minimal(plans=[{"path": str(target)}]))
        assert _assert_one_line(info.value, "s.yaml") == (
            f"s.yaml: plans[0].path: {target}: cannot read plan: {kind}; expected a regular file"
        )


# --- the published JSON Schema -----------------------------------------------------------------


def test_committed_schema_is_current() -> None:
    committed = (ROOT / "scenarios" / "schema.json").read_text(encoding="utf-8")
    assert committed == schema_text(), "run: python -m chaos.scenario"
    schema = json.loads(committed)
    assert schema["$defs"]["RunnerFault"]["properties"]["action"]["enum"] == [
        "kill_worker",
        "restart_worker",
        "pause_worker",
        "kill_redis",
        "pause_redis",
        "kill_sentinel",
        "kill_broker",
        "pause_broker",
        "stop_redis",
        "stop_broker",
        "cancel",
        "resume",
        "add_toxic",
        "update_toxic",
        "remove_toxic",
        "cut_link",
        "publish_poison",
        "kill_service",
        "stop_service",
        "pause_service",
        "restart_service",
    ]
    assert schema["$defs"]["ToxicSpec"]["properties"]["type"]["enum"] == list(TOXIC_TYPES)
    assert schema["properties"]["invariants"]["items"]["enum"] == list(INVARIANT_NAMES)


def test_write_schema(tmp_path: Path) -> None:
    out = write_schema(tmp_path / "schema.json")
    assert out.read_text(encoding="utf-8") == schema_text()
    assert json.loads(schema_text())["title"] == "Scenario"


def test_schema_accepts_what_the_loader_accepts() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json.loads(schema_text()))
    validator.check_schema(validator.schema)
    full = yaml.safe_load(FULL.read_text())
    assert list(validator.iter_errors(full)) == []
    assert list(validator.iter_errors({"name": "t", "plan": TINY, "evaluations": 2})) == []
    for data in (
        {**full, "retires": 3},  # unknown field
        {"name": "t"},  # no plan at all
        {"name": "t", "plan": TINY, "plans": [{"path": TINY}]},  # both forms
        {"name": "t", "plans": [{"path": TINY}], "evaluations": 2},  # evaluations alone
        {**full, "faults": [{"failpoint": "nope"}]},
        {**full, "faults": [{"at_s": 1, "action": "explode"}]},
        {**full, "invariants": ["no_rerun"]},
    ):
        assert list(validator.iter_errors(data)), data


@pytest.mark.parametrize(
    ("path", "ok", "bad", "expected"),
    [b for b in BOUNDS if not b[0].startswith("agent.") and b[0] != "engine.heartbeat_ms"],
    ids=lambda v: str(v)[:20],
)
def test_schema_has_the_loaders_bounds(path: str, ok: Any, bad: Any, expected: str) -> None:
    """What the loader refuses for a number past its bound, the published schema refuses
    (the agent profile is one mapping there; heartbeat vs stale_ms is beyond a schema)."""
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json.loads(schema_text()))
    good, broken = _with(path, ok), _with(path, bad)
    assert list(validator.iter_errors(good)) == [], good
    assert list(validator.iter_errors(broken)), broken


# --- fuzzing: nothing but ScenarioError ever escapes -------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 40)
    | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
field_names = st.sampled_from(
    [
        "name",
        "plan",
        "plans",
        "path",
        "evaluations",
        "agent",
        "retry",
        "engine",
        "faults",
        "failpoint",
        "action",
        "stall_ms",
        "workers",
        "evaluation",
        "rule",
        "at_s",
        "random_at_s",
        "after",
        "event",
        "target",
        "count",
        "every_s",
        "invariants",
        "budgets",
        "tiers_ms",
        "stale_ms",
        "seed",
        "fail_rules",
        "extra",
    ]
)
#: names the schema knows, values at and past the bounds, line breaks, huge numbers
INTERESTING: list[Any] = [
    "random", "all", "stall", "cancel", "kill_worker", "after_ack", "compiles", TINY,
    "a\nb", "\u2028", 0, 1, 2, 16, 10**30, 10**400, -1, 0.5, 1e308, float("inf"),
    "x" * 500, [0, 1], [3, 1], [0, 10**400], {"event": "acked"}, {"failpoint": "after_ack"},
    {"latency_ms": 10**400}, {"x" * 300: 1},
]  # fmt: skip
# a fresh copy each time: a later edit of the example must not change the strategy
interesting = st.sampled_from(INTERESTING).map(copy.deepcopy)

odd_keys = st.text(max_size=4) | st.sampled_from(["a\nb", "id\r", "x\u2028", "\x00"])
VALID_FULL: dict[str, Any] = yaml.safe_load(FULL.read_text())
VALID_FULL["plans"] = [{"path": str(ROOT / TINY), "evaluations": 2}, {"path": CODE_REVIEW}]


@st.composite
def mutated_scenarios(draw: st.DrawFn) -> Any:
    """The full example with a few random edits: keys deleted, values replaced, unknown
    keys added; most results are broken, a few are still valid."""
    data = copy.deepcopy(VALID_FULL)
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.sampled_from(containers(data)))
        node = data
        for key in where:
            node = node[key]
        op = draw(st.sampled_from(["set", "set", "delete", "replace_root"]))
        if op == "replace_root":
            return draw(json_values)
        if isinstance(node, dict):
            key = draw(field_names | odd_keys | st.sampled_from(list(node) or ["x"]))
            if op == "delete":
                node.pop(key, None)
            else:
                node[key] = draw(json_values | interesting)
        elif node:
            i = draw(st.integers(0, len(node) - 1))
            if op == "delete":
                del node[i]
            else:
                node[i] = draw(json_values | interesting)
    return data


def _only_scenario_errors(call: Callable[[], Any], source: str) -> None:
    try:
        call()
    except ScenarioError as exc:
        _assert_one_line(exc, source)


@settings(max_examples=300, deadline=None)
@given(mutated_scenarios())
def test_fuzz_scenario_from_dict(data: Any) -> None:
    _only_scenario_errors(
        lambda: scenario_from_dict(data, source="fuzz.yaml", base_dir=ROOT), "fuzz.yaml"
    )


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for every example (hypothesis refuses function-scoped fixtures)."""
    return tmp_path_factory.mktemp("fuzz")


def _yaml_dump(data: Any) -> str:
    try:
        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    except yaml.YAMLError:
        return str(data)


#: YAML text: mutated scenarios, random text, the full example with a slice replaced
scenario_texts = st.one_of(
    mutated_scenarios().map(_yaml_dump),
    st.text(max_size=200),
    st.tuples(
        st.just(_yaml_dump(VALID_FULL)),
        st.integers(0, 2000),
        st.integers(0, 40),
        st.text(max_size=6),
    ).map(lambda t: t[0][: t[1]] + t[3] + t[0][t[1] + t[2] :]),
    st.binary(max_size=64).map(lambda b: b.decode("latin-1")),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario_texts)
def test_fuzz_load_scenario_text(fuzz_dir: Path, text: str) -> None:
    path = fuzz_dir / "fuzz.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    _only_scenario_errors(lambda: load_scenario(path), str(path))


def test_fuzz_mutation_reaches_deep_errors() -> None:
    """The fuzzer's mutations do reach field errors (a mutation that only broke the top
    level would prove little)."""
    seen: set[str] = set()

    @settings(max_examples=200, deadline=None, database=None)
    @given(mutated_scenarios())
    def collect(data: Any) -> None:
        try:
            scenario_from_dict(data, source="f", base_dir=ROOT)
        except ScenarioError as exc:
            field = re.match(r"f: ([a-z_]+)", str(exc))
            if field:
                seen.add(field.group(1))

    collect()
    assert {"faults", "plans"} <= seen, seen


# --- not_checked --------------------------------------------------------------------------------


def test_not_checked_leaves_out_only_what_it_names() -> None:
    spec = load(minimal(not_checked=["retry_delays_respected"])).spec
    assert "retry_delays_respected" not in spec.invariants
    assert set(spec.invariants) == set(INVARIANT_NAMES) - {"retry_delays_respected"}
    listed = load(minimal(invariants=["all_terminal", "dag_order"], not_checked=["dag_order"])).spec
    assert listed.invariants == ("all_terminal",)


def test_not_checked_reads_the_same_twice_and_refuses_unknown_names() -> None:
    once = load(minimal(not_checked=["dag_order"])).spec
    again = load(minimal(invariants=list(once.invariants), not_checked=["dag_order"])).spec
    assert again.invariants == once.invariants
    with pytest.raises(ScenarioError) as err:
        load(minimal(not_checked=["no_such_check"]))
    assert "not_checked" in _assert_one_line(err.value, "s.yaml")
    with pytest.raises(ScenarioError) as err:  # exercised must still be checked
        load(minimal(not_checked=["dag_order"], exercised={"dag_order": 1}))
    assert "exercised.dag_order" in _assert_one_line(err.value, "s.yaml")


# --- the refused suite (scenarios/refused/): the engine's own checks judge first -----------

REFUSED = sorted((ROOT / "scenarios" / "refused").glob("*.yaml"))


def test_the_refused_suite_covers_every_bound_of_the_engine() -> None:
    from engine.policy import ENGINE_BOUNDS

    text = "\n".join(p.read_text() for p in REFUSED)
    for name in (*ENGINE_BOUNDS, "max_attempts", "immediate_retries", "tiers_ms", "jitter"):
        assert name in text, name
    assert len(REFUSED) >= 30


@pytest.mark.parametrize("path", REFUSED, ids=lambda p: p.stem)
def test_a_refused_scenario_is_refused_with_its_line(path: Path) -> None:
    from chaos.scenario import expected_refusal, refusal_problem

    want = expected_refusal(path)
    assert want is not None
    assert refusal_problem(path) is None
    with pytest.raises(ScenarioError) as err:
        load_scenario(path)
    assert str(err.value) == f"{path}: {want}"


def test_a_refused_scenario_that_loads_or_says_otherwise_is_named(tmp_path: Path) -> None:
    from chaos.scenario import expected_refusal, refusal_problem

    good = tmp_path / "good.yaml"
    good.write_text(f"# refused: retry.max_attempts: nope\nname: g\nplan: {ROOT / TINY}\n")
    assert expected_refusal(good) == "retry.max_attempts: nope"
    assert refusal_problem(good) == "loaded, but must be refused with 'retry.max_attempts: nope'"
    other = tmp_path / "other.yaml"
    other.write_text(f"# refused: x\nname: o\nplan: {ROOT / TINY}\nretry: {{max_attempts: 0}}\n")
    problem = refusal_problem(other)
    assert problem is not None and problem.startswith("refused with 'retry.max_attempts: expected")
    assert expected_refusal(ROOT / "scenarios" / "delay_tiers.yaml") is None
