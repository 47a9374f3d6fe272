"""Against a baseline (`reports/baseline.py`, `--baseline` of `chaos report` and `chaos
run`): what faults cost beside an earlier run's, what got worse flagged, and the budget
`max_regression_ratio` failing the run."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import yaml

from chaos.cli import main
from reports.baseline import compare, over_budget
from reports.runs import ReportError

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "crash_after_ack.yaml"


def _m(tokens: int, l2: float | None = None) -> dict[str, Any]:
    """Metrics as `reports.build.metrics` shapes them, the compared parts only."""
    level = {"production_estimate_s": {"n": 1, "p99": l2} if l2 is not None else {"n": 0}}
    return {
        "cost": {"duplicated_tokens": tokens, "duplicated_ratio": tokens / 1000},
        "recovery": {"next_rule_start_s": {"n": 1, "p99": 0.5}},
        "retry_latency": {"level_2": level},
    }


def test_compare_flags_what_grew_beyond_the_tolerance_only() -> None:
    key = ("s", "sim")
    assert not any(r["worse"] for r in compare({key: _m(100)}, {key: _m(100)}))
    rows = {r["figure"]: r for r in compare({key: _m(111)}, {key: _m(100)}, tolerance=0.1)}
    assert rows["duplicated_tokens"]["worse"] and rows["duplicated_ratio"]["worse"]
    assert not rows["recovery_p99_s"]["worse"] and rows["recovery_p99_s"]["change"] == 0
    rows = {r["figure"]: r for r in compare({key: _m(110)}, {key: _m(100)}, tolerance=0.2)}
    assert not rows["duplicated_tokens"]["worse"]
    # retries of a level the baseline never had: new, worse, and over any budget
    rows = {r["figure"]: r for r in compare({key: _m(100, l2=3.0)}, {key: _m(100)})}
    new = rows["retry_p99_l2_s"]
    assert new["worse"] and new["new"] and new["change"] is None
    assert over_budget([new], {"s": 100.0})
    assert not over_budget([rows["duplicated_tokens"]], {"s": 0.0})
    assert not over_budget([new], {"s": None})
    with pytest.raises(ReportError, match="no scenario in common"):
        compare({key: _m(1)}, {("s", "live"): _m(1)})


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean `crash_after_ack` run in the simulator: the baseline."""
    out = tmp_path_factory.mktemp("baseline") / "clean"
    assert main(["run", str(SCENARIO), "--mode", "sim", "--quiet", "--out", str(out)]) == 0
    return out


def _variant(tmp: Path, stem: str, **changes: Any) -> Path:
    doc = yaml.safe_load(SCENARIO.read_text())
    doc["plan"] = str(ROOT / "plans" / "code_review.yaml")
    doc.update(changes)
    path = tmp / f"{stem}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_run_against_itself_shows_no_regression(
    clean: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    capsys.readouterr()
    out = tmp_path / "again"
    argv = ["run", str(SCENARIO), "--mode", "sim", "--quiet", "--report", "--out", str(out)]
    assert main([*argv, "--baseline", str(clean)]) == 0
    assert "nothing got worse" in capsys.readouterr().out
    document = json.loads((out / "report" / "metrics.json").read_text())
    rows = document["against_baseline"]["rows"]
    assert {r["figure"] for r in rows} >= {"duplicated_tokens", "recovery_p99_s"}
    assert all(r["change"] == 0 and not r["worse"] for r in rows)
    for page in (out / "summary.md", out / "report" / "summary.md", out / "report" / "report.html"):
        assert "Against the baseline" in page.read_text()


def test_a_mutant_that_pays_finished_rules_again_is_flagged(
    clean: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    broken = tmp_path / "broken"
    argv = ["run", str(SCENARIO), "--mode", "sim", "--quiet", "--out", str(broken)]
    assert main([*argv, "--mutant", "no_redis_results"]) == 1  # its invariant, not cost
    capsys.readouterr()
    report = tmp_path / "report"
    assert main(["report", str(broken), "--baseline", str(clean), "--out", str(report)]) == 0
    said = capsys.readouterr().out
    assert "got worse: crash_after_ack duplicated_tokens +" in said
    rows = json.loads((report / "metrics.json").read_text())["against_baseline"]["rows"]
    tokens = next(r for r in rows if r["figure"] == "duplicated_tokens")
    assert tokens["worse"] and tokens["current"] > tokens["baseline"] > 0
    assert "| duplicated_tokens |" in (report / "summary.md").read_text()
    assert "<strong>WORSE</strong>" in (report / "report.html").read_text()
    # the mutant's run with the budget: its cost regression is named as a failure too
    budgeted = _variant(tmp_path, "budgeted", budgets={"max_regression_ratio": 0.5})
    argv = ["run", str(budgeted), "--mode", "sim", "--quiet", "--mutant", "no_redis_results"]
    assert main([*argv, "--out", str(tmp_path / "b"), "--baseline", str(clean)]) == 1
    assert "FAIL baseline: crash_after_ack (sim): duplicated_tokens" in capsys.readouterr().out


def test_max_regression_ratio_fails_a_run_that_costs_more_than_its_baseline(
    clean: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A crash at the first write (not the third) passes every invariant but pays more."""
    fault = {"failpoint": "rule_after_write", "action": "crash", "hit": 1, "evaluation": 0}
    dearer = _variant(tmp_path, "dearer", faults=[fault])
    argv = ["run", str(dearer), "--mode", "sim", "--quiet", "--baseline", str(clean)]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0  # flagged, no budget: passes
    assert "got worse: crash_after_ack duplicated_tokens" in capsys.readouterr().out
    budget = {"max_regression_ratio": 0.5}
    limited = _variant(tmp_path, "limited", faults=[fault], budgets=budget)
    argv = ["run", str(limited), "--mode", "sim", "--quiet", "--baseline", str(clean)]
    assert main([*argv, "--out", str(tmp_path / "b")]) == 1
    said = capsys.readouterr().out
    assert "FAIL baseline: crash_after_ack (sim): duplicated_tokens" in said
    assert "> max_regression_ratio 0.5" in said
    junit = ET.parse(tmp_path / "b" / "junit.xml").getroot()  # CI's tab says it too
    [suite] = [s for s in junit.findall("testsuite") if s.get("name") == "baseline"]
    failed = said.count("FAIL baseline: ")  # a failing case per figure over the budget
    assert failed >= 1 and suite.get("failures") == str(failed)
    assert int(junit.get("failures") or 0) == failed
    loose = _variant(tmp_path, "loose", faults=[fault], budgets={"max_regression_ratio": 100})
    argv = ["run", str(loose), "--mode", "sim", "--quiet", "--baseline", str(clean)]
    assert main([*argv, "--out", str(tmp_path / "c")]) == 0
    junit = ET.parse(tmp_path / "c" / "junit.xml").getroot()
    [suite] = [s for s in junit.findall("testsuite") if s.get("name") == "baseline"]
    assert suite.get("failures") == "0" and suite.get("tests") == "1"


def test_a_baseline_without_runs_or_in_common_is_one_line_exit_2(
    clean: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    capsys.readouterr()
    out = tmp_path / "out"
    argv = ["run", str(SCENARIO), "--mode", "sim", "--quiet", "--out", str(out)]
    assert main([*argv, "--baseline", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"chaos run: --baseline {tmp_path}: expected a run folder (with journal.json) or a "
        "folder of runs"
    ]
    assert not out.exists()  # refused before anything ran
    other = _variant(tmp_path, "other", name="not_crash_after_ack")
    assert main(["run", str(other), "--mode", "sim", "--quiet", "--baseline", str(clean)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("chaos run: --baseline ") and "no scenario in common" in line
    theirs = tmp_path / "theirs"
    assert main(["run", str(other), "--mode", "sim", "--quiet", "--out", str(theirs)]) == 0
    capsys.readouterr()
    assert main(["report", str(theirs), "--baseline", str(clean)]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("chaos report: baseline: no scenario in common")
    assert main(["report", str(clean), "--baseline", str(tmp_path / "missing")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == f"chaos report: --baseline {tmp_path / 'missing'}: no such file or directory"
    assert not (theirs / "report").exists()
