"""`chaos coverage`: the measurement names the protocol's branches, and every branch
docs/coverage.md says a scenario reaches is reached by that scenario (its run alone, in the
simulator), so a change that leaves one unreached fails here, not in a reader's trust."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from chaos.cli import main
from chaos.coverage import (
    REFERENCE_FILE,
    Measurement,
    _branches,
    _reference_methods,
    measure,
    reached_by,
    unreachable,
)

ROOT = Path(__file__).resolve().parent.parent
WHERE = re.compile(r"(engine/(core|shell)/\w+|sim/redis)\.py:\d+ -> (\d+|exit)")


@pytest.fixture(scope="module")
def documented_scenarios() -> dict[str, tuple[Measurement, list[str]]]:
    """Each scenario docs/coverage.md names as reaching a branch, run once alone, measured."""
    scenarios = sorted({s for paths in reached_by().values() for s in paths})
    assert scenarios, "docs/coverage.md names no scenario that reaches a branch"
    return {s: measure([s], seeds=0, jobs=1) for s in scenarios}


def test_the_measurement_names_each_branch(
    documented_scenarios: dict[str, tuple[Measurement, list[str]]],
) -> None:
    m, failed = next(iter(documented_scenarios.values()))
    assert not failed
    assert m.runs == 1 and m.total > 300 and 0 < m.reached < m.total
    assert {f.path for f in m.files} >= {"engine/core/evaluation.py", REFERENCE_FILE}
    for b in m.unreached():
        assert WHERE.fullmatch(b.where()), b.where()
    every = [b for f in m.files for b in [*f.reached, *f.unreached]]
    assert len({b.key for b in every}) == len(every)  # a key names one branch
    references = _reference_methods()
    in_store = [b for b in every if b.path == REFERENCE_FILE]
    assert in_store and all(b.function.split(".<locals>.")[0] in references for b in in_store)


def test_each_branch_the_docs_say_a_scenario_reaches_is_reached_by_it(
    documented_scenarios: dict[str, tuple[Measurement, list[str]]],
) -> None:
    missing = []
    for key, scenarios in reached_by().items():
        for scenario in scenarios:
            m, failed = documented_scenarios[scenario]
            assert not failed, failed
            if key not in {b.key for f in m.files for b in f.reached}:
                missing.append(f"{scenario}: {key}")
    assert not missing, f"docs/coverage.md says these are reached, they are not: {missing}"


def test_the_docs_give_each_unreached_branch_a_reason() -> None:
    for key, why in unreachable().items():
        assert "::" in key and len(why.strip("| ")) > 10, key


def test_a_key_survives_edits_elsewhere_and_tells_equal_code_apart(tmp_path: Path) -> None:
    code = "def f(x):\n    if x:\n        return 1\n    if x:\n        return 1\n    return 2\n"
    (tmp_path / "m.py").write_text(code)
    arcs = [(2, 3), (2, 4), (4, 5), (4, 6)]
    before = {b.key for b in _branches("m.py", arcs, tmp_path)}
    assert len(before) == 4 and any(k.endswith(" #2") for k in before)
    (tmp_path / "m.py").write_text("import os\n\n" + code)  # two lines above: same keys
    after = _branches("m.py", [(a + 2, b + 2) for a, b in arcs], tmp_path)
    assert {b.key for b in after} == before
    assert after[0].where() == "m.py:4 -> 5"


def test_the_command_prints_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "coverage.json"
    argv = ["coverage", "scenarios/every_rule_fails.yaml", "--seeds", "0", "--jobs", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "engine/shell/orchestrator.py" in printed and "unreached branches:" in printed
    data = json.loads(out.read_text())
    assert data["runs"] == 1 and 0 < data["reached"] < data["branches"]
    first = next(u for f in data["files"].values() for u in f["unreached"])
    assert WHERE.fullmatch(first["where"]) and first["key"]


def test_a_missing_scenario_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["coverage", "scenarios/nope.yaml", "--seeds", "0"]) == 2
    assert capsys.readouterr().err.strip() == "scenarios/nope.yaml: expected a scenario file"


@pytest.mark.slow  # the sim suite's every scenario and 50 seeds of each, under coverage.py
def test_every_branch_the_suite_leaves_unreached_is_documented(tmp_path: Path) -> None:
    """`chaos coverage --strict` on the default suite: an engine change that adds a branch
    no scenario reaches, or moves one, fails here until docs/coverage.md says why (or a
    scenario reaches it). The runs are simulated, so the measurement is the same on any
    machine; a branch documented as unreached that a run now reaches is no failure."""
    assert main(["coverage", "--strict", "--json", str(tmp_path / "coverage.json")]) == 0
