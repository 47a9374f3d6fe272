"""The simulator's side of the command line: `chaos run --mode sim` and `chaos sim`."""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from chaos.explore import SeedResult, document, explore, shrink, simulate, write_regression
from chaos.scenario import LoadedScenario
from engine.failpoints import FAILPOINTS

EXIT_OK, EXIT_VIOLATION = 0, 1
MAX_HITS = 64  # the most hits of one failpoint --all-failpoints tries


def run_in_sim(
    loaded: list[LoadedScenario], out: Path, args: argparse.Namespace, console: Console
) -> int:
    """`chaos run` in the simulator: same checker, outputs and exit codes as live."""
    from chaos.journal import format_violation, write_junit
    from sim import outputs, run_scenario

    out.mkdir(parents=True, exist_ok=True)
    suites = []
    worst = EXIT_OK
    for sc in loaded:
        started = time.monotonic()
        outcome = run_scenario(sc, seed=args.seed, mutant=args.mutant)
        run_dir = out / sc.spec.name
        outputs(outcome, run_dir)
        result = outcome.result
        suites.append((sc.spec.name, result, outcome.sim_time_s))
        mark = "[green]PASS[/]" if result.ok else "[red]FAIL[/]"
        failed = [k for k, v in result.verdicts.items() if v == "fail"]
        console.print(
            f"{mark} {sc.spec.name} (sim): {len(outcome.attempt_ids)} evaluations, "
            f"{outcome.sim_time_s:.1f} s simulated in {time.monotonic() - started:.2f} s; "
            f"reruns {result.stats.get('reruns', 0)}; history {outcome.history_hash[:16]}"
            + (f"; [red]broken: {', '.join(failed)}[/]" if failed else "")
            + (
                f"; [red]budgets: {'; '.join(result.budget_failures)}[/]"
                if result.budget_failures
                else ""
            )
        )
        for v in result.violations[:10]:
            console.print(format_violation(v), markup=False)
        if not result.ok:
            worst = EXIT_VIOLATION
    write_junit(out / "junit.xml", suites)
    console.print(f"outputs: {out}")
    return worst


def explore_command(loaded: LoadedScenario, args: argparse.Namespace, console: Console) -> int:
    data = document(loaded)
    if args.all_failpoints:
        return _all_failpoints(data, args, console)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    bar = Progress(
        TextColumn(f"{loaded.spec.name}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,
        transient=True,
    )
    failures: list[SeedResult] = []
    started = time.monotonic()
    with bar:
        task = bar.add_task("seeds", total=len(seeds), info="")

        def seen(r: SeedResult) -> None:
            if not r.ok:
                failures.append(r)
            bar.update(task, advance=1, info=f"{len(failures)} failing")

        exploration = explore(data, seeds, args.jobs, args.mutant, seen)
    took = time.monotonic() - started
    n = len(exploration.results)
    console.print(
        f"{loaded.spec.name}: {n} seeds in {took:.1f} s ({n / took:.0f} seeds/s), "
        f"{len(failures)} failing" + (f" with mutant {args.mutant}" if args.mutant else "")
    )
    for r in sorted(failures, key=lambda r: r.seed):
        console.print(f"  seed {r.seed}: {', '.join(r.failed)}: {r.message}", markup=False)
    if failures and args.shrink:
        first = min(failures, key=lambda r: r.seed)
        _shrink_and_write(data, first, loaded, args, console)
    return EXIT_VIOLATION if failures else EXIT_OK


def _shrink_and_write(
    data: dict[str, Any],
    failure: SeedResult,
    loaded: LoadedScenario,
    args: argparse.Namespace,
    console: Console,
) -> Path:
    from chaos.explore import swarm

    invariant = failure.failed[0]
    variant = swarm(data, failure.seed)
    small = shrink(variant, invariant, args.mutant)
    name = f"{loaded.spec.name}-{invariant}-s{failure.seed}".replace("_", "-")
    if args.mutant:
        name += f"-{args.mutant}".replace("_", "-")
    description = (
        f"Shrunk from seed {failure.seed} of {loaded.spec.name}"
        + (f" with mutant {args.mutant}" if args.mutant else "")
        + f": breaks {invariant}. {failure.message}"
    )
    path = write_regression(small, args.regressions, name, description)
    console.print(
        f"shrunk to {len(small.get('faults', []))} fault(s); replay with: "
        f"python -m chaos run {path}" + (f" --mutant {args.mutant}" if args.mutant else "")
    )
    return path


def _all_failpoints(data: dict[str, Any], args: argparse.Namespace, console: Console) -> int:
    """A crash at every hit of every failpoint of the run, one simulation each."""
    base = copy.deepcopy(data)
    base["faults"] = []
    seed = args.first_seed if args.first_seed else int(base.get("seed", 0))
    base["seed"] = seed
    failures: list[tuple[str, int, SeedResult]] = []
    tried = 0
    started = time.monotonic()
    for name in FAILPOINTS:
        for hit in range(1, MAX_HITS + 1):
            variant = copy.deepcopy(base)
            variant["faults"] = [
                {"failpoint": name, "action": "crash", "hit": hit, "workers": "all"}
            ]
            result = simulate(variant, args.mutant)
            tried += 1
            if not result.crashed:
                break  # this failpoint is hit fewer times than `hit`
            if not result.ok:
                failures.append((name, hit, result))
    console.print(
        f"{tried} crash points tried in {time.monotonic() - started:.1f} s, {len(failures)} failing"
    )
    for name, hit, r in failures:
        console.print(f"  {name} hit {hit}: {', '.join(r.failed)}: {r.message}", markup=False)
    return EXIT_VIOLATION if failures else EXIT_OK
