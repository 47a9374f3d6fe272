"""The lease machinery and the fence on hand-built histories: `leases_renewed`,
`leases_respected`, `writes_fenced`, and `reruns_explained`'s attribution of a rerun to a
fault of its own execution (its processes, the services they used), not any fault of the
run.

Each invariant has a history that passes and the broken ones it must name, with the events
that prove it (the builder of `tests.test_checker_more`, which writes what the engine, the
runner and the harness's consumer record).
"""

from __future__ import annotations

from typing import Any

from chaos.checker import CheckResult
from tests.test_checker_more import A, H, failing, passing, rerun

LEASE_MS = 600


def renew(h: H, src: str = "w1", pid: int = 11, dt: float = 0.1, **f: Any) -> dict:
    """One heartbeat renewal of `A`, sent `dt` after the last event and answered at once."""
    h.t += dt
    fields = {
        "attempt_id": A,
        "fence": f"1:{src}",
        "held": 1,
        "sent_ms": round(h.t * 1000),
        "lease_ms": LEASE_MS,
        "expires_ms": round(h.t * 1000) + LEASE_MS,
        **f,
    }
    return h.ev("lease_renewed", src, pid, dt=0.0, **fields)


def held(beats: int, gap: float = 0.1, park: bool = True) -> H:
    """w1 begins A, renews its lease `beats` times `gap` apart, and parks it (`park`)."""
    h = H().submit()
    h.ev("delivered", "w1", 11, attempt_id=A, kind="execute")
    h.ev("evaluation_started", "w1", 11, attempt_id=A, kind="execute", fence="1:w1")
    for _ in range(beats):
        renew(h, dt=gap)
    if park:
        h.ev("parked", "w1", 11, attempt_id=A, waiting={})
    return h


def check(h: H, name: str) -> CheckResult:
    return h.check(name)


# --- leases_renewed ------------------------------------------------------------------------


def test_a_lease_renewed_in_time_passes() -> None:
    result = check(held(5), "leases_renewed")
    passing(result, "leases_renewed")
    assert result.cases["leases_renewed"] == 6 + 5  # six intervals, five extensions


def test_a_renewal_sent_in_the_begins_millisecond_counts() -> None:
    """`sent_ms` is whole milliseconds: a renewal sent at once after the begin may read a
    millisecond before the begin's record; it still renews that lease (sentinel_failover
    seed 43 in sim: each Redis batch waits 0.3 s for the replica)."""
    h = H().submit()
    h.ev("delivered", "w1", 11, attempt_id=A, kind="execute")
    h.t += 0.0004  # the begin recorded 0.4 ms into a millisecond
    h.ev("evaluation_started", "w1", 11, attempt_id=A, kind="execute", fence="1:w1")
    first = renew(h, dt=0.0, sent_ms=int(h.t * 1000))  # sent in the same millisecond
    first["t"] = h.t = h.t + 0.59  # answered 0.59 s later
    renew(h, dt=0.1)  # 0.69 s after the begin, 0.1 s after the first renewal's answer
    h.ev("parked", "w1", 11, attempt_id=A, waiting={})
    passing(check(h, "leases_renewed"), "leases_renewed")


def test_a_heartbeat_that_stops_is_a_violation() -> None:
    h = held(2, park=False)
    h.t += 1.0  # a second without a renewal, the lease is 0.6 s
    h.ev("evaluation_abandoned", "w1", 11, attempt_id=A, reason="x")
    (v,) = failing(check(h, "leases_renewed"), "leases_renewed")
    assert "without renewing its lease" in v.message
    assert ("w1", "lease_renewed") in [(e["src"], e["ev"]) for e in v.timeline]


def test_a_heartbeat_too_slow_is_a_violation() -> None:
    (v,) = failing(check(held(3, gap=0.9), "leases_renewed"), "leases_renewed")[:1]
    assert "its next renewal was sent" in v.message


def test_a_pause_of_that_process_excuses_a_gap_and_another_s_does_not() -> None:
    def paused(pid: int) -> H:
        h = held(1, park=False)
        h.runner("fault_fired", action="pause_worker", target=0, fault_id=1)
        h.runner("worker_paused", worker=0, pid=pid)
        h.t += 1.0
        h.runner("fault_healed", fault_id=1)
        renew(h)
        h.ev("parked", "w1", 11, attempt_id=A, waiting={})
        return h

    passing(check(paused(11), "leases_renewed"), "leases_renewed")
    failing(check(paused(33), "leases_renewed"), "leases_renewed")


def test_a_renewal_that_does_not_extend_the_lease_is_a_violation() -> None:
    h = held(1, park=False)
    renew(h, expires_ms=round((h.t + 0.1) * 1000) + 250)
    h.ev("parked", "w1", 11, attempt_id=A, waiting={})
    (v,) = failing(check(h, "leases_renewed"), "leases_renewed")
    assert "runs out 350 ms before the 600 ms it asked for" in v.message


def test_the_store_s_millisecond_is_no_violation() -> None:
    h = held(1, park=False)
    renew(h, expires_ms=round((h.t + 0.1) * 1000) + LEASE_MS - 1)
    h.ev("parked", "w1", 11, attempt_id=A, waiting={})
    passing(check(h, "leases_renewed"), "leases_renewed")


def test_no_renewal_recorded_is_unknown() -> None:
    result = check(H().golden(), "leases_renewed")
    assert result.verdicts["leases_renewed"] == "unknown"


# --- leases_respected ----------------------------------------------------------------------


def claimed(after_s: float) -> H:
    """w1 renews A, then w2's sweeper claims it `after_s` later."""
    h = held(2, park=False)
    h.t += after_s
    h.ev("sweeper_resumed", "w2", 22, attempt_id=A, claimed_from_ms=round(h.t * 1000))
    return h


def test_a_claim_after_the_stamp_went_stale_passes() -> None:
    passing(check(claimed(0.7), "leases_respected"), "leases_respected")


def test_a_claim_before_the_stamp_went_stale_is_a_violation() -> None:
    (v,) = failing(check(claimed(0.2), "leases_respected"), "leases_respected")
    assert "sweeper claimed" in v.message


def taken(let_go: bool) -> H:
    """w1 renews A; w2 begins A 0.2 s later (the lease has 0.4 s to run)."""
    h = held(2, park=False)
    if let_go:
        h.ev("evaluation_abandoned", "w1", 11, attempt_id=A, reason="worker stopping")
    h.ev("delivered", "w2", 22, attempt_id=A, kind="retry", dt=0.2)
    h.ev("evaluation_started", "w2", 22, attempt_id=A, kind="retry", fence="2:w2")
    return h


def test_a_begin_while_the_holder_s_lease_runs_is_a_violation() -> None:
    (v,) = failing(check(taken(let_go=False), "leases_respected"), "leases_respected")
    assert "began" in v.message and "still holding it" in v.message


def test_a_begin_after_the_holder_let_go_passes() -> None:
    passing(check(taken(let_go=True), "leases_respected"), "leases_respected")


def parking(then: str | None) -> H:
    """w1 renews A and sends a park; `then`: what it records next of A (None: it dies first,
    the park's reply never recorded); w2 begins A while w1's last stamp still runs."""
    h = held(2, park=False)
    h.ev("parking", "w1", 11, attempt_id=A, sent_ms=round(h.t * 1000))
    if then is not None:
        h.ev(then, "w1", 11, attempt_id=A, rule_id="a", attempt=1, try_no=1, execution=1)
    h.ev("delivered", "w2", 22, attempt_id=A, kind="retry", dt=0.2)
    h.ev("evaluation_started", "w2", 22, attempt_id=A, kind="retry", fence="2:w2")
    return h


def test_a_park_its_sender_died_before_answering_may_have_let_go() -> None:
    """The park was on the wire when its process died: it may have landed and released the
    lease, and a begin after it is not early (seen with a crash at every failpoint)."""
    passing(check(parking(None), "leases_respected"), "leases_respected")


def test_a_park_its_sender_outlived_let_go_only_if_it_says_so() -> None:
    """A process that went on with the evaluation after sending a park (its reply was an
    error) still held the lease: the begin beside it is early."""
    (v,) = failing(check(parking("rule_started"), "leases_respected"), "leases_respected")
    assert "still holding it" in v.message


def resumed(held_reply: bool, sent_first: bool) -> H:
    """w1 renews A; a resume from a checkpoint is asked and answered; w1's next renewal (sent
    before the answer when `sent_first`) is answered `held` or lost after it; w2 begins A
    at once, as the resume's owner (pg/resume_from_checkpoint in CI, 2026-12-05)."""
    h = held(1, park=False)
    h.runner("resume_requested", attempt_id=A, checkpoint=1)
    sent_ms = round(h.t * 1000)
    h.runner("resume_written", attempt_id=A, resume={"checkpoint_id": "chk_0001"}, dt=0.01)
    if not sent_first:  # 2 ms after the resume's answer, before w2's begin
        sent_ms = round(h.t * 1000) + 2
    h.ev("delivered", "w2", 22, attempt_id=A, kind="execute", reason="resume", dt=0.005)
    h.ev("evaluation_started", "w2", 22, attempt_id=A, kind="execute", fence="3:w2", dt=0.001)
    answer = {"held": 1} if held_reply else {"held": 0, "expires_ms": None}
    renew(h, dt=0.002, sent_ms=sent_ms, **answer)
    return h


def test_a_renewal_held_before_a_resume_is_taken_by_it_whenever_answered() -> None:
    """Its answer may be recorded after the resume's, and the new owner's begin: sent before
    the resume was answered and held, it was applied before the resume (which moves the
    fence: after it, the renewal is refused), and the resume took that lease."""
    passing(
        check(resumed(held_reply=True, sent_first=True), "leases_respected"), "leases_respected"
    )
    # sent after the resume's answer and still held: the store let the old owner renew a
    # lease the resume had taken, and the new owner began while it ran
    (v,) = failing(
        check(resumed(held_reply=True, sent_first=False), "leases_respected"), "leases_respected"
    )
    assert "still holding it" in v.message


def test_a_redis_restart_excuses_an_early_begin() -> None:
    h = held(2, park=False)
    h.runner("service_killed", service="redis")
    h.runner("service_restarted", service="redis")
    h.ev("evaluation_started", "w2", 22, attempt_id=A, kind="retry", fence="2:w2")
    passing(check(h, "leases_respected"), "leases_respected")


# --- writes_fenced -------------------------------------------------------------------------


def written(token: str, landed: bool = True, ev: str = "status_written") -> H:
    """w1 begins A (token 1), w2 begins it (token 2), then w1 sends a write with `token`."""
    h = H().submit()
    h.ev("evaluation_started", "w1", 11, attempt_id=A, kind="execute", fence="1:w1")
    h.ev("evaluation_started", "w2", 22, attempt_id=A, kind="execute", fence="2:w2")
    h.t += 0.1
    fields = {"attempt_id": A, "rule_id": "a", "fence": token, "sent_ms": round(h.t * 1000)}
    if landed:
        h.ev(ev, "w1", 11, landed=True, **fields)
    else:
        h.ev("write_refused", "w1", 11, write="status", landed=False, **fields)
    return h


def test_a_landed_write_with_the_current_token_passes() -> None:
    passing(check(written("2:w2"), "writes_fenced"), "writes_fenced")


def test_a_stale_write_refused_passes() -> None:
    h = written("1:w1", landed=False)
    h.ev("result_persisted", "w2", 22, attempt_id=A, rule_id="a", fence="2:w2", landed=True)
    passing(check(h, "writes_fenced"), "writes_fenced")


def test_a_stale_status_final_write_park_or_pass_flag_that_landed_is_a_violation() -> None:
    for ev in (
        "status_written",
        "evaluation_terminal",
        "result_persisted",
        "parked",
        "pass_published",
    ):
        (v,) = failing(check(written("1:w1", ev=ev), "writes_fenced"), "writes_fenced")
        assert "landed with token 1:w1" in v.message and "token 2:w2" in v.message


def resumed_then_written(sent_after: bool, landed: bool = True) -> H:
    """w1 holds A (token 1); a resume from a checkpoint is asked and answered (it moves the
    fence: pg's `eai.resume`); w1's result write, sent before the answer or after it, is
    recorded after it."""
    h = held(1, park=False)
    h.runner("resume_requested", attempt_id=A, checkpoint=1)
    sent_ms = round(h.t * 1000) + 1
    h.runner("resume_written", attempt_id=A, resume={"checkpoint_id": "chk_0001"}, dt=0.01)
    if sent_after:
        sent_ms = round(h.t * 1000) + 2
    fields = {"attempt_id": A, "rule_id": "a", "fence": "1:w1", "sent_ms": sent_ms}
    h.ev("result_persisted", "w1", 11, landed=landed, dt=0.005, **fields)
    return h


def test_a_pass_flag_sent_after_a_resume_with_a_token_it_revoked_must_be_refused() -> None:
    """The owner's flag of a pass, sent after the resume moved the fence, landed (the
    `pg_pass_unfenced` mutant): judged as any other write of the owner."""
    h = held(1, park=False)
    h.runner("resume_requested", attempt_id=A, checkpoint=1)
    h.runner("resume_written", attempt_id=A, resume={"checkpoint_id": "chk_0001"}, dt=0.01)
    fields = {"attempt_id": A, "fence": "1:w1", "sent_ms": round(h.t * 1000) + 2}
    flag = {"pass_id": "p", "outcome": "complete", "rules": {"a": "pass"}}
    h.ev("pass_published", "w1", 11, landed=True, dt=0.005, **fields, **flag)
    (v,) = failing(check(h, "writes_fenced"), "writes_fenced")
    assert "(pass published) landed with token 1:w1" in v.message


def test_a_write_sent_after_a_resume_with_a_token_it_revoked_must_be_refused() -> None:
    """The resume took the lease and moved the fence; the old owner's write landed after
    it, as if the resume had not happened (the `pg_resume_keeps_owner` mutant)."""
    (v,) = failing(check(resumed_then_written(True), "writes_fenced"), "writes_fenced")
    assert "landed with token 1:w1" in v.message and "a resume" in v.message
    assert not check(resumed_then_written(True, landed=False), "writes_fenced").violations
    # sent before the resume was answered: the store may have applied it first
    passing(check(resumed_then_written(False), "writes_fenced"), "writes_fenced")


# --- reruns_explained: a fault of that execution -------------------------------------------


def _paused(pid: int) -> list[tuple[str, str, int, dict[str, Any]]]:
    return [
        ("fault_fired", "runner", 1, {"action": "pause_worker", "target": 0, "fault_id": 7}),
        ("worker_paused", "runner", 1, {"worker": 0, "pid": pid}),
        ("fault_healed", "runner", 1, {"fault_id": 7}),
    ]


def _cut(pids: list[int]) -> list[tuple[str, str, int, dict[str, Any]]]:
    return [
        ("fault_fired", "runner", 1, {"action": "cut_link", "target": 0, "fault_id": 8}),
        ("link_cut", "runner", 1, {"link": "redis", "workers": [0], "pids": pids}),
        ("fault_healed", "runner", 1, {"fault_id": 8}),
    ]


def test_a_pause_of_the_process_that_ran_it_explains_a_rerun() -> None:
    result = rerun(_paused(11)).check("reruns_explained")
    passing(result, "reruns_explained")
    assert result.stats["reruns_explained_by"] == {"process_fault": 1}


def test_a_pause_of_another_process_explains_no_rerun() -> None:
    failing(rerun(_paused(33)).check("reruns_explained"), "reruns_explained")


def test_a_cut_of_its_own_link_explains_a_rerun_another_s_does_not() -> None:
    passing(rerun(_cut([11])).check("reruns_explained"), "reruns_explained")
    failing(rerun(_cut([33])).check("reruns_explained"), "reruns_explained")
