"""The code stays ruff clean: lint and formatting are part of the test command."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import imports_of

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("ruff")
    cmd = [exe] if exe else [sys.executable, "-m", "ruff"]
    return subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, check=False)


@pytest.mark.parametrize("args", [("check", "."), ("format", "--check", ".")])
def test_ruff(args: tuple[str, ...]) -> None:
    out = _ruff(*args)
    assert out.returncode == 0, out.stdout + out.stderr


#: Who may import whom: `engine` knows nothing of `sim` or `chaos`, `sim` nothing of
#: `chaos` (scenarios and checks drive the simulator, never the other way round), and
#: neither `sim` nor the engine's configuration knows the live runtime (the store's
#: replies are the shell's, `engine.shell.replies`; a Sentinel URL is parsed apart from
#: its client, `engine.sentinel_url`); `reports` define the figures (cost, latency) and read
#: the runs, the harness judges and shows them: `chaos` imports `reports`, never the reverse.
FORBIDDEN = {
    "engine": ("sim", "chaos"),
    "engine/config.py": ("engine.runtime",),
    "sim": ("chaos", "engine.runtime"),
    "reports": ("chaos",),
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependencies_point_one_way(package: str) -> None:
    root = Path(__file__).resolve().parent.parent
    wrong = []
    place = root / package
    for path in sorted(place.rglob("*.py")) if place.is_dir() else [place]:
        for line, name in imports_of(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package]):
                wrong.append(f"{path.relative_to(root)}:{line}: imports {name}")
    assert wrong == []


#: The stored result's data type: the one part of `engine.core` the checker may read (the
#: final state is made of them); everything else there decides, and the checker judges it.
_CHECKER_MAY_READ = ("engine.core.results",)


def test_the_checker_and_its_reference_decide_nothing_with_the_engine() -> None:
    """`chaos/checker/` and `chaos/reference.py` compute what the engine owes with their own
    code: an import of the engine's core or policy would let a bug there move the
    expectation with the engine (a per-rule `max_attempts` ignored by both, and
    `matches_reference` agreeing)."""
    import ast

    root = Path(__file__).resolve().parent.parent
    paths = [*sorted((root / "chaos" / "checker").rglob("*.py")), root / "chaos" / "reference.py"]
    wrong = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                base = node.module or ""
                names = [f"{base}.{a.name}" for a in node.names] if base == "engine" else [base]
            else:
                continue
            for name in names:
                core = name == "engine.core" or name.startswith("engine.core.")
                if (core and not name.startswith(_CHECKER_MAY_READ)) or name.startswith(
                    "engine.policy"
                ):
                    wrong.append(f"{path.relative_to(root)}:{node.lineno}: imports {name}")
    assert wrong == []
