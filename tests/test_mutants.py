"""Each mutant has the effect it claims, and the engine without it behaves.

No patch ever reaches this process. Mutants of the pure core are probed in a fresh
interpreter (`_probe`): it runs a scenario on the correct engine, applies the mutant, runs
it again, and prints both outcomes. Mutants of the store, the broker and the worker run as
real worker processes, `python -m chaos.mutants NAME ...`, beside a normal worker doing the
same work; each worker has its own namespace of the local Redis and RabbitMQ, deleted
afterwards (`tests.live.conftest.Live`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest
import simpy
from aio_pika.abc import AbstractIncomingMessage

from chaos.insim import mutants as sim_mutants
from chaos.mutants import INVARIANT_NAMES, MUTANTS
from chaos.workers import WorkerProcess
from engine.config import DEFAULT_AMQP_URL, STATE_TTL_SECONDS, EngineConfig
from engine.core import (
    AckRetry,
    Evaluation,
    PersistResult,
    PersistStatus,
    PublishPassResult,
    RuleResult,
    RunRule,
    ScheduleRetry,
    SkipRules,
    Snapshot,
)
from engine.history import FileHistory, read_history
from engine.plan import Plan
from engine.policy import RetryPolicy
from engine.runtime.store import LeaseLost, RedisStore, eval_key, result_key
from sim.history import Source
from tests.helpers import OK, PERMANENT, TRANSIENT, agent, example_plan, result_for, run_plan
from tests.live.conftest import PATIENCE_S, ROOT, Live, _broker_objects
from tests.live.test_engine_live import reference_verdicts

TINY = example_plan("tiny")
CODE_REVIEW = example_plan("code_review")


# --- the table and the command line --------------------------------------------------------


def test_table() -> None:
    for name, m in MUTANTS.items():
        assert m.name == name
        assert m.breaks in INVARIANT_NAMES
        assert m.description and "\n" not in m.description
        assert f"test_{name}" in globals(), f"mutant {name} has no test"


def test_unknown_mutant_exits_2_with_one_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "chaos.mutants", "nope", "--namespace", "x."],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "'nope'" in out.stderr


def test_a_mistyped_mutant_gets_a_hint() -> None:
    """`chaos run --mutant` and `python -m chaos.mutants` name the mutant meant."""
    for cmd in (
        ["chaos", "run", "scenarios/crash_after_ack.yaml", "--mode", "sim", "--mutant"],
        ["chaos.mutants"],
    ):
        out = subprocess.run(
            [sys.executable, "-m", *cmd, "no_sweepr"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
            check=False,
        )
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert "'no_sweepr' (did you mean 'no_sweeper'?)" in out.stderr
    assert all(name in out.stderr for name in MUTANTS)


# --- mutants of the core, probed in a fresh interpreter ------------------------------------


def _probe(probe: str, mutant: str) -> tuple[Any, Any]:
    """`probe()` on the correct engine, then with `mutant` applied, in a child process."""
    code = f"from tests.test_mutants import _child; _child({probe!r}, {mutant!r})"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    both = json.loads(out.stdout.splitlines()[-1])
    return both["before"], both["after"]


def _child(probe: str, mutant: str) -> None:
    fn = globals()[probe]
    before = fn()
    MUTANTS[mutant].apply()
    print(json.dumps({"before": before, "after": fn()}))


DOOMED = "static_analysis"
DEPENDENTS = sorted(CODE_REVIEW.transitive_dependents([DOOMED]))


def probe_permanent_failure() -> dict[str, Any]:
    """code_review, one rule at a time, static_analysis failing for good."""
    shell = run_plan(CODE_REVIEW, agent(**{DOOMED: PERMANENT}), max_parallel=1)
    assert shell.final is not None
    return {
        "skipped": sorted(r for a in shell.of_type(SkipRules) for r in a.rule_ids),
        "ran": sorted({c.rule_id for c in shell.calls}),
        "status": shell.final.status.value,
    }


def test_prune_everything() -> None:
    before, after = _probe("probe_permanent_failure", "prune_everything")
    assert DEPENDENTS == ["code_feedback", "correctness_review", "security_review"]
    assert before["skipped"] == DEPENDENTS
    assert before["ran"] == sorted(set(CODE_REVIEW.order) - set(DEPENDENTS))
    # Rules still pending when static_analysis failed, independent branches included, are
    # skipped too: the docs branch never runs.
    assert set(after["skipped"]) > set(DEPENDENTS)
    assert {"docs_quality", "docs_feedback", "style_consistency"} <= set(after["skipped"])
    assert not set(after["ran"]) & set(after["skipped"])
    assert after["status"] == before["status"] == "partial"


def test_prune_nothing() -> None:
    before, after = _probe("probe_permanent_failure", "prune_nothing")
    assert before["skipped"] == DEPENDENTS
    assert not set(before["ran"]) & set(DEPENDENTS)
    assert after["skipped"] == []
    assert after["ran"] == sorted(CODE_REVIEW.order)  # the dependents ran anyway
    assert after["status"] == "partial"


def probe_retry_after_recovery() -> dict[str, Any]:
    """tiny, unit_tests in `failed_attempt_1`: the attempt its retry runs, when the retry
    rebuilds the evaluation (`due`) and when it reaches one already resumed in memory."""
    snap = Snapshot(
        results={"compiles": result_for("compiles")},
        statuses={"unit_tests": "failed_attempt_1"},
    )

    def runs(actions: list[Any]) -> list[int]:
        return [a.attempt for a in actions if isinstance(a, RunRule) and a.rule_id == "unit_tests"]

    rebuilt = Evaluation(TINY, "a", snapshot=snap, due={"unit_tests": 2})
    from_due = runs(rebuilt.start())
    resumed = Evaluation(TINY, "a", snapshot=snap)
    waiting = runs(resumed.start())
    in_memory = runs(resumed.retry_due("unit_tests", 2))
    done = resumed.rule_succeeded("unit_tests", result_for("unit_tests", in_memory[0]))
    acks = [a.attempt for a in done if isinstance(a, AckRetry)]
    return {"due": from_due, "waiting": waiting, "in_memory": in_memory, "acks": acks}


def test_reset_attempts_on_recovery_in_the_core() -> None:
    before, after = _probe("probe_retry_after_recovery", "reset_attempts_on_recovery")
    assert before == {"due": [2], "waiting": [], "in_memory": [2], "acks": [2]}
    # Back at attempt 1 either way; the retry message (attempt 2) is still acked.
    assert after == {"due": [1], "waiting": [], "in_memory": [1], "acks": [2]}


def probe_dependencies() -> list[str]:
    """tiny, every call succeeding: the rules started before each of their dependencies
    had a persisted result."""
    shell = run_plan(TINY)
    deps = {rid: set(rule.depends_on) for rid, rule in TINY.rules.items()}
    persisted: set[str] = set()
    early: list[str] = []
    for action in shell.actions:
        if isinstance(action, PersistResult):
            persisted.add(action.rule_id)
        elif isinstance(action, RunRule) and deps[action.rule_id] - persisted:
            early.append(action.rule_id)
    return sorted(early)


def test_ignore_dag() -> None:
    before, after = _probe("probe_dependencies", "ignore_dag")
    assert before == []
    # The chain compiles -> unit_tests -> feedback starts at once, with style_check.
    assert after == ["feedback", "unit_tests"]


def _unit_tests(shell: Any) -> dict[str, Any]:
    """What a toy run did with unit_tests: its calls (attempt, try), the statuses written
    and the delayed retries scheduled (tier, delay, and the due time written with them)."""
    return {
        "calls": [[c.attempt, c.try_no] for c in shell.calls if c.rule_id == "unit_tests"],
        "statuses": [s.status for s in shell.of_type(PersistStatus)],
        "tiers": [s.tier for s in shell.of_type(ScheduleRetry)],
        "delays": [s.delay_ms for s in shell.of_type(ScheduleRetry)],
        "due": [s.retry_due_in_ms for s in shell.of_type(PersistStatus) if s.retry_due_in_ms],
    }


def probe_one_transient_failure() -> dict[str, Any]:
    """tiny, unit_tests' first call failing transiently, every other call succeeding."""
    flaky = agent(unit_tests=lambda attempt, try_no: TRANSIENT if attempt == try_no == 1 else OK)
    return _unit_tests(run_plan(TINY, flaky))


def test_no_immediate_retries() -> None:
    before, after = _probe("probe_one_transient_failure", "no_immediate_retries")
    # Level 1 absorbs the failure: a second call of attempt 1.
    assert before["calls"] == [[1, 1], [1, 2]] and before["statuses"] == []
    # Without it the attempt ends at once: failed_attempt_1, and a delayed retry.
    assert after["calls"] == [[1, 1], [2, 1]] and after["statuses"] == ["failed_attempt_1"]


def _tries(history: list[dict[str, Any]]) -> dict[tuple[str, str, int], list[int]]:
    """Each attempt's calls, by their try numbers, in the order they started."""
    out: dict[tuple[str, str, int], list[int]] = {}
    for e in history:
        if e["ev"] == "rule_started":
            out.setdefault((e["attempt_id"], e["rule_id"], e["attempt"]), []).append(e["try_no"])
    return out


def test_try_made_twice() -> None:
    # Caught by retry_budget on transient_llm_errors, live and in sim: the call made again
    # has no fault before it, so it counts (tests/test_chaos_runs.py, tests/test_explore.py).
    from chaos.insim import run_scenario
    from chaos.scenario import load_scenario

    loaded = load_scenario(ROOT / "scenarios" / "transient_llm_errors.yaml")
    before = _tries(run_scenario(loaded).history)
    after = _tries(run_scenario(loaded, mutant="try_made_twice").history)
    assert before.keys() == after.keys()
    redone = {k for k, tries in before.items() if 2 in tries and tries != after[k]}
    assert redone and all(before[k] == [1, 2, 3] for k in redone)
    # try 2, failed, made once more: four calls where level 1 allows three
    assert all(after[k] == [1, 2, 2, 3] for k in redone)
    assert all(after[k] == before[k] for k in before.keys() - redone)


def probe_always_failing() -> dict[str, Any]:
    """tiny, unit_tests failing every call transiently: three attempts of three calls (the
    default policy), and under a policy of one attempt."""
    failing = agent(unit_tests=TRANSIENT)
    once = RetryPolicy(max_attempts=1)
    return {
        "default": _unit_tests(run_plan(TINY, failing)),
        "one_attempt": _unit_tests(run_plan(TINY, failing, policy=once))["statuses"],
    }


def test_give_up_early() -> None:
    before, after = _probe("probe_always_failing", "give_up_early")
    tries = [[a, t] for a in (1, 2, 3) for t in (1, 2, 3)]
    assert before["default"]["calls"] == tries
    assert before["default"]["statuses"] == [
        "failed_attempt_1",
        "failed_attempt_2",
        "permanently_failed",
    ]
    # Attempt 3 is never made; level 1 is untouched.
    assert after["default"]["calls"] == tries[:6]
    assert after["default"]["statuses"] == ["failed_attempt_1", "permanently_failed"]
    assert before["one_attempt"] == after["one_attempt"] == ["permanently_failed"]


def probe_rule_max_attempts() -> dict[str, Any]:
    """code_review, test_run (max_attempts 5 in the plan) and license_header (1) failing
    every call transiently, under the default policy (3 attempts): each one's attempts."""
    failing = agent(test_run=TRANSIENT, license_header=TRANSIENT)
    shell = run_plan(CODE_REVIEW, failing)
    return {
        r: sorted({c.attempt for c in shell.calls if c.rule_id == r})
        for r in ("test_run", "license_header")
    }


def test_ignore_rule_max_attempts() -> None:
    # Caught by matches_reference on rule_max_attempts (tests/test_chaos_runs.py, live and
    # in sim), whose reference reads the plan with the checker's own code.
    before, after = _probe("probe_rule_max_attempts", "ignore_rule_max_attempts")
    assert before == {"test_run": [1, 2, 3, 4, 5], "license_header": [1]}
    assert after == {"test_run": [1, 2, 3], "license_header": [1, 2, 3]}


def probe_resume_after_permanent_failure() -> dict[str, Any]:
    """code_review resumed from a snapshot where license_header is permanently_failed:
    what the rebuilt evaluation starts and skips at once."""
    from engine.shell.reevaluate import ReEvaluateUseCase

    snap = Snapshot(statuses={"license_header": "permanently_failed"})
    core = ReEvaluateUseCase(EngineConfig(), "w").rebuild(CODE_REVIEW, "a", snap, {})
    actions = core.start()
    return {
        "runs": sorted(a.rule_id for a in actions if isinstance(a, RunRule)),
        "skipped": sorted(r for a in actions if isinstance(a, SkipRules) for r in a.rule_ids),
    }


def test_forget_permanent_failure() -> None:
    # Caught by attempts_monotonic on resume_after_permanent_failure (a start after the
    # permanently_failed write), live and in sim: tests/test_chaos_runs.py, tests/test_sim.py.
    before, after = _probe("probe_resume_after_permanent_failure", "forget_permanent_failure")
    assert "license_header" not in before["runs"] and before["skipped"] == ["docs_feedback"]
    assert "license_header" in after["runs"] and after["skipped"] == []


def _marked_to_started(history: list[dict[str, Any]]) -> list[float]:
    """For each delayed retry's first start: seconds from its start marker's write."""
    marked = {
        (e["src"], e["attempt_id"], e["rule_id"], e["attempt"]): e["t"]
        for e in history
        if e["ev"] == "start_marked"
    }
    return [
        e["t"] - marked[key]
        for e in history
        if e["ev"] == "rule_started"
        and e["attempt"] > 1
        and e["try_no"] == 1
        and (key := (e["src"], e["attempt_id"], e["rule_id"], e["attempt"])) in marked
    ]


def test_hold_due_retry() -> None:
    # Caught by retry_delays_respected on delay_tiers, live and in sim
    # (tests/test_chaos_runs.py, tests/test_sim.py): 0.5 s at its time scale, half the
    # slack the check once allowed, and no slot, resume or fault to explain it.
    from chaos.insim import run_scenario
    from chaos.mutants import HOLD_DUE_RETRY_MS
    from chaos.scenario import load_scenario

    loaded = load_scenario(ROOT / "scenarios" / "delay_tiers.yaml")
    before = _marked_to_started(run_scenario(loaded).history)
    after = _marked_to_started(run_scenario(loaded, mutant="hold_due_retry").history)
    held = HOLD_DUE_RETRY_MS * loaded.spec.time_scale / 1000
    assert before and max(before) < 0.005
    # (the times are differences of simulated clock readings: a float's last bit aside)
    assert len(after) == len(before) and min(after) >= held - 1e-9


def probe_retry_tiers() -> dict[str, Any]:
    """tiny, unit_tests failing every call, four attempts on tiers 0.1 s, 2 s and 30 s
    without jitter: where each delayed retry goes."""
    policy = RetryPolicy(tiers_ms=(100, 2000, 30000), max_attempts=4, jitter=0.0)
    return _unit_tests(run_plan(TINY, agent(unit_tests=TRANSIENT), policy=policy))


def test_slow_tier() -> None:
    before, after = _probe("probe_retry_tiers", "slow_tier")
    assert (before["tiers"], before["delays"]) == ([0, 1, 2], [100, 2000, 30000])
    assert before["due"] == before["delays"]
    # One tier later each time, the last one staying the last; the due time agrees.
    assert (after["tiers"], after["delays"]) == ([1, 2, 2], [2000, 30000, 30000])
    assert after["due"] == after["delays"]
    assert after["calls"] == before["calls"]  # the same attempts, only later


def probe_history_seqs() -> list[int]:
    """Fifteen events recorded by a worker's history writer: the seqs its file holds."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "history.jsonl"
        history = FileHistory(path, "probe")
        for n in range(15):
            history.record("probe", n=n)
        history.close()
        return [e["seq"] for e in read_history(path)]


def test_drop_history_events() -> None:
    before, after = _probe("probe_history_seqs", "drop_history_events")
    assert before == list(range(1, 16))
    assert after == [s for s in range(1, 16) if s not in (7, 14)]  # numbered, not written

    # The simulator's history source of a worker loses the same events, the runner's none
    # (another process, live); and the source is whole again after the run.
    def seqs(src: str) -> list[int]:
        events: list[dict[str, Any]] = []
        source = Source(simpy.Environment(), events, src, 1)
        for n in range(15):
            source.record("probe", n=n)
        return [e["seq"] for e in events]

    with sim_mutants.patched("drop_history_events"):
        assert seqs("sim-w0-1") == after
        assert seqs("runner") == before
    assert seqs("sim-w0-1") == before


# --- mutants run as worker processes, beside a normal worker --------------------------------


class Slice(Live):
    """One namespace of the live stack, whose workers run `mutant` (None: the engine)."""

    def __init__(self, tmp: Path, mutant: str | None) -> None:
        tmp.mkdir()
        super().__init__(tmp)
        self.mutant = mutant

    def worker(
        self,
        *flags: str,
        agent: dict[str, Any] | None = None,
        failpoints: list[str] | None = None,
        **opts: str,
    ) -> WorkerProcess:
        """Start a worker (not waiting for it: see `_ready`)."""
        args: list[str] = []
        for key, value in {**self.base_args, **opts}.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        args += ["--history", str(self.history_path), "--log-level", "INFO", *flags]
        if agent is not None:
            args += ["--agent", json.dumps(agent)]
        for fp in failpoints or []:
            args += ["--failpoint", fp]
        module = ("chaos.mutants", self.mutant) if self.mutant else ("engine.worker",)
        n = len(self.workers)
        w = WorkerProcess(
            args, log_path=self.tmp / f"worker{n}.log", name=f"worker{n}", module=module
        )
        self.workers.append(w.start())
        return w


def _ready(*workers: WorkerProcess) -> None:
    for w in workers:
        assert w.log_path is not None
        if not w.wait_for_log("ready", PATIENCE_S):
            raise AssertionError(f"worker did not start:\n{w.log_path.read_text()}")


@contextlib.contextmanager
def _pair(tmp: Path, mutant: str, **base_args: str) -> Iterator[tuple[Slice, Slice]]:
    """A slice whose workers run `mutant`, and one whose workers run the engine."""
    slices = [Slice(tmp / "mutant", mutant), Slice(tmp / "engine", None)]
    try:
        for s in slices:
            s.base_args.update(base_args)
        yield slices[0], slices[1]
    finally:
        for s in slices:
            s.close()


def _both(mut: Slice, ref: Slice, *flags: str, **kw: Any) -> tuple[WorkerProcess, WorkerProcess]:
    """The same worker in each slice, started side by side."""
    pair = mut.worker(*flags, **kw), ref.worker(*flags, **kw)
    _ready(*pair)
    return pair


def live(test: Any) -> Any:
    """The machine's Redis and RabbitMQ: a live test, and a slow one (`-m "not slow"`)."""
    return pytest.mark.slow(pytest.mark.live(test))


@live
def test_result_without_ttl(tmp_path: Path) -> None:
    with _pair(tmp_path, "result_without_ttl") as (mut, ref):
        _both(mut, ref)
        for s in (mut, ref):
            s.submit(TINY, s.ids(1))
        for s in (mut, ref):
            [a] = s.ids(1)
            assert s.wait([a]) == {a: "completed"}
            results = {f"attempt:{a}:rule:{r}:result" for r in TINY.order}
            others = set(s.redis.scan_iter(f"attempt:{a}:*")) - results
            result_ttls = {s.redis.ttl(k) for k in results}
            assert others and all(0 < s.redis.ttl(k) <= STATE_TTL_SECONDS for k in others)
            assert all(s.result(a, r) is not None for r in TINY.order)
            if s is mut:
                assert result_ttls == {-1}  # written, and never to expire
            else:
                assert all(STATE_TTL_SECONDS - 120 < t <= STATE_TTL_SECONDS for t in result_ttls)


def probe_result_writes() -> dict[str, Any]:
    """Two writes of one rule's result, verdicts apart (a late write by an execution that
    lost its lease): which reported a win, and what Redis keeps, with its TTL."""

    async def go() -> dict[str, Any]:
        store = RedisStore(EngineConfig(namespace=f"probe-{uuid.uuid4().hex[:8]}."))
        a = f"probe-{uuid.uuid4().hex[:8]}"
        first = RuleResult(rule_id="r1", verdict="pass", score=0.9, tokens=10)
        late = dataclasses.replace(first, verdict="fail", score=0.2)
        try:
            won = [(await store.write_result(a, r))[0] is None for r in (first, late)]
            raw = await store.redis.get(result_key(a, "r1"))
            ttl = await store.redis.ttl(result_key(a, "r1"))
        finally:
            await store.redis.delete(result_key(a, "r1"))
            await store.close()
        kept = RuleResult.from_json(raw).verdict
        return {"won": won, "kept": kept, "ttl": 0 < ttl <= STATE_TTL_SECONDS}

    return asyncio.run(go())


@live
def test_overwrite_result() -> None:
    before, after = _probe("probe_result_writes", "overwrite_result")
    assert before == {"won": [True, False], "kept": "pass", "ttl": True}  # the first wins
    assert after == {"won": [True, True], "kept": "fail", "ttl": True}  # the last wins


@live
def test_double_final_publish(tmp_path: Path) -> None:
    with _pair(tmp_path, "double_final_publish") as (mut, ref):
        workers = _both(mut, ref)

        async def bind(s: Slice) -> tuple[aio_pika.abc.AbstractConnection, aio_pika.Queue]:
            conn = await aio_pika.connect(DEFAULT_AMQP_URL, timeout=PATIENCE_S)
            ch = await conn.channel()
            ex = await ch.get_exchange(s.config().name("evaluation.events"))
            q = await ch.declare_queue(exclusive=True)
            await q.bind(ex, "evaluation.completed")
            return conn, q

        async def drain(q: aio_pika.Queue) -> list[AbstractIncomingMessage]:
            out = []
            while (msg := await q.get(fail=False, timeout=PATIENCE_S)) is not None:
                out.append(msg)
                await msg.ack()
            return out

        async def run() -> dict[Slice, list[AbstractIncomingMessage]]:
            bound = {s: await bind(s) for s in (mut, ref)}
            try:
                for s, copies in ((mut, 2), (ref, 1)):
                    [a] = s.ids(1)
                    await asyncio.to_thread(s.submit, TINY, [a])
                    # Each copy is recorded once the broker has confirmed it.
                    await asyncio.to_thread(
                        s.wait_for,
                        lambda s=s, a=a, n=copies: len(s.events("final_published", a)) >= n,
                        what="the final event",
                    )
                # Stopped workers publish nothing more: what the queues hold is all there is.
                await asyncio.to_thread(lambda: [w.terminate() for w in workers])
                return {s: await drain(q) for s, (_, q) in bound.items()}
            finally:
                for conn, _ in bound.values():
                    await conn.close()

        got = asyncio.run(run())
        for s, copies in ((mut, 2), (ref, 1)):
            [a] = s.ids(1)
            msgs = got[s]
            assert len(msgs) == copies
            assert {m.body for m in msgs} == {msgs[0].body}  # the same body
            assert {m.message_id for m in msgs} == {f"{a}:completed"}
            assert json.loads(msgs[0].body)["status"] == "completed"
            assert len(s.events("final_published", a)) == copies


@live
def test_per_message_ttl(tmp_path: Path) -> None:
    # Tier 1 is 100 ms, tier 2 2 s, and unit_tests fails its first two attempts. B is
    # submitted once A's retry of attempt 3 (2 s) is out; B's retry of attempt 2 (100 ms)
    # follows it into the delay queues.
    base = {"time-scale": "1", "tiers-ms": "100,2000", "jitter": "0", "retry-grace-ms": "30000"}
    with _pair(tmp_path, "per_message_ttl", **base) as (mut, ref):
        _both(mut, ref, agent={"fail_rules": {"unit_tests": 6}})
        ids = {s: s.ids(2) for s in (mut, ref)}
        for s in (mut, ref):
            s.submit(TINY, ids[s][:1])
        for s in (mut, ref):
            s.wait_for(lambda s=s: s.events("retry_published", ids[s][0], attempt=3), what="A")
            s.submit(TINY, ids[s][1:])
        for s in (mut, ref):
            s.wait_for(
                lambda s=s: s.events("delivered", ids[s][1], kind="retry", attempt=2),
                timeout=PATIENCE_S,
                what="B's retry",
            )
            s.wait_for(
                lambda s=s: s.events("delivered", ids[s][0], kind="retry", attempt=3),
                timeout=PATIENCE_S,
                what="A's retry",
            )
        for s in (mut, ref):
            a, b = ids[s]
            [long] = s.events("retry_published", a, attempt=3)
            [short] = s.events("retry_published", b, attempt=2)
            [short_out] = s.events("delivered", b, kind="retry", attempt=2)
            [long_out] = s.events("delivered", a, kind="retry", attempt=3)
            assert (long["delay_ms"], short["delay_ms"]) == (2000, 100)  # what was meant
            assert long["t"] < short["t"]
            # Each TTL runs from an enqueue that follows the status write before it (the
            # publish is recorded once confirmed, maybe late): lower bounds from there
            # hold however busy the machine is.
            [a_failed] = s.events("status_written", a, status="failed_attempt_2")
            [b_failed] = s.events("status_written", b, status="failed_attempt_1")
            if s is mut:  # out only when A's message, at the head of the one queue, expired
                assert short_out["t"] >= a_failed["t"] + 2.0 - 0.005, short_out["t"]
            else:
                # not held behind A's 2 s message: out before it, after its own 100 ms
                assert short_out["t"] - b_failed["t"] >= 0.1 - 0.005
                assert short_out["t"] < long_out["t"]
        assert f"{mut.ns}evaluation.retry.shared" in _broker_objects("queues", mut.ns)


@live
def test_reset_attempts_on_recovery(tmp_path: Path) -> None:
    # unit_tests fails its first attempt; its retry (tier 1, 300 ms) finds the evaluation
    # parked, and rebuilds it from Redis. The agent fails the calls of attempt 1 whoever
    # makes them, so the mutant, back at attempt 1, fails again, and again: it never ends.
    with _pair(tmp_path, "reset_attempts_on_recovery", **{"time-scale": "0.01"}) as (mut, ref):
        _both(mut, ref, agent={"fail_rules": {"unit_tests": 3}})
        for s in (mut, ref):
            s.submit(TINY, s.ids(1))
        ids = {s: s.ids(1)[0] for s in (mut, ref)}
        assert ref.wait([ids[ref]]) == {ids[ref]: "completed"}
        mut.wait_for(
            lambda: mut.events("retry_acked", ids[mut], rule_id="unit_tests", attempt=2),
            what="the mutant's rerun, and its retry message acked",
        )
        for s, a in ids.items():
            starts = s.events("rule_started", a, rule_id="unit_tests", try_no=1)
            parked = s.events("parked", a)[0]
            retry = s.events("delivered", a, kind="retry", rule_id="unit_tests", attempt=2)[0]
            assert parked["t"] < retry["t"] < starts[1]["t"]
            assert s.events("recovered", a)[0]["retrying"] == {"unit_tests": 1}
            assert s.status(a, "unit_tests") == "failed_attempt_1"
            expected = 1 if s is mut else 2  # the mutant went back to attempt 1
            assert [e["attempt"] for e in starts[:2]] == [1, expected]
        assert ref.result(ids[ref], "unit_tests").attempt == 2
        assert mut.result(ids[mut], "unit_tests") is None


@live
def test_nondeterministic_agent(tmp_path: Path) -> None:
    with _pair(tmp_path, "nondeterministic_agent") as (mut, ref):
        _both(mut, ref)
        for s in (mut, ref):
            s.submit(CODE_REVIEW, s.ids(2))
        differ = {}
        for s in (mut, ref):
            ids = s.ids(2)
            assert s.wait(ids) == dict.fromkeys(ids, "completed")
            differ[s] = [
                (a, r)
                for a in ids
                for r, verdict in reference_verdicts(CODE_REVIEW, a).items()
                if s.result(a, r).verdict != verdict
            ]
        assert differ[ref] == []
        # 26 rules, each agreeing with the reference by chance with p < 0.55
        assert differ[mut]


def probe_wait_replicas() -> int:
    """What a worker asked to wait for one replica gets."""
    from engine.config import EngineConfig

    return EngineConfig(wait_replicas=1).wait_replicas


def test_no_wait() -> None:
    # Every config waits for no replica, whatever it was given (the worker's own included):
    # sentinel_failover_with_partition then loses what the cut replica never got
    # (tests/test_sim_sentinel.py, tests/test_chaos_runs.py).
    assert _probe("probe_wait_replicas", "no_wait") == (1, 0)


def probe_confirm_final() -> list[Any]:
    """What the owner's final write asks Redis to hold again: the results and permanent
    failures `finish` writes back (SET NX) before the final state."""
    from types import SimpleNamespace

    from engine.core import Finish, RuleResult, RuleState
    from engine.core.states import EvaluationStatus

    result = RuleResult("r1", "pass", 1.0, 0)
    core = SimpleNamespace(
        results={"r1": result},
        rules_in=lambda state: ["r2"] if state is RuleState.PERMANENTLY_FAILED else [],
    )
    owner = SimpleNamespace(
        core=core, attempt_id="a", fence="1:w", host=SimpleNamespace(outbox=False)
    )
    action = Finish(EvaluationStatus.PARTIAL, {"r1": "pass", "r2": "failed"})
    from engine.shell.orchestrator import PassExecutionOrchestrator

    step = PassExecutionOrchestrator._confirm_final(owner, action)  # type: ignore[arg-type]
    effect = next(step)
    return [effect.op, sorted(effect.args[2]), effect.args[3]]


def test_no_restore() -> None:
    # The final write no longer carries what it must make sure Redis holds: a result lost
    # to a failover or a lossy restart is announced all the same (redis_data_loss,
    # tests/test_chaos_runs.py; sentinel_paused_primary with no_wait too: unmitigated).
    before, after = _probe("probe_confirm_final", "no_restore")
    assert before == ["finish", ["r1"], ["r2"]]
    assert after == ["finish", [], []]


def test_unmitigated() -> None:
    # Both answers gone at once (tests/test_sim_sentinel.py shows each alone suffices on
    # sentinel_paused_primary, and both gone fail it).
    assert _probe("probe_wait_replicas", "unmitigated") == (1, 0)
    assert _probe("probe_confirm_final", "unmitigated")[1] == ["finish", [], []]


@live
def test_no_sweeper(tmp_path: Path) -> None:
    # What a worker that died right after the ACK leaves behind: an evaluation begun (its
    # lease, plan, state and running stamp), that nobody holds any more.
    with _pair(tmp_path, "no_sweeper", **{"stale-ms": "300"}) as (mut, ref):
        _both(mut, ref)
        for s in (mut, ref):
            asyncio.run(_orphan(s, TINY, s.ids(1)[0]))
        [a] = ref.ids(1)
        assert ref.wait([a], timeout=10) == {a: "completed"}
        assert ref.events("sweeper_resumed", a)
        [a] = mut.ids(1)
        assert mut.wait([a], timeout=2.0) == {a: "running"}  # six stale periods later
        assert mut.history(a) == []
        for s, on in ((mut, False), (ref, True)):
            assert [e["sweeper"] for e in s.history() if e["ev"] == "worker_started"] == [on]


async def _orphan(s: Slice, plan: Plan, attempt_id: str) -> None:
    store = RedisStore(dataclasses.replace(s.config(), stale_ms=int(s.base_args["stale-ms"])))
    try:
        begun = await store.begin(attempt_id, "dead-worker", plan.order, plan.to_json())
        assert begun.snapshot is not None
    finally:
        await store.close()


@live
def test_no_redis_results(tmp_path: Path) -> None:
    # The first worker dies after its third result write, past the ACK; the sweeper of a
    # second one resumes the evaluation.
    with _pair(tmp_path, "no_redis_results") as (mut, ref):
        first = _both(mut, ref, failpoints=["rule_after_write=crash,hit=3"])
        for s in (mut, ref):
            s.submit(CODE_REVIEW, s.ids(1))
        for w in first:
            assert w.wait_exit(PATIENCE_S) == -9
        _both(mut, ref)
        for s, w in zip((mut, ref), first, strict=True):
            [a] = s.ids(1)
            assert s.wait([a]) == {a: "completed"}
            finished = {e["rule_id"] for e in s.events("result_persisted", a, pid=w.pid)}
            assert len(finished) == 3
            starts = s.starts(a)
            loaded = {r for e in s.events("recovered", a) for r in e["loaded"]}
            if s is mut:  # finished rules ran again, and their second write lost
                assert all(starts[r] == 2 for r in finished), starts
                assert not loaded
                reruns = [e for e in s.events("result_persisted", a) if e["rule_id"] in finished]
                assert [e["won"] for e in reruns].count(False) == 3
            else:
                assert all(starts[r] == 1 for r in finished), starts
                assert loaded == finished


# --- cancels, announcements, indexes and leases ---------------------------------------------


def probe_pass_outcomes() -> dict[str, str]:
    """code_review, static_analysis failing for good: the outcome each pass is announced with."""
    shell = run_plan(CODE_REVIEW, agent(**{DOOMED: PERMANENT}), max_parallel=1)
    return {a.pass_id: a.outcome for a in shell.of_type(PublishPassResult)}


def test_all_passes_complete() -> None:
    before, after = _probe("probe_pass_outcomes", "all_passes_complete")
    assert before == {
        "intake": "complete",
        "analysis": "partial",  # static_analysis failed for good
        "review": "partial",  # its dependents skipped
        "synthesis": "partial",
    }
    assert after == dict.fromkeys(before, "complete")


def probe_pass_announcements() -> list[str] | str:
    """code_review, one rule at a time: each pass announcement in order, or what the unit
    tests' driver refused (`tests.helpers`: a pass announced twice)."""
    try:
        shell = run_plan(CODE_REVIEW, agent(), max_parallel=1)
    except AssertionError as exc:
        return str(exc)
    return [a.pass_id for a in shell.of_type(PublishPassResult)]


def test_pass_announced_again() -> None:
    before, after = _probe("probe_pass_announcements", "pass_announced_again")
    assert before == [p.id for p in CODE_REVIEW.passes]  # each once, in the plan's order
    assert after == "pass intake published twice"  # at the next rule's end


async def _probe_store(go: Any, evaluations: int = 2) -> dict[str, Any]:
    """`go(store, attempt_ids)` on a store of a namespace of its own, deleted afterwards."""
    ns = f"probe-{uuid.uuid4().hex[:8]}."
    store = RedisStore(EngineConfig(namespace=ns))
    ids = [f"{ns}att-{i}" for i in range(evaluations)]
    try:
        return await go(store, ids)
    finally:
        for pattern in [f"attempt:{ns}*", f"{ns}*"]:
            async for key in store.redis.scan_iter(match=pattern):
                await store.redis.delete(key)
        await store.close()


def probe_running_index() -> dict[str, bool]:
    """Whether the running index still holds an evaluation once it is over: one finished
    and announced (`done`), then met by the sweeper's claim; one whose final state another
    writer won (`unindex`)."""

    async def go(store: RedisStore, ids: list[str]) -> dict[str, bool]:
        a, b = ids
        for x in ids:
            assert (await store.begin(x, "w", TINY.order, TINY.to_json())).snapshot is not None
        assert await store.finish(a, "completed", {}, []) == (None, [])
        assert await store.done(a, "w")
        indexed = {"done": await store.redis.zscore(store.running_index, a) is not None}
        claimed = await store.claim_stale(a, -3_600_000)  # stale by any measure
        indexed["claimed"] = claimed or await store.redis.zscore(store.running_index, a) is not None
        assert await store.set_state(b, "cancelled") is None
        await store.unindex(b)
        indexed["unindexed"] = await store.redis.zscore(store.running_index, b) is not None
        return indexed

    return asyncio.run(_probe_store(go))


@live
def test_leak_running_index() -> None:
    before, after = _probe("probe_running_index", "leak_running_index")
    assert before == {"done": False, "claimed": False, "unindexed": False}
    assert after == {"done": True, "claimed": True, "unindexed": True}  # never claimed, kept


def probe_lease_after_done() -> dict[str, bool]:
    """Whether the announcer still holds the lease of the evaluation it announced."""

    async def go(store: RedisStore, ids: list[str]) -> dict[str, bool]:
        a = ids[0]
        assert (await store.begin(a, "w", TINY.order, TINY.to_json())).snapshot is not None
        assert await store.finish(a, "completed", {}, []) == (None, [])
        assert await store.done(a, "w")
        return {"held": await store.redis.get(eval_key(a, "owner")) is not None}

    return asyncio.run(_probe_store(go))


@live
def test_done_keeps_lease() -> None:
    before, after = _probe("probe_lease_after_done", "done_keeps_lease")
    assert before == {"held": False}
    assert after == {"held": True}


def probe_lease() -> dict[str, Any]:
    """Worker w1 begins an evaluation; w2 begins it while w1's lease runs."""

    async def go(store: RedisStore, ids: list[str]) -> dict[str, Any]:
        a = ids[0]
        assert (await store.begin(a, "w1", TINY.order, TINY.to_json())).snapshot is not None
        second = await store.begin(a, "w2", TINY.order, None)
        owner = await store.redis.get(eval_key(a, "owner"))
        return {"holder": second.holder, "begun": second.snapshot is not None, "owner": owner}

    return asyncio.run(_probe_store(go))


@live
def test_ignore_lease() -> None:
    before, after = _probe("probe_lease", "ignore_lease")
    assert before == {"holder": "w1", "begun": False, "owner": "w1"}
    assert after == {"holder": None, "begun": True, "owner": "w2"}  # taken from a live owner


def probe_fence() -> dict[str, Any]:
    """w1 begins an evaluation; its lease lapses; w2 begins it (a new token); w1, awake,
    writes a result and counts a start with its old token. What lands?"""

    async def go(store: RedisStore, ids: list[str]) -> dict[str, Any]:
        a = ids[0]
        first = await store.begin(a, "w1", TINY.order, TINY.to_json())
        await store.redis.delete(eval_key(a, "owner"))  # the lease lapses
        second = await store.begin(a, "w2", TINY.order, None)
        late = RuleResult("compiles", "fail", 0.1, 5)
        try:
            await store.write_result(a, late, [("unit_tests", 1)], first.fence)
            refused = False
        except LeaseLost:
            refused = True
        stored = await store.redis.get(result_key(a, "compiles"))
        return {
            "tokens": [first.fence, second.fence],
            "refused": refused,
            "written": stored is not None,
            "owner": await store.redis.get(eval_key(a, "owner")),
        }

    return asyncio.run(_probe_store(go))


@live
def test_no_fencing() -> None:
    before, after = _probe("probe_fence", "no_fencing")
    assert before == {"tokens": ["1:w1", "2:w2"], "refused": True, "written": False, "owner": "w2"}
    # The stale owner's write lands beside the new owner.
    assert after == {"tokens": ["1:w1", "2:w2"], "refused": False, "written": True, "owner": "w2"}


def probe_renewals() -> dict[str, Any]:
    """Three heartbeats of an evaluation's owner: what each renewal reports, and the lease."""

    async def go(store: RedisStore, ids: list[str]) -> dict[str, Any]:
        a = ids[0]
        begun = await store.begin(a, "w", TINY.order, TINY.to_json())
        assert begun.snapshot is not None
        renewed = [(await store.renew({a: begun.fence}, "w"))[a] for _ in range(3)]
        return {"renewed": renewed, "owner": await store.redis.get(eval_key(a, "owner"))}

    return asyncio.run(_probe_store(go))


@live
def test_needless_rerun_in_the_store() -> None:
    before, after = _probe("probe_renewals", "needless_rerun")
    assert before == {"renewed": [True, True, True], "owner": "w"}
    # The second renewal says the lease is lost, although Redis renewed it.
    assert after == {"renewed": [True, False, True], "owner": "w"}


@live
def test_needless_rerun(tmp_path: Path) -> None:
    # Rules of 100 ms, one at a time: the second heartbeat (200 ms) finds one in flight.
    with _pair(tmp_path, "needless_rerun") as (mut, ref):
        _both(mut, ref, agent={"latency_ms": 100_000}, max_parallel="1")
        for s in (mut, ref):
            s.submit(CODE_REVIEW, s.ids(1))
        for s in (mut, ref):
            [a] = s.ids(1)
            assert s.wait([a]) == {a: "completed"}
            abandoned = s.events("evaluation_abandoned", a)
            rerun = [r for r, n in s.starts(a).items() if n > 1]
            if s is mut:  # given up without a fault, resumed, and its rule in flight rerun
                assert [e["reason"] for e in abandoned] == ["lease lost"]
                assert s.events("evaluation_started", a, resumed=True)
                assert rerun
            else:
                assert not abandoned and not rerun


def _terminal_event(s: Slice, a: str) -> dict[str, Any]:
    s.wait_for(lambda: s.events("evaluation_terminal", a), what=f"{a} to end in memory")
    [e] = s.events("evaluation_terminal", a)
    return e


@live
def test_start_after_cancel(tmp_path: Path) -> None:
    # Rules of 100 ms, one at a time; the cancel comes once two have finished.
    with _pair(tmp_path, "start_after_cancel") as (mut, ref):
        _both(mut, ref, agent={"latency_ms": 100_000}, max_parallel="1")
        for s in (mut, ref):
            s.submit(CODE_REVIEW, s.ids(1))
        for s in (mut, ref):
            [a] = s.ids(1)
            s.wait_for(lambda s=s, a=a: len(s.events("rule_finished", a)) >= 2, what="2 rules")
            assert s.cancel(a) == "cancelled"
        for s in (mut, ref):
            [a] = s.ids(1)
            end = _terminal_event(s, a)
            # Told by the broadcast, or by the state its next write read back.
            told = min(e["t"] for e in s.events("cancel_received", a) + s.events("cancel_seen", a))
            after = [e for e in s.events("rule_started", a) if e["t"] > told]
            assert s.wait([a]) == {a: "cancelled"}  # the cancel's state stays
            results = [r for r in CODE_REVIEW.order if s.result(a, r) is not None]
            if s is mut:  # it heard of the cancel and went on to the end
                assert (end["decided"], end["won"]) == ("completed", False)
                assert s.events("cancel_received", a, held=True)
                assert not s.events("cancel_seen", a)
                assert len(after) >= 5 and results == list(CODE_REVIEW.order)
            else:
                assert (end["decided"], end["won"]) == ("cancelled", False)
                assert len(after) <= 1 and len(results) < len(CODE_REVIEW.order)


@live
def test_spurious_cancel(tmp_path: Path) -> None:
    # Two evaluations in one worker; only the first is cancelled, once both run.
    with _pair(tmp_path, "spurious_cancel") as (mut, ref):
        _both(mut, ref, agent={"latency_ms": 100_000}, max_parallel="1")
        for s in (mut, ref):
            s.submit(CODE_REVIEW, s.ids(2))
        for s in (mut, ref):
            ids = s.ids(2)
            for a in ids:
                s.wait_for(lambda s=s, a=a: s.events("rule_finished", a), what=f"{a} running")
            assert s.cancel(ids[0]) == "cancelled"
        for s in (mut, ref):
            a, b = s.ids(2)
            end = _terminal_event(s, b)
            if s is mut:  # b's owner cancelled it, and announced it cancelled
                assert s.wait([a, b]) == {a: "cancelled", b: "cancelled"}
                assert (end["status"], end["won"]) == ("cancelled", True)
                assert s.events("final_published", b, status="cancelled")
            else:
                assert s.wait([a, b]) == {a: "cancelled", b: "completed"}
                assert (end["status"], end["won"]) == ("completed", True)


@live
def test_no_completed_event(tmp_path: Path) -> None:
    with _pair(tmp_path, "no_completed_event") as (mut, ref):
        workers = _both(mut, ref)

        async def run() -> dict[Slice, list[AbstractIncomingMessage]]:
            conn = await aio_pika.connect(DEFAULT_AMQP_URL, timeout=PATIENCE_S)
            try:
                ch = await conn.channel()
                queues = {}
                for s in (mut, ref):
                    queues[s] = await ch.declare_queue(exclusive=True)
                    ex = await ch.get_exchange(s.config().name("evaluation.events"))
                    await queues[s].bind(ex, "evaluation.completed")
                for s in (mut, ref):
                    [a] = s.ids(1)
                    await asyncio.to_thread(s.submit, TINY, [a])
                    await asyncio.to_thread(
                        s.wait_for, lambda s=s, a=a: s.events("final_published", a), what=a
                    )
                # Stopped workers publish nothing more: what the queues hold is all there is.
                await asyncio.to_thread(lambda: [w.terminate() for w in workers])
                got = {}
                for s, q in queues.items():
                    got[s] = []
                    while (msg := await q.get(fail=False, timeout=PATIENCE_S)) is not None:
                        got[s].append(msg)
                        await msg.ack()
                return got
            finally:
                await conn.close()

        got = asyncio.run(run())
        for s in (mut, ref):
            [a] = s.ids(1)
            assert s.redis.get(eval_key(a, "final_published")) == "1"  # flagged either way
            assert s.redis.get(eval_key(a, "state")) == "completed"
        assert got[mut] == []  # the engine believes it announced: nobody heard
        assert [json.loads(m.body)["status"] for m in got[ref]] == ["completed"]


def probe_lost_retry() -> dict[str, Any]:
    """The sweeper finds a retry overdue, its rule in `failed_attempt_2`: which attempt does
    it re-publish? The shared step itself (`engine.shell.sweeper`), with scripted replies."""
    from engine.keys import retry_member
    from engine.shell import sweeper
    from engine.shell.effects import PublishWork
    from tests.test_shell import CONFIG, play

    member = retry_member("a1", "compiles")
    store = {
        "stale_evaluations": lambda older: [],
        "overdue_retries": lambda grace: [member],
        "claim_retry": lambda m, grace: "failed_attempt_2",
    }
    done = play(sweeper.sweep(CONFIG, set()), store)
    return {"attempts": [e.body["attempt"] for e in done if isinstance(e, PublishWork)]}


def test_sweep_wrong_attempt() -> None:
    before, after = _probe("probe_lost_retry", "sweep_wrong_attempt")
    assert before == {"attempts": [3]}
    # the attempt that failed: a stale retry, dropped on arrival, and nothing wakes the
    # evaluation (lost_dead_letter fails all_terminal, live and in sim, from this one patch)
    assert after == {"attempts": [2]}


def probe_stored_verdicts() -> dict[str, str]:
    """code_review read back from a store where static_analysis failed for good."""
    snapshot = Snapshot(
        results={"compiles": RuleResult("compiles", "pass", 0.9, 10)},
        statuses={"static_analysis": "permanently_failed"},
    )
    core = Evaluation(CODE_REVIEW, "a", snapshot=snapshot)
    return {r: v for r, v in core.stored_verdicts().items() if v != "pending"}


def test_results_only_reannounced() -> None:
    # The re-announcement drops what has no result: the failed rule and its skipped chain
    # (announcer_dies_after_a_permanent_failure, live and in sim: tests/test_chaos_runs.py,
    # tests/test_sim.py, tests/test_held_out_bugs.py).
    before, after = _probe("probe_stored_verdicts", "results_only_reannounced")
    assert before == {
        "compiles": "pass",
        "static_analysis": "permanently_failed",
        **dict.fromkeys(DEPENDENTS, "skipped"),
    }
    assert after == {"compiles": "pass"}


def _after_stop(s: Slice) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The worker's graceful stop: its first event (`worker_stopping`, else its first
    abandon "worker stopping") and what it took on after it (deliveries, begins)."""
    events = s.history()
    stop = [
        e
        for e in events
        if e["ev"] == "worker_stopping"
        or (e["ev"] == "evaluation_abandoned" and e.get("reason") == "worker stopping")
    ]
    assert stop, "the worker never stopped"
    t = stop[0]["t"]
    taken = [e for e in events if e["ev"] in ("delivered", "evaluation_started") and e["t"] > t]
    return stop, taken


@live
def test_old_close_order(tmp_path: Path) -> None:
    # One worker per slice holds the retries of four evaluations (attempt 2 of compiles
    # running, 300 ms calls) when it is told to stop (SIGTERM), each as soon as its own
    # slice holds them: a worker left running while the other slice catches up (a CI run,
    # the machine loaded) finished its four evaluations first, and its stop abandoned none.
    with _pair(tmp_path, "old_close_order", **{"max-evaluations": "4"}) as (mut, ref):
        agent_profile = {"latency_ms": 300_000, "fail_rules": {"compiles": 1}}
        workers = _both(mut, ref, agent=agent_profile, immediate_retries="0")
        for s in (mut, ref):
            s.submit(TINY, s.ids(4))
        for s, w in zip((mut, ref), workers, strict=True):
            s.wait_for(
                lambda s=s: sum(len(s.events("rule_started", a, attempt=2)) for a in s.ids(4)) >= 4,
                what="four retries held",
            )
            # the stop's own end, however long a busy machine makes it: its history is whole
            w.terminate(timeout=PATIENCE_S)
        stop, taken = _after_stop(mut)
        assert stop[0]["ev"] == "evaluation_abandoned"  # no worker_stopping in the old close
        assert taken, "the requeued retries came back to the stopping worker"
        stop, taken = _after_stop(ref)
        assert stop[0]["ev"] == "worker_stopping"
        assert len([e for e in stop if e["ev"] == "evaluation_abandoned"]) == 4
        assert taken == []


# --- engine errors, evaluation.started, flow control and durability (sim; live in
# --- tests/test_chaos_runs.py on the same scenarios) ------------------------------------------


def _sim_pair(name: str, mutant: str) -> tuple[Any, Any]:
    """The scenario `name` in the simulator, on the engine and with `mutant`."""
    from chaos.insim import run_scenario
    from chaos.scenario import load_scenario

    loaded = load_scenario(ROOT / "scenarios" / f"{name}.yaml")
    return run_scenario(loaded), run_scenario(loaded, mutant=mutant)


def _broken(outcome: Any) -> set[str]:
    return {k for k, v in outcome.result.verdicts.items() if v == "fail"}


def test_raise_in_shell() -> None:
    clean, broken = _sim_pair("crash_right_after_ack", "raise_in_shell")
    assert clean.result.ok and clean.result.stats["engine_errors"] == 0
    # Absorbed: every evaluation ends as it should; only the error tells, with its trace.
    assert _broken(broken) == {"no_engine_error"}
    errors = [e for e in broken.history if e["ev"] == "engine_error"]
    assert errors and all(e["error"].startswith("KeyError: ") for e in errors)
    assert all("engine/shell/controller.py" in e["traceback"] for e in errors)


def test_retry_to_undeclared_queue() -> None:
    clean, broken = _sim_pair("transient_llm_errors", "retry_to_undeclared_queue")
    assert clean.result.ok
    assert "no_engine_error" in _broken(broken)
    assert broken.result.verdicts["all_terminal"] == "pass"  # the sweeper re-published
    errors = [e for e in broken.history if e["ev"] == "engine_error"]
    assert errors and all("KeyError: (" in e["error"] for e in errors)


def test_skips_untold() -> None:
    clean, broken = _sim_pair("permanent_failure_prunes", "skips_untold")
    assert clean.result.ok
    assert _broken(broken) == {"prune_only_dependents"}
    # the same rules pruned, the same end: only the record of it is gone
    assert [e for e in broken.history if e["ev"] == "rules_skipped"] == []

    def ends(o: Any) -> dict[str, Any]:
        return {a: (f.state, sorted(f.statuses.items())) for a, f in o.final.evaluations.items()}

    assert ends(broken) == ends(clean)
    assert all("never recorded as skipped" in v.message for v in broken.result.violations)


def test_never_passed_on() -> None:
    clean, broken = _sim_pair("busy_workers_pass_retries_on", "never_passed_on")
    assert clean.result.ok
    assert any(e["ev"] == "forwarded" for e in clean.history)  # passed on at once
    held_back = [e for e in broken.history if e["ev"] == "slot_wait" and e.get("kind") == "retry"]
    assert held_back
    assert _broken(broken) == {"retry_delays_respected"}
    # each late retry waited for a slot while its evaluation's owner held it
    assert all("should have been passed on" in v.message for v in broken.result.violations)


def test_executions_uncounted() -> None:
    clean, broken = _sim_pair("crash_after_ack", "executions_uncounted")
    assert clean.result.ok
    assert any(e["ev"] == "rule_started" and e["rerun"] for e in clean.history)
    assert _broken(broken) == {"history_well_formed"}
    starts = [e for e in broken.history if e["ev"] == "rule_started"]
    assert starts and all(e["execution"] == 1 and not e["rerun"] for e in starts)
    assert any(
        "told to an earlier start of its attempt" in v.message for v in broken.result.violations
    )


def test_marker_write_misread() -> None:
    """A start marker's write longer than the time since the retry's delivery is caught
    within the clocks' derived disagreement (adjtime's slew, the fields' rounding)."""
    clean, broken = _sim_pair("delay_tiers", "marker_write_misread")
    assert clean.result.ok
    assert any(e["ev"] == "start_marked" for e in clean.history)
    assert _broken(broken) == {"history_well_formed"}
    assert all("`start_marked` of a" in v.message for v in broken.result.violations)


def test_retry_starts_unmarked() -> None:
    """A delayed retry started with no marker written and no start_marked before it: the
    well-formedness rule that only unit tests reached before (`_markers_accounted`)."""
    clean, broken = _sim_pair("delay_tiers", "retry_starts_unmarked")
    assert clean.result.ok
    assert any(e["ev"] == "start_marked" for e in clean.history)
    assert not any(e["ev"] == "start_marked" for e in broken.history)
    assert _broken(broken) == {"history_well_formed"}
    assert all("with no write of its start marker" in v.message for v in broken.result.violations)


def test_failed_calls_free() -> None:
    clean, broken = _sim_pair("transient_llm_errors", "failed_calls_free")
    assert clean.result.ok and clean.result.stats["reference_calls_compared"] > 0
    assert _broken(broken) == {"matches_reference"}  # history and metrics agree: only the draw
    failed = [e for e in broken.history if e["ev"] == "rule_failed"]
    assert failed and all(e["tokens"] == 0 for e in failed)
    assert all(
        "a call costs what the fake agent drew" in v.message for v in broken.result.violations
    )


def test_cancel_unknown() -> None:
    clean, broken = _sim_pair("cancel_midway", "cancel_unknown")
    assert clean.result.ok
    assert "poison_rejected" in _broken(broken)
    assert any("engine's own as 'cancel'" in v.message for v in broken.result.violations)


def test_cancel_read_unheard() -> None:
    clean, broken = _sim_pair(
        "regressions/cancel-read-before-a-call-quiet-state-s4", "cancel_read_unheard"
    )
    assert clean.result.ok and any(e["ev"] == "cancel_seen" for e in clean.history)
    assert _broken(broken) == {"quiet_state"}
    assert any("when the run's deadline passed" in v.message for v in broken.result.violations)


def test_call_after_close() -> None:
    clean, broken = _sim_pair(
        "regressions/cancel-before-a-call-cancel-respected-s15", "call_after_close"
    )
    assert clean.result.ok and clean.result.verdicts["cancel_respected"] == "pass"
    assert _broken(broken) == {"cancel_respected"}
    assert all("holding no session" in v.message for v in broken.result.violations)
    # the calls the closed evaluation's waiting tasks made were paid for
    assert broken.result.stats["not_run_tokens"] < clean.result.stats["not_run_tokens"]


def test_final_retry_disowned() -> None:
    clean, broken = _sim_pair(
        "regressions/final-write-retried-completed-delivered-s1", "final_retry_disowned"
    )
    assert clean.result.ok and clean.result.verdicts["completed_delivered"] == "pass"
    assert _broken(broken) == {"completed_delivered"}
    # the owner's retried final write found its own end: announced clean, not broken
    (won,) = [e["won"] for e in clean.history if e["ev"] == "evaluation_terminal"]
    (lost,) = [e["won"] for e in broken.history if e["ev"] == "evaluation_terminal"]
    assert won is True and lost is False


def test_started_after_ack() -> None:
    clean, broken = _sim_pair("crash_right_after_ack", "started_after_ack")
    assert clean.result.ok and clean.result.verdicts["started_announced"] == "pass"
    assert _broken(broken) == {"started_announced"}
    # the two workers that crashed right after their ACK announced nothing
    flagged = {v.message.split()[0] for v in broken.result.violations}
    crashed = {e["src"] for e in broken.history if e["ev"] == "crash"}
    assert flagged == crashed and len(crashed) == 2


def test_no_started_event() -> None:
    clean, broken = _sim_pair("crash_right_after_ack", "no_started_event")
    assert clean.result.stats["started_received"] >= 3
    assert broken.result.stats["started_received"] == 0
    assert _broken(broken) == {"started_announced"}


def test_unlabelled_reruns() -> None:
    clean, broken = _sim_pair("crash_after_ack", "unlabelled_reruns")
    assert clean.result.ok and clean.result.verdicts["history_well_formed"] == "pass"
    # and the reruns the counters count are no longer in the history
    assert _broken(broken) == {"history_well_formed", "metrics_match_history"}
    started = sum(e["ev"] == "rule_started" for e in broken.history)
    assert broken.result.cases["history_well_formed"] >= started > 0
    texts = [v.message for v in broken.result.violations]
    assert any("without its field `rerun`" in t for t in texts)
    assert any("without its field `execution`" in t for t in texts)


def test_failed_calls_uncounted() -> None:
    clean, broken = _sim_pair("transient_llm_errors", "failed_calls_uncounted")
    assert clean.result.ok and clean.result.verdicts["metrics_match_history"] == "pass"
    assert clean.result.cases["metrics_match_history"] > 0
    assert _broken(broken) == {"metrics_match_history"}
    texts = [v.message for v in broken.result.violations]
    assert all('engine_agent_calls_total{outcome="' in t for t in texts)
    assert not any('outcome="ok"' in t for t in texts)


def test_poison_requeued() -> None:
    clean, broken = _sim_pair("poison_messages", "poison_requeued")
    assert clean.result.ok and clean.result.verdicts["poison_rejected"] == "pass"
    assert clean.result.stats["poison_published"] == 19
    assert clean.result.stats["poison_rejections"] == 19  # each once
    delivered = sum(e["ev"] == "delivered" for e in clean.history)
    assert clean.result.cases["poison_rejected"] == 19 + delivered
    assert _broken(broken) == {"poison_rejected"}
    assert broken.result.stats["poison_rejections"] > 19
    assert any("rejected again" in v.message for v in broken.result.violations)


def test_failpoints_blind() -> None:
    clean, broken = _sim_pair("failpoints_aimed", "failpoints_blind")
    assert clean.result.ok and clean.result.cases["faults_fired"] == 14 + 1  # and none unplanned
    assert _broken(broken) == {"faults_fired"}
    # the sites that name a rule: their failpoints, aimed at one, never fire
    missed = {v.message.split()[1] for v in broken.result.violations}
    assert "rule_after_write" in missed and "before_final_write" not in missed
    assert all("never fired" in v.message for v in broken.result.violations)


def test_pass_result_misrouted() -> None:
    clean, broken = _sim_pair("permanent_failure_prunes", "pass_result_misrouted")
    assert clean.result.ok
    got = [e for e in clean.history if e["ev"] == "pass_received"]
    assert len(got) == sum(e["ev"] == "pass_published" for e in clean.history) > 0
    assert all(e["message_id"] == f"{e['attempt_id']}:pass:{e['body']['pass_id']}" for e in got)
    assert _broken(broken) == {"pass_results_correct"}
    assert not any(e["ev"] == "pass_received" for e in broken.history)
    assert all("no evaluation.pass_result" in v.message for v in broken.result.violations)


def test_retry_held_to_the_end() -> None:
    clean, broken = _sim_pair("delay_tiers", "retry_held_to_the_end")
    assert clean.result.ok and clean.result.verdicts["retries_acked"] == "pass"
    acked = sum(e["ev"] == "retry_acked" for e in clean.history)
    assert 0 < clean.result.cases["retries_acked"] <= acked
    assert _broken(broken) == {"retries_acked"}
    assert not any(e["ev"] == "retry_acked" for e in broken.history)
    assert all("without ACKing it" in v.message for v in broken.result.violations)


def test_unbounded_prefetch() -> None:
    clean, broken = _sim_pair("prefetch_backlog", "unbounded_prefetch")
    assert clean.result.ok and clean.result.stats["deliveries_in_flight_max"] == 4
    assert _broken(broken) == {"prefetch_respected"}
    assert broken.result.stats["deliveries_in_flight_max"] > 4
    assert "prefetch 0" in broken.result.violations[0].message


def test_non_persistent() -> None:
    clean, broken = _sim_pair("broker_restart_holding_retries", "non_persistent")
    assert clean.result.ok and clean.result.stats["transient_messages"] == 0
    assert _broken(broken) == {"nothing_lost_on_restart"}
    lost = [v.message for v in broken.result.violations if "lost" in v.message]
    assert lost and "found" in lost[0]  # the model's count: the restart found fewer
    # and message by message, as live: retries waiting at the kill never came back
    assert any(v.rule_id and "never delivered" in v.message for v in broken.result.violations)
    # the engine still ends every evaluation: the sweeper re-publishes the lost retries
    assert broken.result.verdicts["all_terminal"] == "pass"


# --- the lease machinery and the fence -----------------------------------------------------


class _Held:
    """An evaluation in memory, as the heartbeat sees it (its fence token, not leaving)."""

    fence = "1:w"
    leaving = False


def probe_heartbeat() -> dict[str, Any]:
    """The heartbeat's first beats: idle, then holding an evaluation; what each asks of the
    world, and how long the loop sleeps."""
    from engine.shell import heartbeat

    idle = [type(e).__name__ for e in heartbeat.beat("w", {}, 600)]
    busy = heartbeat.beat("w", {"a": _Held()}, 600)  # type: ignore[dict-item]
    asked = [type(next(busy)).__name__, type(busy.send(0)).__name__]
    loop = heartbeat.heartbeat(EngineConfig(heartbeat_ms=100, stale_ms=600), "w", {})
    return {"idle": idle, "busy": asked, "sleeps": next(loop).seconds}


def probe_heartbeat_started_idle() -> dict[str, Any]:
    """The heartbeat's loop, started with nothing held (as every worker starts), then
    given an evaluation: what it asks of the world in its first two beats."""
    from engine.shell import heartbeat

    held: dict[str, Any] = {}
    loop = heartbeat.heartbeat(EngineConfig(heartbeat_ms=100, stale_ms=600), "w", held)
    asked = []
    with contextlib.suppress(StopIteration):
        asked.append(type(next(loop)).__name__)  # the first sleep
        held["a"] = _Held()
        asked.append(type(loop.send(None)).__name__)
        asked.append(type(loop.send(0)).__name__)
    return {"asked": asked}


def test_heartbeat_stops_when_idle() -> None:
    before, after = _probe("probe_heartbeat_started_idle", "heartbeat_stops_when_idle")
    assert before == {"asked": ["Sleep", "Clock", "Store"]}  # sleep, the clock, the renewal
    assert after == {"asked": []}  # ended before its first sleep: nothing renewed ever


def test_slow_heartbeat() -> None:
    before, after = _probe("probe_heartbeat", "slow_heartbeat")
    assert before == {"idle": [], "busy": ["Clock", "Store"], "sleeps": 0.1}
    assert after == {"idle": [], "busy": ["Clock", "Store"], "sleeps": 1.0}  # ten times


def probe_renewal_extends() -> dict[str, Any]:
    """An owner's lease with 100 ms left is renewed: when the store says it runs out, and
    what is left of it."""

    async def go(store: RedisStore, ids: list[str]) -> dict[str, Any]:
        a = ids[0]
        begun = await store.begin(a, "w", TINY.order, TINY.to_json())
        await store.redis.pexpire(eval_key(a, "owner"), 100)
        now = await store.redis.time()  # the store's clock, which the answer is told by
        got = (await store.renew({a: begun.fence}, "w"))[a]
        left = await store.redis.pttl(eval_key(a, "owner"))
        reported = got.expires_ms - (now[0] * 1000 + now[1] // 1000)
        return {"held": int(got), "reported": reported > 100, "left": left > 100}

    return asyncio.run(_probe_store(go))


@live
def test_renew_never_extends() -> None:
    before, after = _probe("probe_renewal_extends", "renew_never_extends")
    assert before == {"held": 1, "reported": True, "left": True}
    # Still answered held, and the store reports (truly) that the lease was not extended.
    assert after == {"held": 1, "reported": False, "left": False}


def probe_early_claim() -> dict[str, Any]:
    """w begins an evaluation (its lease held, its stamp fresh); a sweeper sweeps at once."""
    from engine.shell import sweeper

    async def go(store: RedisStore, ids: list[str]) -> dict[str, Any]:
        a = ids[0]
        await store.begin(a, "w", TINY.order, TINY.to_json())
        claimed = await store.claim_stale(a, 0)  # the stamp is old enough; the lease is not
        asked = []
        step = sweeper.sweep(EngineConfig(stale_ms=600), set())
        effect = next(step)
        asked.append(list(effect.args))
        return {"claimed": claimed, "stale_evaluations": asked}

    return asyncio.run(_probe_store(go))


@live
def test_sweeper_claims_early() -> None:
    before, after = _probe("probe_early_claim", "sweeper_claims_early")
    assert before == {"claimed": False, "stale_evaluations": [[600]]}
    assert after == {"claimed": True, "stale_evaluations": [[60]]}  # a tenth, lease or not


def probe_stale_writes() -> dict[str, Any]:
    """w1 begins an evaluation; its lease lapses; w2 begins it (a new token); w1, awake,
    writes a status, the final state or a park with its old token. What lands?"""

    async def go(store: RedisStore, ids: list[str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for a, what in zip(ids, ("status", "final", "park"), strict=True):
            first = await store.begin(a, "w1", TINY.order, TINY.to_json())
            await store.redis.delete(eval_key(a, "owner"))  # the lease lapses
            await store.begin(a, "w2", TINY.order, None)
            try:
                if what == "status":
                    await store.write_status(a, "compiles", "failed_attempt_1", None, first.fence)
                elif what == "final":
                    await store.finish(a, "completed", {}, [], first.fence)
                else:
                    await store.park(a, "w1", first.fence, ["compiles"])
                out[what] = "landed"
            except LeaseLost:
                out[what] = "refused"
        return out

    return asyncio.run(_probe_store(go, evaluations=3))


@live
def test_status_unfenced() -> None:
    before, after = _probe("probe_stale_writes", "status_unfenced")
    assert before == {"status": "refused", "final": "refused", "park": "refused"}
    assert after == {"status": "landed", "final": "refused", "park": "refused"}  # alone


@live
def test_final_unfenced() -> None:
    before, after = _probe("probe_stale_writes", "final_unfenced")
    assert before == {"status": "refused", "final": "refused", "park": "refused"}
    assert after == {"status": "refused", "final": "landed", "park": "refused"}  # alone


@live
def test_park_unfenced() -> None:
    before, after = _probe("probe_stale_writes", "park_unfenced")
    assert before == {"status": "refused", "final": "refused", "park": "refused"}
    assert after == {"status": "refused", "final": "refused", "park": "landed"}  # alone


# --- pg-store: broken PL/pgSQL functions (chaos.systems.pg_store.mutants) ----------------------
# Live, each is a function of the run's database replaced by the pg-store adapter (shown to
# misbehave on a real PostgreSQL by tests/live/test_pg_mutants_live.py); in the simulator,
# the same misstep of its Python reference. Each is caught on its pg-store scenario.


def _pg_caught(
    name: str,
    mutant: str,
    seeds: tuple[int | None, ...] = (None,),
    folder: str = "pg_store",
    system: str = "pg-store",
) -> list[tuple[Any, Any]]:
    """`scenarios/<folder>/<name>.yaml`, on `system`, passes on the engine and fails on
    `mutant`'s invariant with it, for each seed (None: the file's); each seed's (clean,
    broken) outcomes."""
    from chaos.insim import run_scenario
    from chaos.scenario import load_scenario
    from chaos.systems import on_system

    loaded = on_system(load_scenario(ROOT / "scenarios" / folder / f"{name}.yaml"), system)
    assert loaded.spec.system == system
    breaks = MUTANTS[mutant].breaks
    pairs = []
    for seed in seeds:
        clean = run_scenario(loaded, seed)
        assert clean.result.ok, (seed, clean.result.violations[:1], clean.result.budget_failures)
        assert clean.result.verdicts[breaks] == "pass"
        broken = run_scenario(loaded, seed, mutant)
        assert broken.extra["system"] == system and broken.extra["mutant"] == mutant
        assert broken.result.verdicts[breaks] == "fail", (seed, broken.result.verdicts)
        assert any(v.invariant == breaks for v in broken.result.violations)
        pairs.append((clean, broken))
    return pairs


def test_pg_unfenced() -> None:
    # The frozen owner's failed_attempt_1 lands with its old token (as status_unfenced).
    _pg_caught("postgres_stale_owner_status", "pg_unfenced", (None, 1, 2))


def test_pg_overwrite_result() -> None:
    # The frozen worker's late result replaces the first (as overwrite_result); the seed is
    # one whose rerun drifts, so the two results differ.
    _pg_caught("postgres_write_window", "pg_overwrite_result")


def test_pg_double_claim() -> None:
    # A retry delivered to the worker not holding its evaluation is begun there, beside the
    # owner (as ignore_lease).
    _pg_caught("postgres_calls_outlast_lease", "pg_double_claim", (None, 2, 3))


def test_pg_resume_forgets() -> None:
    # A resume from chk_0001 deletes chk_0001 too: its rule (compiles) runs again.
    _pg_caught("resume_from_checkpoint", "pg_resume_forgets", (None, 1, 2), folder="pg")


def test_pg_resume_keeps_owner() -> None:
    # A resume that takes no lease: the busy owner goes on, its writes landing past it.
    _pg_caught("resume_from_checkpoint", "pg_resume_keeps_owner", (None, 1, 2), folder="pg")


def test_pg_pass_unfenced() -> None:
    # The owner a resume fenced off flags its pass published over the resumed run; clean,
    # that write is refused (`write_refused`, write `pass`).
    for clean, broken in _pg_caught("resume_before_a_pass_mark", "pg_pass_unfenced"):
        refused = [e for e in clean.history if e["ev"] == "write_refused"]
        assert [e["write"] for e in refused] == ["pass"]
        assert not [e for e in broken.history if e["ev"] == "write_refused"]


def test_pg_jobs_unlogged() -> None:
    # pg only: the kill's crash recovery empties the unlogged eai.jobs, and the retries that
    # waited in it are never delivered (as non_persistent's on RabbitMQ). Live, the table
    # really is unlogged (tests/live/test_pg_mutants_live.py) and the kill loses its rows
    # (tests/test_chaos_runs.py).
    pairs = _pg_caught(
        "postgres_restart_holding_retries",
        "pg_jobs_unlogged",
        (None, 1, 2),
        folder="pg",
        system="pg",
    )
    for clean, broken in pairs:

        def counts(o: Any) -> list[Any]:
            return [e["messages"] for e in o.history if e["ev"].startswith("service_")]

        held = counts(clean)[0]
        assert held > 0 and counts(clean) == [held, held]  # logged: the restart finds them
        assert counts(broken)[1] == 0  # the restart found an empty queue
        lost = [v for v in broken.result.violations if v.invariant == "nothing_lost_on_restart"]
        assert any(v.rule_id and "never delivered" in v.message for v in lost)
        # only this guarantee: the sweeper re-publishes the lost retries, and all end
        assert _broken(broken) == {"nothing_lost_on_restart"}


def _shipped_function(function: str) -> str:
    """`function`'s definition as the migration ships it (the text from its CREATE to its
    closing `END $$;`: what `pg_get_functiondef` gives back, the header aside)."""
    import re

    from engine.runtime.pgstore import migrations

    sql = "".join(m.sql for m in migrations())
    found = re.findall(rf"CREATE FUNCTION {re.escape(function)}\(.*?\nEND \$\$;", sql, re.S)
    assert len(found) == 1, function
    return found[0]


def _shipped_table(table: str) -> str:
    """`table`'s CREATE TABLE as the migrations ship it."""
    import re

    from engine.runtime.pgstore import migrations

    sql = "".join(m.sql for m in migrations())
    found = re.findall(rf"CREATE TABLE {re.escape(table)} \(.*?\n\);", sql, re.S)
    assert len(found) == 1, table
    return found[0]


def test_pg_mutants_are_the_database_s_and_find_their_seams() -> None:
    """Every SQL mutant is a mutant of the registry (its worker patch does nothing) of one
    PostgreSQL design, and its edits each apply exactly once to the function the migration
    ships (applied again, to the broken text, they fail loudly); a table it makes unlogged
    is one the migrations create."""
    from chaos.systems.pg_store.mutants import SQL_MUTANTS, SeamGone, broken

    assert set(SQL_MUTANTS) == {m for m in MUTANTS if m.startswith("pg_")}
    for name, m in SQL_MUTANTS.items():
        assert name in sim_mutants.PATCHED
        assert MUTANTS[name].system in ("pg-store", "pg")
        assert MUTANTS[name].description.startswith(f"{MUTANTS[name].system} only: ")
        assert m.functions or m.unlogged
        for table in m.unlogged:  # a table the migrations create
            assert _shipped_table(table).startswith(f"CREATE TABLE {table} (")
        for fe in m.functions:
            shipped = _shipped_function(fe.function)
            twin = broken(name, fe.function, shipped)
            assert twin != shipped and twin.count("mutant") == len(fe.edits)
            with pytest.raises(SeamGone, match=f"^{name}: {fe.function} changed: "):
                broken(name, fe.function, twin)
