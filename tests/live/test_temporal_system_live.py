"""`--system temporal`: the shipped scenarios on Temporal, judged by the same checker as the
engine's own designs (`chaos.systems.temporal`), and what this design cannot take refused
in one line before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.systems.temporal.mutants import MUTANTS
from tests.live.test_pg_store_live import _chaos, applicable, caught, sweep

pytestmark = pytest.mark.slow  # a private Temporal server, worker processes

FOLDERS = (
    "scenarios/*.yaml",
    "scenarios/regressions/*",
    "scenarios/pg_store/*.yaml",
    "scenarios/pg/*.yaml",
    "scenarios/temporal/*.yaml",
)


#: What Temporal breaks that the engine's designs do not, when the live schedule reaches it:
#: a worker frozen past the activity's heartbeat timeout (a `freeze` failpoint, SIGSTOP)
#: still holds the next attempt its SDK core polled meanwhile, and runs it once it wakes,
#: after another worker finished the rule: the server refuses that answer, but the call ran
#: again and its tokens are spent (`no_completed_rerun`; the reruns past the budget).
FROZEN_WORKER_RERUNS = {"no_completed_rerun", "budgets"}
FINDINGS = {
    name: FROZEN_WORKER_RERUNS
    for name in (
        "crash_in_write_window",
        "lagging_worker",
        "paused_worker",
        "postgres_write_window",
        "crash-in-write-window-no-completed-rerun-s2317",
        "lagging-owner-write-window-no-completed-rerun-s4",
        "paused-before-call-no-completed-rerun-s4",
    )
}


def test_every_shipped_scenario_whose_faults_apply_passes_on_temporal_live(
    tmp_path: Path,
) -> None:
    """Worker kills, pauses and restarts, the two failpoints inside the activity, the
    server's kill and the worker's cut link among them, and the second document's L3 proof
    (`worker_killed_in_step_2`), each passing or breaking only what `FINDINGS` says; the
    settings that decide recovery are in each journal."""
    ran = applicable("temporal", FOLDERS)
    for needed in (
        "scenarios/worker_killed_in_step_2.yaml",
        "scenarios/temporal/server_restart_holding_timers.yaml",
        "scenarios/temporal/worker_link_cut.yaml",
        "scenarios/crash_in_write_window.yaml",
    ):
        assert needed in ran
    docs = sweep("temporal", FOLDERS, tmp_path, set(), least=20, findings=FINDINGS)
    for doc in docs:
        settings = doc["extra"]["design_settings"]
        assert settings["activity_heartbeat_timeout_s"] == 1.0
        assert settings["timer_max_time_shift_ms"] == 10
        assert settings["queue_poll_rps"] == 1000
        for name in ("leases_respected", "writes_fenced", "retries_acked"):
            assert doc["verdicts"].get(name, "n/a") == "n/a"  # unless not checked at all
    judged = [doc for doc in docs if "leases_respected" in doc["verdicts"]]
    assert len(judged) > 10
    # the cut-off worker is never told it lost its workflows, and needs not be waited for:
    # the server refuses a stale worker's commands (`System.stale_copies_act`)
    cut = (tmp_path / "out" / "worker_link_cut" / "history.jsonl").read_text()
    assert '"evaluation_started"' in cut and '"deadline_passed"' not in cut


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_a_broken_temporal_design_is_caught(mutant: str, tmp_path: Path) -> None:
    """The checker judges Temporal as it judges the engine: calls that never heartbeat
    are taken for dead past the 1 s timeout and run again beside themselves, with no
    fault to explain it (calls of 1.2 to 2.4 s)."""
    verdicts = caught("temporal", "calls_outlast_lease", mutant, tmp_path)
    assert verdicts[MUTANTS[mutant][0]] == "fail", verdicts


def test_the_simulator_has_no_model_of_temporal() -> None:
    run = _chaos("run", "scenarios/temporal/worker_link_cut.yaml", "--mode", "sim")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and "temporal does not run in sim mode" in run.stderr


@pytest.mark.parametrize(
    ("scenario", "said"),
    [
        ("cancel_midway", "faults[0].action: temporal has no cancel"),
        ("poison_messages", "temporal has no publish_poison"),
        ("failpoints_aimed", "temporal has rule_before_call and rule_after_call_before_write"),
        ("broker_restart", "temporal has no service 'broker'"),
        ("redis_latency", "temporal has no link 'redis'"),
    ],
)
def test_what_temporal_does_not_have_is_refused_in_one_line(scenario: str, said: str) -> None:
    run = _chaos("run", f"scenarios/{scenario}.yaml", "--system", "temporal", "--mode", "live")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and said in run.stderr, run.stderr
