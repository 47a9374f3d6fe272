"""`pg` live: PostgreSQL alone, the second document's default design, on a private
PostgreSQL of the run's own (`chaos.systems.pg`): the shipped scenarios whose faults apply
pass on it, its own scenarios (`scenarios/pg/`: the document's acceptance tests, a resume
from a checkpoint) pass, and nothing is left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chaos.scenario import load_scenario
from chaos.systems import on_system, refusal
from tests.live.test_pg_store_live import ROOT, _chaos

pytestmark = pytest.mark.slow  # a private PostgreSQL, real workers


def _applicable() -> list[str]:
    shipped = sorted(ROOT.glob("scenarios/*.yaml")) + sorted(ROOT.glob("scenarios/regressions/*"))
    shipped += sorted(ROOT.glob("scenarios/pg_store/*.yaml"))
    return [
        str(p.relative_to(ROOT))
        for p in shipped
        if refusal(on_system(load_scenario(p), "pg"), "pg", "live") is None
    ]


def test_every_shipped_scenario_whose_faults_apply_passes_on_pg_live(tmp_path: Path) -> None:
    applicable = _applicable()
    assert len(applicable) > 40
    out = tmp_path / "out"
    run = _chaos(
        "run", *applicable, "--system", "pg", "--mode", "live", "--quiet", "--out", str(out)
    )
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAIL")]
    assert run.returncode == 0, "\n".join(failed) + run.stdout[-3000:] + run.stderr[-2000:]
    journals = sorted(out.glob("*/journal.json"))
    assert len(journals) == len(applicable)
    for journal in journals:
        doc = json.loads(journal.read_text())
        assert doc["extra"]["system"] == "pg" and doc["ok"], journal


def test_a_scenario_with_a_broker_fault_is_refused_on_pg() -> None:
    """No broker here: a fault on one is refused in one line before anything starts."""
    run = _chaos("run", "scenarios/broker_restart.yaml", "--system", "pg", "--mode", "live")
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "pg has no service 'broker'" in run.stderr
