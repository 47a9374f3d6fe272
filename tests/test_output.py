"""Output that reads well in a pipe and in a CI log (issue 7, point 4).

Off a terminal nothing is wrapped at 80 columns (paths and replay commands stay whole and
copy-pasteable), no escape code is written, a long run prints progress lines instead of
staying silent, the summary says the mode, the faults fired and the reruns by kind, the
journal records the mode, and each JUnit test case carries its own check's time. No test
here reads the wall clock: progress is driven by a fake clock or a zero interval.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from chaos import journal
from chaos.checker import INVARIANTS, CheckResult, CheckSpec, FinalState, check
from chaos.cli import NO_WRAP_WIDTH, live_progress_line
from chaos.journal import Ticker, rerun_split, summary_line, write_junit
from chaos.runner import Progress
from chaos.scenario import load_scenario
from chaos.simcli import explore_command, seeds_progress_line

ROOT = Path(__file__).resolve().parent.parent
ANSI = "\x1b"


def chaos(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m chaos ...` with stdout and stderr pipes, as in CI: no variable that would
    make rich believe it writes to a terminal, and COLUMNS=80 (the width it would wrap at)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "CLICOLOR_FORCE")
    }
    env["COLUMNS"] = "80"
    return subprocess.run(
        [sys.executable, "-m", "chaos", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def long_dir(base: Path, name: str = "out") -> Path:
    """A folder whose path is well over 120 characters: rich off a terminal used to cut it."""
    path = base / ("a_rather_long_folder_name_for_ci_logs_" * 4) / name
    assert len(str(path)) > 120
    return path


def line_with(text: str, needle: str) -> str:
    [line] = [ln for ln in text.splitlines() if needle in ln]
    return line


# --- the rerun split, on a hand-built history ---------------------------------------------


def _history() -> list[dict[str, Any]]:
    """One rerun of each kind, for evaluation `e1` with rules a, b, c:
    - a: w1's call finished, w1 crashed before the write -> w2 reruns it (write window);
    - b: w1 crashed mid-call -> w2 reruns it (in flight);
    - c: w2 wrote its result, then w3 starts it again (after completion: a violation)."""
    events: list[dict[str, Any]] = []
    seqs: dict[str, int] = {}

    def ev(t: float, src: str, ev: str, **fields: Any) -> None:
        seqs[src] = seqs.get(src, 0) + 1
        pid = {"w1": 11, "w2": 12, "w3": 13}.get(src, 1)
        events.append({"t": t, "src": src, "pid": pid, "seq": seqs[src], "ev": ev, **fields})

    def rule(t: float, src: str, ev_name: str, r: str, **fields: Any) -> None:
        ev(t, src, ev_name, attempt_id="e1", rule_id=r, attempt=1, **fields)

    answer = {"verdict": "pass", "score": 0.9, "tokens": 100}
    rule(1.0, "w1", "rule_started", "a", try_no=1)
    rule(1.0, "w1", "rule_started", "b", try_no=1)
    rule(1.1, "w1", "rule_finished", "a", try_no=1, **answer)
    ev(1.2, "w1", "crash", failpoint="rule_after_call_before_write")
    for t, r in ((2.0, "a"), (2.1, "b"), (2.2, "c")):
        rule(t, "w2", "rule_started", r, try_no=1)
        rule(t + 0.01, "w2", "rule_finished", r, try_no=1, **answer)
        rule(t + 0.02, "w2", "result_persisted", r, verdict="pass", score=0.9, won=True)
    rule(3.0, "w3", "rule_started", "c", try_no=1)
    return events


def hand_built() -> CheckResult:
    return check(_history(), FinalState(), CheckSpec(invariants=("no_completed_rerun",)))


def test_reruns_are_split_by_kind() -> None:
    result = hand_built()
    stats = result.stats
    assert stats["reruns_by_cause"] == {
        "write_window": 1, "redelivery": 0, "sweeper_resume": 0, "in_flight": 1,
        "lost_state": 0, "resume": 0, "mutant": 0, "after_completion": 1,
    }  # fmt: skip
    assert stats["completed_reruns"] == 1  # no_completed_rerun's own count of violations
    assert stats["reruns"] == 3
    # b's first call was cut short (no tokens): only a's call was paid twice
    assert stats["duplicated_by_cause"]["write_window"] == 100 == stats["duplicated_tokens"]
    assert stats["tokens_total"] == 400 and stats["reference_tokens"] == 300
    assert result.verdicts == {"no_completed_rerun": "fail"}  # the verdict is unchanged
    assert rerun_split(stats) == "reruns 3 (write_window 1, in_flight 1, after_completion 1)"
    assert stats["faults_fired"] == {"crash@rule_after_call_before_write": 1}


def test_summary_line_says_mode_faults_and_rerun_kinds() -> None:
    result = hand_built()
    line = summary_line("s1", "sim", result, 1, "in 3.0 s simulated (0.01 s real)", "history ab")
    assert line.plain == (
        "FAIL s1 (sim): 1 evaluation in 3.0 s simulated (0.01 s real); "
        "faults crash@rule_after_call_before_write; "
        "reruns 3 (write_window 1, in_flight 1, after_completion 1); duplicated tokens 100 "
        "(write_window 100) = 33.3% of the fault-free bill 300; "
        "3 cases judged; history ab; broken: no_completed_rerun (3 cases)"
    )
    out = io.StringIO()
    Console(file=out, soft_wrap=True, width=NO_WRAP_WIDTH).print(line)
    assert out.getvalue() == line.plain + "\n"  # no colour off a terminal


def test_rerun_split_of_an_old_journal() -> None:
    assert rerun_split({"reruns": 4}) == "reruns 4"


# --- progress lines ---------------------------------------------------------------------------


def test_ticker_prints_on_its_interval_only() -> None:
    now = [100.0]
    out = io.StringIO()
    ticker = Ticker(every_s=5.0, stream=out, clock=lambda: now[0])
    calls: list[float] = []

    def line(took: float) -> str:
        calls.append(took)
        return f"at {took:.1f} s"

    assert not ticker.tick(line)
    now[0] = 104.9
    assert not ticker.tick(line)
    now[0] = 105.0
    assert ticker.tick(line)
    now[0] = 107.0
    assert not ticker.tick(line)
    now[0] = 111.0
    assert ticker.tick(line)
    assert out.getvalue() == "at 5.0 s\nat 11.0 s\n"
    assert calls == [5.0, 11.0]  # formatted only when printed
    off = Ticker(enabled=False, every_s=0.0, stream=out, clock=lambda: now[0])
    assert not off.tick(line)


def test_progress_lines() -> None:
    assert (
        seeds_progress_line("worker_kill_storm", 2400, 10000, 0, 12.34)
        == "chaos sim worker_kill_storm: 2400/10000 seeds, 0 failing, 12.3 s"
    )
    p = Progress("crash_after_ack", total=3, terminal=1, workers_alive=2, faults_fired=1)
    assert live_progress_line(p, 7.0) == (
        "chaos run crash_after_ack (live): 1/3 evaluations terminal, 2 workers alive, "
        "1 fault fired, 7.0 s"
    )


def test_chaos_sim_prints_progress_off_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(journal, "PROGRESS_EVERY_S", 0.0)  # a line per seed
    out = io.StringIO()
    console = Console(file=out, highlight=False, soft_wrap=True, width=NO_WRAP_WIDTH)
    assert not console.is_terminal
    args = argparse.Namespace(
        seeds=3, first_seed=0, jobs=1, mutant=None, shrink=False, all_failpoints=False
    )
    code = explore_command(load_scenario(ROOT / "scenarios/crash_after_ack.yaml"), args, console)
    assert code == 0
    progress = capsys.readouterr().err.splitlines()
    assert [ln.split(", 0 failing")[0] for ln in progress] == [
        f"chaos sim crash_after_ack: {i}/3 seeds" for i in (1, 2, 3)
    ]
    assert out.getvalue().startswith("crash_after_ack (sim): 3 seeds in ")


# --- JUnit times --------------------------------------------------------------------------


def test_junit_times_are_each_invariants_own(tmp_path: Path) -> None:
    result = hand_built()
    assert set(result.durations_s) == {"no_completed_rerun"}  # only what was judged
    timed = CheckResult(
        {"no_completed_rerun": "pass", "all_terminal": "pass"},
        [],
        {},
        [],
        {"no_completed_rerun": 0.25, "all_terminal": 0.000125},
    )
    write_junit(tmp_path / "junit.xml", [("s1", timed, 9.0)])
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert suite is not None and suite.get("time") == "9.000"  # the scenario's own time
    times = {c.get("name"): c.get("time") for c in suite.findall("testcase")}
    assert times == {
        "no_completed_rerun": "0.250000",
        "all_terminal": "0.000125",
        "exercised": "9.000000",  # the scenario's time, so that a CI tab adds up to it
    }


def test_junit_counts_a_scenario_the_harness_could_not_judge_as_an_error(tmp_path: Path) -> None:
    write_junit(tmp_path / "junit.xml", [("s1 (live, seed 1)", "the injector failed", 3.0)])
    root = ET.parse(tmp_path / "junit.xml").getroot()
    assert (root.get("errors"), root.get("failures"), root.get("tests")) == ("1", "0", "1")
    error = root.find("testsuite/testcase/error")
    assert error is not None and error.get("message") == "the injector failed"


def test_junit_fails_a_scenario_that_exercised_too_little(tmp_path: Path) -> None:
    """A run short of its `exercised` minimums exits 1: its JUnit must say so too."""
    short = CheckResult(
        {"no_completed_rerun": "pass"},
        [],
        {},
        [],
        {"no_completed_rerun": 0.5},
        {"no_completed_rerun": 5},
        ["no_completed_rerun judged 5 case(s) < exercised 6"],
    )
    assert not short.ok
    write_junit(tmp_path / "junit.xml", [("s1 (sim, seed 1)", short, 2.0)])
    root = ET.parse(tmp_path / "junit.xml").getroot()
    assert root.get("failures") == "1"
    [case] = [c for c in root.iter("testcase") if c.find("failure") is not None]
    assert case.get("name") == "exercised" and case.get("classname") == "s1 (sim, seed 1)"
    failure = case.find("failure")
    assert failure is not None and "judged 5 case(s) < exercised 6" in (
        failure.get("message") or ""
    )


# --- the commands, in a pipe --------------------------------------------------------------


def test_chaos_run_in_a_pipe(tmp_path: Path) -> None:
    out = long_dir(tmp_path)
    done = chaos("run", "scenarios/crash_after_ack.yaml", "--mode", "sim", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert ANSI not in done.stdout and ANSI not in done.stderr
    assert "[green]" not in done.stdout and "[/]" not in done.stdout
    assert f"outputs: {out}" in done.stdout.splitlines()  # whole, on one line
    summary = line_with(done.stdout, "crash_after_ack")
    assert summary.startswith("PASS crash_after_ack (sim): 3 evaluations in ")
    assert "faults crash@rule_after_write" in summary
    kinds = json.loads((out / "crash_after_ack" / "journal.json").read_text())
    split = kinds["stats"]["reruns_by_cause"]
    total = sum(split.values())
    assert split["after_completion"] == 0 and total > 0
    named = ", ".join(f"{cause} {n}" for cause, n in split.items() if n)
    assert f"reruns {total} ({named})" in summary
    assert kinds["mode"] == "sim" and kinds["extra"]["mode"] == "sim"

    [suite] = ET.parse(out / "junit.xml").getroot().findall("testsuite")
    assert suite.get("name") == "crash_after_ack (sim, seed 2)"  # the mode and seed it ran
    cases = suite.findall("testcase")
    ran = [c for c in cases if c.get("name") == "exercised"]
    assert len(ran) == 1
    assert float(ran[0].get("time") or 0) == pytest.approx(float(suite.get("time") or -1), abs=1e-3)
    times = {c.get("name"): float(c.get("time") or "nan") for c in cases if c not in ran}
    judged = set(INVARIANTS) - {"retry_delays_respected"}  # the scenario has no retry
    assert set(times) == judged == set(kinds["verdicts"])
    checked = kinds["check_durations_s"]
    assert set(checked) == judged
    for name, took in times.items():  # the checker's own timings, not a split duration
        assert took == pytest.approx(checked[name], abs=2e-6)
    assert len(set(times.values())) > 1


def test_chaos_sim_in_a_pipe() -> None:
    done = chaos("sim", "scenarios/crash_after_ack.yaml", "--seeds", "30", "--jobs", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert ANSI not in done.stdout and ANSI not in done.stderr
    summary = line_with(done.stdout, "seeds in")
    assert summary.startswith("crash_after_ack (sim): 30 seeds in ")
    # no delayed retry in it: the check of their ACKs judged nothing, and says so
    assert summary.endswith(", 0 failing, 30 seeds with unknown verdicts (retries_acked x30)")


def test_chaos_sim_explores_several_scenarios_and_shrinks_into_out(tmp_path: Path) -> None:
    """Several scenarios, each explored; --shrink writes under --out, never into the
    repository, unless --regressions says where."""
    out = tmp_path / "out"
    done = chaos(
        "sim", "scenarios/crash_after_ack.yaml", "scenarios/crash_before_ack.yaml",
        "--seeds", "5", "--jobs", "1", "--mutant", "no_redis_results", "--shrink",
        "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert line_with(done.stdout, "crash_after_ack (sim): 5 seeds in ")
    assert line_with(done.stdout, "crash_before_ack (sim): 5 seeds in ")
    written = sorted((out / "regressions").glob("*.yaml"))
    assert written, done.stdout
    replay = line_with(done.stdout, "replay with: ").split("replay with: ", 1)[1]
    assert shlex.split(replay)[4] in [str(p) for p in written]


def test_chaos_sim_failures_and_replay_command_in_a_pipe(tmp_path: Path) -> None:
    folder = long_dir(tmp_path, "regressions")
    done = chaos(
        "sim", "scenarios/crash_after_ack.yaml", "--seeds", "5", "--jobs", "1",
        "--mutant", "no_redis_results", "--shrink", "--regressions", str(folder),
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert ANSI not in done.stdout and ANSI not in done.stderr
    seed = line_with(done.stdout, "  seed 4: ")
    assert seed.startswith("  seed 4: no_completed_rerun: ") and "persisted" in seed
    replay = line_with(done.stdout, "replay with: ")
    command = shlex.split(replay.split("replay with: ", 1)[1])
    assert command[:4] == ["python", "-m", "chaos", "run"]
    assert command[5:] == ["--mode", "sim", "--mutant", "no_redis_results"]  # as it was found
    path = Path(command[4])
    assert path.parent == folder and path.is_file()  # copy-pasteable as printed


def test_chaos_validate_and_list_in_a_pipe(tmp_path: Path) -> None:
    folder = long_dir(tmp_path, "scenarios")
    folder.mkdir(parents=True)
    copy = folder / "crash_after_ack.yaml"
    text = (ROOT / "scenarios/crash_after_ack.yaml").read_text()
    copy.write_text(text.replace("../plans/", f"{ROOT / 'plans'}/"))
    done = chaos("validate", str(copy))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [f"{copy}: ok (crash_after_ack)"]
    listed = chaos("list")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert ANSI not in listed.stdout
    assert not set("┏━┃│└─") & set(listed.stdout)  # no box drawing in a log
    row = line_with(listed.stdout, "scenarios/worker_kill_storm.yaml")
    assert "Six SIGKILLs at times and on workers drawn from the seed" in row  # not wrapped
    assert "Finished rules are never rerun" not in row  # the first sentence only
    assert max(len(line.rstrip()) for line in listed.stdout.splitlines()) < 200
    long = chaos("list", "--long")
    row = line_with(long.stdout, "scenarios/worker_kill_storm.yaml")
    assert "Finished rules are never rerun" in row  # whole, and not wrapped


# --- --help -------------------------------------------------------------------------------


def _undocumented(parser: argparse.ArgumentParser, name: str) -> list[str]:
    """Every argument of `parser` and its subcommands without a help text."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                missing += _undocumented(subparser, f"{name} {sub}")
        elif not isinstance(action, argparse._HelpAction) and not action.help:
            missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_option_has_help_and_descriptions_are_whole() -> None:
    from chaos.cli import build_parser as chaos_parser
    from engine.submit import build_parser as submit_parser
    from engine.worker import build_parser as worker_parser

    parsers = [
        ("chaos", chaos_parser()),
        ("engine.submit", submit_parser()),
        ("engine.worker", worker_parser()),
    ]
    for name, parser in parsers:
        assert _undocumented(parser, name) == []
        description = parser.description or ""
        assert description.endswith("."), f"{name}: {description!r} is cut"
