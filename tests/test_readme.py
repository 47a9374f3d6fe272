"""The README's example scenario stays a valid scenario, and one that runs and passes."""

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


def _example() -> dict[str, Any]:
    """The YAML block under 'the invariants to check and budgets:', as a document."""
    text = (ROOT / "README.md").read_text()
    block = text.split("the invariants to check and budgets:\n\n")[1].split("\n\nA bad file")[0]
    return yaml.safe_load("\n".join(line[4:] for line in block.splitlines()))


def test_readme_scenario_example_is_valid() -> None:
    loaded = scenario_from_dict(_example(), source="README.md", base_dir=ROOT / "scenarios")
    assert loaded.spec.name == "crash_after_ack" and len(loaded.spec.faults) == 2


def test_readme_scenario_example_passes_in_the_simulator() -> None:
    """Its plan path (`../plans/...`) is relative to scenarios/, where such files live."""
    loaded = scenario_from_dict(_example(), source="README.md", base_dir=ROOT / "scenarios")
    outcome = run_scenario(loaded)
    assert outcome.result.ok, (outcome.result.verdicts, outcome.result.budget_failures)


def test_readme_scenario_example_passes_from_the_command_line(tmp_path: Path) -> None:
    """The same file as a user would save it next to the shipped scenarios: exit 0."""
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    (tmp_path / "plans").symlink_to(ROOT / "plans", target_is_directory=True)
    path = scenarios / "readme_example.yaml"
    path.write_text(yaml.safe_dump(_example(), sort_keys=False), encoding="utf-8")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["run", str(path), "--mode", "sim", "--quiet", "--out", str(tmp_path / "o")])
    assert code == 0, out.getvalue()


def test_readme_network_faults_example_is_valid() -> None:
    """The network faults the README shows load as a scenario's faults, as they read."""
    text = (ROOT / "README.md").read_text()
    block = text.split("shows each toxic's attributes):\n\n")[1].split("\n\n")[0]
    faults = yaml.safe_load("\n".join(line[4:] for line in block.splitlines()))["faults"]
    doc = {"name": "net", "plan": "../plans/tiny.yaml", "workers": 2, "faults": faults}
    loaded = scenario_from_dict(doc, source="README.md", base_dir=ROOT / "scenarios")
    cut, toxic = loaded.spec.faults
    assert (cut.action, cut.link, cut.workers, cut.for_s) == ("cut_link", "redis", (0,), 3.0)
    assert toxic.toxic is not None and toxic.toxic.name == "latency_downstream"
