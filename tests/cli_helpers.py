"""`python -m chaos` as a user runs it, for the tests that check a whole command: its exit
code, its stdout and its stderr (one shared helper, so every such test runs it alike)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Long enough for a CLI run of the suite's size, short enough that a hang fails the test.
TIMEOUT_S = 300


def chaos(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m chaos ARGS` from the repository's root, in a fresh interpreter (its exit
    code and what it prints are the user's), its output captured; `env` replaces the
    environment when given."""
    return subprocess.run(
        [sys.executable, "-m", "chaos", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        env=env,
    )
