"""The engine bugs of issue 8 and the broker and Redis faults behind them, on the real
services: the store's Lua scripts (which `sim/redis.py` copies), worker processes killed
for real, and the shipped scenarios run live against the run's own Redis and RabbitMQ.

(a) A terminal evaluation leaves every index: no sweeper re-publishes it.
(b) A Redis that lost acknowledged writes never gets a false `completed` announced.
(c) A cancel is seen at the owner's next step from the store, without its broadcast.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from chaos.runner import Outcome, ScenarioRun
from chaos.scenario import load_scenario
from chaos.systems.redis_rabbitmq.services import Services
from engine.core import RuleResult
from engine.core.states import RuleState
from engine.plan import Plan
from engine.runtime.store import RedisStore, eval_key, result_key, retry_member, status_key
from engine.submit import EngineClient
from tests.live.conftest import ROOT, Live

pytestmark = [pytest.mark.live, pytest.mark.slow]

RULE_STATES = {s.value for s in RuleState}  # a verdict that names no result


def of(history: list[dict], ev: str, **match: Any) -> list[dict]:
    return [e for e in history if e["ev"] == ev and all(e.get(k) == v for k, v in match.items())]


def indexed(live: Live, attempt_id: str) -> dict[str, Any]:
    """What the namespace's running and retries indexes hold of one evaluation."""
    config = live.config()
    running = live.redis.zscore(config.name("engine:running"), attempt_id)
    members = live.redis.zrange(config.name("engine:retries"), 0, -1)
    return {"running": running, "retries": [m for m in members if m.startswith(attempt_id)]}


# --- the scripts, as the simulator copies them -----------------------------------------------


def test_the_store_scripts_treat_a_terminal_evaluation_as_the_simulator_does(
    live: Live, code_review: Plan
) -> None:
    [a, b] = live.ids(2)

    async def go() -> None:
        store = RedisStore(live.config())
        try:
            begun = await store.begin(a, "w1", code_review.order, code_review.to_json())
            assert begun.snapshot is not None
            result = RuleResult("compiles", "pass", 0.9, 10)
            assert await store.write_result(a, result, [("static_analysis", 1)]) == (
                None,
                [1],
                None,
            )
            before_ms = int(live.redis.time()[0]) * 1000
            kept, over, due = await store.write_status(
                a, "tests_present", "failed_attempt_1", 10**9
            )
            assert (kept, over) == (None, None)
            # due a delay after the write landed, by Redis's clock
            assert due is not None and 0 <= due - 10**9 - before_ms < 60_000
            assert indexed(live, a)["retries"] == [retry_member(a, "tests_present")]
            # a cancel: the retries index loses the evaluation at once
            assert await store.set_state(a, "cancelled") is None
            assert indexed(live, a)["retries"] == []
            late = RuleResult("readme_present", "pass", 0.5, 10)
            assert await store.write_result(a, late, [("docs_quality", 1)]) == (
                None,
                [],
                "cancelled",
            )
            assert await store.mark_started(a, [("test_run", 1)]) == ([], "cancelled")
            assert await store.mark_started(a, []) == ([], "cancelled")
            assert await store.write_status(a, "license_header", "failed_attempt_1", 1) == (
                None,
                "cancelled",
                None,
            )
            assert indexed(live, a)["retries"] == []
            assert await store.renew({a: begun.fence}, "w1") == {a: True}
            # announced: out of the running index; a sweeper claims nothing of it
            assert await store.done(a, "") is True
            assert indexed(live, a) == {"running": None, "retries": []}
            live.redis.zadd(live.config().name("engine:running"), {a: 1})
            live.redis.delete(eval_key(a, "owner"))
            assert await store.claim_stale(a, 0) is False
            assert indexed(live, a)["running"] is None
            live.redis.zadd(live.config().name("engine:retries"), {retry_member(a, "x"): 1})
            assert await store.claim_retry(retry_member(a, "x"), 0) is None
            assert indexed(live, a)["retries"] == []

            # (b): the final write restores what vanished, in the same round trip
            await store.begin(b, "w1", code_review.order, code_review.to_json())
            kept = RuleResult("compiles", "pass", 0.9, 10)
            lost = RuleResult("tests_present", "fail", 0.2, 10)
            await store.write_result(b, kept, [])
            results = {"compiles": kept, "tests_present": lost}
            assert await store.finish(b, "partial", results, ["license_header"]) == (
                None,
                ["tests_present", "license_header"],
            )
            assert live.result(b, "tests_present") == lost
            assert live.status(b, "license_header") == "permanently_failed"
            assert await store.finish(b, "completed", results, []) == ("partial", [])
            live.redis.delete(eval_key(b, "state"))  # lost after the announcement
            assert await store.done(b, "w1") is False
            assert live.redis.get(eval_key(b, "final_published")) is None
        finally:
            await store.close()

    asyncio.run(go())
    assert live.redis.get(result_key(a, "readme_present")) is not None
    assert live.redis.get(status_key(a, "license_header")) == "failed_attempt_1"


# --- (a) and (c) with real worker processes ---------------------------------------------------


def test_a_cancel_while_the_owner_is_dead_is_never_swept_again(
    live: Live, code_review: Plan
) -> None:
    agent = {"latency_ms": 200_000}  # 200 ms a call
    first = live.worker(agent=agent)
    cancelled, other = live.ids(2)
    live.submit(code_review, [cancelled, other])
    live.wait_for(
        lambda: all(live.events("rule_started", a) for a in (cancelled, other)),
        what="both evaluations running",
    )
    first.kill()
    assert indexed(live, cancelled)["running"] is not None  # its owner is dead
    assert live.cancel(cancelled) == "cancelled"
    assert indexed(live, cancelled) == {"running": None, "retries": []}
    live.worker(agent=agent)
    # the sweeper resumes the other evaluation, both having gone stale together; it never
    # re-publishes the cancelled one
    live.wait_for(lambda: live.events("sweeper_resumed", other), what="the other resumed")
    assert live.wait([other]) == {other: "completed"}
    live.wait_for(lambda: live.events("final_published", other), what="the other announced")
    assert not live.events("sweeper_resumed", cancelled)
    assert not live.events("delivered", cancelled, reason="stale_heartbeat")
    assert live.redis.get(f"attempt:{cancelled}:state") == "cancelled"
    assert indexed(live, cancelled) == {"running": None, "retries": []}
    assert indexed(live, other) == {"running": None, "retries": []}


def test_a_cancel_during_retries_leaves_no_retry_to_sweep(live: Live, code_review: Plan) -> None:
    live.time_scale = 0.01  # tier 1: 600 ms, time to cancel while the retry waits
    live.base_args.update({"time-scale": "0.01", "tiers-ms": "60000", "retry-grace-ms": "300"})
    agent = {"latency_ms": 10_000, "fail_rules": {"compiles": 3}, "error_kinds": {"quota": 1}}
    live.worker(agent=agent)
    [a] = live.ids(1)
    live.submit(code_review, [a])
    live.wait_for(lambda: live.events("retry_published", a), what="a retry in its tier")
    assert indexed(live, a)["retries"] == [retry_member(a, "compiles")]
    assert live.cancel(a) == "cancelled"
    assert indexed(live, a)["retries"] == []
    live.wait_for(
        lambda: live.events("terminal_dropped", a, kind="retry"), what="the retry dropped"
    )
    live.wait_for(lambda: live.events("evaluation_terminal", a), what="the owner's stop")
    assert indexed(live, a) == {"running": None, "retries": []}
    assert not live.events("sweeper_retried", a)
    started = live.events("rule_started", a)
    stopped = (live.events("cancel_seen", a) + live.events("cancel_received", a, held=True))[0]
    assert not [e for e in started if e["t"] > stopped["t"]]


def test_a_cancel_is_seen_in_the_store_without_its_broadcast(live: Live, code_review: Plan) -> None:
    live.worker("--max-parallel", "1", agent={"latency_ms": 150_000})  # 150 ms a call
    [a] = live.ids(1)
    live.submit(code_review, [a])
    live.wait_for(lambda: sum(live.starts(a).values()) >= 2, what="two rules started")

    async def cancel_without_broadcast() -> None:
        """`EngineClient.cancel` but for the control broadcast (lost, or late)."""
        async with EngineClient(live.config()) as client:
            assert await client.store.set_state(a, "cancelled") is None
            body = {"attempt_id": a, "status": "cancelled", "verdicts": {}}
            await client.broker.publish_event("evaluation.completed", body, f"{a}:completed")
            assert await client.store.done(a, "") is True

    asyncio.run(cancel_without_broadcast())
    live.wait_for(lambda: live.events("evaluation_terminal", a), what="the owner's stop")
    [seen] = live.events("cancel_seen", a)
    assert seen["state"] == "cancelled"
    assert not live.events("cancel_received", a)
    # the owner started nothing once it had read the cancel, and stopped at that step
    assert not [e for e in live.events("rule_started", a) if e["t"] > seen["t"]]
    assert sum(live.starts(a).values()) < len(code_review.order)
    terminal = live.events("evaluation_terminal", a)
    assert [(e["status"], e["won"]) for e in terminal] == [("cancelled", False)]
    assert indexed(live, a) == {"running": None, "retries": []}


# --- the shipped scenarios, live ------------------------------------------------------------


def run(services: Services, name: str, out: Path) -> Outcome:
    loaded = load_scenario(ROOT / "scenarios" / f"{name}.yaml")
    outcome = asyncio.run(ScenarioRun(loaded, services, out).run())
    for svc in (services.redis, services.broker):  # a scenario may leave one down
        if svc is not None and not svc.alive:
            svc.restart()
    assert outcome.result.ok, (outcome.result.verdicts, outcome.result.violations[:2])
    return outcome


def test_redis_data_loss_announces_only_results_redis_holds(
    services: Services, tmp_path: Path
) -> None:
    outcome = run(services, "redis_data_loss", tmp_path)
    history = outcome.history
    [restarted] = of(history, "service_restarted", service="redis")
    assert restarted["lost_writes"] == 12  # the append-only file really lost them
    assert of(history, "results_restored") or of(history, "final_state_restored")
    announced = of(history, "completed_received")
    assert {e["body"]["attempt_id"] for e in announced} == set(outcome.attempt_ids)
    for e in announced:
        body = e["body"]
        final = outcome.final.evaluations[body["attempt_id"]]
        assert body["status"] == final.state == "completed"
        for rule_id, verdict in body["verdicts"].items():
            if verdict not in RULE_STATES:
                held = final.results.get(rule_id)
                assert held is not None and held.verdict == verdict, (body, rule_id)


def test_a_lost_dead_letter_is_taken_off_its_queue_and_swept(
    services: Services, tmp_path: Path
) -> None:
    loaded = load_scenario(ROOT / "scenarios" / "lost_dead_letter.yaml")
    outcome = run(services, "lost_dead_letter", tmp_path)
    history = outcome.history
    lost = {(e["attempt_id"], e["rule_id"], e["attempt"]) for e in of(history, "retry_lost")}
    drawn = {
        (e["attempt_id"], e["rule_id"], e["attempt"])
        for e in of(history, "retry_published")
        if loaded.spec.broker.loses(
            loaded.spec.seed, f"{e['attempt_id']}:{e['rule_id']}:{e['attempt']}"
        )
    }
    assert lost and lost == drawn  # the simulator loses the same ones
    assert not of(history, "retry_loss_missed")
    swept = {(e["attempt_id"], e["rule_id"], e["attempt"]) for e in of(history, "sweeper_retried")}
    assert lost <= swept
    assert {f.state for f in outcome.final.evaluations.values()} == {"completed"}


def test_a_short_consumer_timeout_redelivers_held_retries(
    services: Services, tmp_path: Path
) -> None:
    outcome = run(services, "consumer_timeout", tmp_path)
    redelivered = [e for e in of(outcome.history, "delivered", kind="retry") if e["redelivered"]]
    assert redelivered  # the broker closed the channel holding them and requeued them
    assert outcome.result.stats["reruns"] == 0
    assert {f.state for f in outcome.final.evaluations.values()} == {"completed"}
    assert services.broker is not None and services.broker.consumer_timeout_ms == 500
