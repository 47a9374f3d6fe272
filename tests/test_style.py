"""The code stays ruff clean: lint and formatting are part of the test command."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
#: `chaos` (scenarios and checks drive the simulator, never the other way round).
FORBIDDEN = {"engine": ("sim", "chaos"), "sim": ("chaos",)}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependencies_point_one_way(package: str) -> None:
    import ast

    root = Path(__file__).resolve().parent.parent
    wrong = []
    for path in sorted((root / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            for name in names:
                if name.split(".")[0] in FORBIDDEN[package]:
                    wrong.append(f"{path.relative_to(root)}:{node.lineno}: imports {name}")
    assert wrong == []
