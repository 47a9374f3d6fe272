"""The PostgreSQL designs' command lines refuse bad input in one line (exit 2), before any
service is contacted."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = [
    (
        ["engine.worker", "--system", "pg", "--store", "redis"],
        "engine.worker: --store redis: system pg keeps its store in postgres",
    ),
    (
        ["engine.submit", "--system", "pg", "--store", "redis", "--heartbeats"],
        "engine.submit: --store redis: system pg keeps its store in postgres",
    ),
    (
        ["engine.submit", "--from-checkpoint", "chk_0001", "--status", "x"],
        "engine.submit: --from-checkpoint and --reason go with --resume RUN",
    ),
    (
        ["engine.submit", "--resume", "x", "--heartbeats"],
        "engine.submit: give only one of: a plan, --cancel ID, --status ID, --resume RUN, "
        "--heartbeats, --purge PREFIX...",
    ),
]


@pytest.mark.parametrize(("argv", "line"), CASES)
def test_bad_input_is_one_line_and_exit_2(argv: list[str], line: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert done.stderr == line + "\n" and done.stdout == ""
