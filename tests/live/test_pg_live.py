"""`pg` live: PostgreSQL alone, the second document's default design, on a private
PostgreSQL of the run's own (`chaos.systems.pg`): the shipped scenarios whose faults apply
pass on it, its own scenarios (`scenarios/pg/`: the document's acceptance tests, a resume
from a checkpoint) pass, and nothing is left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chaos.mutants import MUTANTS
from tests.live.test_pg_store_live import _chaos, sweep
from tests.test_chaos_runs import CATCHES

pytestmark = pytest.mark.slow  # a private PostgreSQL, real workers


def test_every_shipped_scenario_whose_faults_apply_passes_on_pg_live(tmp_path: Path) -> None:
    folders = ("scenarios/*.yaml", "scenarios/regressions/*", "scenarios/pg_store/*.yaml")
    sweep("pg", folders, tmp_path, set())


def test_a_scenario_with_a_broker_fault_is_refused_on_pg() -> None:
    """No broker here: a fault on one is refused in one line before anything starts."""
    run = _chaos("run", "scenarios/broker_restart.yaml", "--system", "pg", "--mode", "live")
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "pg has no service 'broker'" in run.stderr


#: The mutants of the events' path, which on `pg` is the outbox's own (each event rides the
#: store operation whose change it announces) rather than a publish: caught live here, as
#: every applicable mutant is in sim (`tests/test_sim_pg.py`).
OUTBOX_MUTANTS = ("no_started_event", "no_completed_event", "double_final_publish")


@pytest.mark.parametrize("mutant", OUTBOX_MUTANTS)
def test_the_outbox_s_mutants_are_caught_live_on_pg(mutant: str, tmp_path: Path) -> None:
    name = CATCHES[mutant]
    out = tmp_path / "out"
    run = _chaos(
        "run", f"scenarios/{name}.yaml", "--system", "pg", "--mode", "live", "--quiet",
        "--mutant", mutant, "--out", str(out),
    )  # fmt: skip
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    (journal,) = out.glob("*/journal.json")
    verdicts = json.loads(journal.read_text())["verdicts"]
    assert verdicts[MUTANTS[mutant].breaks] == "fail", verdicts
