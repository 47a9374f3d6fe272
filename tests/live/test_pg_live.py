"""`pg` live: PostgreSQL alone, the second document's default design, on a private
PostgreSQL of the run's own (`chaos.systems.pg`): the shipped scenarios whose faults apply
pass on it, its own scenarios (`scenarios/pg/`: the document's acceptance tests, a resume
from a checkpoint) pass, and nothing is left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.live.test_pg_store_live import _chaos, sweep

pytestmark = pytest.mark.slow  # a private PostgreSQL, real workers


def test_every_shipped_scenario_whose_faults_apply_passes_on_pg_live(tmp_path: Path) -> None:
    folders = ("scenarios/*.yaml", "scenarios/regressions/*", "scenarios/pg_store/*.yaml")
    sweep("pg", folders, tmp_path, set())


def test_a_scenario_with_a_broker_fault_is_refused_on_pg() -> None:
    """No broker here: a fault on one is refused in one line before anything starts."""
    run = _chaos("run", "scenarios/broker_restart.yaml", "--system", "pg", "--mode", "live")
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "pg has no service 'broker'" in run.stderr
