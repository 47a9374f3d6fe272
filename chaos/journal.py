"""A run's records for people and machines: the merged history, the journal, JUnit XML,
the one-line summary and the progress lines of a log.

`write_outputs` leaves, in one directory, `history.jsonl` (every event of the run, sorted
by time, then source and sequence) and `journal.json` (the mode, verdicts, violations with
their timelines, stats, how long each check took, budget failures and whatever the runner
adds: seed, mutant, duration). `write_junit` turns the verdicts of several scenarios into
one JUnit report, one test case per (scenario, invariant), so CI shows each named anomaly
on its own, with the time its own check took. Every file is written to a temporary name
and moved into place: a reader never sees half a file, and a crash leaves the previous
one.

`summary_line` is the line a run prints per scenario: mode, faults fired, reruns and
duplicated tokens by cause, under the names the journal and the report use (the figures
of `reports.cost`, as the checker recorded them). `Ticker` prints a progress line
every few seconds where no progress bar can be drawn (a pipe, a CI log), so a long run is
never silent.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

from rich.text import Text

from chaos.checker import INVARIANTS, CheckResult, Violation, sort_key

#: Fields every event has; the rest is what a timeline line shows.
_ENVELOPE = ("t", "src", "pid", "seq", "ev", "attempt_id")
_FIELD_WIDTH = 48
#: Seconds between two progress lines of a log (`Ticker`); read when a ticker is made.
PROGRESS_EVERY_S = 5.0


def write_outputs(
    out_dir: str | Path,
    scenario_name: str,
    history: Iterable[Mapping[str, Any]],
    result: CheckResult,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write `history.jsonl` and `journal.json` for one scenario run into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    events = sorted(history, key=sort_key)
    lines = "".join(json.dumps(dict(e), default=str) + "\n" for e in events)
    _atomic_write(out / "history.jsonl", lines)
    journal = {
        "scenario": scenario_name,
        "mode": (extra or {}).get("mode"),
        "ok": result.ok,
        "verdicts": dict(result.verdicts),
        "cases": dict(result.cases),
        "invariants": {name: INVARIANTS[name] for name in result.verdicts},
        "violations": [v.to_dict() for v in result.violations],
        "stats": dict(result.stats),
        "check_durations_s": {k: round(v, 6) for k, v in result.durations_s.items()},
        "budget_failures": list(result.budget_failures),
        "exercise_failures": list(result.exercise_failures),
        **({"not_applicable": dict(result.not_applicable)} if result.not_applicable else {}),
        "extra": dict(extra or {}),
    }
    _atomic_write(out / "journal.json", json.dumps(journal, indent=2, default=str) + "\n")


def fresh_run_dir(out: Path, name: str) -> Path:
    """A scenario's folder under `out`: its `name:`, or `name-2`, `name-3`, ... when an earlier
    scenario of the same invocation took it (two files of one name never overwrite)."""
    run_dir, n = out / name, 1
    while run_dir.exists():
        n += 1
        run_dir = out / f"{name}-{n}"
    return run_dir


def suite_name(scenario: str, mode: str, seed: int | None) -> str:
    """A JUnit suite's name: the scenario's `name:` with the mode and seed it ran with, so a
    live and a simulated run of one scenario (or two seeds) are two suites, not one."""
    return f"{scenario} ({mode}, seed {seed})" if seed is not None else f"{scenario} ({mode})"


def junit_cases(
    scenario_name: str, result: CheckResult, duration_s: float = 0.0
) -> list[ET.Element]:
    """One `<testcase>` per invariant judged (classname = scenario, name = invariant), timed
    by its own check (`result.durations_s`): a `<failure>` with the violations and their
    timelines, `<skipped>` for "unknown" and "n/a" (with why); a `budgets` case (time 0: comparing
    numbers) when any budget was set (`stats["budgets"]` lists them); and an `exercised` case timed
    by the scenario's own run (`duration_s`: what a CI tab adds up is then the scenario's time),
    failing when the run judged fewer cases than its `exercised` minimums, which fails the
    run as a violation does."""
    cases: list[ET.Element] = []
    for name, verdict in result.verdicts.items():
        took = _seconds(result.durations_s.get(name, 0.0))
        case = ET.Element("testcase", classname=scenario_name, name=name, time=took)
        found = [v for v in result.violations if v.invariant == name]
        if verdict == "fail":
            failure = ET.SubElement(
                case,
                "failure",
                message=f"{len(found)} violation(s): {found[0].message}" if found else "violated",
                type=name,
            )
            failure.text = "\n\n".join(format_violation(v) for v in found)
        elif verdict == "unknown":
            n = result.cases.get(name, 0)
            why = "no case judged" if n == 0 else f"{n} case(s) on an incomplete history"
            ET.SubElement(case, "skipped", message=f"unknown: {why}")
        elif verdict == "n/a":
            ET.SubElement(case, "skipped", message=f"n/a: {result.not_applicable.get(name)}")
        cases.append(case)
    budgets = result.stats.get("budgets")
    if result.budget_failures or budgets:
        case = ET.Element("testcase", classname=scenario_name, name="budgets", time="0")
        if result.budget_failures:
            failure = ET.SubElement(
                case, "failure", message="; ".join(result.budget_failures), type="budgets"
            )
            failure.text = "\n".join(result.budget_failures)
        cases.append(case)
    case = ET.Element(
        "testcase", classname=scenario_name, name="exercised", time=_seconds(duration_s)
    )
    if result.exercise_failures:
        failure = ET.SubElement(
            case, "failure", message="; ".join(result.exercise_failures), type="exercised"
        )
        failure.text = "\n".join(result.exercise_failures)
    cases.append(case)
    return cases


def _seconds(value: float) -> str:
    """JUnit seconds at microsecond precision: a check often takes under a millisecond."""
    return f"{max(value, 0.0):.6f}"


def write_junit(path: str | Path, suites: Iterable[tuple[str, CheckResult | str, float]]) -> None:
    """Write one JUnit XML report: a `<testsuite>` per (suite name, result, duration). A
    result that is a string is a scenario the harness could not judge (its injector
    failed): one `run` case with that `<error>`. Two suites of one name (one scenario file
    given twice) are kept apart: `#2`, `#3`, ..."""
    root = ET.Element("testsuites", name="chaos")
    total = failures = errors = skipped = 0
    elapsed = 0.0
    seen: dict[str, int] = {}
    for given, result, duration in suites:
        seen[given] = seen.get(given, 0) + 1
        scenario = given if seen[given] == 1 else f"{given} #{seen[given]}"
        if isinstance(result, str):
            case = ET.Element("testcase", classname=scenario, name="run", time=_seconds(duration))
            ET.SubElement(case, "error", message=result, type="harness")
            cases = [case]
        else:
            cases = junit_cases(scenario, result, duration)
        n_fail = sum(1 for c in cases if c.find("failure") is not None)
        n_err = sum(1 for c in cases if c.find("error") is not None)
        n_skip = sum(1 for c in cases if c.find("skipped") is not None)
        suite = ET.SubElement(
            root,
            "testsuite",
            name=scenario,
            tests=str(len(cases)),
            failures=str(n_fail),
            errors=str(n_err),
            skipped=str(n_skip),
            time=f"{max(duration, 0.0):.3f}",
        )
        suite.extend(cases)
        total += len(cases)
        failures += n_fail
        errors += n_err
        skipped += n_skip
        elapsed += max(duration, 0.0)
    root.set("tests", str(total))
    root.set("failures", str(failures))
    root.set("errors", str(errors))
    root.set("skipped", str(skipped))
    root.set("time", f"{elapsed:.3f}")
    ET.indent(root)
    text = ET.tostring(root, encoding="unicode", xml_declaration=True)
    _atomic_write(Path(path), text + "\n")


def append_junit_suite(path: str | Path, name: str, cases: list[tuple[str, str | None]]) -> None:
    """Add one `<testsuite>` to a JUnit file `write_junit` wrote: a case per (name, failure
    message or None), e.g. the figures `chaos run --baseline` bounds by a budget."""
    path = Path(path)
    root = ET.parse(path).getroot()
    suite = ET.SubElement(root, "testsuite", name=name, errors="0", skipped="0", time="0.000")
    failed = 0
    for case_name, failure in cases:
        case = ET.SubElement(suite, "testcase", classname=name, name=case_name, time="0")
        if failure is not None:
            failed += 1
            ET.SubElement(case, "failure", message=failure, type="budgets").text = failure
    suite.set("tests", str(len(cases)))
    suite.set("failures", str(failed))
    root.set("tests", str(int(root.get("tests", "0")) + len(cases)))
    root.set("failures", str(int(root.get("failures", "0")) + failed))
    ET.indent(root)
    text = ET.tostring(root, encoding="unicode", xml_declaration=True)
    _atomic_write(path, text + "\n")


def rerun_split(stats: Mapping[str, Any]) -> str:
    """`reruns 9 (write_window 4, sweeper_resume 5)`: every rerun, then each cause that
    had one, named as in the journal and the report (`reports.cost.CAUSE_TEXT`)."""
    return f"reruns {stats.get('reruns', 0)}" + _by_cause(stats.get("reruns_by_cause"))


def cost_text(stats: Mapping[str, Any]) -> str:
    """`duplicated tokens 4826 (write_window 4826) = 10.3% of the fault-free bill 46765`:
    the checker's figures (`reports.cost.Figures`), as the report shows them; and
    the reference's calls this run never made (`not_run`), when there are any."""
    text = f"duplicated tokens {stats.get('duplicated_tokens', 0)}"
    text += _by_cause(stats.get("duplicated_by_cause"))
    bill = stats.get("reference_tokens")
    if isinstance(bill, int) and bill > 0 and "duplicated_ratio" in stats:
        text += f" = {100 * float(stats['duplicated_ratio']):.1f}% of the fault-free bill {bill}"
    not_run = stats.get("not_run_tokens")
    if isinstance(not_run, int) and not_run > 0:
        text += f", not_run {not_run}"
    return text


def _by_cause(counts: Any) -> str:
    """` (a 4, b 5)`: the causes with a count, in the order given; empty if none."""
    if not isinstance(counts, Mapping):
        return ""
    shown = [f"{cause} {n}" for cause, n in counts.items() if n]
    return f" ({', '.join(shown)})" if shown else ""


def faults_text(stats: Mapping[str, Any]) -> str:
    """`faults kill_worker x6, crash@rule_after_write`: what was done to the run; and
    `(lost writes 16)` when the store counted the acknowledged writes it lost."""
    fired = stats.get("faults_fired")
    if not isinstance(fired, Mapping) or not fired:
        return "faults none"
    text = "faults " + ", ".join(k if n == 1 else f"{k} x{n}" for k, n in fired.items())
    lost = stats.get("lost_writes")
    return text + (f" (lost writes {lost})" if isinstance(lost, int) else "")


def summary_line(
    name: str, mode: str, result: CheckResult, evaluations: int, timing: str, tail: str = ""
) -> Text:
    """The one line a run prints per scenario, in a pipe as on a terminal (the styles are
    dropped where colours are): verdict, scenario, mode, size and time, faults fired,
    reruns and duplicated tokens by cause, the cases judged in all, then `tail` (e.g. the
    sim's history hash) and only what broke or stayed unknown, with its case count.
    `timing` is already worded ("in 4.2 s", "in 12.0 s simulated (0.31 s real)")."""
    stats = result.stats
    failed = [k for k, v in result.verdicts.items() if v == "fail"]
    unknown = [k for k, v in result.verdicts.items() if v == "unknown"]
    line = Text.assemble(
        ("PASS", "green") if result.ok else ("FAIL", "red"),
        f" {name} ({mode}): {evaluations} evaluation{'' if evaluations == 1 else 's'} {timing}; "
        f"{faults_text(stats)}; "
        f"{rerun_split(stats)}; {cost_text(stats)}",
    )
    if result.cases:
        line.append(f"; {sum(result.cases.values())} cases judged")
    if tail:
        line.append(f"; {tail}")
    if failed:
        line.append(f"; broken: {_with_cases(result, failed)}", style="red")
    if unknown:
        line.append(f"; unknown: {_with_cases(result, unknown)}", style="yellow")
    if result.not_applicable:
        shown = ", ".join(f"{n} ({why})" for n, why in result.not_applicable.items())
        line.append(f"; n/a: {shown}", style="dim")
    if result.exercise_failures:
        line.append(f"; exercised: {'; '.join(result.exercise_failures)}", style="red")
    if result.budget_failures:
        line.append(f"; budgets: {'; '.join(result.budget_failures)}", style="red")
    return line


def _with_cases(result: CheckResult, names: list[str]) -> str:
    """`a (3 cases), b (0 cases)`: what each verdict was judged on."""
    return ", ".join(f"{n} ({result.cases.get(n, 0)} cases)" for n in names)


class Ticker:
    """A progress line every `every_s` seconds, for a log where no progress bar can be
    drawn (stdout a pipe or a file): a run of minutes is never silent. The lines go to
    `stream` (stderr by default, so stdout keeps only results); `clock` is injectable so
    tests never wait on wall time."""

    def __init__(
        self,
        enabled: bool = True,
        every_s: float | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.enabled = enabled
        self.every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self.stream = stream
        self.clock = clock
        self.started = self.last = clock()

    def tick(self, line: Callable[[float], str]) -> bool:
        """Print `line(elapsed seconds)` if `every_s` passed since the last one; whether it
        printed. `line` is only called then: formatting costs nothing between lines."""
        if not self.enabled:
            return False
        now = self.clock()
        if now - self.last < self.every_s:
            return False
        self.last = now
        print(line(now - self.started), file=self.stream or sys.stderr, flush=True)
        return True


def format_violation(v: Violation) -> str:
    """A violation for a terminal: its name and message, then its timeline, one event a
    line, time relative to the first event of the timeline."""
    where = v.attempt_id + (f" / {v.rule_id}" if v.rule_id else "")
    lines = [f"{v.invariant}  {where}: {v.message}"]
    if not v.timeline:
        return lines[0]
    t0 = min(_t(e) for e in v.timeline)
    src_w = max(len(str(e.get("src", ""))) for e in v.timeline)
    ev_w = max(len(str(e.get("ev", ""))) for e in v.timeline)
    for e in v.timeline:
        fields = " ".join(
            f"{k}={_short(val)}"
            for k, val in e.items()
            if k not in _ENVELOPE and val is not None and val != "" and k != "verdicts"
        )
        other = e.get("attempt_id")
        if other is not None and other != v.attempt_id:
            fields = f"attempt_id={other} {fields}".rstrip()
        lines.append(
            f"  +{_t(e) - t0:8.3f}s  {e.get('src', '')!s:<{src_w}}  "
            f"{e.get('ev', '')!s:<{ev_w}}  {fields}".rstrip()
        )
    return "\n".join(lines)


def _t(e: Mapping[str, Any]) -> float:
    t = e.get("t")
    return float(t) if isinstance(t, int | float) else 0.0


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= _FIELD_WIDTH else text[: _FIELD_WIDTH - 3] + "..."


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
