"""What may make a delayed retry late is recorded, and only that excuses it.

`retry_delays_respected` has no slack: a retry may start past its tier only by its
delivery's own latency, a wait for a slot the shell recorded and the checker verified, its
evaluation's resume, its start marker's write, or a fault. Here: the shell's records in
the simulator (which runs the shell that ships), the broker's head-of-line blocking caught
by the order retries fall due in, and the live worker's measure of its event loop's lag.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from chaos.checker import check
from chaos.insim import run_scenario
from chaos.scenario import load_scenario
from engine.runtime.drive import LoopLag
from tests.test_checker import A, Run, retry_run
from tests.test_checker_invariants import clean, fails, judged

ROOT = Path(__file__).resolve().parents[1]
BUSY = (
    ROOT / "scenarios" / "regressions" / "busy-worker-holds-a-retry-retry-delays-respected-s3.yaml"
)


def test_the_shell_records_each_wait_for_a_slot_and_the_checker_proves_it() -> None:
    """One evaluation slot per worker, four rule slots busy with long calls: due retries
    wait, the shell says so, and their lateness is the wait, reported as latency."""
    loaded = load_scenario(BUSY)
    outcome = run_scenario(loaded)
    result, history = outcome.result, outcome.history
    assert result.verdicts["retry_delays_respected"] == "pass", result.violations
    waits = [e for e in history if e["ev"] == "slot_wait" and e["slot"] == "rule"]
    assert waits
    for w in waits:
        assert len(w["running"]) == w["slots"] == 4 and w["rule_id"] not in w["running"]
        granted = [
            e
            for e in history
            if e["ev"] == "slot_granted"
            and e["slot"] == "rule"
            and e["src"] == w["src"]
            and (e["attempt_id"], e["rule_id"], e["attempt"])
            == (w["attempt_id"], w["rule_id"], w["attempt"])
        ]
        assert granted and granted[0]["t"] >= w["t"]
    assert result.stats["late_retries_explained"] >= 1
    assert result.stats["retry_slot_wait_max_s"] > 0.01
    assert result.stats["retry_unexplained_max_s"] <= 0.005

    # the same history with its slot records blanked (their `seq` kept, or the history
    # would have a gap and nothing be judged): the late starts are violations
    bare = [{**e, "ev": "note"} if e["ev"] in ("slot_wait", "slot_granted") else e for e in history]
    seed = loaded.spec.seed
    spec = loaded.check_spec(seed, loaded.evaluations(seed), set(), loaded.agent)
    unexplained = check(bare, outcome.final, spec)
    assert unexplained.verdicts["retry_delays_respected"] == "fail"


def test_a_retry_held_behind_a_later_one_is_caught_whatever_its_delivery_took() -> None:
    """Its lateness alone is the delivery's own (allowed); that a message due 1 s later
    was delivered first is the per-message TTL's head-of-line blocking."""
    late = retry_run(wait_s=1.5)
    t_status = next(e["t"] for e in late.events if e["ev"] == "status_written")
    delivered = next(e for e in late.events if e["ev"] == "delivered")
    delivered.update(published_ms=round(t_status * 1000), delay_ms=300)
    clean(judged(late, "retry_delays_respected", time_scale=0.01))  # late by its delivery
    held = retry_run(wait_s=1.5)
    t_status = next(e["t"] for e in held.events if e["ev"] == "status_written")
    delivered = next(e for e in held.events if e["ev"] == "delivered")
    delivered.update(published_ms=round(t_status * 1000), delay_ms=300)
    # another retry, due 1 s after b's, delivered 10 ms before it (more than the timer
    # granularity, `delay_tolerance_s`)
    ahead = {  # to another worker: its first event
        **delivered,
        "t": delivered["t"] - 0.01,
        "src": "w0",  # listed first at a tie
        "pid": 22,
        "seq": 1,
        "rule_id": "c",
        "attempt": 2,
        "published_ms": round(t_status * 1000) + 1000,
    }
    held.events.insert(held.events.index(delivered), ahead)
    [message] = fails(
        judged(held, "retry_delays_respected", time_scale=0.01), "retry_delays_respected"
    )
    assert "behind a retry due 1.000 s later than it" in message and A in message
    # delivered at the same instant to two consumers (a busy broker's backlog reaching
    # both): no order between them, whatever the history lists first
    ahead["t"] = delivered["t"]
    clean(judged(held, "retry_delays_respected", time_scale=0.01))
    ahead["t"] = delivered["t"] - 0.01

    # b's publish answered only after c was due (on `pg`, a group commit behind a busy
    # transaction): the broker could not hand out b before c, nothing was held
    published = next(e for e in held.events if e["ev"] == "retry_published")
    published["t"] = t_status + 1.4
    clean(judged(held, "retry_delays_respected", time_scale=0.01))
    published["t"] = t_status  # answered at once again: held behind, as above...
    fails(judged(held, "retry_delays_respected", time_scale=0.01), "retry_delays_respected")
    # ...unless the design's retries are timers of their own (a workflow engine's)
    clean(judged(held, "retry_delays_respected", time_scale=0.01, retries_in_due_order=False))

    # c due only 20 ms after b by their stamps: b's publish answered 40 ms after its
    # stamp may have reached the broker then, and its delay counts from there (the
    # queue's TTL; on `pg`, the commit's clock), so b was due as late as 40 ms after c
    ahead["published_ms"] = round(t_status * 1000) + 20
    fails(judged(held, "retry_delays_respected", time_scale=0.01), "retry_delays_respected")
    published["t"] = t_status + 0.04
    clean(judged(held, "retry_delays_respected", time_scale=0.01))
    published["t"] = t_status + 0.01  # still surely due 10 ms before c: held behind
    fails(judged(held, "retry_delays_respected", time_scale=0.01), "retry_delays_respected")


def test_the_live_worker_measures_its_event_loops_lag() -> None:
    """A loop blocked for 60 ms shows it in the lag the next events are recorded with; a
    free loop shows (next to) none."""

    async def main() -> tuple[float, float]:
        lag = LoopLag()
        lag.lag_ms()  # starts measuring
        for _ in range(3):
            await asyncio.sleep(LoopLag.INTERVAL_S)
        quiet = lag.lag_ms()
        time.sleep(0.06)  # the loop is blocked: nothing due runs meanwhile
        for _ in range(3):
            await asyncio.sleep(LoopLag.INTERVAL_S)
        return quiet, lag.lag_ms()

    quiet, blocked = asyncio.run(main())
    assert blocked >= 50.0 > quiet


def test_a_stall_just_before_an_event_is_in_its_lag() -> None:
    """The loop blocked for 60 ms, then an event recorded before the measuring task has run
    again (it is overdue, not yet woken): the event carries the stall all the same."""

    async def main() -> float:
        lag = LoopLag()
        lag.lag_ms()
        for _ in range(3):
            await asyncio.sleep(LoopLag.INTERVAL_S)
        time.sleep(0.06)
        return lag.lag_ms()  # no await in between: the task has not woken since

    assert asyncio.run(main()) >= 50.0


def test_a_history_without_a_delivery_in_the_starting_process_proves_no_wait() -> None:
    run = Run()
    run.submit()
    run.ok(A, "a")
    run.fail(A, "b", 1)
    run.retry(A, "b", 2, 300)
    run.wait(0.31)
    run.ev("delivered", "w2", 22, attempt_id=A, kind="retry", rule_id="b", attempt=2)
    run.wait(0.3)
    run.ok(A, "b", 2)
    [message] = fails(
        judged(run, "retry_delays_respected", time_scale=0.01), "retry_delays_respected"
    )
    assert "no delivery of it recorded in the process that started it" in message
