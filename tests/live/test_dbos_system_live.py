"""`--system dbos`: the shipped scenarios on DBOS, judged by the same checker as the engine's
own designs (`chaos.systems.dbos`), the operator's recovery of a worker gone for good, and
what this design cannot take refused in one line before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chaos.systems.dbos.mutants import MUTANTS
from tests.live.test_pg_store_live import _chaos, applicable, caught, sweep

pytestmark = pytest.mark.slow  # a private PostgreSQL, worker processes

FOLDERS = (
    "scenarios/*.yaml",
    "scenarios/regressions/*",
    "scenarios/pg_store/*.yaml",
    "scenarios/pg/*.yaml",
    "scenarios/dbos/*.yaml",
)


def _events(run_dir: Path, ev: str) -> list[dict]:
    lines = (run_dir / "history.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("ev") == ev]


def test_every_shipped_scenario_whose_faults_apply_passes_on_dbos_live(tmp_path: Path) -> None:
    """Worker kills, pauses and restarts, the two failpoints inside the step, PostgreSQL's
    kill, pause and cut link, and the second document's L3 proof (`worker_killed_in_step_2`),
    each passing; the settings that decide recovery are in each journal."""
    ran = applicable("dbos", FOLDERS)
    for needed in (
        "scenarios/worker_killed_in_step_2.yaml",
        "scenarios/dbos/worker_gone_for_good.yaml",
        "scenarios/crash_in_write_window.yaml",
        "scenarios/worker_kill_storm.yaml",
        "scenarios/pg_store/postgres_restart.yaml",
        "scenarios/pg/postgres_restart_holding_retries.yaml",
    ):
        assert needed in ran
    docs = sweep("dbos", FOLDERS, tmp_path, set(), least=20)
    for doc in docs:
        assert "none of DBOS's own" in doc["extra"]["design_settings"]["takeover"]
        for name in ("leases_respected", "writes_fenced", "retries_acked"):
            assert doc["verdicts"].get(name, "n/a") == "n/a"  # unless not checked at all
    # DBOS has no takeover: the workflows of the worker that died for good waited for the
    # operator's recovery, and the other worker ran them from their last step
    gone = tmp_path / "out" / "worker_gone_for_good"
    (recovery,) = _events(gone, "operator_recovered")
    assert recovery["executor_id"] == "worker0" and recovery["attempt_ids"]
    resumed = [e for e in _events(gone, "evaluation_started") if e["resumed"]]
    assert {e["attempt_id"] for e in resumed} == set(recovery["attempt_ids"])
    assert {e["src"] for e in resumed} == {"worker1"}
    # the L3 proof: the slot relaunched under its executor id recovered its own at launch
    l3 = tmp_path / "out" / "worker_killed_in_step_2"
    assert not _events(l3, "operator_recovered")
    starts = [(e["rule_id"], e["execution"]) for e in _events(l3, "rule_started")]
    assert starts == [("step_1", 1), ("step_2", 1), ("step_2", 2), ("step_3", 1)]


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_a_broken_dbos_design_is_caught_by_the_l3_proof(mutant: str, tmp_path: Path) -> None:
    """The checker judges DBOS as it judges the engine: with its agent calls not steps,
    the worker killed in step 2 comes back to run step 1 again."""
    verdicts = caught("dbos", "worker_killed_in_step_2", mutant, tmp_path)
    assert verdicts[MUTANTS[mutant][0]] == "fail", verdicts


def test_the_simulator_has_no_model_of_dbos() -> None:
    run = _chaos("run", "scenarios/dbos/worker_gone_for_good.yaml", "--mode", "sim")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and "dbos does not run in sim mode" in run.stderr


@pytest.mark.parametrize(
    ("scenario", "said"),
    [
        ("cancel_midway", "faults[0].action: dbos has no cancel"),
        ("poison_messages", "dbos has no publish_poison"),
        ("failpoints_aimed", "dbos has rule_before_call and rule_after_call_before_write"),
        ("broker_restart", "dbos has no service 'broker'"),
        ("redis_latency", "dbos has no link 'redis'"),
    ],
)
def test_what_dbos_does_not_have_is_refused_in_one_line(scenario: str, said: str) -> None:
    run = _chaos("run", f"scenarios/{scenario}.yaml", "--system", "dbos", "--mode", "live")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and said in run.stderr, run.stderr
