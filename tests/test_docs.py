"""The README and docs/ stand alone (every link inside the repository), the CI runs the
README's test command, and the generated reference pages are up to date."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from chaos import docsgen

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_docs_link_only_inside_the_repository() -> None:
    for doc in DOCS:
        text = doc.read_text()
        name = doc.relative_to(ROOT)
        assert "../shared" not in text, f"{name} points outside the repository"
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            path = (doc.parent / target).resolve()
            assert path.is_relative_to(ROOT), f"{name}: {target} leaves the repository"
            assert path.exists(), f"{name}: {target} does not exist"


def _slug(heading: str) -> str:
    """A heading's anchor, as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_anchor_names_a_heading() -> None:
    headings = {
        doc: {_slug(h) for h in re.findall(r"^#+ (.+)$", doc.read_text(), re.M)} for doc in DOCS
    }
    for doc in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#]*)#([^)]*)\)", doc.read_text()):
            page = (doc.parent / target).resolve() if target else doc
            if page in headings:
                assert anchor in headings[page], f"{doc.relative_to(ROOT)}: no heading #{anchor}"


def test_the_readme_names_the_design() -> None:
    assert "(docs/design.md)" in (ROOT / "README.md").read_text()


def test_the_readme_stays_short() -> None:
    """What this is, install, a first run, scenarios, CI, the report, the tests: the rest
    is in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 160


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    command = readme.split("the line fails if either did):\n\n")[1].splitlines()[0].strip()
    assert command.startswith("python3 -m pytest")
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_quick_subset_is_registered_and_documented() -> None:
    assert '"slow: ' in (ROOT / "pyproject.toml").read_text()
    assert 'python3 -m pytest -q -m "not slow"' in (ROOT / "README.md").read_text()


def test_the_generated_reference_is_up_to_date() -> None:
    stale = [str(p) for p in docsgen.stale(ROOT)]
    assert not stale, f"{', '.join(stale)} out of date: run `{docsgen.COMMAND}`"


def test_every_shipped_scenario_is_in_the_generated_list() -> None:
    page = docsgen.scenarios_page(ROOT)
    for path in ROOT.glob("scenarios/**/*.yaml"):
        assert f"](../../{path.relative_to(ROOT).as_posix()})" in page, path


def test_a_stale_page_is_named_with_the_command_that_regenerates_it(tmp_path: Path) -> None:
    """`chaos docs --check` on a copy whose invariants page was edited by hand: exit 1, one
    line naming the page and the command; `chaos docs` rewrites it."""
    reference = tmp_path / docsgen.REFERENCE
    reference.mkdir(parents=True)
    for rel, text in docsgen.render().items():
        (tmp_path / rel).write_text(text, encoding="utf-8")
    (reference / "invariants.md").write_text("edited by hand\n", encoding="utf-8")
    assert docsgen.stale(tmp_path) == [docsgen.REFERENCE / "invariants.md"]
    assert docsgen.write(tmp_path) == [docsgen.REFERENCE / "invariants.md"]
    assert docsgen.stale(tmp_path) == []
    check = [sys.executable, "-m", "chaos", "docs", "--check"]
    proc = subprocess.run(check, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_seed_means_only_randomness_in_the_docs() -> None:
    """The two design texts are the source documents; a seed is a number."""
    for doc in DOCS:
        for phrase in ("the seed's design", "the seed as written", "seed name", "the seed leaves"):
            assert phrase not in doc.read_text(), f"{doc.relative_to(ROOT)}: {phrase!r}"
