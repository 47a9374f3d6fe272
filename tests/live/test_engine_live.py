"""The engine's guarantees on the real Redis and RabbitMQ, with worker processes really killed.

Time scale 0.001 everywhere unless a test needs a measurable tier: 30 s is 30 ms.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter

import aio_pika
import pytest

from engine.agent import AgentProfile, FakeAgent
from engine.config import DEFAULT_AMQP_URL, STATE_TTL_SECONDS
from engine.plan import Plan
from tests.live.conftest import PATIENCE_S, ROOT, Live

pytestmark = [pytest.mark.live, pytest.mark.slow]


def reference_verdicts(plan: Plan, attempt_id: str, profile: AgentProfile | None = None) -> dict:
    """The fault-free verdicts: the agent's verdict depends on (seed, attemptId, ruleId) only."""
    agent = FakeAgent(profile or AgentProfile())
    return {r: agent.draw(attempt_id, r, 1, 1, 0).result.verdict for r in plan.order}


def persisted_before(live: Live, attempt_id: str, pid: int) -> set[str]:
    return {
        e["rule_id"]
        for e in live.history(attempt_id)
        if e["ev"] == "result_persisted" and e["pid"] == pid
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the happy path ------------------------------------------------------------------------


def test_golden_run(live: Live, code_review: Plan) -> None:
    live.worker()
    ids = live.ids(3)

    async def run() -> list[tuple[str, dict]]:
        conn = await aio_pika.connect(DEFAULT_AMQP_URL)
        ch = await conn.channel()
        ex = await ch.get_exchange(live.config().name("evaluation.events"))
        q = await ch.declare_queue(exclusive=True)
        await q.bind(ex, "evaluation.#")
        await asyncio.to_thread(live.submit, code_review, ids)
        final = await asyncio.to_thread(live.wait, ids)
        assert set(final.values()) == {"completed"}, final
        # evaluation.completed follows the terminal state; it is recorded once confirmed.
        await asyncio.to_thread(
            live.wait_for,
            lambda: all(live.events("final_published", a) for a in ids),
            what="every final event",
        )
        events = []
        while (msg := await q.get(fail=False, timeout=PATIENCE_S)) is not None:
            events.append((msg.routing_key or "", json.loads(msg.body)))
            await msg.ack()
        await conn.close()
        return events

    events = asyncio.run(run())
    for a in ids:
        assert live.calls(a) == Counter(dict.fromkeys(code_review.order, 1))
        expected = reference_verdicts(code_review, a)
        for rid in code_review.order:
            result = live.result(a, rid)
            assert result is not None and result.verdict == expected[rid]
            assert live.status(a, rid) is None
            ttl = live.redis.ttl(f"attempt:{a}:rule:{rid}:result")
            assert STATE_TTL_SECONDS - 120 < ttl <= STATE_TTL_SECONDS
        mine = [(k, b) for k, b in events if b["attempt_id"] == a]
        kinds = Counter(k for k, _ in mine)
        assert kinds == {
            "evaluation.started": 1,
            "evaluation.pass_result": len(code_review.passes),
            "evaluation.completed": 1,
        }
        done = next(b for k, b in mine if k == "evaluation.completed")
        assert done["status"] == "completed" and done["verdicts"] == expected
        # evaluation.started is published before the ACK, which comes before any rule.
        hist = [e["ev"] for e in live.history(a)]
        assert hist.index("evaluation_started") < hist.index("acked") < hist.index("rule_started")


# --- the three retry levels ----------------------------------------------------------------


def test_transient_failure_absorbed_at_level_1(live: Live, tiny: Plan) -> None:
    port = free_port()
    live.worker(agent={"fail_rules": {"unit_tests": 2}}, metrics_port=str(port))
    [a] = live.ids(1)
    live.submit(tiny, [a])
    assert live.wait([a]) == {a: "completed"}
    assert live.calls(a)["unit_tests"] == 3  # two immediate retries inside attempt 1
    assert live.starts(a)["unit_tests"] == 1
    assert live.status(a, "unit_tests") is None  # level 1 persists nothing
    assert live.result(a, "unit_tests").attempt == 1
    assert not [e for e in live.history(a) if e["ev"] == "retry_published"]
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    text = metrics.decode()
    assert 'engine_retries_total{level="1"} 2.0' in text
    assert 'engine_evaluations_total{status="completed"} 1.0' in text
    assert "engine_tokens_total" in text


def test_level_2_retry_goes_through_the_delay_queue(live: Live, tiny: Plan) -> None:
    live.time_scale = 0.01  # tier 1 = 300 ms (+ up to 10 % jitter): long enough to measure
    live.base_args["time-scale"] = "0.01"
    live.worker(agent={"fail_rules": {"unit_tests": 3}})
    [a] = live.ids(1)
    live.submit(tiny, [a])
    assert live.wait([a]) == {a: "completed"}
    assert live.status(a, "unit_tests") == "failed_attempt_1"
    assert live.result(a, "unit_tests").attempt == 2
    assert live.starts(a)["unit_tests"] == 2
    assert live.starts(a)["compiles"] == 1  # the retry reran nothing that had finished
    hist = live.history(a)
    published = next(e for e in hist if e["ev"] == "retry_published")
    assert published["tier"] == 1 and 300 <= published["delay_ms"] <= 330
    # The TTL runs from the enqueue, which follows the status write (the publish event is
    # recorded only once the broker confirmed, which may come late under load).
    failed = next(e for e in hist if e["ev"] == "status_written")
    assert failed["status"] == "failed_attempt_1"
    delivered = next(e for e in hist if e["ev"] == "delivered" and e["kind"] == "retry")
    waited = delivered["t"] - failed["t"]
    assert waited >= published["delay_ms"] / 1000 - 0.005, waited
    second = [e for e in hist if e["ev"] == "rule_started" and e["rule_id"] == "unit_tests"][-1]
    assert second["attempt"] == 2 and second["t"] >= delivered["t"]
    assert any(e["ev"] == "retry_acked" and e["attempt"] == 2 for e in hist)


def test_permanent_failure_skips_exactly_the_dependents(live: Live, code_review: Plan) -> None:
    doomed = "static_analysis"
    live.worker("--max-attempts", "2", agent={"always_fail_rules": [doomed]})
    [a] = live.ids(1)
    live.submit(code_review, [a])
    assert live.wait([a]) == {a: "partial"}
    assert live.status(a, doomed) == "permanently_failed"
    dependents = code_review.transitive_dependents([doomed])
    assert dependents == {"security_review", "correctness_review", "code_feedback"}
    hist = live.history(a)
    skipped = {r for e in hist if e["ev"] == "rules_skipped" for r in e["rule_ids"]}
    assert skipped == dependents
    for rid in code_review.order:
        if rid == doomed or rid in dependents:
            assert live.result(a, rid) is None
        else:  # the independent branches never noticed
            assert live.result(a, rid) is not None, rid
    assert live.starts(a)[doomed] == 2  # two attempts, each with its immediate retries
    assert live.calls(a)[doomed] == 6
    assert not {r for r in dependents if live.starts(a)[r]}
    outcomes = {e["pass_id"]: e["outcome"] for e in hist if e["ev"] == "pass_published"}
    assert outcomes == {
        "intake": "complete",
        "analysis": "partial",
        "review": "partial",
        "synthesis": "partial",
    }


# --- crashes -------------------------------------------------------------------------------


def test_sigkill_before_ack_is_redelivered(live: Live, code_review: Plan) -> None:
    # A 2 s lease: the dead owner's lease is still valid when the message comes back. Its
    # private queue is gone, which proves nothing (a live owner's is gone for a while after
    # a broker restart): the message goes round until the lease expires, and only then
    # does the new worker begin the evaluation.
    live.base_args["stale-ms"] = "2000"
    w1 = live.worker(failpoints=["before_ack=crash"])
    [a] = live.ids(1)
    live.submit(code_review, [a])
    assert w1.wait_exit(PATIENCE_S) == -9
    assert not live.starts(a)  # it died before any rule
    live.worker("--no-sweeper")  # redelivery alone must bring it back
    assert live.wait([a]) == {a: "completed"}
    assert live.calls(a) == Counter(dict.fromkeys(code_review.order, 1))
    hist = live.history(a)
    assert any(e["ev"] == "delivered" and e["redelivered"] for e in hist)
    assert any(e["ev"] == "forward_failed" for e in hist)
    assert not any(e["ev"] == "lease_taken_over" for e in hist)
    # Not before the lease ran out: it was set after the first delivery was recorded, so
    # however late events are recorded on a busy machine, this bound only gets looser.
    first = next(e for e in hist if e["ev"] == "delivered")
    began = [e["t"] for e in hist if e["ev"] == "evaluation_started"]
    assert len(began) == 2 and began[1] - first["t"] >= 2.0 - 0.005


def test_crash_during_a_retry_redelivers_the_retry(live: Live, tiny: Plan) -> None:
    # Attempt 1 of unit_tests fails (3 calls); its retry is delivered, the worker dies on
    # the first call of attempt 2 while holding the retry message unacked.
    w1 = live.worker(
        agent={"fail_rules": {"unit_tests": 3}},
        failpoints=["rule_before_call=crash,rule=unit_tests,hit=4"],
    )
    [a] = live.ids(1)
    live.submit(tiny, [a])
    assert w1.wait_exit(PATIENCE_S) == -9
    finished = persisted_before(live, a, w1.pid)
    assert {"compiles", "style_check"} <= finished
    live.worker("--no-sweeper")
    assert live.wait([a]) == {a: "completed"}
    starts = live.starts(a)
    assert all(starts[r] == 1 for r in finished), starts
    assert live.result(a, "unit_tests").attempt == 2
    redelivered = [e for e in live.history(a) if e["ev"] == "delivered" and e["kind"] == "retry"]
    assert redelivered[-1]["redelivered"] is True


def test_sigkill_after_ack_is_resumed_by_the_sweeper(live: Live, code_review: Plan) -> None:
    w1 = live.worker(failpoints=["rule_after_write=crash,hit=3"])
    [a] = live.ids(1)
    live.submit(code_review, [a])
    assert w1.wait_exit(PATIENCE_S) == -9
    finished = persisted_before(live, a, w1.pid)
    assert len(finished) == 3
    live.worker()
    assert live.wait([a]) == {a: "completed"}
    starts = live.starts(a)
    assert all(starts[r] == 1 for r in finished), starts  # loaded, not rerun
    assert all(starts[r] in (1, 2) for r in code_review.order)
    # The sweeper records its resume once the broker confirms the publish, which may come
    # after the resumed evaluation has run to its end: wait for the event.
    live.wait_for(lambda: live.events("sweeper_resumed", a), what="the sweeper's resume")
    hist = live.history(a)
    recovered = next(e for e in hist if e["ev"] == "recovered")
    assert set(recovered["loaded"]) == finished
    expected = reference_verdicts(code_review, a)
    assert {r: live.result(a, r).verdict for r in code_review.order} == expected


def test_without_the_sweeper_the_hole_after_ack_stays_open(live: Live, tiny: Plan) -> None:
    w1 = live.worker(failpoints=["after_ack=crash"])
    [a] = live.ids(1)
    live.submit(tiny, [a])
    assert w1.wait_exit(PATIENCE_S) == -9
    live.worker("--no-sweeper")
    time.sleep(3.0)  # five times the stale threshold
    assert live.redis.get(f"attempt:{a}:state") == "running"
    assert not live.starts(a)
    live.worker()  # a worker with its sweeper closes the hole
    assert live.wait([a]) == {a: "completed"}


def test_crash_in_the_write_window_reruns_only_that_rule(live: Live, tiny: Plan) -> None:
    w1 = live.worker(failpoints=["rule_after_call_before_write=crash,rule=unit_tests"])
    [a] = live.ids(1)
    live.submit(tiny, [a])
    assert w1.wait_exit(PATIENCE_S) == -9
    finished = persisted_before(live, a, w1.pid)
    assert "unit_tests" not in finished and "compiles" in finished
    first = next(
        e for e in live.history(a) if e["ev"] == "rule_finished" and e["rule_id"] == "unit_tests"
    )
    live.worker()
    assert live.wait([a]) == {a: "completed"}
    starts = live.starts(a)
    assert starts["unit_tests"] == 2
    assert all(starts[r] == 1 for r in finished)
    rerun = [
        e for e in live.history(a) if e["ev"] == "rule_started" and e["rule_id"] == "unit_tests"
    ]
    assert [e["rerun"] for e in rerun] == [False, True]
    assert live.result(a, "unit_tests").verdict == first["verdict"]  # idempotent


def test_lost_retry_is_found_by_the_sweeper(live: Live, tiny: Plan) -> None:
    w1 = live.worker(
        agent={"fail_rules": {"unit_tests": 3}},
        failpoints=["after_status_write_before_retry_publish=crash"],
    )
    [a] = live.ids(1)
    live.submit(tiny, [a])
    assert w1.wait_exit(PATIENCE_S) == -9
    assert live.status(a, "unit_tests") == "failed_attempt_1"
    live.worker()
    assert live.wait([a]) == {a: "completed"}
    # Recorded once the broker confirms the retry's publish: maybe after the evaluation ends.
    live.wait_for(lambda: live.events("sweeper_retried", a, attempt=2), what="the sweeper's retry")
    assert live.result(a, "unit_tests").attempt == 2


def test_duplicate_retry_after_publish_before_ack_is_dropped(live: Live, tiny: Plan) -> None:
    # Attempt 2 (run from a retry message) fails too; retry 3 is published, then the worker
    # dies before acking retry 2, which comes back: it must be recognised as stale.
    w1 = live.worker(
        agent={"fail_rules": {"unit_tests": 6}},
        failpoints=["after_retry_publish_before_ack=crash,hit=2"],
    )
    [a] = live.ids(1)
    live.submit(tiny, [a])
    assert w1.wait_exit(PATIENCE_S) == -9
    assert live.status(a, "unit_tests") == "failed_attempt_2"
    live.worker("--no-sweeper")
    assert live.wait([a]) == {a: "completed"}
    assert live.result(a, "unit_tests").attempt == 3
    hist = live.history(a)
    # Recognised as stale whichever comes first once the dead owner's lease has run out:
    # retry 2 begins the evaluation and is dropped there, or retry 3 does and retry 2 then
    # reaches the evaluation in memory, whose core acks it without running anything.
    assert any(
        e["ev"] in ("stale_retry_dropped", "retry_acked") and e["attempt"] == 2 for e in hist
    )
    assert live.starts(a)["unit_tests"] == 3


def test_cancel_midway(live: Live, code_review: Plan) -> None:
    live.worker("--max-parallel", "1", agent={"latency_ms": 150_000})  # 150 ms a call
    [a] = live.ids(1)
    live.submit(code_review, [a])
    live.wait_for(lambda: sum(live.starts(a).values()) >= 2, what="two rules started")
    assert live.cancel(a) == "cancelled"
    time.sleep(1.0)
    assert live.redis.get(f"attempt:{a}:state") == "cancelled"
    hist = live.history(a)
    # the owner stops at the broadcast, or sooner if its next step read the cancel in Redis
    stop = next(
        e
        for e in hist
        if e["ev"] == "cancel_seen" or (e["ev"] == "cancel_received" and e["held"] is True)
    )
    assert not [e for e in hist if e["ev"] == "rule_started" and e["t"] > stop["t"]]
    assert sum(live.starts(a).values()) < len(code_review.order)
    terminal = [e for e in hist if e["ev"] == "evaluation_terminal"]
    assert [(e["status"], e["won"]) for e in terminal] == [("cancelled", False)]
    assert not [e for e in hist if e["ev"] == "final_published"]  # the canceller published
    assert live.cancel(a) == "cancelled"  # idempotent


# --- command lines -------------------------------------------------------------------------


def test_submit_rejects_a_bad_plan_in_one_line(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "plan: p\npasses:\n  - id: a\n    rules:\n      - id: x\n        depends_on: [y]\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "engine.submit", str(bad), "--attempt-id", "x"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "bad.yaml" in out.stderr and "'y'" in out.stderr
    assert "Traceback" not in out.stderr


def test_worker_rejects_a_bad_failpoint_in_one_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "engine.worker", "--failpoint", "nowhere=crash"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        timeout=30,
    )
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "nowhere" in out.stderr
