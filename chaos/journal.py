"""A run's records for people and machines: the merged history, the journal, JUnit XML.

`write_outputs` leaves, in one directory, `history.jsonl` (every event of the run, sorted
by time, then source and sequence) and `journal.json` (verdicts, violations with their
timelines, stats, budget failures and whatever the runner adds: seed, mode, mutant,
duration). `write_junit` turns the verdicts of several scenarios into one JUnit report,
one test case per (scenario, invariant), so CI shows each named anomaly on its own.
Every file is written to a temporary name and moved into place: a reader never sees half
a file, and a crash leaves the previous one.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from chaos.checker import INVARIANTS, CheckResult, Violation, sort_key

#: Fields every event has; the rest is what a timeline line shows.
_ENVELOPE = ("t", "src", "pid", "seq", "ev", "attempt_id")
_FIELD_WIDTH = 48


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
        "ok": result.ok,
        "verdicts": dict(result.verdicts),
        "invariants": {name: INVARIANTS[name] for name in result.verdicts},
        "violations": [v.to_dict() for v in result.violations],
        "stats": dict(result.stats),
        "budget_failures": list(result.budget_failures),
        "extra": dict(extra or {}),
    }
    _atomic_write(out / "journal.json", json.dumps(journal, indent=2, default=str) + "\n")


def junit_cases(scenario_name: str, result: CheckResult, duration_s: float) -> list[ET.Element]:
    """One `<testcase>` per invariant judged (classname = scenario, name = invariant): a
    `<failure>` with the violations and their timelines, `<skipped>` for "unknown"; plus
    a `budgets` case when any budget was set (`stats["budgets"]` lists them)."""
    cases: list[ET.Element] = []
    for name, verdict in result.verdicts.items():
        case = ET.Element("testcase", classname=scenario_name, name=name, time="0")
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
            ET.SubElement(case, "skipped", message="unknown: the history holds no evidence")
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
    if cases:
        cases[0].set("time", f"{max(duration_s, 0.0):.3f}")
    return cases


def write_junit(path: str | Path, suites: Iterable[tuple[str, CheckResult, float]]) -> None:
    """Write one JUnit XML report: a `<testsuite>` per (scenario, result, duration)."""
    root = ET.Element("testsuites", name="chaos")
    total = failures = skipped = 0
    elapsed = 0.0
    for scenario, result, duration in suites:
        cases = junit_cases(scenario, result, duration)
        n_fail = sum(1 for c in cases if c.find("failure") is not None)
        n_skip = sum(1 for c in cases if c.find("skipped") is not None)
        suite = ET.SubElement(
            root,
            "testsuite",
            name=scenario,
            tests=str(len(cases)),
            failures=str(n_fail),
            errors="0",
            skipped=str(n_skip),
            time=f"{max(duration, 0.0):.3f}",
        )
        suite.extend(cases)
        total += len(cases)
        failures += n_fail
        skipped += n_skip
        elapsed += max(duration, 0.0)
    root.set("tests", str(total))
    root.set("failures", str(failures))
    root.set("errors", "0")
    root.set("skipped", str(skipped))
    root.set("time", f"{elapsed:.3f}")
    ET.indent(root)
    text = ET.tostring(root, encoding="unicode", xml_declaration=True)
    _atomic_write(Path(path), text + "\n")


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
