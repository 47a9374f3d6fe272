"""The engine bugs of issue 8 and the broker and Redis faults it made reachable, in the
simulator (fast, simulated time only).

(a) A terminal evaluation leaves every index: cancelled while its owner is dead or while
    its retries wait in the delay tiers, it is never re-published by a sweeper.
(b) Lost Redis writes never give a false `completed`: what an announcement names is in
    Redis when it goes out (restored from the owner's memory if a failover lost it).
(c) A cancel is seen at the owner's next step, from the store, without its broadcast.

And the scenario fields `broker.consumer_timeout_s`, `broker.dead_letter_loss`,
`redis.lose_last_writes` reach the simulated broker and Redis, the explorer's variants,
and (refused in one line where they cannot) the live runner.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import simpy

from chaos import acts
from chaos.explore import document, swarm
from chaos.insim import SimOptions
from chaos.insim.run import SimOutcome, SimRun, scenario_options
from chaos.scenario import LoadedScenario, load_scenario
from chaos.systems.redis_rabbitmq.aof import write_offsets
from chaos.systems.redis_rabbitmq.live import refusal
from chaos.systems.redis_rabbitmq.sim import RedisRabbitSim
from engine.core import RuleResult
from engine.core.states import RuleState
from engine.plan import load_plan
from engine.runtime.store import eval_key, result_key, retry_member, status_key
from sim.broker import BrokerClient
from sim.redis import SimRedis

ROOT = Path(__file__).resolve().parents[1]
PLAN = load_plan(ROOT / "plans" / "code_review.yaml")
TERMINAL = {"completed", "partial", "failed", "cancelled"}
RULE_STATES = {s.value for s in RuleState}  # a verdict that names no result


def scenario(name: str) -> LoadedScenario:
    return load_scenario(ROOT / "scenarios" / f"{name}.yaml")


def of(history: list[dict], ev: str, **match: Any) -> list[dict]:
    return [e for e in history if e["ev"] == ev and all(e.get(k) == v for k, v in match.items())]


def run(loaded: LoadedScenario, seed: int | None = None) -> tuple[SimRun, SimOutcome]:
    sim = SimRun(loaded, seed)
    outcome = sim.run()
    assert outcome.result.ok, (outcome.result.verdicts, outcome.result.violations[:2])
    return sim, outcome


def indexed(sim: SimRun) -> tuple[set[str], set[str]]:
    """The evaluations in the running index and in the retries index at the end."""
    redis = sim.system.redis
    running = set(redis.get(redis.running_index) or {})
    retries = {m.partition("\x1f")[0] for m in redis.get(redis.retries_index) or {}}
    return running, retries


# --- (a) a terminal evaluation leaves every index ------------------------------------------


def test_a_cancel_while_the_owner_is_dead_is_never_swept_again() -> None:
    sim, outcome = run(scenario("cancel_while_owner_dead"))
    history = outcome.history
    cancelled = of(history, "cancel_written")[0]
    a = cancelled["attempt_id"]
    assert (
        of(history, "worker_killed")[0]["t"]
        < cancelled["t"]
        < of(history, "worker_restarted")[0]["t"]
    )
    assert outcome.final.evaluations[a].state == "cancelled"
    # the restarted worker's sweeper resumed the other evaluation, never the cancelled one
    assert of(history, "sweeper_resumed")
    assert not [e for e in of(history, "sweeper_resumed", attempt_id=a) if e["t"] > cancelled["t"]]
    assert not of(history, "delivered", attempt_id=a, reason="stale_heartbeat")
    running, retries = indexed(sim)
    assert not running & set(outcome.attempt_ids) and not retries


def test_a_cancel_during_retries_empties_the_retries_index() -> None:
    sim, outcome = run(scenario("cancel_during_retry"))
    history = outcome.history
    written = of(history, "cancel_written")[0]
    a = written["attempt_id"]
    waiting = {e["rule_id"] for e in of(history, "retry_published", attempt_id=a)}
    assert len(waiting) == 2, "the cancel must land while two retries wait in the tiers"
    assert outcome.final.evaluations[a].state == "cancelled"
    # the retries came due and were dropped; the sweeper never re-published one
    assert len(of(history, "terminal_dropped", attempt_id=a, kind="retry")) == 2
    assert not of(history, "sweeper_retried", attempt_id=a)
    assert not [e for e in of(history, "rule_started", attempt_id=a) if e["t"] > written["t"]]
    running, retries = indexed(sim)
    assert a not in running and a not in retries


def _redis() -> tuple[simpy.Environment, SimRedis]:
    env = simpy.Environment()
    return env, SimRedis(env, running_index="r", retries_index="q", ttl_s=3600, lease_ms=600)


def test_the_claim_scripts_drop_a_terminal_evaluation_instead_of_restamping_it() -> None:
    _, redis = _redis()
    redis.begin("a1", "w1", PLAN.order, PLAN, 0)
    redis.write_status("a1", "compiles", "failed_attempt_1", 100)
    redis.release("a1", "w1")
    redis._set(eval_key("a1", "state"), "cancelled", 3600)  # a cancel that cleaned nothing
    redis._set(eval_key("a1", "final_published"), "1", 3600)
    assert redis.claim_retry(retry_member("a1", "compiles"), 0, 10_000) is None
    assert redis.claim_stale("a1", 0, 10_000) is False
    assert not redis.get("r") and not redis.get("q")  # (an emptied set is gone)
    # a terminal evaluation not yet announced is still claimed: the resume announces it
    redis.begin("a2", "w1", PLAN.order, PLAN, 0)
    redis.release("a2", "w1")
    redis._set(eval_key("a2", "state"), "completed", 3600)
    assert redis.claim_stale("a2", 0, 10_000) is True


def test_the_owner_does_not_restamp_nor_index_a_cancelled_evaluation() -> None:
    _, redis = _redis()
    begun = redis.begin("a1", "w1", PLAN.order, PLAN, 0)
    assert redis.set_state("a1", "cancelled") is None
    assert redis.renew({"a1": begun.fence}, "w1", 500) == {"a1": True}
    assert redis.get("r") == {"a1": 0}  # the stamp goes stale; the lease is still renewed
    assert redis.write_status("a1", "compiles", "failed_attempt_1", 900) == (
        None,
        "cancelled",
        None,
    )
    assert redis.get(status_key("a1", "compiles")) == "failed_attempt_1"
    assert not redis.get("q")
    assert redis.done("a1", "") is True
    assert not redis.get("r")


# --- (c) a cancel is seen at the next step --------------------------------------------------


class _NoBroadcast(RedisRabbitSim):
    """A design whose cancel client never publishes the control broadcast (a lost or late
    broadcast): the owner can learn of the cancel from Redis only."""

    def on_cancel(self, a: acts.Cancel) -> Generator[Any, Any, str]:
        attempt_id = a.attempt_id
        client = BrokerClient(self.env, self.broker, "runner-cancel")
        while not (yield from client.connect()):
            yield self.env.timeout(self.options.reconnect_interval_s)
        kept = yield from self.store.call(self.redis.set_state, attempt_id, "cancelled")
        assert kept is None
        body = {"attempt_id": attempt_id, "status": "cancelled", "verdicts": {}}
        yield from client.publish_event("evaluation.completed", body, f"{attempt_id}:completed")
        yield from self.store.call(self.redis.done, attempt_id, "")
        yield from client.close()
        return "cancelled"


@pytest.mark.parametrize("name", ["cancel_midway", "cancel_during_retry"])
def test_a_cancel_is_seen_in_the_store_before_the_next_start(name: str) -> None:
    outcome = SimRun(scenario(name), adapter=_NoBroadcast).run()
    history = outcome.history
    written = of(history, "cancel_written")[0]
    a = written["attempt_id"]
    assert not of(history, "cancel_received")  # no broadcast: only the store can tell
    seen = of(history, "cancel_seen", attempt_id=a)
    assert seen and seen[0]["state"] == "cancelled"
    # rules take 100 ms at least here: a start later than one round trip after the write
    # would be a start the owner decided after the cancel was durable
    late = [e for e in of(history, "rule_started", attempt_id=a) if e["t"] > written["t"] + 0.01]
    assert late == []
    assert not of(history, "retry_published", attempt_id=a) or all(
        e["t"] < written["t"] for e in of(history, "retry_published", attempt_id=a)
    )
    assert len(of(history, "rule_started", attempt_id=a)) < len(PLAN.order)
    assert outcome.final.evaluations[a].state == "cancelled"


def test_the_start_markers_carry_the_state_check() -> None:
    _, redis = _redis()
    redis.begin("a1", "w1", PLAN.order, PLAN, 0)
    result = RuleResult("compiles", "pass", 0.9, 10)
    assert redis.write_result("a1", result, [("static_analysis", 1)]) == (None, [1], None)
    assert redis.mark_started("a1", [("test_run", 1)]) == ([1], None)
    redis.set_state("a1", "cancelled")
    late = RuleResult("tests_present", "pass", 0.9, 10)
    assert redis.write_result("a1", late, [("test_run", 1)]) == (None, [], "cancelled")
    assert redis.mark_started("a1", [("test_run", 1)]) == ([], "cancelled")
    assert redis.mark_started("a1", []) == ([], "cancelled")  # a level-1 retry's look
    # a finished rule is kept
    assert redis.get(result_key("a1", "tests_present")) == late.to_json()


# --- (b) lost writes never give a false completed -------------------------------------------


def test_redis_data_loss_announces_only_results_redis_holds() -> None:
    sim, outcome = run(scenario("redis_data_loss"))
    history = outcome.history
    restarted = of(history, "service_restarted", service="redis")
    assert restarted and restarted[0]["lost_writes"] == 12
    restored = of(history, "results_restored")
    assert restored, "the loss must have taken results the owners held"
    announced = of(history, "completed_received")
    assert {e["body"]["attempt_id"] for e in announced} == set(outcome.attempt_ids)
    for e in announced:
        body = e["body"]
        final = outcome.final.evaluations[body["attempt_id"]]
        assert body["status"] == final.state == "completed"
        for rule_id, verdict in body["verdicts"].items():
            if verdict in RULE_STATES:
                continue
            held = final.results.get(rule_id)
            assert held is not None and held.verdict == verdict, (body["attempt_id"], rule_id)
    # nothing was run again to get them back: the owners wrote them from memory
    assert outcome.result.stats.get("reruns", 0) == 0
    running, retries = indexed(sim)
    assert not running and not retries


def test_the_final_write_restores_what_a_failover_lost() -> None:
    _, redis = _redis()
    redis.begin("a1", "w1", PLAN.order, PLAN, 0)
    kept = RuleResult("compiles", "pass", 0.9, 10)
    lost = RuleResult("tests_present", "fail", 0.2, 10)
    redis.write_result("a1", kept, [])
    redis.write_status("a1", "license_header", "permanently_failed", None)
    redis._del(status_key("a1", "license_header"))  # as a failover would have it
    results = {"compiles": kept, "tests_present": lost}
    assert redis.finish("a1", "partial", results, ["license_header"]) == (
        None,
        ["tests_present", "license_header"],
    )
    assert redis.get(result_key("a1", "tests_present")) == lost.to_json()
    assert redis.get(status_key("a1", "license_header")) == "permanently_failed"
    assert redis.get(eval_key("a1", "state")) == "partial"
    # once terminal, the state is kept and nothing is written
    assert redis.finish("a1", "completed", results, []) == ("partial", [])
    # the flag after the announcement refuses when the final state is gone again
    redis._del(eval_key("a1", "state"))
    assert redis.done("a1", "w1") is False
    assert redis.get(eval_key("a1", "final_published")) is None


# --- the faults, from scenario files ---------------------------------------------------------


def test_scenario_fields_set_the_simulated_broker_and_redis() -> None:
    options = scenario_options(scenario("consumer_timeout").spec, SimOptions())
    assert options.consumer_timeout_s == 0.5
    options = scenario_options(scenario("lost_dead_letter").spec, SimOptions())
    assert options.dead_letter_loss == 0.5
    options = scenario_options(scenario("redis_data_loss").spec, SimOptions())
    assert options.redis_failover_loss == 12
    # a scenario without them leaves the options as given
    given = SimOptions(dead_letter_loss=0.3)
    assert scenario_options(scenario("cancel_midway").spec, given) is given


def test_lost_dead_letters_are_the_ids_the_live_runner_would_take() -> None:
    loaded = scenario("lost_dead_letter")
    _, outcome = run(loaded)
    lost = of(outcome.history, "retry_lost")
    assert lost, "half the retries should have been lost"
    broker = loaded.spec.broker
    published = of(outcome.history, "retry_published")
    drawn = {
        (e["attempt_id"], e["rule_id"], e["attempt"])
        for e in published
        if broker.loses(loaded.spec.seed, f"{e['attempt_id']}:{e['rule_id']}:{e['attempt']}")
    }
    assert {(e["attempt_id"], e["rule_id"], e["attempt"]) for e in lost} == drawn
    rescued = {
        (e["attempt_id"], e["rule_id"], e["attempt"])
        for e in of(outcome.history, "sweeper_retried")
    }
    assert drawn <= rescued
    assert {f.state for f in outcome.final.evaluations.values()} == {"completed"}


def test_a_consumer_timeout_redelivers_a_held_retry() -> None:
    _, outcome = run(scenario("consumer_timeout"))
    redelivered = [e for e in of(outcome.history, "delivered", kind="retry") if e["redelivered"]]
    assert redelivered  # the broker took them back from the channel it closed
    assert outcome.result.stats["reruns"] == 0  # and no attempt ran twice for it
    assert {f.state for f in outcome.final.evaluations.values()} == {"completed"}


def test_the_explorer_draws_the_broker_and_redis_faults() -> None:
    base = document(scenario("redis_data_loss"))
    drawn = [swarm(base, seed).get("redis", {}).get("lose_last_writes") for seed in range(40)]
    assert None in drawn  # left out on some seeds
    kept = [n for n in drawn if n is not None]
    assert kept and all(1 <= n <= 12 for n in kept)
    base = document(scenario("lost_dead_letter"))
    shares = [swarm(base, seed).get("broker", {}).get("dead_letter_loss") for seed in range(40)]
    assert None in shares and all(0.25 <= p <= 0.5 for p in shares if p is not None)
    plain = document(scenario("crash_after_ack"))
    assert "broker" not in swarm(plain, 3) and "redis" not in swarm(plain, 3)


def test_live_mode_refuses_these_settings_on_shared_services() -> None:
    assert refusal(scenario("consumer_timeout"), {"redis"}) == (
        f"{ROOT / 'scenarios' / 'consumer_timeout.yaml'}: broker.consumer_timeout_s: needs "
        "the run's own broker, but this run uses a shared one (AMQP_URL); unset it to let the "
        "run start its own"
    )
    assert "redis" in (refusal(scenario("redis_data_loss"), {"broker"}) or "")
    assert refusal(scenario("lost_dead_letter"), set()) is None  # the runner's own doing
    assert refusal(scenario("consumer_timeout"), {"redis", "broker"}) is None


@pytest.mark.slow  # the run's own redis-server: installed
def test_chaos_run_live_refuses_in_one_line() -> None:
    """Before anything starts: a shared broker (AMQP_URL) cannot take a consumer_timeout."""
    env = {**os.environ, "AMQP_URL": "amqp://guest:guest@127.0.0.1:5672/"}
    proc = subprocess.run(
        [sys.executable, "-m", "chaos", "run", "scenarios/consumer_timeout.yaml", "--mode", "live"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "broker.consumer_timeout_s" in lines[0]


def test_an_aof_is_cut_by_whole_writes() -> None:
    def cmd(*parts: str) -> bytes:
        out = f"*{len(parts)}\r\n".encode()
        for p in parts:
            out += f"${len(p)}\r\n{p}\r\n".encode()
        return out

    chunks = [
        cmd("SELECT", "0") + cmd("SET", "a", "1"),
        cmd("MULTI") + cmd("SET", "b", "2") + cmd("ZADD", "z", "1", "m") + cmd("EXEC"),
        cmd("HINCRBY", "h", "f", "1"),
    ]
    data = b"".join(chunks)
    starts = write_offsets(data + b"*3\r\n$3\r\nSET")  # a torn last command is no write
    assert starts == [0, len(chunks[0]), len(chunks[0]) + len(chunks[1])]
