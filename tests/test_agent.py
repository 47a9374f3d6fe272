"""The fake agent: replayable draws, idempotent verdicts, forced failures, profile parsing."""

from __future__ import annotations

import asyncio
import os
import pickle
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.agent import (
    ERROR_KINDS,
    FAILED_CALL_TOKENS,
    PERMANENT_KINDS,
    TRANSIENT_KINDS,
    AgentError,
    AgentProfile,
    AgentService,
    Draw,
    FakeAgent,
    Latency,
    PermanentAgentError,
    TransientAgentError,
    agent_error,
)
from engine.core.results import RuleResult
from engine.plan import Rule

ROOT = Path(__file__).resolve().parent.parent


def rule(rule_id: str) -> Rule:
    return Rule(id=rule_id, pass_id="p1")


def run_calls(agent: FakeAgent, attempt_id: str, rule_id: str, n: int) -> list[object]:
    """Call `evaluate` n times in a row; each outcome is a RuleResult or the AgentError."""

    async def go() -> list[object]:
        out: list[object] = []
        for i in range(n):
            try:
                out.append(await agent.evaluate(attempt_id, rule(rule_id), 1, i + 1))
            except AgentError as exc:
                out.append(exc)
        return out

    return asyncio.run(go())


# --- errors ----------------------------------------------------------------------------------


def test_error_kinds_table_and_classes() -> None:
    assert set(TRANSIENT_KINDS) == {"timeout", "quota", "tool_unavailable"}
    assert PERMANENT_KINDS == ("invalid_output",)
    for kind, retryable in ERROR_KINDS.items():
        err = agent_error(kind, "boom", tokens=7)
        assert err.kind == kind and err.retryable is retryable and err.tokens == 7
        assert isinstance(err, TransientAgentError if retryable else PermanentAgentError)
        back = pickle.loads(pickle.dumps(err))
        assert (type(back), back.kind, back.tokens, str(back)) == (
            type(err),
            kind,
            7,
            str(err),
        )
    with pytest.raises(ValueError):
        TransientAgentError("invalid_output")
    with pytest.raises(ValueError):
        PermanentAgentError("timeout")
    with pytest.raises(ValueError):
        agent_error("teapot")


def test_fake_agent_is_an_agent_service() -> None:
    assert isinstance(FakeAgent(AgentProfile()), AgentService)


# --- determinism -----------------------------------------------------------------------------


def test_same_inputs_same_draw_across_instances() -> None:
    profile = AgentProfile(seed=42, error_rate=0.3, latency_ms=Latency.lognormal(200, 0.8))
    a, b = FakeAgent(profile), FakeAgent(profile)
    draws = [
        (a.draw(f"att{i}", f"r{j}", att, t, 0), b.draw(f"att{i}", f"r{j}", att, t, 0))
        for i in range(5)
        for j in range(10)
        for att in (1, 2)
        for t in (1, 2)
    ]
    assert all(x == y for x, y in draws)
    # and the draws are not all alike (the test would pass for a constant agent otherwise)
    assert len({x.latency_ms for x, _ in draws}) > len(draws) // 2


_REPLAY_SNIPPET = """
from engine.agent import AgentProfile, FakeAgent, Latency
agent = FakeAgent(AgentProfile(seed=7, error_rate=0.3, latency_ms=Latency.uniform(1, 100)))
print([agent.draw("att", f"r{i}", 1, 1, 0) for i in range(20)])
"""


def test_draws_replay_across_processes_whatever_the_hash_seed() -> None:
    outputs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        proc = subprocess.run(
            [sys.executable, "-c", _REPLAY_SNIPPET],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        outputs.append(proc.stdout)
    assert outputs[0] == outputs[1]
    agent = FakeAgent(AgentProfile(seed=7, error_rate=0.3, latency_ms=Latency.uniform(1, 100)))
    assert outputs[0].strip() == repr([agent.draw("att", f"r{i}", 1, 1, 0) for i in range(20)])


def test_different_seed_changes_results() -> None:
    a, b = FakeAgent(AgentProfile(seed=0)), FakeAgent(AgentProfile(seed=1))
    differ = 0
    for i in range(200):
        ra = a.draw("att", f"r{i}", 1, 1, 0).result
        rb = b.draw("att", f"r{i}", 1, 1, 0).result
        assert ra is not None and rb is not None
        differ += not ra.same_verdict(rb)
    assert differ > 150


def test_verdict_independent_of_attempt_and_try() -> None:
    agent = FakeAgent(AgentProfile(seed=3, latency_ms=Latency.uniform(5, 500)))
    latencies = set()
    for i in range(100):
        first = agent.draw("att", f"r{i}", 1, 1, 0).result
        assert first is not None
        for attempt in (1, 2, 3):
            for try_no in (1, 2, 3):
                d = agent.draw("att", f"r{i}", attempt, try_no, attempt * 3 + try_no)
                assert d.result is not None
                assert d.result.same_verdict(first)
                assert d.result.attempt == attempt
                latencies.add(d.latency_ms)
    # latency and tokens, unlike the verdict, do depend on (attempt, try_no)
    assert len(latencies) > 800


def test_verdict_depends_on_attempt_id() -> None:
    agent = FakeAgent(AgentProfile())
    results = [agent.draw(f"att{i}", "r1", 1, 1, 0).result for i in range(100)]
    assert len({r.score for r in results if r is not None}) > 90


def test_nondeterministic_mutant_breaks_idempotence_but_replays_with_a_salt() -> None:
    mutant = FakeAgent(AgentProfile(), nondeterministic=True, salt=5)
    disagree = 0
    for i in range(50):
        a = mutant.draw("att", f"r{i}", 1, 1, 0).result
        b = mutant.draw("att", f"r{i}", 2, 1, 3).result
        assert a is not None and b is not None
        disagree += not a.same_verdict(b)
    assert disagree > 40
    again = FakeAgent(AgentProfile(), nondeterministic=True, salt=5)
    assert again.draw("att", "r1", 2, 1, 3) == mutant.draw("att", "r1", 2, 1, 3)


# --- rates -----------------------------------------------------------------------------------


def test_error_rate_roughly_respected() -> None:
    agent = FakeAgent(AgentProfile(seed=11, error_rate=0.2, permanent_error_rate=0.1))
    kinds = Counter(agent.draw("att", f"r{i}", 1, 1, 0).error for i in range(2000))
    transient = sum(kinds[k] for k in TRANSIENT_KINDS)
    assert 0.15 * 2000 < transient < 0.25 * 2000
    assert 0.06 * 2000 < kinds["invalid_output"] < 0.14 * 2000
    for k in TRANSIENT_KINDS:  # equal weights by default: each about a third
        assert transient / 5 < kinds[k] < transient / 2


def test_error_kind_weights() -> None:
    agent = FakeAgent(AgentProfile(error_rate=1.0, error_kinds={"quota": 1.0}))
    assert {agent.draw("att", f"r{i}", 1, 1, 0).error for i in range(300)} == {"quota"}


def test_zero_error_rate_never_fails() -> None:
    agent = FakeAgent(AgentProfile(seed=5))
    assert all(agent.draw("att", f"r{i}", 1, 1, 0).error is None for i in range(1000))


def test_pass_rate_roughly_respected() -> None:
    agent = FakeAgent(AgentProfile(pass_rate=0.7, review_share=0.25))
    results = [agent.draw("att", f"r{i}", 1, 1, 0).result for i in range(2000)]
    verdicts = Counter(r.verdict for r in results if r is not None)
    assert 0.65 * 2000 < verdicts["pass"] < 0.75 * 2000
    assert 0.05 * 2000 < verdicts["needs_review"] < 0.10 * 2000
    assert 0.19 * 2000 < verdicts["fail"] < 0.26 * 2000


def test_failed_calls_cost_their_share_of_tokens() -> None:
    ok = FakeAgent(AgentProfile(seed=9, tokens=1000))
    for kind in TRANSIENT_KINDS:
        failing = FakeAgent(
            AgentProfile(seed=9, tokens=1000, error_rate=1.0, error_kinds={kind: 1})
        )
        for i in range(50):
            full = ok.draw("att", f"r{i}", 1, 1, 0)
            failed = failing.draw("att", f"r{i}", 1, 1, 0)
            assert failed.error == kind and failed.result is None
            assert failed.tokens == round(full.tokens * FAILED_CALL_TOKENS[kind])
    assert FAILED_CALL_TOKENS["timeout"] == 1.0  # a timeout costs the whole call
    tokens = [ok.draw("att", f"r{i}", 1, 1, 0).tokens for i in range(500)]
    assert 750 <= min(tokens) < max(tokens) <= 1250
    assert 950 < sum(tokens) / len(tokens) < 1050


def test_latency_distributions_and_cap() -> None:
    uni = FakeAgent(AgentProfile(latency_ms=Latency.uniform(10, 20)))
    values = [uni.draw("a", f"r{i}", 1, 1, 0).latency_ms for i in range(300)]
    assert 10 <= min(values) < 11 and 19 < max(values) <= 20
    logn = FakeAgent(AgentProfile(latency_ms=Latency.lognormal(100, 2.0, cap_ms=300)))
    values = [logn.draw("a", f"r{i}", 1, 1, 0).latency_ms for i in range(300)]
    assert max(values) == 300 and min(values) < 50
    timeouts = FakeAgent(
        AgentProfile(
            latency_ms=Latency.lognormal(100, 2.0, cap_ms=300),
            error_rate=1.0,
            error_kinds={"timeout": 1},
        )
    )
    assert {timeouts.draw("a", f"r{i}", 1, 1, 0).latency_ms for i in range(50)} == {300}


# --- evaluate --------------------------------------------------------------------------------


def test_fail_rules_fail_their_first_calls_per_evaluation() -> None:
    agent = FakeAgent(AgentProfile(fail_rules={"r1": 3}))
    outcomes = run_calls(agent, "att1", "r1", 5)
    assert [type(o) for o in outcomes] == [TransientAgentError] * 3 + [RuleResult] * 2
    assert all(o.retryable and o.kind in TRANSIENT_KINDS for o in outcomes[:3])  # type: ignore[union-attr]
    assert agent.call_count("att1", "r1") == 5
    # another rule is not affected, and another evaluation has its own count
    assert isinstance(run_calls(agent, "att1", "r2", 1)[0], RuleResult)
    assert [type(o) for o in run_calls(agent, "att2", "r1", 4)] == [TransientAgentError] * 3 + [
        RuleResult
    ]


def test_always_fail_rules_fail_every_call() -> None:
    agent = FakeAgent(AgentProfile(always_fail_rules=frozenset({"doomed"})))
    outcomes = run_calls(agent, "att", "doomed", 20)
    assert all(isinstance(o, TransientAgentError) for o in outcomes)
    assert isinstance(run_calls(agent, "att", "fine", 1)[0], RuleResult)


def test_permanent_errors_are_not_retryable() -> None:
    agent = FakeAgent(AgentProfile(permanent_error_rate=1.0))
    (outcome,) = run_calls(agent, "att", "r1", 1)
    assert isinstance(outcome, PermanentAgentError)
    assert outcome.kind == "invalid_output" and outcome.retryable is False
    assert outcome.tokens > 0


def _slept(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The delays the agent asks asyncio to sleep (recorded, not timed: CI is busy)."""
    asked: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float, *args: Any) -> Any:
        asked.append(delay)
        return await real_sleep(0)

    monkeypatch.setattr("engine.agent.asyncio.sleep", sleep)
    return asked


def test_zero_latency_evaluate_never_sleeps_and_matches_draw(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked = _slept(monkeypatch)
    agent = FakeAgent(AgentProfile(seed=4))
    results = [run_calls(agent, "att", f"r{i}", 1)[0] for i in range(200)]
    assert asked == []
    for i, res in enumerate(results):
        assert isinstance(res, RuleResult)
        assert res == agent.draw("att", f"r{i}", 1, 1, 0).result


def test_evaluate_sleeps_the_scaled_latency(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _slept(monkeypatch)
    profile = AgentProfile(latency_ms=Latency.fixed(200))
    run_calls(FakeAgent(profile, time_scale=0.25), "att", "r1", 1)
    assert asked == [pytest.approx(0.05)]
    run_calls(FakeAgent(profile, time_scale=0.0), "att", "r1", 1)
    assert asked == [pytest.approx(0.05)]  # time scale 0: no sleep at all


def test_concurrent_calls_get_distinct_call_indexes() -> None:
    agent = FakeAgent(AgentProfile(latency_ms=Latency.fixed(10), fail_rules={"r1": 2}), 0.1)

    async def go() -> list[object]:
        calls = [agent.evaluate("att", rule("r1"), 1, t) for t in (1, 2, 3)]
        return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = asyncio.run(go())
    assert sorted(type(o).__name__ for o in outcomes) == [
        "RuleResult",
        "TransientAgentError",
        "TransientAgentError",
    ]


# --- profiles --------------------------------------------------------------------------------


def test_from_dict_reads_a_yaml_like_mapping() -> None:
    profile = AgentProfile.from_dict(
        {
            "seed": 3,
            "latency_ms": {"kind": "uniform", "low_ms": 5, "high_ms": 50, "cap_ms": 40},
            "error_rate": 0.1,
            "error_kinds": {"timeout": 2, "quota": 1},
            "tokens": 900,
            "fail_rules": {"r1": 2},
            "always_fail_rules": ["r9"],
            "pass_rate": 0.5,
        }
    )
    assert profile.seed == 3
    assert profile.latency_ms == Latency.uniform(5, 50, cap_ms=40)
    assert profile.error_kinds == {"timeout": 2, "quota": 1}
    assert profile.always_fail_rules == frozenset({"r9"})
    assert profile.fail_rules == {"r1": 2} and profile.tokens == 900
    assert AgentProfile.from_dict(profile.to_dict()) == profile
    assert AgentProfile.from_dict({"latency_ms": 25}).latency_ms == Latency.fixed(25)
    assert AgentProfile.from_dict(None) == AgentProfile()


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"error_rate": "lots"}, "error_rate"),
        ({"error_rate": 1.5}, "error_rate"),
        ({"permanent_error_rate": -0.1}, "permanent_error_rate"),
        ({"eror_rate": 0.1}, "eror_rate"),
        ({"seed": "x"}, "seed"),
        ({"tokens": -5}, "tokens"),
        ({"tokens": 1.5}, "tokens"),
        ({"pass_rate": 2}, "pass_rate"),
        ({"latency_ms": "slow"}, "latency_ms"),
        ({"latency_ms": {"kind": "gamma"}}, "latency_ms.kind"),
        ({"latency_ms": {"kind": "uniform", "low_ms": 9, "high_ms": 1}}, "latency_ms.high_ms"),
        ({"latency_ms": {"kind": "lognormal", "median_ms": 0}}, "latency_ms.median_ms"),
        ({"latency_ms": {"kind": "fixed", "value": 3}}, "latency_ms.value"),
        ({"error_kinds": {"teapot": 1}}, "error_kinds.teapot"),
        ({"error_kinds": {"timeout": 0}}, "error_kinds"),
        ({"fail_rules": {"r1": -1}}, "fail_rules.r1"),
        ({"fail_rules": {"r1": "three"}}, "fail_rules.r1"),
        ({"always_fail_rules": "r1"}, "always_fail_rules"),
    ],
)
def test_from_dict_errors_name_the_field(data: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError) as info:
        AgentProfile.from_dict(data)
    message = str(info.value)
    assert message.startswith(f"{field}:") or f" {field}:" in message, message
    assert "\n" not in message


def test_from_dict_rejects_a_non_mapping() -> None:
    with pytest.raises(ValueError, match="mapping"):
        AgentProfile.from_dict([1, 2])


# --- property --------------------------------------------------------------------------------

_profiles = st.builds(
    AgentProfile,
    seed=st.integers(),
    latency_ms=st.sampled_from(
        [Latency(), Latency.uniform(0, 10), Latency.lognormal(50, 3.0, cap_ms=1000)]
    ),
    error_rate=st.floats(0, 0.5),
    permanent_error_rate=st.floats(0, 0.5),
    tokens=st.integers(0, 10**6),
    fail_rules=st.dictionaries(st.text(max_size=5), st.integers(0, 5), max_size=3),
    pass_rate=st.floats(0, 1),
)


@settings(max_examples=300, deadline=None)
@given(
    profile=_profiles,
    attempt_id=st.text(),
    rule_id=st.text(),
    attempt=st.integers(),
    try_no=st.integers(),
    call_index=st.integers(),
)
def test_draw_never_raises_and_is_well_formed(
    profile: AgentProfile, attempt_id: str, rule_id: str, attempt: int, try_no: int, call_index: int
) -> None:
    d = FakeAgent(profile).draw(attempt_id, rule_id, attempt, try_no, call_index)
    assert isinstance(d, Draw)
    assert d.tokens >= 0 and d.latency_ms >= 0
    assert (d.error is None) != (d.result is None)
    if d.error is not None:
        assert d.error in ERROR_KINDS
    else:
        assert d.result is not None
        assert d.result.rule_id == rule_id and d.result.attempt == attempt
        assert d.result.tokens == d.tokens
        assert d.result.verdict in {"pass", "fail", "needs_review"}
        assert 0.0 <= d.result.score <= 1.0
