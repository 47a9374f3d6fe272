"""The `mutate` subcommand: its arguments and what it does.

    python -m chaos mutate [--paths P ...] [--function NAME] [--scenarios S ...]
                           [--jobs J] [--timeout S] [--explore N] [--limit N] [--out DIR]

Exit 0 when every scored mutant was killed, 1 when some survived, 2 on bad input (one
line), 1 with one line when the unmutated engine fails its own suite.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

EXIT_OK, EXIT_SURVIVORS, EXIT_INPUT = 0, 1, 2
DEFAULT_SCENARIOS = ("scenarios/*.yaml", "scenarios/regressions/*.yaml", "scenarios/refused/*.yaml")
EQUIVALENT = Path(__file__).with_name("equivalent.toml")


def add_parser(sub: Any, within: Callable[[int, int], Callable[[str], int]]) -> None:
    """Register `mutate` on the CLI's subparsers (`within`: the CLI's bounded-int type)."""
    m = sub.add_parser("mutate", help="mutants of the engine's code against the sim suite")
    m.add_argument(
        "--paths",
        nargs="+",
        metavar="PATH",
        help="files or folders to mutate (default: engine/core engine/policy.py engine/shell "
        "and the store references of sim/redis.py)",
    )
    m.add_argument("--function", help="only this function (`name` or `Class.method`)")
    m.add_argument(
        "--scenarios",
        nargs="+",
        metavar="SCENARIO",
        help="the suite (default: scenarios/*.yaml scenarios/regressions/*.yaml "
        "scenarios/refused/*.yaml; a refused one must be refused with its first line)",
    )
    m.add_argument(
        "--jobs",
        type=within(1, 256),
        default=os.cpu_count() or 1,
        help="mutants at once (default: every core)",
    )
    m.add_argument(
        "--timeout",
        type=_seconds,
        help="seconds a mutant may take (default: 10 x the baseline's, at least 30)",
    )
    m.add_argument(
        "--explore", type=within(0, 10_000), default=0, help="also N swarm seeds per scenario"
    )
    m.add_argument("--limit", type=within(1, 10**9), help="only the first N mutants")
    m.add_argument(
        "--only",
        type=Path,
        metavar="FILE",
        help="only the mutants whose ids FILE lists, one a line (a `mutation.json` too: its "
        "survivors), e.g. to try an earlier run's survivors against a new scenario",
    )
    m.add_argument(
        "--equivalent",
        type=Path,
        default=EQUIVALENT,
        help="the equivalent mutants' list (default chaos/mutate/equivalent.toml)",
    )
    m.add_argument("--out", type=Path, help="output folder (default out/mutate-<time>)")
    m.add_argument("--by-file", action="store_true", help="the console table per file only")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 86_400:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, 86400]; got {text[:40]}")
    return value


def mutate_command(args: argparse.Namespace, console: Console) -> int:
    from chaos.mutate import generate, report, run
    from chaos.scenario import ScenarioError, expected_refusal, load_scenario

    root = Path.cwd()
    try:
        targets = generate.targets(args.paths, root)
    except generate.TargetError as exc:
        print(f"chaos mutate: {exc}", file=sys.stderr)
        return EXIT_INPUT
    patterns = args.scenarios or [p for d in DEFAULT_SCENARIOS for p in sorted(glob.glob(d))]
    scenarios = []
    for path in patterns:
        try:
            if expected_refusal(path) is None:  # a refused one is judged by its refusal
                load_scenario(path)
        except ScenarioError as exc:
            print(str(exc), file=sys.stderr)
            return EXIT_INPUT
        scenarios.append(path)
    if not scenarios:
        print("chaos mutate: --scenarios: no scenario file found", file=sys.stderr)
        return EXIT_INPUT
    try:
        equivalent = report.load_equivalent(args.equivalent)
    except report.EquivalentError as exc:
        print(f"chaos mutate: {exc}", file=sys.stderr)
        return EXIT_INPUT
    started = time.monotonic()
    with console.status("generating mutants...", spinner="dots"):
        mutants = [m for t in targets for m in generate.mutants(t, root, args.function)]
    if args.function is not None and not mutants:
        print(
            f"chaos mutate: --function: {args.function}: no mutant in the targets", file=sys.stderr
        )
        return EXIT_INPUT
    if args.only is not None:
        try:
            wanted = _listed(args.only)
        except (OSError, ValueError) as exc:
            print(f"chaos mutate: --only: {args.only}: {exc}", file=sys.stderr)
            return EXIT_INPUT
        mutants = [m for m in mutants if m.id in wanted]
    if args.limit is not None:
        mutants = mutants[: args.limit]
    ids = {m.id for m in mutants}
    # an entry is stale when its file was mutated whole and no mutant has its id any more
    whole = (
        {t.path for t in targets}
        if args.function is None and args.limit is None and args.only is None
        else set()
    )
    stale = sorted(i for i in equivalent if i not in ids and i.split(":")[0] in whole)
    to_run = [m for m in mutants if m.id not in equivalent]
    console.print(
        f"chaos mutate: {len(mutants)} mutants of {len(targets)} files "
        f"({len(mutants) - len(to_run)} equivalent), {len(scenarios)} scenarios"
        + (f" + {args.explore} seeds each" if args.explore else "")
        + f", {args.jobs} jobs",
        markup=False,
    )
    out = args.out or Path("out") / datetime.now(UTC).strftime("mutate-%Y%m%dT%H%M%SZ")
    modules = sorted({m.module for m in mutants})
    with run.pool(root) as p:
        try:
            base = run.baseline(p, scenarios, args.explore, modules, [t.path for t in targets])
        except run.BaselineError as exc:
            print(str(exc), file=sys.stderr)
            return EXIT_SURVIVORS
        missing = [name for name, where in base.imported.items() if where is None]
        for name in missing:
            console.print(f"warning: no scenario imports {name}: its mutants survive", markup=False)
        timeout = args.timeout or max(run.MIN_TIMEOUT_S, run.TIMEOUT_FACTOR * base.seconds)
        unreached = [
            run.Verdict(m, "survived", detail=_unreached(m), reached=False)
            for m in to_run
            if not base.reached(m)
        ]
        reached = [m for m in to_run if base.reached(m)]
        console.print(
            f"chaos mutate: baseline {base.seconds:.1f} s; {len(unreached)} mutants on lines "
            f"no scenario runs (survivors, not run); {len(reached)} to run, "
            f"timeout {timeout:.0f} s each",
            markup=False,
        )
        out.mkdir(parents=True, exist_ok=True)
        progress = _Progress(console, len(reached), out / "verdicts.jsonl")
        verdicts_run = unreached + run.run_all(
            p,
            reached,
            scenarios,
            args.explore,
            base.skip,
            args.jobs,
            timeout,
            on_verdict=progress.tick,
        )
    by_id = {v.mutant.id: v for v in verdicts_run}
    verdicts = [
        by_id.get(m.id) or run.Verdict(m, "equivalent", detail=equivalent.get(m.id, ""))
        for m in mutants
    ]
    meta = {
        "command": "python -m chaos mutate " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
        "scenarios_count": len(scenarios),
        "scenarios": scenarios,
        "explore": args.explore,
        "skipped_seeds": [list(s) for s in base.skip],
        "jobs": args.jobs,
        "timeout_s": timeout,
        "baseline_s": round(base.seconds, 3),
        "seconds": round(time.monotonic() - started, 1),
        "ran": len(verdicts_run) - len(unreached),  # the others survived unrun
    }
    report.print_summary(console, verdicts, by_function=not args.by_file)
    for s in stale:
        console.print(f"warning: {args.equivalent}: {s} matches no mutant (stale)", markup=False)
    json_path, md_path = report.write(out, verdicts, meta, stale)
    console.print(f"outputs: {json_path}, {md_path} ({meta['seconds']:.0f} s)", markup=False)
    survived = any(v.status in ("survived", "not_imported") for v in verdicts)
    return EXIT_SURVIVORS if survived else EXIT_OK


def _listed(path: Path) -> set[str]:
    """Mutant ids: one a line (blank lines and `#` comments ignored), or the survivors of a
    `mutation.json`."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
        rows = data.get("mutants") if isinstance(data, dict) else None
        if not isinstance(rows, list):
            raise ValueError("expected the `mutants` list of a `chaos mutate` mutation.json")
        return {str(r.get("id")) for r in rows if r.get("status") == "survived"}
    return {ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")}


def _unreached(m: Any) -> str:
    shown = ", ".join(str(n) for n in m.lines)
    return f"not reached: no scenario runs line{'s' if len(m.lines) > 1 else ''} {shown}"


class _Progress:
    """A line on stderr every 10 % of the mutants; each verdict appended to a JSON-lines
    file as it comes, so that a run stopped midway keeps what it measured."""

    def __init__(self, console: Console, total: int, journal: Path) -> None:
        self.console, self.total, self.done, self.started = console, total, 0, time.monotonic()
        self.counts: dict[str, int] = {}
        self.step = max(1, total // 10)
        self.journal = journal

    def tick(self, verdict: Any) -> None:
        with self.journal.open("a", encoding="utf-8") as f:
            m = verdict.mutant
            line = {"id": m.id, "status": verdict.status, "scenario": verdict.scenario}
            line |= {"seed": verdict.seed, "detail": verdict.detail, "seconds": verdict.seconds}
            f.write(json.dumps(line) + "\n")
        self.done += 1
        self.counts[verdict.status] = self.counts.get(verdict.status, 0) + 1
        if self.done % self.step == 0 or self.done == self.total:
            shown = ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
            took = time.monotonic() - self.started
            print(
                f"chaos mutate: {self.done}/{self.total} mutants, {shown}, {took:.0f} s",
                file=sys.stderr,
                flush=True,
            )
