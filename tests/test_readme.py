"""The README's example scenario stays a valid scenario."""

from __future__ import annotations

from pathlib import Path

from chaos.scenario import scenario_from_dict

ROOT = Path(__file__).resolve().parents[1]


def test_readme_scenario_example_is_valid() -> None:
    import yaml

    text = (ROOT / "README.md").read_text()
    block = text.split("the invariants to check and budgets:\n\n")[1].split("\n\nA bad file")[0]
    data = yaml.safe_load("\n".join(line[4:] for line in block.splitlines()))
    loaded = scenario_from_dict(data, source="README.md", base_dir=ROOT / "scenarios")
    assert loaded.spec.name == "crash_after_ack" and len(loaded.spec.faults) == 2
