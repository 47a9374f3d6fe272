"""The command line on hostile input: what `validate` accepts, `run` runs.

Generated scenario files (the shipped ones with extreme numbers, huge integers, floats like
1e30, nan and inf, negative values, duplicated plans, duplicate keys and long strings) go
through `chaos validate` and then `chaos run --mode sim`: every file ends in a verdict (exit
0 or 1) or one line of bad input (exit 2), never a traceback and never another code. Then
the inputs that used to hang or blow up: devices, FIFOs and 10 MB files as scenario and
plan paths, and several bad files in one call (each one reported).

The generated files run in-process (`chaos.cli.main`), which is fast; the real entry point
(`python -m chaos`) is run on a few files, always under a subprocess timeout, so that a
regression is a failed test, never a hung suite.
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chaos.cli import main
from tests.helpers import containers

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "scenarios").glob("*.yaml"))
#: Generous: a subprocess that takes this long has hung (they take about a second).
TIMEOUT_S = 120


def _absolute_plans(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """The scenario with plan paths made absolute, so that it runs from any directory."""
    if isinstance(data.get("plan"), str):
        data["plan"] = str((base / data["plan"]).resolve())
    for ref in data.get("plans") or []:
        if isinstance(ref, dict) and isinstance(ref.get("path"), str):
            ref["path"] = str((base / ref["path"]).resolve())
    return data


BASES: list[dict[str, Any]] = [
    _absolute_plans(yaml.safe_load(p.read_text(encoding="utf-8")), p.parent) for p in SHIPPED
]

#: Values past every bound, at some bounds, and of every wrong kind. Valid values that make
#: a run long (10,000 evaluations, a day's deadline) are left out: they are not bugs.
EXTREMES: list[Any] = [
    0, 1, -1, 2, 7, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30,
    10**400, -(10**4000), 1e30, -1e30, 1e308, 1e-300, float("nan"), float("inf"),
    float("-inf"), 0.5, -0.5, 604_800_000, 604_800_001, 86_400_000, 86_400_001, 3_600_000,
    1_000_000, 1_000_001, 1000, 1001, True, None, "", "x" * 5_000, "a\nb\u2028c",
    "../plans/tiny.yaml", "all", "random", [], [0, 10**30], [1e30], {}, {"x" * 300: 1},
]  # fmt: skip
#: Valid values at or near the bounds, so that a good share of the files run.
OPS = [int(n) for n in os.environ.get("FUZZ_CLI_OPS", "1,1,2,3").split(",")]
PLAUSIBLE: list[Any] = [0, 1, 2, 3, 5, 20, 0.25, 0.9, 100, 500, 2_000, 60_000]
extremes = st.sampled_from(EXTREMES).map(copy.deepcopy) | st.sampled_from(PLAUSIBLE)
#: Where a value goes: each mapping of a scenario and its fields with numbers (and a few
#: others), so that most edits reach a field's own checks rather than "unknown field".
SLOTS: dict[str, list[str]] = {
    "top": ["seed", "workers", "time_scale", "deadline_s", "restart_delay_s", "name"],
    "retry": ["immediate_retries", "max_attempts", "tiers_ms", "jitter"],
    "engine": [
        "max_evaluations", "max_parallel", "heartbeat_ms", "stale_ms", "sweep_ms",
        "retry_grace_ms",
    ],
    "budgets": ["max_duplicated_tokens", "max_reruns", "max_retry_latency_s"],
    "agent": [
        "seed", "latency_ms", "tokens", "error_rate", "token_spread", "fail_rules",
        "error_kinds", "pass_rate",
    ],
    "latency": ["value_ms", "low_ms", "high_ms", "median_ms", "sigma", "cap_ms"],
    "failpoint": ["stall_ms", "hit", "times", "evaluation", "workers", "rule"],
    "runner": [
        "at_s", "every_s", "count", "target", "restart_after_s", "random_at_s", "after",
    ],
    "plan": ["evaluations", "path"],
}  # fmt: skip


def _slot(data: dict[str, Any], slot: str) -> dict[str, Any] | None:
    """The mapping a slot names in `data`; None when an earlier edit replaced it (or the
    scenario has none of that kind)."""
    node: Any = data
    if slot == "latency":
        node = _get(_get(data, "agent"), "latency_ms")
    elif slot in ("failpoint", "runner", "plan"):
        items = _get(data, "plans" if slot == "plan" else "faults")
        kinds = [
            f
            for f in (items if isinstance(items, list) else [])
            if isinstance(f, dict)
            and (slot == "plan" or ("failpoint" in f) == (slot == "failpoint"))
        ]
        node = kinds[0] if kinds else None
    elif slot != "top":
        node = _get(data, slot)
    return node if isinstance(node, dict) else None


def _get(node: Any, key: str) -> Any:
    return node.get(key) if isinstance(node, dict) else None


@st.composite
def mutated(draw: st.DrawFn) -> tuple[dict[str, Any], list[str]]:
    """A shipped scenario with a few edits, and lines to append once it is YAML (duplicate
    keys, which a dict cannot hold)."""
    data = copy.deepcopy(draw(st.sampled_from(BASES)))
    data.setdefault("agent", {})
    if not isinstance(data["agent"].get("latency_ms"), dict):
        data["agent"]["latency_ms"] = {"kind": "lognormal", "median_ms": 900, "cap_ms": 4000}
    for key in ("engine", "retry", "budgets"):
        data.setdefault(key, {})
    text_edits: list[str] = []
    for _ in range(draw(st.sampled_from(OPS))):
        op = draw(st.sampled_from(["slot"] * 8 + ["anywhere", "plans", "duplicate_key"]))
        if op == "duplicate_key":
            text_edits.append(draw(st.sampled_from(["name: again", "seed: 1", "agent: {}"])))
        elif op == "plans":  # one plan listed twice, or twice under another spelling
            ref = {"path": data.pop("plan", None), "evaluations": data.pop("evaluations", 1)}
            plans = data.get("plans") or [ref]
            if not isinstance(plans, list) or not isinstance(plans[0], dict):
                continue  # an earlier edit made `plans` something else: nothing to repeat
            again = dict(plans[0])
            if draw(st.booleans()) and isinstance(again.get("path"), str):
                again["path"] = str(Path(again["path"]).parent / "." / Path(again["path"]).name)
            data["plans"] = [*plans, again]
        elif op == "slot":
            slot = draw(st.sampled_from(sorted(SLOTS)))
            node = _slot(data, slot)
            if node is not None:
                node[draw(st.sampled_from(SLOTS[slot]))] = draw(extremes)
        else:  # any mapping or list, any of its keys
            where = draw(st.sampled_from(containers(data)))
            node = data
            for key in where:
                node = node[key]
            if isinstance(node, dict) and node:
                node[draw(st.sampled_from(list(node)))] = draw(extremes)
            elif isinstance(node, list) and node:
                node[draw(st.integers(0, len(node) - 1))] = draw(extremes)
    return data, text_edits


def _dump(data: Any, text_edits: list[str]) -> str:
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    return text + "".join(f"{line}\n" for line in text_edits)


def _cli(*argv: str) -> tuple[int, str, str]:
    """`chaos.cli.main(argv)` in this process: (exit code, stdout, stderr). An exception
    other than SystemExit propagates, and fails the test with its traceback."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def _check_error_lines(err: str, files: int) -> None:
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == files, f"expected one line per bad file: {lines!r}"
    for line in lines:
        assert len(line) < 1_000, f"values are shortened: {line[:300]!r}..."


_runs = itertools.count()


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for every example (hypothesis refuses function-scoped fixtures)."""
    return tmp_path_factory.mktemp("fuzz-cli")


@settings(
    max_examples=int(os.environ.get("FUZZ_CLI_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(mutated())
def test_validated_files_run_and_bad_ones_are_one_line(
    fuzz_dir: Path, case: tuple[dict[str, Any], list[str]]
) -> None:
    data, text_edits = case
    try:
        text = _dump(data, text_edits)
    except (yaml.YAMLError, ValueError):  # a value YAML cannot write: nothing to test
        return
    n = next(_runs)
    path = fuzz_dir / f"s{n}.yaml"
    path.write_text(text, encoding="utf-8")
    code, out, err = _cli("validate", str(path))
    assert code in (0, 2), (code, out, err)
    if code == 2:
        _check_error_lines(err, 1)
        assert err.startswith(f"{path}: "), err
    else:
        assert err == "" and f"{path}: ok" in out
    code_run, out, err_run = _cli(
        "run", str(path), "--mode", "sim", "--quiet", "--out", str(fuzz_dir / f"out{n}")
    )
    assert "Traceback" not in out + err_run
    if code == 2:  # refused before anything runs, with the same line
        assert (code_run, err_run) == (2, err), (code_run, out, err_run)
        assert not (fuzz_dir / f"out{n}").exists()
    else:
        assert code_run in (0, 1), (code_run, out, err_run)


def test_the_mutations_reach_past_the_bounds(fuzz_dir: Path) -> None:
    """The generator does produce bound errors, duplicate keys and duplicated plans (a
    fuzzer whose files were all refused at the top would prove little)."""
    seen: set[str] = set()

    @settings(max_examples=150, deadline=None, database=None)
    @given(mutated())
    def collect(case: tuple[dict[str, Any], list[str]]) -> None:
        from chaos.scenario import ScenarioError, load_scenario

        try:
            text = _dump(*case)
        except (yaml.YAMLError, ValueError):
            return
        path = fuzz_dir / "collect.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            load_scenario(path)
        except ScenarioError as exc:
            msg = str(exc)
            for mark in ("expected a value <=", "duplicate key", "plans[1].path", "got nan"):
                if mark in msg:
                    seen.add(mark)

    collect()
    assert {"expected a value <=", "duplicate key", "plans[1].path"} <= seen, seen


# --- every bad file at once ------------------------------------------------------------------


def _scenario(tmp_path: Path, name: str, **changes: Any) -> Path:
    data = _absolute_plans(yaml.safe_load(SHIPPED[0].read_text()), SHIPPED[0].parent)
    data.update(changes)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def test_validate_reports_every_bad_file(tmp_path: Path) -> None:
    good = _scenario(tmp_path, "good")
    seed = _scenario(tmp_path, "seed", seed=2**64)
    stale = _scenario(tmp_path, "stale", engine={"stale_ms": 10**12})
    missing = tmp_path / "missing.yaml"
    code, out, err = _cli("validate", str(seed), str(good), str(stale), str(missing))
    assert code == 2
    _check_error_lines(err, 3)
    lines = err.splitlines()
    assert lines[0].startswith(f"{seed}: seed: expected an integer within [0, 9223372036854775807]")
    assert lines[1].startswith(f"{stale}: engine.stale_ms: expected an integer within [50, 6048")
    assert lines[2].startswith(f"{missing}: cannot read scenario: No such file")
    assert out.splitlines() == [f"{good}: ok ({yaml.safe_load(good.read_text())['name']})"]
    assert _cli("validate", str(good))[0] == 0


def test_run_reports_every_bad_file_before_running_anything(tmp_path: Path) -> None:
    good = _scenario(tmp_path, "good")
    bad = [_scenario(tmp_path, f"bad{i}", seed=-1) for i in range(2)]
    out_dir = tmp_path / "out"
    code, out, err = _cli(
        "run", str(bad[0]), str(good), str(bad[1]), "--mode", "sim", "--out", str(out_dir)
    )
    assert code == 2 and not out_dir.exists(), out
    _check_error_lines(err, 2)
    assert [line.split(": ")[0] for line in err.splitlines()] == [str(b) for b in bad]


# --- paths that are not files, and files too large ---------------------------------------------


def _python_m_chaos(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """`python -m chaos ARGV` with this checkout first on the path; a hang fails the test."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "chaos", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def _refused(proc: subprocess.CompletedProcess[str], *expected: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    _check_error_lines(proc.stderr, len(expected))
    for line, want in zip(proc.stderr.splitlines(), expected, strict=True):
        assert want in line, (want, line)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_devices_and_fifos_are_refused_promptly(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    zero = Path("/dev/zero")
    assert zero.exists()
    on_zero = tmp_path / "plan_zero.yaml"
    on_zero.write_text(f"name: z\nplan: {zero}\n")
    on_fifo = tmp_path / "plan_fifo.yaml"
    on_fifo.write_text(f"name: f\nplan: {fifo}\n")
    proc = _python_m_chaos("validate", str(zero), str(fifo), str(on_zero), str(on_fifo))
    _refused(
        proc,
        "/dev/zero: cannot read scenario: a character device; expected a regular file",
        f"{fifo}: cannot read scenario: a FIFO; expected a regular file",
        f"{on_zero}: plan: /dev/zero: cannot read plan: a character device",
        f"{on_fifo}: plan: {fifo}: cannot read plan: a FIFO; expected a regular file",
    )
    proc = _python_m_chaos("run", str(fifo), "--mode", "sim", "--out", str(tmp_path / "o"))
    _refused(proc, f"{fifo}: cannot read scenario: a FIFO")


def test_a_10_mb_file_is_refused_at_once(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("name: big\nplan: plans/tiny.yaml\ndescription: |\n" + "  x\n" * 2_500_000)
    assert big.stat().st_size > 10_000_000
    plan = tmp_path / "big_plan.yaml"
    plan.write_text("plan: p\npasses:\n" + "#\n" * 5_000_000)
    on_plan = tmp_path / "on_big_plan.yaml"
    on_plan.write_text(f"name: s\nplan: {plan}\n")
    proc = _python_m_chaos("validate", str(big), str(on_plan))
    _refused(
        proc,
        f"{big}: cannot read scenario: too large ({big.stat().st_size} bytes); expected at most",
        f"{on_plan}: plan: {plan}: cannot read plan: too large",
    )


def test_files_just_under_the_size_cap_take_seconds_not_minutes(tmp_path: Path) -> None:
    """The worst YAML for the parser (blank lines, a flow list of numbers) just under the
    cap: a line, promptly (the subprocess timeout is the guard)."""
    from engine.yamlfile import MAX_BYTES

    blank = tmp_path / "blank.yaml"
    blank.write_text("name: blank\nplan: plans/tiny.yaml\n" + "\n" * (MAX_BYTES - 100))
    numbers = tmp_path / "numbers.yaml"
    numbers.write_text(
        "name: n\nplan: plans/tiny.yaml\nfaults: [" + "1," * (MAX_BYTES // 3) + "]\n"
    )
    proc = _python_m_chaos("validate", str(blank), str(numbers))
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.startswith(f"{blank}: ok"), proc.stdout  # valid, only long
    _refused(proc, f"{numbers}: not valid YAML: too large: more than 100000 YAML nodes")


def test_the_entry_point_never_shows_a_traceback(tmp_path: Path) -> None:
    """The real `python -m chaos` on a mix of files: bad ones one line each, then a run."""
    bad = [
        _scenario(tmp_path, "huge_seed", seed=10**4000),
        _scenario(tmp_path, "nan", time_scale=float("nan")),
        _scenario(tmp_path, "tiers", retry={"tiers_ms": [10**30]}),
    ]
    dup = tmp_path / "dup.yaml"
    dup.write_text(_scenario(tmp_path, "d").read_text() + "seed: 3\n")
    proc = _python_m_chaos("validate", *map(str, bad), str(dup))
    _refused(
        proc,
        "seed: expected an integer within [0, 9223372036854775807]; got an integer of about 4001",
        "time_scale: expected a number within (0, 1]; got nan",
        "retry.tiers_ms[0]: expected an integer within [1, 86400000]; got an integer of about 31",
        "not valid YAML: duplicate key 'seed' (line",
    )
    good = _scenario(tmp_path, "good")
    proc = _python_m_chaos(
        "run", str(good), "--mode", "sim", "--quiet", "--out", str(tmp_path / "o")
    )
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr


def test_extremes_are_what_they_say() -> None:
    """The value pool holds what the docstring promises (a cheap guard against edits)."""
    floats = [v for v in EXTREMES if isinstance(v, float)]
    assert any(math.isnan(v) for v in floats) and math.inf in floats and 1e30 in floats
    assert 2**64 in EXTREMES and any(isinstance(v, int) and v > 10**300 for v in EXTREMES)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run", "S", "--seed", str(2**64)], "--seed: expected a whole number within"),
        (["sim", "S", "--seeds", "-5"], "--seeds: expected a whole number within [1, "),
        (["sim", "S", "--first-seed", str(2**63)], "--first-seed: expected a whole number"),
        (["sim", "S", "--jobs", "x"], "--jobs: expected a whole number; got 'x'"),
        (["bogus"], "invalid choice: 'bogus'"),
    ],
)
def test_command_line_numbers_are_bounded_in_one_line(argv: list[str], expected: str) -> None:
    scenario = str(Path(__file__).resolve().parents[1] / "scenarios" / "crash_after_ack.yaml")
    code, out, err = _cli(*[scenario if a == "S" else a for a in argv])
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and expected in err, err
