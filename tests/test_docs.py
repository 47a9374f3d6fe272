"""The README stands alone: everything it points to is inside the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_docs_link_only_inside_the_repository() -> None:
    for doc in DOCS:
        text = doc.read_text()
        assert "../shared" not in text, f"{doc.name} points outside the repository"
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            path = (doc.parent / target).resolve()
            assert path.is_relative_to(ROOT), f"{doc.name}: {target} leaves the repository"
            assert path.exists(), f"{doc.name}: {target} does not exist"


def test_the_readme_names_the_design() -> None:
    assert "(docs/design.md)" in (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    command = readme.split("the line fails if either did):\n\n")[1].splitlines()[0].strip()
    assert command.startswith("python3 -m pytest")
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()
