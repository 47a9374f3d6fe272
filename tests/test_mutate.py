"""`python -m chaos mutate`: mutants of the engine's own code judged by the sim suite.

Kept fast: one function of the engine at a time, against one scenario (`amqp_blackhole`).
Each run is a real `python -m chaos mutate` in a subprocess (or the pool it drives), its
workers real interpreters with the mutated module imported in place of the file's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from chaos.mutate import run
from chaos.mutate.generate import Mutant, mutants, targets
from chaos.stack import marked_pids

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = "scenarios/amqp_blackhole.yaml"
TIMEOUT_S = 240  # a hang of the command itself fails the test


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


def _mutate(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chaos", "mutate", *argv],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def _left_dirs(pid: int) -> list[Path]:
    """The temp dirs the command with this pid made (`chaos-mutate-<pid>_<start>-*`)."""
    return list(Path(tempfile.gettempdir()).glob(f"chaos-mutate-{pid}_*"))


def _planted(name: str, source: str) -> Mutant:
    policy = targets(["engine/policy.py"], ROOT)[0]
    return Mutant(f"engine/policy.py:x:{name}", policy.path, policy.module, "x", 1, "", "", source)


def test_an_endless_mutant_times_out_and_a_raising_one_crashes() -> None:
    # a module whose import never ends (an endless loop for certain, on any machine), and
    # one whose import raises: the harness cannot even load a scenario, no verdict
    endless = _planted("endless", "while True:\n    pass\n")
    raising = _planted("raising", "raise RuntimeError('planted')\n")
    with run.pool(ROOT) as p:
        folder = p.dir
        verdict, crash = run.run_all(p, [endless, raising], [SCENARIO], 0, [], 2, 2.0)
    assert verdict.status == "timeout"
    assert verdict.detail == "no verdict within 2 s"
    # stopped at its deadline, from the pool's own record: it waited the whole 2 s (its
    # `wait(2)` ends no sooner), then SIGKILLed the worker, which never ended by itself
    assert verdict.seconds >= 2.0
    assert verdict.returncode == -signal.SIGKILL
    assert crash.returncode == 0  # the raising one ended by itself, its verdict written
    assert crash.status == "crashed"
    assert crash.detail == "RuntimeError: planted at engine/policy.py:1"
    assert not folder.exists()
    assert marked_pids(f"mutate-{os.getpid()}") == []  # its process group: SIGKILLed


def test_a_survivor_is_listed_with_its_diff_and_an_equivalent_is_excluded(
    tmp_path: Path,
) -> None:
    # amqp_blackhole runs `pass_outcome`'s line, but no pass of it ends partial: a wrong
    # word for "partial" goes unseen there
    target = targets(["engine/core/dag.py"], ROOT)[0]
    found = {m.change.rpartition("else ")[2]: m for m in mutants(target, ROOT, "pass_outcome")}
    survivor, equivalent = found['"XXpartialXX"'], found['"PARTIAL"']
    listed = tmp_path / "equivalent.toml"
    listed.write_text(f'[[mutant]]\nid = "{equivalent.id}"\nwhy = "test: same either way"\n')
    out = tmp_path / "out"
    argv = ["--paths", "engine/core/dag.py", "--function", "pass_outcome", "--scenarios"]
    got = _mutate(*argv, SCENARIO, "--equivalent", str(listed), "--out", str(out))
    assert got.returncode == 1, got.stdout + got.stderr  # survivors
    data = json.loads((out / "mutation.json").read_text())
    status = {m["id"]: m["status"] for m in data["mutants"]}
    assert status[equivalent.id] == "equivalent"
    assert status[survivor.id] == "survived"
    assert data["counts"]["equivalent"] == 1
    # "complete" misspelt: the pass announced is checked against the reference
    (misspelt,) = (m for m in data["mutants"] if '"XXcompleteXX" if' in m["diff"])
    assert misspelt["status"] == "killed"
    assert misspelt["scenario"] == SCENARIO
    assert "pass_results_correct" in misspelt["detail"]
    # `all(None)`: the engine raises, the run ends in an `engine_error` verdict
    (raising,) = (m for m in data["mutants"] if "if all(None) else" in m["diff"])
    assert raising["status"] == "killed"
    assert "no_engine_error" in raising["detail"]
    assert data["counts"]["killed"] >= 4
    assert f"survived: {survivor.id} line 42" in got.stdout
    kills = sum(data["counts"][s] for s in ("killed", "crashed", "timeout"))
    assert f"{kills} of {len(status) - 1} killed" in got.stdout
    md = (out / "mutation.md").read_text()
    assert "```diff\n" + survivor.diff.rstrip("\n") + "\n```" in md
    assert "test: same either way" in md
    assert survivor.diff.startswith("--- a/engine/core/dag.py\n+++ b/engine/core/dag.py\n")
    journal = (out / "verdicts.jsonl").read_text().splitlines()
    assert {json.loads(line)["id"] for line in journal} == set(status) - {equivalent.id}


def test_a_mutant_on_lines_no_scenario_runs_survives_unrun(tmp_path: Path) -> None:
    # `_show` only shapes the message of a setting out of bounds: no scenario has one
    out = tmp_path / "out"
    argv = ["--paths", "engine/policy.py", "--function", "_show", "--limit", "2"]
    got = _mutate(*argv, "--scenarios", SCENARIO, "--out", str(out))
    assert got.returncode == 1, got.stdout + got.stderr
    data = json.loads((out / "mutation.json").read_text())
    assert [(m["status"], m["reached"]) for m in data["mutants"]] == [("survived", False)] * 2
    assert all(
        m["detail"].startswith("not reached: no scenario runs line") for m in data["mutants"]
    )
    assert data["ran"] == 0
    assert "survived 2 (2 on lines no scenario runs)" in got.stdout


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for argv, expected in (
        (["--paths", "engine/nowhere.py"], "engine/nowhere.py: no such file or folder"),
        (["--jobs", "0"], "--jobs"),
        (["--timeout", "-3"], "--timeout"),
        (["--paths", "engine/policy.py", "--function", "nope"], "--function: nope"),
        (["--scenarios", "scenarios/none.yaml"], "scenarios/none.yaml"),
    ):
        got = _mutate(*argv, "--out", str(tmp_path / "out"))
        assert got.returncode == 2, (argv, got.stderr)
        assert len(got.stderr.strip().splitlines()) == 1, got.stderr
        assert expected in got.stderr, got.stderr
    assert not (tmp_path / "out").exists()


def test_ctrl_c_stops_the_workers_and_removes_the_temp_dir(tmp_path: Path) -> None:
    argv = ["--paths", "engine/core/dag.py", "--function", "ready", "--scenarios", SCENARIO]
    proc = subprocess.Popen(
        [sys.executable, "-m", "chaos", "mutate", *argv, "--timeout", "600", "--jobs", "1"],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # the first mutant (the endless one) runs once its job is written (m1: the baseline)
        deadline = time.monotonic() + TIMEOUT_S
        dirs: list[Path] = []
        while not any((d / "m2.job.json").exists() for d in dirs):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
            dirs = _left_dirs(proc.pid)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "interrupted (SIGINT)" in stderr
    assert _left_dirs(proc.pid) == []
    assert not any(d.exists() for d in dirs)
    assert marked_pids(f"mutate-{proc.pid}") == []  # the worker it was running: killed


def test_a_spliced_mutant_is_the_file_rebuilt_with_the_mutated_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the fast path (the node's text replaced in place) against libcst's whole-tree rebuild
    import chaos.mutate.generate as generate

    dag, policy = targets(["engine/core/dag.py", "engine/policy.py"], ROOT)
    fast = mutants(dag, ROOT) + mutants(policy, ROOT)
    monkeypatch.setattr(generate, "_spliced", lambda *_args: None)
    rebuilt = mutants(dag, ROOT) + mutants(policy, ROOT)
    assert len(fast) == len(rebuilt) > 150
    assert fast == rebuilt


def test_only_runs_the_listed_mutants_or_a_runs_survivors(tmp_path: Path) -> None:
    first = tmp_path / "first"
    argv = ["--paths", "engine/policy.py", "--function", "_show", "--limit", "3"]
    assert _mutate(*argv, "--scenarios", SCENARIO, "--out", str(first)).returncode == 1
    ran = json.loads((first / "mutation.json").read_text())["mutants"]
    wanted = tmp_path / "ids.txt"
    wanted.write_text(f"# one\n{ran[1]['id']}\n\n")
    for only, expected in (
        (wanted, [ran[1]["id"]]),
        (first / "mutation.json", [m["id"] for m in ran]),
    ):
        out = tmp_path / f"out-{only.suffix}"
        got = _mutate(*argv[:4], "--only", str(only), "--scenarios", SCENARIO, "--out", str(out))
        assert got.returncode == 1, got.stdout + got.stderr
        data = json.loads((out / "mutation.json").read_text())
        assert [m["id"] for m in data["mutants"]] == expected
    bad = _mutate(*argv, "--only", str(tmp_path / "none.txt"), "--scenarios", SCENARIO)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--only" in bad.stderr
