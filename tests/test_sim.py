"""The simulator: every scenario passes, one seed is one history, every mutant is caught.

Layers, as in the rest of the suite: the broker and Redis models alone (head-of-line
blocking, requeue on a dead consumer, unroutable forwards, TTLs and retries on simulated
time), then whole scenarios through `chaos.insim.run_scenario` and the live checker. Everything
runs on simulated time: the whole file takes seconds.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import simpy
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from chaos.insim import SimOptions, outputs, run_scenario
from chaos.insim.mutants import _OWNERS, _SHELL_OWNERS, PATCHED, patched
from chaos.mutants import MUTANTS
from chaos.scenario import LoadedScenario, load_scenario, scenario_from_dict
from engine.core import RuleResult
from engine.runtime.store import eval_key, result_key, runs_key
from sim.broker import WORK_QUEUE, BrokerClient, Delivery, SimBroker, Unroutable
from sim.redis import TERMINAL, RedisClient, SimRedis
from tests.test_chaos_runs import CATCHES

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted((ROOT / "scenarios").glob("*.yaml"))
#: Each a shrunk seed that failed on an engine before a fix: it must go on passing.
REGRESSIONS = sorted((ROOT / "scenarios" / "regressions").glob("*.yaml"))
DAY = 24 * 3600


def scenario(name: str) -> LoadedScenario:
    return load_scenario(ROOT / "scenarios" / f"{name}.yaml")


def of(history: list[dict], ev: str, **match: Any) -> list[dict]:
    return [e for e in history if e["ev"] == ev and all(e.get(k) == v for k, v in match.items())]


# --- the broker alone --------------------------------------------------------------------


def _broker(per_message_ttl: bool) -> tuple[simpy.Environment, SimBroker, list]:
    """Two delay tiers (1 s and 10 s) dead-lettering to the work queue, one consumer that
    notes when each message arrives."""
    env = simpy.Environment()
    tiers = {(0, 0): ("t1", 1.0), (1, 0): ("t2", 10.0)}
    broker = SimBroker(env, random.Random(0), (0.0, 0.0), tiers)
    conn = broker.connect("consumer", None)
    seen: list[tuple[float, str]] = []

    def handler(d: Delivery) -> None:
        seen.append((env.now, d.body["name"]))
        broker.settle_arrive(conn, d.tag, True)

    broker.consume(conn, WORK_QUEUE, 10, handler)
    return env, broker, seen


@pytest.mark.parametrize("per_message_ttl", [False, True])
def test_head_of_line_blocking_only_with_per_message_ttl(per_message_ttl: bool) -> None:
    from chaos.insim import mutants

    env, broker, seen = _broker(per_message_ttl)
    with mutants.patched("per_message_ttl" if per_message_ttl else None):
        broker.publish_delay((1, 0), {"name": "long"}, "long")  # due at 10 s
        broker.publish_delay((0, 0), {"name": "short"}, "short")  # due at 1 s
    env.run(until=20)
    arrivals = dict((name, t) for t, name in seen)
    assert arrivals["long"] == pytest.approx(10.0)
    if per_message_ttl:  # RabbitMQ expires only the head: the short one waits behind
        assert arrivals["short"] == pytest.approx(10.0)
        assert [n for _, n in seen] == ["long", "short"]
    else:  # one queue per tier: each expires on its own
        assert arrivals["short"] == pytest.approx(1.0)


def test_dead_consumer_requeues_at_the_front_and_loses_its_private_queue() -> None:
    env = simpy.Environment()
    broker = SimBroker(env, random.Random(0), (0.001, 0.001), {})
    dead = broker.connect("dead", None)
    broker.declare_private(dead, "worker.dead")
    held: list[Delivery] = []
    broker.consume(dead, WORK_QUEUE, 2, held.append)
    for name in ("a", "b", "c"):
        broker.publish_arrive("", WORK_QUEUE, {"name": name}, name)
    env.run(until=1)
    assert [d.body["name"] for d in held] == ["a", "b"]  # prefetch 2: "c" waits
    broker.drop(dead)
    assert "worker.dead" not in broker.queues
    later = broker.connect("later", None)
    got: list[Delivery] = []
    broker.consume(later, WORK_QUEUE, 10, got.append)
    env.run(until=2)
    assert [(d.body["name"], d.redelivered) for d in got] == [
        ("a", True),
        ("b", True),
        ("c", False),
    ]
    client = BrokerClient(env, broker, "sender")
    outcome: list[str] = []

    def forward() -> Generator:
        assert (yield from client.connect())
        try:
            yield from client.forward("worker.dead", {"name": "x"}, "x")
        except Unroutable:
            outcome.append("unroutable")

    env.process(forward())
    env.run(until=3)
    assert outcome == ["unroutable"]


def test_consumer_timeout_hands_a_held_message_back() -> None:
    env = simpy.Environment()
    broker = SimBroker(env, random.Random(0), (0.001, 0.001), {}, consumer_timeout_s=1.0)
    lost: list[str] = []
    slow = broker.connect("slow", lambda conn: lost.append(conn.name))
    broker.declare_private(slow, "worker.slow")
    held: list[Delivery] = []
    broker.consume(slow, WORK_QUEUE, 1, held.append)
    broker.publish_arrive("", WORK_QUEUE, {"name": "a"}, "a")
    env.run(until=0.9)
    assert [d.body["name"] for d in held] == ["a"] and lost == []
    env.run(until=1.1)  # never acked: the channel is closed, the message requeued
    assert lost == ["slow"]
    assert "worker.slow" in broker.queues  # the connection's exclusive queue stays
    other = broker.connect("other", None)
    got: list[Delivery] = []
    broker.consume(other, WORK_QUEUE, 1, got.append)
    env.run(until=1.2)
    assert [(d.body["name"], d.redelivered) for d in got] == [("a", True)]


# --- Redis alone -----------------------------------------------------------------------


def _redis(**kw: Any) -> tuple[simpy.Environment, SimRedis]:
    env = simpy.Environment()
    return env, SimRedis(
        env, running_index="r", retries_index="q", ttl_s=7 * DAY, lease_ms=600, **kw
    )


def test_keys_expire_on_simulated_time() -> None:
    env, redis = _redis()
    result = RuleResult("compiles", "pass", 0.9, 10)
    assert redis.write_result("a1", result, [("compiles", 1)]) == (None, [1], None)
    assert redis.begin("a1", "w1", ["compiles"], "plan", 0).snapshot is not None
    key, owner = result_key("a1", "compiles"), eval_key("a1", "owner")
    assert redis.ttl_of(key) == 7 * DAY
    env.run(until=0.599)
    assert redis.get(owner) == "w1"
    assert redis.begin("a1", "w2", ["compiles"], "plan", 599).holder == "w1"  # a live lease
    env.run(until=0.601)
    assert redis.get(owner) is None  # the lease lapsed: any worker may take it
    assert redis.begin("a1", "w2", ["compiles"], "plan", 601).fence == "2:w2"
    env.run(until=7 * DAY - 1)
    assert redis.get(key) == result.to_json() and redis.ttl_of(key) == 1
    env.run(until=7 * DAY + 1)
    assert redis.get(key) is None and redis.ttl_of(key) == -2
    assert redis.get(runs_key("a1", "compiles")) is None


def test_a_result_written_without_ttl_never_expires() -> None:
    from chaos.insim import mutants

    env, redis = _redis()
    with mutants.patched("result_without_ttl"):  # the mutant's SET NX, without EX
        redis.write_result("a1", RuleResult("compiles", "pass", 0.9, 10), [])
    redis.write_result("a1", RuleResult("tests", "pass", 0.9, 10), [])  # restored after
    env.run(until=30 * DAY)
    assert redis.ttl_of(result_key("a1", "compiles")) == -1
    assert redis.ttl_of(result_key("a1", "tests")) == -2  # expired after its 7 days


def test_calls_wait_out_a_redis_kill_and_a_lost_reply_runs_twice() -> None:
    env, redis = _redis()
    client = RedisClient(env, redis, random.Random(0), (0.01, 0.01))
    replies: list[Any] = []

    def count() -> Generator:
        replies.append((yield from client.call(redis.mark_started, "a1", [("r", 1)])))

    env.process(count())
    env.run(until=0.015)  # applied at 0.01; the reply is on its way back
    redis.kill()
    env.run(until=0.5)
    assert replies == []  # the client retries, with backoff, while Redis is down
    redis.restart()
    env.run(until=5)
    assert replies == [([2], None)]  # the script ran twice: once before the kill, once after
    assert redis.get(runs_key("a1", "r")) == {"1": 2}


def test_a_request_on_its_way_lands_even_if_its_sender_dies() -> None:
    env, redis = _redis()
    client = RedisClient(env, redis, random.Random(0), (0.01, 0.01))

    def write() -> Generator:
        yield from client.call(redis.mark_started, "a1", [("r", 1)])

    sender = env.process(write())
    env.run(until=0.005)
    sender.interrupt()  # SIGKILL with the request on the wire
    with pytest.raises(simpy.Interrupt):
        env.run(until=sender)
    assert redis.get(runs_key("a1", "r")) is None
    env.run(until=0.02)
    assert redis.get(runs_key("a1", "r")) == {"1": 1}


def test_a_failover_loses_the_last_writes() -> None:
    _, redis = _redis(failover_loss=2)
    for rule in ("r1", "r2", "r3"):
        redis.apply(redis.write_result, ("a1", RuleResult(rule, "pass", 0.5, 1), []))
    redis.kill()
    redis.restart()
    kept = {r for r in ("r1", "r2", "r3") if redis.get(result_key("a1", r)) is not None}
    assert kept == {"r1"}


_STEPS = st.lists(
    st.tuples(
        st.sampled_from(["state", "final_published", "del", "expire", "wait", "failover"]),
        st.sampled_from(["a1", "a2", "a3"]),
        st.sampled_from(["completed", "running", "cancelled"]),
        st.sampled_from([None, 0.5, 2.0]),
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(steps=_STEPS)
@example(  # settled, then expired with no write in between
    steps=[
        ("state", "a1", "completed", 0.5),
        ("final_published", "a1", "completed", None),
        ("wait", "a1", "completed", 2.0),
    ]
)
def test_the_settled_poll_reads_what_record_reads(steps: list[tuple]) -> None:
    """`SimRedis.settled` reads again only what was written or expired since it last
    looked: after any writes, deletions, TTLs, time and failovers, it finds what a read of
    every evaluation's record finds."""
    env, redis = _redis(failover_loss=2)
    ids = ["a1", "a2", "a3"]
    for what, a, state, ex in steps:
        if what in ("state", "final_published"):
            value = state if what == "state" else "1"
            redis.apply(redis._set, (eval_key(a, what), value, ex))
        elif what == "del":
            redis.apply(redis._del, (eval_key(a, "final_published" if ex else "state"),))
        elif what == "expire":
            redis.apply(redis._expire, (eval_key(a, "state"), ex or 1.0))
        elif what == "wait":
            env.run(until=env.now + (ex or 1.0))
        else:
            redis.kill()
            redis.restart()
        records = {i: redis.record(i) for i in ids} if state == "running" else None
        asked = ids if ex != 2.0 else list(ids)  # the same ids, or others (read afresh)
        found = redis.settled(asked)  # before or after the reads, as they come
        records = records or {i: redis.record(i) for i in ids}
        assert found == {i for i in ids if records[i][0] in TERMINAL and records[i][2]}


# --- whole scenarios --------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", SCENARIOS + REGRESSIONS, ids=[p.stem for p in SCENARIOS + REGRESSIONS]
)
def test_every_scenario_passes_in_the_simulator(path: Path) -> None:
    loaded = load_scenario(path)
    started = time.perf_counter()
    outcome = run_scenario(loaded)
    wall = time.perf_counter() - started
    print(f"{loaded.spec.name}: {outcome.sim_time_s:.3f} s simulated in {wall * 1000:.1f} ms")
    result = outcome.result
    assert result.ok, (result.verdicts, result.budget_failures, result.violations[:2])
    assert outcome.extra["shell_errors"] == []
    states = {fin.state for fin in outcome.final.evaluations.values()}
    assert states <= {"completed", "partial", "failed", "cancelled"}
    assert len(of(outcome.history, "submitted")) == len(outcome.attempt_ids)
    assert outcome.history[-1]["ev"] == "run_finished"


@pytest.mark.parametrize("name", ["crash_after_ack", "worker_kill_storm"])
def test_one_seed_one_history(name: str) -> None:
    loaded = scenario(name)
    first, again = run_scenario(loaded), run_scenario(loaded)
    assert first.history_hash == again.history_hash
    assert first.history == again.history
    other = run_scenario(loaded, seed=loaded.spec.seed + 1)
    assert other.history_hash != first.history_hash


def test_a_crash_after_the_ack_is_resumed_from_redis() -> None:
    history = run_scenario(scenario("crash_after_ack")).history
    (crash,) = of(history, "crash")
    assert (crash["src"], crash["failpoint"]) == ("sim-w0-1", "rule_after_write")
    assert of(history, "worker_exited", worker=0, code=-9)
    (restarted,) = of(history, "worker_restarted", worker=0)
    assert restarted["t"] >= crash["t"] + 0.2  # restart_delay_s
    victim = next(e["attempt_id"] for e in of(history, "rule_started"))
    written = {
        e["rule_id"]
        for e in of(history, "result_persisted", attempt_id=victim, src="sim-w0-1", won=True)
    }
    assert len(written) == 3  # hit=3: the crash came right after the third write
    resumed = of(history, "sweeper_resumed", attempt_id=victim, src="sim-w0-2")
    assert resumed and resumed[0]["t"] - crash["t"] >= 0.6  # stale_ms
    (recovered,) = of(history, "recovered", attempt_id=victim)
    assert written <= set(recovered["loaded"])
    rerun = [
        e
        for e in of(history, "rule_started", attempt_id=victim, src="sim-w0-2")
        if e["rule_id"] in written
    ]
    assert rerun == []
    # The start markers: what was running at the crash and has no result in Redis restarts
    # flagged as a rerun. (A marker rides on the write that made a rule ready, so a rule
    # made ready by the third write, and cut off before its `rule_started`, is flagged too,
    # as in the live engine; a write that landed with its reply lost to the crash, as one
    # sent in the same batch can, is loaded instead.)
    started_before = {
        e["rule_id"] for e in of(history, "rule_started", attempt_id=victim, src="sim-w0-1")
    }
    flags = {
        e["rule_id"]: e["rerun"]
        for e in of(history, "rule_started", attempt_id=victim, src="sim-w0-2", try_no=1)
    }
    landed = set(recovered["loaded"])
    assert started_before - landed <= {r for r, rerun in flags.items() if rerun}
    assert not all(flags.values())  # rules that became ready after the resume: first runs


def test_a_crash_before_the_ack_is_redelivered_by_the_broker() -> None:
    outcome = run_scenario(scenario("crash_before_ack"))
    history = outcome.history
    crashes = of(history, "crash", failpoint="before_ack")
    assert crashes
    # `crash` names the failpoint only: the victim is what that worker had just started
    t0 = crashes[0]["t"]
    victim = of(history, "evaluation_started", src=crashes[0]["src"])[-1]["attempt_id"]
    again = [e for e in of(history, "delivered", attempt_id=victim) if e["t"] > t0]
    assert again and again[0]["redelivered"] is True and again[0]["reason"] == "submit"
    # The dead owner's queue is gone, which proves nothing (a live owner's can be gone for
    # a while too): the copy goes round until the lease has expired, then resumes it.
    resumed = [e for e in of(history, "evaluation_started", attempt_id=victim) if e["t"] > t0]
    failed = [e for e in of(history, "forward_failed", attempt_id=victim) if e["t"] > t0]
    assert failed and resumed and failed[0]["t"] < resumed[0]["t"]
    assert resumed[0]["t"] - t0 >= 0.5  # the lease (600 ms) ran out first, not a guess
    assert outcome.result.stats["reruns"] == 0


def test_a_retry_held_by_an_abandoned_evaluation_is_handed_back() -> None:
    loaded = scenario_from_dict(
        {
            "name": "raise_holding_a_retry",
            "seed": 2,
            "plan": "plans/tiny.yaml",
            "agent": {"latency_ms": 5000, "fail_rules": {"compiles": 6}},
            "retry": {"tiers_ms": [30000, 60000]},
            "faults": [
                {"failpoint": "after_retry_publish_before_ack", "action": "raise", "hit": 2}
            ],
        },
        base_dir=ROOT,
    )
    outcome = run_scenario(loaded)
    assert outcome.result.ok, outcome.result.verdicts
    (abandoned,) = of(outcome.history, "evaluation_abandoned")
    back = [
        e
        for e in of(outcome.history, "delivered", kind="retry", attempt=2, redelivered=True)
        if e["t"] > abandoned["t"]
    ]
    assert back and back[0]["t"] - abandoned["t"] < 0.01  # a NACK, not the sweeper's grace


def test_an_injected_raise_abandons_the_evaluation_and_the_sweeper_resumes_it() -> None:
    loaded = scenario_from_dict(
        {
            "name": "raise_in_window",
            "seed": 5,
            "plan": "plans/tiny.yaml",
            "agent": {"latency_ms": 5000},
            "faults": [{"failpoint": "rule_after_call_before_write", "action": "raise"}],
        },
        base_dir=ROOT,
    )
    outcome = run_scenario(loaded)
    assert outcome.result.ok, outcome.result.verdicts
    (abandoned,) = of(outcome.history, "evaluation_abandoned")
    assert abandoned["reason"] == "InjectedFault: failpoint rule_after_call_before_write fired"
    assert of(outcome.history, "sweeper_resumed")
    assert outcome.result.stats["reruns_by_cause"]["write_window"] == 1


def test_every_mutant_has_its_scenario() -> None:
    assert set(CATCHES) == set(MUTANTS)


@pytest.mark.parametrize("mutant", sorted(CATCHES))
def test_mutant_is_caught_in_the_simulator(mutant: str) -> None:
    loaded = scenario(CATCHES[mutant])
    outcome = run_scenario(loaded, mutant=mutant)
    breaks = MUTANTS[mutant].breaks
    assert not outcome.result.ok
    assert outcome.result.verdicts[breaks] == "fail", outcome.result.verdicts
    assert any(v.invariant == breaks for v in outcome.result.violations)
    assert outcome.extra["mutant"] == mutant


@pytest.mark.parametrize(
    "mutant",
    ["prune_everything", "reset_attempts_on_recovery", "no_sweeper", "nondeterministic_agent"],
)
def test_a_core_mutant_is_undone_after_its_run(mutant: str) -> None:
    loaded = scenario(CATCHES[mutant])
    before = run_scenario(loaded).history_hash
    owners = [dict(vars(owner)) for owner in _OWNERS]
    assert not run_scenario(loaded, mutant=mutant).result.ok
    assert [dict(vars(owner)) for owner in _OWNERS] == owners
    assert run_scenario(loaded).history_hash == before
    with patched(mutant):
        assert [dict(vars(owner)) for owner in _OWNERS] != owners


@pytest.mark.parametrize("mutant", sorted(PATCHED))
def test_a_patched_shell_mutant_is_undone_after_its_run(mutant: str) -> None:
    loaded = scenario(CATCHES[mutant])
    before = run_scenario(loaded).history_hash
    owners = [dict(vars(owner)) for owner in _SHELL_OWNERS]
    assert not run_scenario(loaded, mutant=mutant).result.ok
    assert [dict(vars(owner)) for owner in _SHELL_OWNERS] == owners
    assert run_scenario(loaded).history_hash == before
    with patched(mutant):
        assert [dict(vars(owner)) for owner in _SHELL_OWNERS] != owners


def test_unknown_mutant_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown mutant"):
        run_scenario(scenario("crash_after_ack"), mutant="nope")


def test_outputs_are_the_live_journal_with_the_sim_mode(tmp_path: Path) -> None:
    outcome = run_scenario(scenario("crash_in_write_window"))
    outputs(outcome, tmp_path)
    journal = json.loads((tmp_path / "journal.json").read_text())
    assert journal["ok"] is True and journal["scenario"] == "crash_in_write_window"
    assert journal["extra"]["mode"] == "sim"
    assert journal["extra"]["history_hash"] == outcome.history_hash
    lines = (tmp_path / "history.jsonl").read_text().splitlines()
    assert len(lines) == len(outcome.history)
    sources = {json.loads(line)["src"] for line in lines}
    assert sources >= {"runner", "sim-w0-1", "sim-w1-1"}  # and the crashed one's restart:
    assert {"sim-w0-2", "sim-w1-2"} & sources


def test_options_reach_the_models() -> None:
    loaded = scenario("every_rule_fails")  # level-2 retries in every evaluation
    lossy = run_scenario(loaded, options=SimOptions(dead_letter_loss=1.0))
    assert lossy.extra["dead_letters_lost"] > 0
    assert of(lossy.history, "sweeper_retried")  # every retry was lost; the sweeper's came
    assert lossy.result.ok, lossy.result.verdicts


def test_a_stall_with_until_ends_on_its_event_and_else_lasts_its_longest() -> None:
    """`final-write-retried-completed-delivered-s1`'s stall ends at the runner's
    `service_paused` (polled as the live worker polls its file); with no pause at all it
    lasts its `stall_ms`, and says that its event never came."""
    path = ROOT / "scenarios" / "regressions" / "final-write-retried-completed-delivered-s1.yaml"
    data = yaml.safe_load(path.read_text())
    for faults, came in ((data["faults"], True), (data["faults"][:2], False)):
        loaded = scenario_from_dict({**data, "faults": faults}, str(path))
        history = run_scenario(loaded).history
        (fired,) = of(history, "failpoint_fired")
        (released,) = of(history, "failpoint_released")
        assert fired["until"] == "service_paused" and released["came"] is came
        waited = released["t"] - fired["t"]
        if came:
            (paused,) = of(history, "service_paused")
            assert 0 <= released["t"] - paused["t"] <= 0.005 + 1e-9
        else:
            assert waited == pytest.approx(fired["stall_ms"] / 1000)
