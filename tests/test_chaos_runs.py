"""The harness can fail: every mutant breaks the invariant it targets on its scenario.

For each mutant there is a scenario that passes on the real engine and fails, on exactly
the invariant the mutant removes, when the workers run the mutant. The runs share one
private Redis and RabbitMQ (started once: the node takes seconds), and the command line's
exit codes and clean-up are checked on real `python -m chaos` processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chaos.mutants import MUTANTS
from chaos.runner import Outcome, ScenarioRun
from chaos.scenario import load_scenario
from chaos.stack import OWNER_ENV, _marked_processes
from chaos.systems.redis_rabbitmq.services import Services

pytestmark = pytest.mark.slow  # live runs: a redis-server and a RabbitMQ node of their own

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "scenarios"

#: The scenario on which each mutant must be caught.
CATCHES = {
    "pg_unfenced": "pg_store/postgres_stale_owner_status",  # the frozen owner's status lands
    "pg_overwrite_result": "pg_store/postgres_write_window",  # the frozen worker's late result
    "pg_double_claim": "pg_store/postgres_calls_outlast_lease",  # a retry begun beside its owner
    "pg_resume_forgets": "pg/resume_from_checkpoint",  # the kept checkpoint's rule runs again
    "pg_resume_keeps_owner": "pg/resume_from_checkpoint",  # the owner writes past the resume
    "pg_pass_unfenced": "pg_store/resume_before_a_pass_mark",  # the fenced-off owner's flag lands
    "pg_jobs_unlogged": "pg/postgres_restart_holding_retries",  # the kill empties the queue
    "no_redis_results": "crash_after_ack",
    "no_sweeper": "crash_after_ack",
    "prune_everything": "permanent_failure_prunes",
    "prune_nothing": "permanent_failure_prunes",
    "skips_untold": "permanent_failure_prunes",
    "never_passed_on": "busy_workers_pass_retries_on",  # held for a slot, then forwarded
    "nondeterministic_agent": "crash_after_ack",  # no drift there: reruns must agree
    "reset_attempts_on_recovery": "delay_tiers",
    "per_message_ttl": "delay_tiers",
    "result_without_ttl": "permanent_failure_prunes",
    "double_final_publish": "permanent_failure_prunes",
    "overwrite_result": "crash_in_write_window",  # a frozen worker's late write
    "ignore_dag": "crash_after_ack",
    "no_immediate_retries": "delay_tiers",  # level 1 spent before each delayed retry
    "give_up_early": "every_rule_fails",  # the same end, one attempt short
    "try_made_twice": "transient_llm_errors",  # each failed try 2 made again
    "slow_tier": "delay_tiers",
    "drop_history_events": "crash_after_ack",
    "start_after_cancel": "cancel_midway",  # the owner runs to the end after the cancel
    "spurious_cancel": "cancel_midway",  # the cancel of evaluation 0 ends the others too
    "all_passes_complete": "permanent_failure_prunes",  # passes that lost a rule
    "pass_announced_again": "crash_after_ack",  # intake's pass again at each rule's end
    "no_completed_event": "permanent_failure_prunes",
    "leak_running_index": "permanent_failure_prunes",
    "done_keeps_lease": "delay_tiers",  # a 2 s lease: still there when the run ends
    "needless_rerun": "permanent_failure_prunes",  # no fault at all: no rerun is owed
    "ignore_lease": "consumer_timeout",  # retries delivered to the worker not owning them
    "no_fencing": "paused_owner",  # the paused owner wakes and starts what was finished
    "no_wait": "sentinel_failover_with_partition",  # the promoted replica never got them
    "no_restore": "redis_data_loss",  # the restarted Redis lost results the owner announces
    "unmitigated": "sentinel_failover_with_partition",  # no_wait's, and nothing restored
    "sweep_wrong_attempt": "lost_dead_letter",  # the re-published retry is stale: parked
    "results_only_reannounced": "announcer_dies_after_a_permanent_failure",
    "old_close_order": "graceful_stop_hands_back",  # the requeued retries come back to it
    "raise_in_shell": "crash_right_after_ack",  # absorbed: the delivery comes round again
    "retry_to_undeclared_queue": "transient_llm_errors",  # absorbed: the sweeper re-publishes
    "started_after_ack": "crash_right_after_ack",  # the crash after the ACK comes first
    "no_started_event": "crash_right_after_ack",
    "unbounded_prefetch": "prefetch_backlog",  # ten deliveries for one slot
    "non_persistent": "broker_restart_holding_retries",  # the retries waiting in the queues
    "ignore_rule_max_attempts": "rule_max_attempts",  # test_run given up two attempts early
    "forget_permanent_failure": "resume_after_permanent_failure",  # license_header again
    "hold_due_retry": "delay_tiers",  # each retry 0.5 s late, within the old 1 s of slack
    "heartbeat_stops_when_idle": "calls_outlast_lease",  # only the heartbeat keeps leases
    "slow_heartbeat": "calls_outlast_lease",
    "renew_never_extends": "calls_outlast_lease",  # the store says what it left
    "sweeper_claims_early": "calls_outlast_lease",  # long calls: stamps a beat old
    "status_unfenced": "stale_owner_status",  # the frozen owner's status write lands
    "final_unfenced": "stale_owner_final_write",  # the frozen owner's final write lands
    "park_unfenced": "stale_owner_park",  # the frozen owner's park lands
    "unlabelled_reruns": "crash_after_ack",
    "executions_uncounted": "crash_after_ack",  # each rerun told it is execution 1
    "marker_write_misread": "delay_tiers",  # a marker's write longer than since its delivery
    "retry_starts_unmarked": "delay_tiers",  # a retry's start with no marker before it
    "failed_calls_uncounted": "transient_llm_errors",
    "failed_calls_free": "transient_llm_errors",  # each failed call drew its tokens
    "cancel_unknown": "cancel_midway",  # the broadcast rejected, the owner reads Redis
    "cancel_read_unheard": "regressions/cancel-read-before-a-call-quiet-state-s4",
    "call_after_close": "regressions/cancel-before-a-call-cancel-respected-s15",
    "final_retry_disowned": "regressions/final-write-retried-completed-delivered-s1",
    "poison_requeued": "poison_messages",  # each malformed one comes round again
    "retry_held_to_the_end": "delay_tiers",
    "pass_result_misrouted": "permanent_failure_prunes",
    "failpoints_blind": "failpoints_aimed",
}


def test_every_mutant_has_a_scenario() -> None:
    assert set(CATCHES) == set(MUTANTS)


@pytest.fixture(scope="module")
def baseline(services: Services) -> dict:
    """Clean live runs, by scenario, shared by the tests of this module."""
    return {}


def run(
    services: Services | Callable[[str], Any], name: str, out: Path, mutant: str | None = None
) -> Outcome:
    """A live run of scenario `name` on the services of its system (`services`: today's
    design's, or the `stacks` of each)."""
    loaded = load_scenario(SCENARIOS / f"{name}.yaml")
    stack = services(loaded.spec.system) if callable(services) else services
    outcome = asyncio.run(ScenarioRun(loaded, stack, out, mutant=mutant).run())
    for service in sorted(stack.killable):  # a scenario may leave one down
        svc = stack.service(service)
        if not svc.alive:
            svc.restart()
    return outcome


def not_ok(name: str, outcome: Outcome) -> str:
    """Why a run is not ok, whole: failed verdicts with their first violations, budgets and
    the cases a scenario promised (a CI log must say which, the run's outputs are gone)."""
    r = outcome.result
    failed = {k: v for k, v in r.verdicts.items() if v != "pass"}
    firsts = [f"{v.invariant}: {v.message}" for v in r.violations[:3]]
    return f"{name}: {failed} {firsts} {r.budget_failures} {r.exercise_failures}"


#: Mutants whose bug only bites when the live schedule makes it: tried up to this many
#: times, caught at least once. `sweeper_claims_early` made no claim at all in one CI run
#: of `calls_outlast_lease` (leases_respected judged its 6 begins only; the cause was not
#: found: see the closing note of 2026-12-04), and claims in every run of it since.
#: `final_retry_disowned` and `call_after_close` missed once each so on a loaded host
#: (2026-12-07), their scenario's failpoint stall over before the runner acted: now the
#: first ends on the runner's act (`until: service_paused`), the second lasts 1 s.
LIVE_TRIES = {"sweeper_claims_early": 3}


@pytest.mark.parametrize("mutant", sorted(CATCHES))
def test_mutant_is_caught(
    mutant: str, stacks: Callable[[str], Any], baseline: dict, tmp_path: Path
) -> None:
    name = CATCHES[mutant]
    if name not in baseline:
        baseline[name] = run(stacks, name, tmp_path / "clean")
    clean = baseline[name]
    assert clean.result.ok, not_ok(name, clean)
    broken = run(stacks, name, tmp_path / "mutant", mutant)
    for again in range(2, LIVE_TRIES.get(mutant, 1) + 1):
        if not broken.result.ok:
            break
        broken = run(stacks, name, tmp_path / f"mutant-{again}", mutant)
    breaks = MUTANTS[mutant].breaks
    assert not broken.result.ok
    assert broken.result.verdicts[breaks] == "fail", broken.result.verdicts
    assert any(v.invariant == breaks for v in broken.result.violations)


# --- the command line ----------------------------------------------------------------------


def chaos(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "AMQP_URL")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "chaos", *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_cli_exit_codes_without_and_with_a_mutant(tmp_path: Path) -> None:
    scenario = "scenarios/permanent_failure_prunes.yaml"
    ok = chaos("run", scenario, "--quiet", "--out", str(tmp_path / "a"))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for name in ("history.jsonl", "journal.json"):
        assert (tmp_path / "a" / "permanent_failure_prunes" / name).is_file()
    assert "<testsuites" in (tmp_path / "a" / "junit.xml").read_text()
    bad = chaos(
        "run", scenario, "--quiet", "--mutant", "prune_nothing", "--out", str(tmp_path / "b")
    )
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "prune_only_dependents" in bad.stdout


def test_a_lossy_restart_loses_this_runs_writes_only(tmp_path: Path) -> None:
    """`redis.lose_last_writes` cuts the AOF's tail: after another scenario of the same
    seed, the cut used to undo the clean-up of its keys too, and a lease of its long-gone
    worker came back (the gate failed redis_forgets_running that way, live only)."""
    done = chaos(
        "run", "scenarios/crash_after_ack.yaml", "scenarios/redis_forgets_running.yaml",
        "--quiet", "--out", str(tmp_path / "out"), timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS redis_forgets_running (live)" in done.stdout


def test_cli_rejects_bad_input_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nplan: plans/tiny.yaml\nworkers: 0\n")
    for args in (
        ("run", str(bad)),
        ("validate", str(bad)),
        ("run", "scenarios/crash_after_ack.yaml", "--mutant", "nope"),
    ):
        out = chaos(*args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr


def test_kill_faults_are_refused_against_shared_services() -> None:
    out = chaos(
        "run",
        "scenarios/redis_restart.yaml",
        env={"REDIS_URL": "redis://127.0.0.1:6379/0", "AMQP_URL": "amqp://guest:guest@127.0.0.1/"},
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and "redis" in out.stderr
    assert "guest" not in out.stderr  # credentials are never printed


def test_missing_services_say_what_to_install(tmp_path: Path) -> None:
    scenario = "scenarios/crash_after_ack.yaml"
    live = chaos("run", scenario, "--mode", "live", env={"PATH": str(tmp_path)})
    assert live.returncode == 3
    assert live.stderr.count("\n") == 1 and "redis-server" in live.stderr
    auto = chaos("run", scenario, "--out", str(tmp_path / "o"), env={"PATH": str(tmp_path)})
    assert auto.returncode == 0, auto.stdout + auto.stderr
    assert "running in the simulator instead" in auto.stdout
    assert (tmp_path / "o" / "crash_after_ack" / "journal.json").is_file()


def test_ctrl_c_leaves_nothing_behind(tmp_path: Path) -> None:
    """Event-driven: SIGINT once the run's history has started (the scenario then has
    seconds to go), with SIGINT at its default in the child, as under a terminal (a
    background job of a CI shell would inherit it ignored); generous deadlines only."""
    from tests.test_signals import started_run

    out = tmp_path / "out"
    proc = started_run(
        ["run", "scenarios/worker_kill_storm.yaml", "--quiet", "--out", str(out)],
        out / "worker_kill_storm" / "history.raw.jsonl",
        patience_s=120,
        env={"CHAOS_TEST_TAG": tmp_path.name},
    )
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    leftovers = subprocess.run(
        ["pgrep", "-f", f"{tmp_path / 'out'}"], capture_output=True, text=True, check=False
    ).stdout.split()
    assert not leftovers, leftovers
    owner = f"{proc.pid}:"
    survivors = [p for p, env in _marked_processes() if env.get(OWNER_ENV, "").startswith(owner)]
    assert not survivors, "a throwaway Redis or RabbitMQ survived"
    for owner_file in Path(tempfile.gettempdir()).glob("chaos-*-*/.owner"):
        assert not owner_file.read_text().startswith(owner), "a temp folder survived"


# --- the simulator agrees with the live stack -------------------------------------------------


def _reran(history: list[dict]) -> set[tuple[str, str, int]]:
    starts = Counter(
        (e["attempt_id"], e["rule_id"], e["attempt"])
        for e in history
        if e["ev"] == "rule_started" and e["try_no"] == 1
    )
    return {key for key, n in starts.items() if n > 1}


def _verdicts(final) -> dict[tuple[str, str], str]:
    return {
        (a, r): res.verdict for a, ev in final.evaluations.items() for r, res in ev.results.items()
    }


@pytest.mark.parametrize(
    "name", ["crash_in_write_window", "permanent_failure_prunes", "crash_before_ack"]
)
def test_sim_and_live_agree(name: str, services: Services, baseline: dict, tmp_path: Path) -> None:
    from chaos.insim import run_scenario

    if name not in baseline:
        baseline[name] = run(services, name, tmp_path / "live")
    live = baseline[name]
    simulated = run_scenario(load_scenario(SCENARIOS / f"{name}.yaml"))
    assert live.result.ok and simulated.result.ok
    assert live.attempt_ids == simulated.attempt_ids
    assert _reran(live.history) == _reran(simulated.history)
    assert _verdicts(live.final) == _verdicts(simulated.final)
    statuses = {a: ev.statuses for a, ev in live.final.evaluations.items()}
    assert statuses == {a: ev.statuses for a, ev in simulated.final.evaluations.items()}
    states = {a: ev.state for a, ev in live.final.evaluations.items()}
    assert states == {a: ev.state for a, ev in simulated.final.evaluations.items()}


def test_a_shrunk_regression_replays_in_sim_and_live(services: Services, tmp_path: Path) -> None:
    """The file `chaos sim --shrink` wrote for no_redis_results: one crash after the first
    result write breaks the mutant, live as in the simulator, and not the real engine."""
    from chaos.insim import run_scenario

    path = SCENARIOS / "regressions" / "crash-after-ack-no-completed-rerun-s4-no-redis-results.yaml"
    loaded = load_scenario(path)
    assert len(loaded.spec.faults) == 1
    mutant = "no_redis_results"
    assert not run_scenario(loaded, mutant=mutant).result.ok
    assert run_scenario(loaded).result.ok
    live_broken = asyncio.run(ScenarioRun(loaded, services, tmp_path / "a", mutant=mutant).run())
    assert live_broken.result.verdicts["no_completed_rerun"] == "fail"
    live_clean = asyncio.run(ScenarioRun(loaded, services, tmp_path / "b").run())
    assert live_clean.result.ok
