"""The README's scenario example is the shipped file it names, and it runs and passes; the
full example of docs/harness.md stays a valid scenario that passes too."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import yaml

from chaos.cli import main
from chaos.insim import run_scenario
from chaos.scenario import scenario_from_dict

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "docs" / "harness.md"


def _block(text: str, after: str, until: str) -> str:
    """An indented block of a page, between two phrases, unindented."""
    block = text.split(after)[1].split(until)[0]
    return "\n".join(line[4:] for line in block.splitlines()) + "\n"


def _readme_example() -> str:
    return _block((ROOT / "README.md").read_text(), "and budgets:\n\n", "\n\nA bad file")


def _example() -> dict[str, Any]:
    """The YAML block of docs/harness.md under 'the invariants to check and budgets:'."""
    text = HARNESS.read_text()
    return yaml.safe_load(_block(text, "the invariants to check and budgets:\n\n", "\n\nA bad"))


def test_the_readme_example_is_the_shipped_scenario_it_names() -> None:
    assert _readme_example() == (ROOT / "scenarios" / "crash_after_ack.yaml").read_text()


def test_the_readme_example_passes_from_the_command_line(tmp_path: Path) -> None:
    """As a user would save it next to the shipped scenarios: exit 0."""
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    (tmp_path / "plans").symlink_to(ROOT / "plans", target_is_directory=True)
    path = scenarios / "readme_example.yaml"
    path.write_text(_readme_example(), encoding="utf-8")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["run", str(path), "--mode", "sim", "--quiet", "--out", str(tmp_path / "o")])
    assert code == 0, out.getvalue()


def test_the_full_example_is_valid() -> None:
    loaded = scenario_from_dict(_example(), source="docs/harness.md", base_dir=ROOT / "scenarios")
    assert loaded.spec.name == "every_fault_kind" and len(loaded.spec.faults) == 2


def test_the_full_example_passes_in_the_simulator() -> None:
    """Its plan path (`../plans/...`) is relative to scenarios/, where such files live."""
    loaded = scenario_from_dict(_example(), source="docs/harness.md", base_dir=ROOT / "scenarios")
    outcome = run_scenario(loaded)
    assert outcome.result.ok, (outcome.result.verdicts, outcome.result.budget_failures)


def test_the_network_faults_example_is_valid() -> None:
    """The network faults docs/harness.md shows load as a scenario's faults, as they read."""
    text = HARNESS.read_text()
    block = text.split("shows each toxic's attributes):\n\n")[1].split("\n\n")[0]
    faults = yaml.safe_load("\n".join(line[4:] for line in block.splitlines()))["faults"]
    doc = {"name": "net", "plan": "../plans/tiny.yaml", "workers": 2, "faults": faults}
    loaded = scenario_from_dict(doc, source="docs/harness.md", base_dir=ROOT / "scenarios")
    cut, toxic = loaded.spec.faults
    assert (cut.action, cut.link, cut.workers, cut.for_s) == ("cut_link", "redis", (0,), 3.0)
    assert toxic.toxic is not None and toxic.toxic.name == "latency_downstream"
