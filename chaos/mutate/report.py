"""The results: `mutation.json` (machines), `mutation.md` (people), and a table on the console.

Per file and function: killed, crashed (the simulator raised: a kill, listed apart),
timeout (a kill, listed apart), survived (each with its diff), equivalent (excluded from
the score, each with its reason). Survivors are grouped by file, function and the kind of
node changed, so whoever adds the scenario or invariant that kills them sees the classes.
"""

from __future__ import annotations

import json
import tomllib
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from chaos.mutate.run import Verdict

KILLS = ("killed", "crashed", "timeout")
#: The table's counts; `unreached`: the survivors on lines no scenario runs (not run).
COLUMNS = ("killed", "crashed", "timeout", "survived", "unreached", "equivalent")
STATUSES = ("killed", "crashed", "timeout", "survived", "not_imported", "equivalent")


class EquivalentError(Exception):
    """The equivalent list cannot be read: one line, exit 2."""


def load_equivalent(path: Path) -> dict[str, str]:
    """id -> why, from a TOML file of `[[mutant]]` tables with `id` and `why` (no file: {})."""
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise EquivalentError(f"{path}: expected TOML: {exc}") from None
    found: dict[str, str] = {}
    for i, entry in enumerate(data.get("mutant", [])):
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            raise EquivalentError(f"{path}: mutant[{i}].id: expected a string")
        why = entry.get("why")
        if not isinstance(why, str) or not why.strip():
            raise EquivalentError(f"{path}: mutant[{i}].why: expected one line of why")
        found[entry["id"]] = why.strip()
    return found


@dataclass
class Summary:
    counts: Counter[str]
    score: float | None  # None: nothing to score

    @property
    def scored(self) -> int:
        return sum(self.counts[s] for s in STATUSES if s != "equivalent")

    @property
    def kills(self) -> int:
        return sum(self.counts[s] for s in KILLS)


def summarize(verdicts: Iterable[Verdict]) -> Summary:
    counts = Counter(v.status for v in verdicts)
    summary = Summary(counts, None)
    if summary.scored:
        summary.score = summary.kills / summary.scored
    return summary


def _rows(verdicts: Sequence[Verdict]) -> list[tuple[str, str, Counter[str]]]:
    by: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for v in verdicts:
        by[(v.mutant.path, v.mutant.function)][v.status] += 1
        if not v.reached:
            by[(v.mutant.path, v.mutant.function)]["unreached"] += 1
    return [(path, fn, c) for (path, fn), c in by.items()]


def _score_text(c: Counter[str]) -> str:
    scored = sum(c[s] for s in STATUSES if s != "equivalent")
    return f"{100 * sum(c[s] for s in KILLS) / scored:.0f} %" if scored else "-"


def table(verdicts: Sequence[Verdict], by_function: bool) -> Table:
    t = Table(title="mutants per " + ("function" if by_function else "file"))
    t.add_column("file")
    if by_function:
        t.add_column("function")
    for name in ("killed", "crashed", "timeout", "survived", "unreached", "equivalent", "score"):
        t.add_column(name, justify="right")
    files: dict[str, Counter[str]] = defaultdict(Counter)
    rows = _rows(verdicts)
    for path, _fn, c in rows:
        files[path].update(c)
    shown = (
        [(p, fn, c) for p, fn, c in rows] if by_function else [(p, "", c) for p, c in files.items()]
    )
    for path, fn, c in shown:
        cells = [str(c[s]) for s in COLUMNS]
        t.add_row(path, *([fn] if by_function else []), *cells, _score_text(c))
    return t


def survivors_by_class(verdicts: Sequence[Verdict], reached: bool) -> Counter[str]:
    """The survivors per kind of node changed, among those the suite reaches or not."""
    return Counter(
        v.mutant.node for v in verdicts if v.status == "survived" and v.reached is reached
    )


def write(
    out: Path,
    verdicts: Sequence[Verdict],
    meta: dict[str, Any],
    stale: Sequence[str],
) -> tuple[Path, Path]:
    """`OUT/mutation.json` and `OUT/mutation.md`."""
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(verdicts)
    data = {
        **meta,
        "score": summary.score,
        "counts": {s: summary.counts[s] for s in STATUSES},
        "stale_equivalent_ids": list(stale),
        "mutants": [
            {
                "id": v.mutant.id,
                "file": v.mutant.path,
                "function": v.mutant.function,
                "line": v.mutant.line,
                "node": v.mutant.node,
                "status": v.status,
                "scenario": v.scenario,
                "seed": v.seed,
                "detail": v.detail,
                "seconds": round(v.seconds, 3),
                "reached": v.reached,
                "diff": v.mutant.diff,
            }
            for v in verdicts
        ],
    }
    json_path = out / "mutation.json"
    json_path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    md_path = out / "mutation.md"
    md_path.write_text(markdown(verdicts, meta, stale), encoding="utf-8")
    return json_path, md_path


def markdown(verdicts: Sequence[Verdict], meta: dict[str, Any], stale: Sequence[str]) -> str:
    summary = summarize(verdicts)
    c = summary.counts
    score = f"{100 * summary.score:.1f} %" if summary.score is not None else "n/a"
    lines = [
        "# Mutation score of the harness",
        "",
        f"**Score: {score}** = (killed {c['killed']} + crashed {c['crashed']} + timeout "
        f"{c['timeout']}) / (mutants {len(verdicts)} - equivalent {c['equivalent']}); "
        f"survived {c['survived']} ({sum(not v.reached for v in verdicts)} on lines no "
        "scenario runs)"
        + (f", not imported {c['not_imported']}" if c["not_imported"] else "")
        + ".",
        "",
        f"Command: `{meta.get('command', '')}`; {meta.get('scenarios_count', '?')} scenarios, "
        f"explore {meta.get('explore', 0)} seed(s) each, {meta.get('jobs', '?')} jobs, "
        f"timeout {meta.get('timeout_s', 0):.0f} s a mutant, "
        f"{meta.get('seconds', 0):.0f} s in all.",
        "",
        "| file | killed | crashed | timeout | survived | of which unreached "
        "| equivalent | score |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    files: dict[str, Counter[str]] = defaultdict(Counter)
    for path, _fn, k in _rows(verdicts):
        files[path].update(k)
    for path, k in files.items():
        cells = " | ".join(str(k[s]) for s in COLUMNS)
        lines.append(f"| {path} | {cells} | {_score_text(k)} |")
    lines += [
        "",
        "| file | function | killed | crashed | timeout | survived | of which unreached "
        "| equivalent | score |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for path, fn, k in _rows(verdicts):
        cells = " | ".join(str(k[s]) for s in COLUMNS)
        lines.append(f"| {path} | {fn} | {cells} | {_score_text(k)} |")
    for reached, title in ((True, "reached by the suite"), (False, "on lines no scenario runs")):
        classes = survivors_by_class(verdicts, reached)
        if classes:
            lines += ["", f"## Survivors {title}, by kind of change", ""]
            lines += [f"- {node}: {n}" for node, n in classes.most_common()]
    unreached = [v for v in verdicts if v.status == "survived" and not v.reached]
    if unreached:
        lines += [
            "",
            f"## Survivors on lines no scenario runs: {len(unreached)}",
            "",
            "Not run: the unmutated suite never executes these lines, so no scenario can "
            "tell the mutant apart. A scenario that reaches them comes first.",
            "",
        ]
        for v in unreached:
            lines.append(f"- `{v.mutant.id}` line {v.mutant.line}: {v.mutant.change}")
    for status, title in (
        ("survived", "Survivors reached by the suite (the harness runs them and misses them)"),
        ("not_imported", "Not imported by any scenario"),
        ("timeout", "Timed out (kills)"),
        ("crashed", "Crashed the simulator (kills)"),
        ("equivalent", "Equivalent (excluded from the score)"),
    ):
        chosen = [v for v in verdicts if v.status == status and v.reached]
        if not chosen:
            continue
        lines += ["", f"## {title}: {len(chosen)}", ""]
        for v in chosen:
            lines.append(f"### `{v.mutant.id}` (line {v.mutant.line}, {v.mutant.node})")
            if v.detail:
                lines += ["", v.detail]
            lines += ["", "```diff", v.mutant.diff.rstrip("\n"), "```", ""]
    if stale:
        lines += ["", "## Equivalent entries that match no mutant (stale)", ""]
        lines += [f"- `{s}`" for s in stale]
    return "\n".join(lines) + "\n"


def print_summary(console: Console, verdicts: Sequence[Verdict], by_function: bool) -> None:
    console.print(table(verdicts, by_function))
    for v in verdicts:
        if v.status in ("survived", "not_imported") and v.reached:
            console.print(f"{v.status}: {v.mutant.id} line {v.mutant.line}", markup=False)
            console.print(f"  {v.mutant.change}", markup=False)
    summary = summarize(verdicts)
    c = summary.counts
    score = f"{100 * summary.score:.1f} %" if summary.score is not None else "n/a"
    console.print(
        f"mutation score {score}: {summary.kills} of {summary.scored} killed "
        f"(killed {c['killed']}, crashed {c['crashed']}, timeout {c['timeout']}), "
        f"survived {c['survived']} ({sum(not v.reached for v in verdicts)} on lines no "
        f"scenario runs), equivalent {c['equivalent']} excluded"
        + (f", not imported {c['not_imported']}" if c["not_imported"] else ""),
        markup=False,
    )
