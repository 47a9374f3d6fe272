"""The second document's L3 proof ("Preuve kit L3": the worker killed in the middle of step
2, a new worker resumes, step 1 executed once, the final result checked) as a shipped
scenario, `scenarios/worker_killed_in_step_2.yaml`, on every design in sim; the live
sweeps (`tests/live/test_pg_live.py`, `test_pg_store_live.py`, the gate) run it live."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.insim.run import SimRun
from chaos.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "worker_killed_in_step_2.yaml"


@pytest.mark.parametrize("system", ["redis-rabbitmq", "pg-store", "pg"])
def test_step_1_runs_once_and_the_result_is_the_fault_free_one(system: str) -> None:
    outcome = SimRun(load_scenario(SCENARIO), system=system).run()
    assert outcome.result.ok, outcome.result.violations
    history = outcome.history
    starts = {
        rule: [e for e in history if e["ev"] == "rule_started" and e["rule_id"] == rule]
        for rule in ("step_1", "step_2", "step_3")
    }
    (crash,) = [e for e in history if e["ev"] == "worker_killed"]  # the runner's SIGKILL
    assert len(starts["step_1"]) == 1 and starts["step_1"][0]["t"] < crash["t"]
    # step 2's call was in flight when the worker died: started again by the new one
    assert [e["t"] < crash["t"] for e in starts["step_2"]] == [True, False]
    assert starts["step_2"][0]["src"] != starts["step_2"][1]["src"]  # a new worker process
    assert len(starts["step_3"]) == 1
    assert outcome.result.verdicts["matches_reference"] == "pass"
    assert outcome.result.verdicts["no_completed_rerun"] == "pass"
