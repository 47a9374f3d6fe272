"""The invariants of issue 8 on hand-built histories: `cancel_respected`,
`pass_results_correct`, `completed_delivered`, `quiet_state` and `reruns_explained`.

Each has a history that passes and the broken ones it must name, with the events that prove
it. The builder below writes what the engine, the runner and the harness's consumer record,
and the final state they leave (keys with their TTLs, the indexes' members).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from chaos.checker import CheckResult, CheckSpec, EvaluationFinal, FinalState, Violation, check
from chaos.reference import Outcome, PassOutcome, Reference
from engine.config import STATE_TTL_SECONDS
from engine.core import RuleResult
from tests.helpers import make_plan
from tests.test_checker import unrecorded

#: a and c in pass one, b (after a) in pass two: failing a skips b.
PLAN = make_plan({"one": {"a": [], "c": []}, "two": {"b": ["a"]}})
A = "att-1"
VERDICT = {"a": "pass", "b": "fail", "c": "needs_review"}
MINE = (
    "cancel_respected",
    "pass_results_correct",
    "completed_delivered",
    "quiet_state",
    "reruns_explained",
)


class H:
    """A hand-built run: events with increasing times and per-source sequence numbers."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.t = 100.0
        self.seq: Counter[str] = Counter()
        self.evals: dict[str, EvaluationFinal] = {}
        self.ttls: dict[str, int] = {"engine:topology": STATE_TTL_SECONDS}
        self.indexes: dict[str, dict[str, float]] | None = {
            "engine:running": {},
            "engine:retries": {},
        }

    def ev(self, ev: str, src: str = "w1", proc: int = 11, dt: float = 0.01, **f: Any) -> dict:
        """One event of process (`src`, `proc`); a `pid` field overrides it, as the runner's
        `worker_killed` (the killed process's pid) does in a real history."""
        self.t += dt
        self.seq[src] += 1
        e = {"t": self.t, "src": src, "pid": proc, "seq": self.seq[src], "ev": ev, **f}
        self.events.append(e)
        return e

    def runner(self, ev: str, **f: Any) -> dict:
        return self.ev(ev, "runner", 1, **f)

    def forget(self, *kinds: str) -> None:
        """As if events of `kinds` had never been recorded (no gap in any source)."""
        self.events = unrecorded(self.events, *kinds)
        self.seq = Counter()
        for e in self.events:
            self.seq[e["src"]] = e["seq"]

    def fin(self, a: str = A) -> EvaluationFinal:
        return self.evals.setdefault(a, EvaluationFinal(a, None, published=False, passes={}))

    def submit(self, a: str = A, bound: bool = True) -> H:
        if bound and not any(e["ev"] == "events_consumer_bound" for e in self.events):
            self.runner("events_consumer_bound", queue="chaos.completed", routing_key="x")
        self.runner("submitted", attempt_id=a, plan=PLAN.id)
        self.fin(a).state = "running"
        return self

    def begin(self, a: str = A, src: str = "w1", pid: int = 11, kind: str = "execute") -> H:
        self.ev("delivered", src, pid, attempt_id=a, kind=kind)
        self.ev("evaluation_started", src, pid, attempt_id=a, kind=kind)
        return self

    def start(self, r: str, a: str = A, src: str = "w1", pid: int = 11, attempt: int = 1) -> dict:
        return self.ev("rule_started", src, pid, attempt_id=a, rule_id=r, attempt=attempt, try_no=1)

    def done(self, r: str, a: str = A, src: str = "w1", pid: int = 11) -> None:
        """The rule's call answered and its result was written."""
        v = VERDICT[r]
        self.ev("rule_finished", src, pid, attempt_id=a, rule_id=r, attempt=1, verdict=v)
        self.ev("result_persisted", src, pid, attempt_id=a, rule_id=r, attempt=1, verdict=v)
        self.fin(a).results[r] = RuleResult(r, v, 0.5, 100, 1)
        self.ttls[f"attempt:{a}:rule:{r}:result"] = STATE_TTL_SECONDS

    def ok(self, r: str, a: str = A, src: str = "w1", pid: int = 11) -> None:
        self.start(r, a, src, pid)
        self.done(r, a, src, pid)

    def failed(self, r: str, a: str = A, src: str = "w1", pid: int = 11) -> None:
        self.start(r, a, src, pid)
        self.ev("status_written", src, pid, attempt_id=a, rule_id=r, status="permanently_failed")
        self.fin(a).statuses[r] = "permanently_failed"
        self.ttls[f"attempt:{a}:rule:{r}:status"] = STATE_TTL_SECONDS

    def announce(self, pass_id: str, outcome: str, rules: dict[str, str], a: str = A, **w: Any):
        self.fin(a).passes[pass_id] = outcome
        return self.ev(
            "pass_published", attempt_id=a, pass_id=pass_id, outcome=outcome, rules=rules, **w
        )

    def finish(self, status: str, verdicts: dict[str, str], a: str = A) -> None:
        self.ev("evaluation_terminal", attempt_id=a, status=status, won=True, verdicts=verdicts)
        self.ev("final_published", attempt_id=a, status=status)
        fin = self.fin(a)
        fin.state, fin.published = status, True
        self.ttls[f"attempt:{a}:state"] = STATE_TTL_SECONDS

    def received(self, body: dict[str, Any], a: str = A, message_id: str | None = None) -> dict:
        return self.runner(
            "completed_received",
            attempt_id=a,
            message_id=message_id or f"{a}:completed",
            body=body,
            redelivered=False,
        )

    def golden(self) -> H:
        self.submit().begin()
        self.ok("a")
        self.ok("c")
        self.announce("one", "complete", {"a": "pass", "c": "needs_review"})
        self.ok("b")
        self.announce("two", "complete", {"b": "fail"})
        self.finish("completed", dict(VERDICT))
        self.received(completed_body())
        return self

    def final(self) -> FinalState:
        return FinalState(dict(self.evals), dict(self.ttls), self.indexes)

    def check(self, *names: str, **spec: Any) -> CheckResult:
        spec.setdefault("plans", dict.fromkeys(self.evals, PLAN))
        return check(self.events, self.final(), CheckSpec(invariants=names or MINE, **spec))


def completed_body(status: str = "completed", verdicts: dict[str, str] | None = None) -> dict:
    shown = dict(VERDICT) if verdicts is None else verdicts
    return {"attempt_id": A, "status": status, "verdicts": shown}


def reference(**passes: PassOutcome) -> Reference:
    """The fault-free reference: every rule completed, with `VERDICT`."""
    default = {
        "one": PassOutcome("complete", {"a": "pass", "c": "needs_review"}),
        "two": PassOutcome("complete", {"b": "fail"}),
    }
    outcome = Outcome(
        status="completed",
        completed=frozenset(VERDICT),
        permanently_failed=frozenset(),
        skipped=frozenset(),
        verdicts=dict(VERDICT),
        passes={**default, **passes},
    )
    return Reference({A: outcome})


def failing(result: CheckResult, invariant: str) -> list[Violation]:
    """Only `invariant` fails, and each violation carries a sorted, short timeline."""
    assert result.verdicts[invariant] == "fail", result.verdicts
    assert {v.invariant for v in result.violations} == {invariant}, result.violations
    for v in result.violations:
        ts = [e["t"] for e in v.timeline]
        assert ts == sorted(ts) and 0 < len(ts) <= 12, v
    return result.violations


def passing(result: CheckResult, *names: str) -> None:
    assert not result.violations, result.violations
    for name in names or MINE:
        assert result.verdicts[name] == "pass", (name, result.verdicts)
        assert result.cases[name] > 0, name


# --- a clean run -----------------------------------------------------------------------------


def test_golden_run_passes_the_five_invariants() -> None:
    result = H().golden().check(reference=reference())
    passing(result)
    assert result.stats["passes_compared_to_reference"] == 2
    assert result.stats["completed_received"] == 1
    assert "unknown_parts" not in result.stats


# --- cancel_respected ------------------------------------------------------------------------


def cancelled_run() -> H:
    """a done, c started; the runner cancels; the owner hears of it, c was in flight."""
    h = H().submit().begin()
    h.ok("a")
    h.start("c")
    h.runner("cancel_requested", attempt_id=A)
    h.runner("cancel_written", attempt_id=A, state="cancelled")
    h.fin().state, h.fin().published = "cancelled", True
    return h


def test_a_rule_in_flight_when_the_cancel_lands_is_allowed_and_counted() -> None:
    h = cancelled_run()
    h.start("b")  # decided before the broadcast reached w1
    h.ev("cancel_received", attempt_id=A, held=True)
    h.ev("evaluation_terminal", attempt_id=A, status="cancelled", won=False, decided="cancelled")
    result = h.check("cancel_respected")
    passing(result, "cancel_respected")
    assert result.stats["cancel_inflight_starts"] == 1


def test_an_owner_that_hears_of_the_cancel_and_carries_on_is_a_violation() -> None:
    h = cancelled_run()
    h.ev("cancel_received", attempt_id=A, held=True)
    h.done("c")
    h.ok("b")  # the core ignored the cancel: it went on and finished
    h.ev("evaluation_terminal", attempt_id=A, status="cancelled", won=False, decided="completed")
    (v,) = failing(h.check("cancel_respected"), "cancel_respected")
    assert "heard of it" in v.message and "still finished the evaluation as completed" in v.message


def test_a_start_after_the_owner_let_the_evaluation_go_is_a_violation() -> None:
    h = cancelled_run()
    h.ev("cancel_received", attempt_id=A, held=True)
    h.ev("evaluation_terminal", attempt_id=A, status="cancelled", won=False)
    late = h.start("b")
    (v,) = failing(h.check("cancel_respected"), "cancel_respected")
    assert "holding no session" in v.message and late in v.timeline


def test_an_owner_never_told_of_the_cancel_that_goes_on_is_a_violation() -> None:
    h = cancelled_run()
    h.ok("b")  # the broadcast never reached w1: it ran b to the end
    h.ev("evaluation_terminal", attempt_id=A, status="cancelled", won=False)
    (v,) = failing(h.check("cancel_respected"), "cancel_respected")
    assert "never heard of it" in v.message
    assert any(e["ev"] == "cancel_written" for e in v.timeline)


def test_a_retry_is_timed_when_it_was_sent_not_when_the_broker_confirmed_it() -> None:
    """The cancel lands between a retry's send and its confirm (a slowed broker link, which
    also holds the broadcast back until the owner parked): the owner did not act after the
    cancel. The same retry sent after the cancel is a violation."""
    for sent_after, broken in ((False, False), (True, True)):
        h = H().submit().begin()
        h.ok("a")
        h.start("c")
        sent = h.t + (0.05 if sent_after else 0.005)
        h.runner("cancel_requested", attempt_id=A)
        h.runner("cancel_written", attempt_id=A, state="cancelled")
        h.fin().state, h.fin().published = "cancelled", True
        h.ev(
            "retry_published",
            attempt_id=A,
            rule_id="c",
            attempt=2,
            tier=1,
            bucket=0,
            delay_ms=300,
            sent_ms=round(sent * 1000),
            dt=1.5,
        )
        h.ev("parked", attempt_id=A, waiting={"c": 2}, sent_ms=round(h.t * 1000))
        h.ev("cancel_received", attempt_id=A, held=False)
        result = h.check("cancel_respected")
        if broken:
            (v,) = failing(result, "cancel_respected")
            assert "published a retry of c" in v.message and "never heard of it" in v.message
        else:
            passing(result, "cancel_respected")


def test_a_late_retry_that_revives_a_cancelled_evaluation_is_a_violation() -> None:
    h = cancelled_run()
    h.ev("cancel_received", attempt_id=A, held=True)
    h.ev("evaluation_terminal", attempt_id=A, status="cancelled", won=False)
    h.begin(src="w2", pid=22, kind="retry")  # begin read a cancelled evaluation, went on
    h.start("b", src="w2", pid=22, attempt=2)
    (v,) = failing(h.check("cancel_respected"), "cancel_respected")
    assert "resumed the evaluation after the cancel" in v.message
    assert {e["ev"] for e in v.timeline} >= {"delivered", "evaluation_started", "rule_started"}


def test_a_cancelled_evaluation_must_stay_cancelled() -> None:
    h = cancelled_run()
    h.fin().state = "completed"
    (v,) = failing(h.check("cancel_respected"), "cancel_respected")
    assert "did not stay cancelled" in v.message


def test_the_sweeper_firing_a_retry_of_a_cancelled_evaluation_is_a_violation() -> None:
    h = cancelled_run()
    h.ev("cancel_received", attempt_id=A, held=True)
    h.ev("evaluation_terminal", attempt_id=A, status="cancelled", won=False)
    h.ev("sweeper_retried", "w2", 22, attempt_id=A, rule_id="c", attempt=2)
    (v,) = failing(h.check("cancel_respected"), "cancel_respected")
    assert "re-published a retry of c" in v.message


def test_cancelled_without_a_cancel_request_is_a_violation() -> None:
    h = H().golden()
    h.fin().state = "cancelled"
    (v,) = failing(h.check("cancel_respected"), "cancel_respected")
    assert "no cancel was requested" in v.message


# --- pass_results_correct --------------------------------------------------------------------


def test_a_pass_announced_before_its_rules_are_terminal_is_a_violation() -> None:
    h = H().submit().begin()
    h.ok("a")
    h.start("c")
    h.announce("one", "complete", {"a": "pass", "c": "needs_review"})  # c still running
    h.done("c")
    h.ok("b")
    h.announce("two", "complete", {"b": "fail"})
    h.finish("completed", dict(VERDICT))
    (v,) = failing(h.check("pass_results_correct"), "pass_results_correct")
    assert "pass one announced" in v.message and "c" in v.message


def test_a_pass_announced_complete_with_a_failed_rule_is_a_violation() -> None:
    h = H().submit().begin()
    h.failed("a")
    h.ok("c")
    h.announce("one", "complete", {"a": "permanently_failed", "c": "needs_review"})
    h.ev("rules_skipped", attempt_id=A, rule_ids=["b"], because_of="a")
    h.announce("two", "partial", {"b": "skipped"})
    h.finish("partial", {"a": "permanently_failed", "b": "skipped", "c": "needs_review"})
    violations = failing(h.check("pass_results_correct"), "pass_results_correct")
    assert any("pass one announced complete" in v.message for v in violations)


def test_a_partial_pass_with_its_skipped_rules_passes() -> None:
    h = H().submit().begin()
    h.failed("a")
    h.ok("c")
    h.announce("one", "partial", {"a": "permanently_failed", "c": "needs_review"})
    h.announce("two", "partial", {"b": "skipped"})
    h.finish("partial", {"a": "permanently_failed", "b": "skipped", "c": "needs_review"})
    passing(h.check("pass_results_correct"), "pass_results_correct")


def test_a_finished_evaluation_must_have_announced_every_pass() -> None:
    h = H().submit().begin()
    h.ok("a")
    h.ok("c")
    h.announce("one", "complete", {"a": "pass", "c": "needs_review"})
    h.ok("b")
    h.finish("completed", dict(VERDICT))
    (v,) = failing(h.check("pass_results_correct"), "pass_results_correct")
    assert "pass two was never announced" in v.message


def test_an_announcement_only_redis_remembers_counts() -> None:
    """The announcer died between the publish and its record: Redis' `passes` hash says it."""
    h = H().submit().begin()
    h.ok("a")
    h.ok("c")
    h.announce("one", "complete", {"a": "pass", "c": "needs_review"})
    h.ok("b")
    h.fin().passes["two"] = "complete"
    h.finish("completed", dict(VERDICT))
    passing(h.check("pass_results_correct"), "pass_results_correct")


def test_copies_of_an_announcement_must_agree() -> None:
    h = H().golden()
    h.announce("two", "complete", {"b": "pass"}, src="w2", pid=22)  # a resumed worker's copy
    violations = failing(h.check("pass_results_correct"), "pass_results_correct")
    assert any("copies of pass two disagree" in v.message for v in violations)


def test_one_process_announcing_a_pass_twice_is_a_violation() -> None:
    h = H().golden()
    h.announce("two", "complete", {"b": "fail"})  # w1 again, with nothing in between
    (v,) = failing(h.check("pass_results_correct"), "pass_results_correct")
    assert "w1 announced pass two twice" in v.message


def test_a_process_that_began_the_evaluation_again_may_announce_again() -> None:
    """A Temporal worker whose workflow task the server refused after it ran (it was frozen
    past the task's timeout) runs the workflow again from its history: a new owner, which
    announces what the refused task had announced, as another process would."""
    h = H().golden()
    h.ev("evaluation_abandoned", attempt_id=A, reason="lease lost")
    h.ev("evaluation_started", attempt_id=A, kind="execute", resumed=True)
    h.announce("two", "complete", {"b": "fail"})
    passing(h.check("pass_results_correct"), "pass_results_correct")
    # another process beginning it is no excuse for this one
    h = H().golden()
    h.ev("evaluation_started", "w2", 22, attempt_id=A, kind="execute", resumed=True)
    h.announce("two", "complete", {"b": "fail"})
    (v,) = failing(h.check("pass_results_correct"), "pass_results_correct")
    assert "announced pass two twice" in v.message


def test_a_pass_announced_unlike_the_reference_is_a_violation() -> None:
    h = H().golden()
    ref = reference(one=PassOutcome("partial", {"a": "permanently_failed", "c": "needs_review"}))
    (v,) = failing(h.check("pass_results_correct", reference=ref), "pass_results_correct")
    assert "fault-free reference announces partial" in v.message


def test_without_a_reference_the_comparison_is_reported_unknown() -> None:
    result = H().golden().check("pass_results_correct")
    passing(result, "pass_results_correct")
    assert "pass_results_correct" in result.stats["unknown_parts"]


# --- completed_delivered ---------------------------------------------------------------------


def test_without_a_consumer_bound_before_the_first_submit_nothing_is_judged() -> None:
    h = H().submit(bound=False)
    h.runner("events_consumer_bound", queue="chaos.completed", routing_key="x")  # too late
    result = h.check("completed_delivered")
    assert result.verdicts["completed_delivered"] == "unknown"
    assert result.cases["completed_delivered"] == 0


def test_a_terminal_evaluation_never_delivered_is_a_violation() -> None:
    h = H().golden()
    h.forget("completed_received")
    (v,) = failing(h.check("completed_delivered"), "completed_delivered")
    assert "never reached the consumer (it was published)" in v.message


def test_copies_with_different_bodies_are_a_violation() -> None:
    h = H().golden()
    h.received(completed_body(verdicts={"a": "pass", "c": "needs_review"}))  # b left out
    violations = failing(h.check("completed_delivered"), "completed_delivered")
    assert any("carry 2 bodies" in v.message for v in violations)
    assert any("differ from the final state's" in v.message for v in violations)


def test_a_body_unlike_the_final_state_is_a_violation() -> None:
    h = H().golden()
    h.forget("completed_received")
    h.received(completed_body(status="partial"))
    (v,) = failing(h.check("completed_delivered"), "completed_delivered")
    assert "says partial, Redis ends with completed" in v.message


def test_verdicts_unlike_the_reference_are_a_violation() -> None:
    h = H().golden()
    ref = reference()
    ref.evaluations[A].verdicts["b"] = "pass"
    (v,) = failing(h.check("completed_delivered", reference=ref), "completed_delivered")
    assert "fault-free reference's b=pass" in v.message


def test_a_cancel_announced_with_the_verdicts_it_had_passes() -> None:
    h = cancelled_run()
    h.ev("cancel_received", attempt_id=A, held=True)
    h.ev("evaluation_terminal", attempt_id=A, status="cancelled", won=False)
    h.received(completed_body(status="cancelled", verdicts={}))
    passing(h.check("completed_delivered", "cancel_respected"), "completed_delivered")


# --- quiet_state -----------------------------------------------------------------------------


def test_an_announced_evaluation_left_in_the_running_index_is_a_violation() -> None:
    h = H().golden()
    assert h.indexes is not None
    h.indexes["engine:running"][A] = 1234.0
    h.ttls["engine:running"] = -1
    violations = failing(h.check("quiet_state"), "quiet_state")
    assert any("still held by engine:running" in v.message for v in violations)
    assert any("engine:running" in v.message and "no TTL" in v.message for v in violations)


def test_a_terminal_evaluation_not_announced_yet_may_stay_in_the_running_index() -> None:
    h = H().golden()
    h.forget("final_published", "completed_received")
    h.fin().published = False
    assert h.indexes is not None
    h.indexes["engine:running"][A] = 1234.0  # the sweeper must still announce it
    result = h.check("quiet_state")
    passing(result, "quiet_state")
    assert result.stats["index_members_excused"] == 1


def test_a_retry_due_for_a_terminal_evaluation_is_a_violation() -> None:
    h = H().golden()
    assert h.indexes is not None
    h.indexes["engine:retries"][f"{A}\x1fb"] = 99.0
    (v,) = failing(h.check("quiet_state"), "quiet_state")
    assert "engine:retries" in v.message


def test_a_terminal_evaluation_swept_again_is_a_violation() -> None:
    h = H().golden()
    h.ev("sweeper_resumed", "w2", 22, attempt_id=A)
    h.ev("delivered", "w2", 22, attempt_id=A, kind="execute", reason="stale_heartbeat")
    h.ev("terminal_dropped", "w2", 22, attempt_id=A, kind="execute")
    (v,) = failing(h.check("quiet_state"), "quiet_state")
    assert "re-swept 1 time(s)" in v.message


def test_a_sweep_judged_before_the_announcement_is_not_a_re_sweep() -> None:
    # The sweeper records its re-publish after the fact: one recorded after the announcement
    # whose claim began before it judged an evaluation not yet terminal.
    h = H().golden()
    announced = max(e["t"] for e in h.events if e["ev"] == "final_published")
    before = int((announced - 0.005) * 1000)
    h.ev("sweeper_retried", "w2", 22, attempt_id=A, rule_id="c", attempt=2, claimed_from_ms=before)
    passing(h.check("quiet_state"), "quiet_state")
    after = int((announced + 0.005) * 1000) + 1
    h.ev("sweeper_retried", "w2", 22, attempt_id=A, rule_id="c", attempt=2, claimed_from_ms=after)
    (v,) = failing(h.check("quiet_state"), "quiet_state")
    assert "re-swept 1 time(s)" in v.message


def test_a_key_without_a_ttl_is_a_violation() -> None:
    h = H().golden()
    h.ttls[f"attempt:{A}:rule:a:runs"] = -1
    (v,) = failing(h.check("quiet_state"), "quiet_state")
    assert v.attempt_id == A and f"attempt:{A}:rule:a:runs" in v.message


def test_a_lease_left_on_an_announced_evaluation_is_a_violation() -> None:
    # read when the run settled: a short lease left then may have expired by the end
    h = H().golden()
    h.runner("leases_at_settle", held={A: "w1"})
    (v,) = failing(h.check("quiet_state"), "quiet_state")
    assert v.attempt_id == A and "lease is still held" in v.message
    h.events.pop()
    h.ttls[f"attempt:{A}:owner"] = 1  # or among the keys at the end
    (v,) = failing(h.check("quiet_state"), "quiet_state")
    assert "lease is still held" in v.message


def test_a_lease_left_by_a_holder_that_was_killed_expires() -> None:
    h = H().golden()
    h.runner("leases_at_settle", held={A: "w1"})
    h.runner("worker_killed", pid=11)
    passing(h.check("quiet_state"), "quiet_state")


def test_an_announced_evaluation_still_held_at_the_deadline_is_a_violation() -> None:
    h = H().golden()
    h.runner("deadline_passed", terminal=1, held={A: [11]})
    (v,) = failing(h.check("quiet_state"), "quiet_state")
    assert "still held in memory by a living worker (pid 11)" in v.message
    h.events[-1]["held"] = {}  # the deadline passed for another reason
    passing(h.check("quiet_state"), "quiet_state")


def test_indexes_not_read_are_reported_unknown() -> None:
    h = H().golden()
    h.indexes = None
    result = h.check("quiet_state")
    passing(result, "quiet_state")  # the sweeps and the TTLs were still judged
    assert "quiet_state" in result.stats["unknown_parts"]


# --- reruns_explained ------------------------------------------------------------------------


def rerun(between: list[tuple[str, str, int, dict[str, Any]]]) -> H:
    """w1 starts c, then `between` happens, then w2 takes over and starts c again."""
    h = H().submit().begin()
    h.ok("a")
    h.start("c")
    for ev, src, pid, fields in between:
        h.ev(ev, src, pid, **fields)
    h.begin(src="w2", pid=22)
    h.ok("c", src="w2", pid=22)
    h.ok("b", src="w2", pid=22)
    return h


def test_a_rerun_after_the_first_process_crashed_is_explained() -> None:
    result = rerun([("crash", "w1", 11, {"failpoint": "rule_after_call_before_write"})]).check(
        "reruns_explained"
    )
    passing(result, "reruns_explained")
    assert result.stats["reruns_explained_by"] == {"crash": 1}


def test_a_rerun_after_the_runner_killed_the_first_process_is_explained() -> None:
    h = rerun([("worker_killed", "runner", 1, {"worker": 0, "pid": 11})])
    passing(h.check("reruns_explained"), "reruns_explained")


def test_a_rerun_during_a_broker_outage_is_explained() -> None:
    h = rerun(
        [
            ("service_killed", "runner", 1, {"service": "broker"}),
            ("service_restarted", "runner", 1, {"service": "broker"}),
        ]
    )
    result = h.check("reruns_explained")
    passing(result, "reruns_explained")
    assert result.stats["reruns_explained_by"] == {"service_fault": 1}


def test_a_rerun_after_the_first_process_froze_is_explained() -> None:
    fired = {"failpoint": "rule_after_call_before_write", "action": "freeze", "stall_ms": 5000}
    h = rerun([("failpoint_fired", "w1", 11, {"attempt_id": A, "rule": "c", **fired})])
    passing(h.check("reruns_explained"), "reruns_explained")


def _fenced_off_then_started(began_again: bool) -> H:
    """w1 holds the evaluation; a resume fences it off; w1, not knowing yet, starts c
    (`began_again`: after beginning the evaluation anew); then w2 resumes it and reruns c."""
    h = H().submit().begin()
    h.ok("a")
    resume = {"checkpoint_id": "chk_0001", "attempt": 2}
    h.ev("resume_written", "runner", 1, attempt_id=A, resume=resume, discarded=["a"])
    if began_again:
        h.begin()
    h.start("c")
    h.ev("evaluation_abandoned", "w1", 11, attempt_id=A, reason="LeaseLost")
    h.begin(src="w2", pid=22)
    h.ok("a", src="w2", pid=22)
    h.ok("c", src="w2", pid=22)
    h.ok("b", src="w2", pid=22)
    return h


def test_a_round_started_by_a_copy_a_resume_had_fenced_off_is_explained() -> None:
    result = _fenced_off_then_started(began_again=False).check("reruns_explained")
    passing(result, "reruns_explained")
    assert result.stats["reruns_explained_by"] == {"resume": 2}  # a, deleted; c, in flight


def test_a_resume_before_the_copy_began_explains_none_of_its_rounds() -> None:
    (v,) = failing(
        _fenced_off_then_started(began_again=True).check("reruns_explained"), "reruns_explained"
    )
    assert v.rule_id == "c"


def test_a_rerun_no_fault_explains_is_a_violation() -> None:
    """The engine gave up a lease it held (nothing broke) and another worker reran c."""
    h = rerun([("evaluation_abandoned", "w1", 11, {"attempt_id": A, "reason": "lease lost"})])
    (v,) = failing(h.check("reruns_explained"), "reruns_explained")
    assert v.rule_id == "c" and "no crash, kill, stall or service fault" in v.message
    shown = [(e["src"], e["ev"]) for e in v.timeline]
    assert ("w1", "rule_started") in shown and ("w2", "rule_started") in shown
    assert ("w1", "evaluation_abandoned") in shown


def test_a_cancel_or_another_workers_kill_explains_no_rerun() -> None:
    h = rerun(
        [
            ("fault_fired", "runner", 1, {"action": "cancel", "target": 1, "fault_id": 1}),
            ("worker_killed", "runner", 1, {"worker": 2, "pid": 33}),
        ]
    )
    failing(h.check("reruns_explained"), "reruns_explained")


def test_runs_without_reruns_are_judged_not_unknown() -> None:
    result = H().golden().check("reruns_explained")
    passing(result, "reruns_explained")
    assert result.cases["reruns_explained"] == len(PLAN.order)
    assert result.stats["reruns_judged"] == 0


# --- poison_rejected: the engine's own messages ----------------------------------------------


def test_a_message_of_the_engines_own_is_rejected_only_when_its_plan_is_gone() -> None:
    h = H().golden()
    h.ev("message_rejected", attempt_id=A, reason="no plan")  # a Redis that lost the plan
    passing(h.check("poison_rejected"), "poison_rejected")
    h.ev("message_rejected", attempt_id=A, reason="cancel")  # its own cancel, unknown to it
    (v,) = failing(h.check("poison_rejected"), "poison_rejected")
    assert "rejected a message of the engine's own as 'cancel'" in v.message


# --- retries_acked: a failed attempt's status makes the ACK owed -----------------------------


def test_a_retry_held_past_its_failed_attempts_status_is_a_violation() -> None:
    def run(acked: bool) -> H:
        h = H().submit().begin()
        h.ev("delivered", attempt_id=A, kind="retry", rule_id="c", attempt=2, redelivered=False)
        h.ev("rule_started", attempt_id=A, rule_id="c", attempt=2, try_no=1, rerun=False)
        h.ev("rule_failed", attempt_id=A, rule_id="c", attempt=2, try_no=1, kind="timeout")
        h.ev("status_written", attempt_id=A, rule_id="c", status="failed_attempt_2")
        if acked:
            h.ev("retry_acked", attempt_id=A, rule_id="c", attempt=2)
        h.ev("parked", attempt_id=A, waiting={"c": 3})
        return h

    result = run(acked=True).check("retries_acked")
    passing(result, "retries_acked")
    assert result.cases["retries_acked"] == 1  # the status (text) made the ACK owed
    (v,) = failing(run(acked=False).check("retries_acked"), "retries_acked")
    assert "held the retry of attempt 2 past the attempt's durable outcome" in v.message
