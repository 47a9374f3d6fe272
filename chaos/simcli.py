"""The simulator's side of the command line: `chaos run --mode sim` and `chaos sim`.

Off a terminal (a pipe, a CI log) there is no progress bar: a long exploration, shrink or
`--all-failpoints` prints a progress line to stderr every few seconds instead
(`chaos.journal.Ticker`), and stdout keeps whole lines only (see `chaos.cli.make_console`).
"""

from __future__ import annotations

import argparse
import copy
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from chaos.explore import (
    SeedResult,
    document,
    explore,
    map_processes,
    shrink,
    simulate,
    write_regression,
)
from chaos.journal import Ticker, summary_line
from chaos.scenario import LoadedScenario
from engine.failpoints import FAILPOINTS

if TYPE_CHECKING:
    from chaos.cluster import ClusterSession

EXIT_OK, EXIT_VIOLATION, EXIT_INPUT, EXIT_STACK = 0, 1, 2, 3
MAX_HITS = 64  # the most hits of one failpoint --all-failpoints tries


def run_in_sim(
    loaded: list[LoadedScenario], out: Path, args: argparse.Namespace, console: Console
) -> int:
    """`chaos run` in the simulator: same checker, outputs and exit codes as live."""
    from chaos.insim import outputs, run_scenario
    from chaos.journal import format_violation, fresh_run_dir, suite_name, write_junit

    if _refused(loaded):
        return EXIT_INPUT
    out.mkdir(parents=True, exist_ok=True)
    suites = []
    worst = EXIT_OK
    for sc in loaded:
        started = time.monotonic()
        outcome = run_scenario(sc, seed=args.seed, mutant=args.mutant)
        run_dir = fresh_run_dir(out, sc.spec.name)
        outputs(outcome, run_dir)
        result = outcome.result
        suites.append(
            (suite_name(sc.spec.name, "sim", outcome.extra.get("seed")), result, outcome.sim_time_s)
        )
        real = time.monotonic() - started
        timing = f"in {outcome.sim_time_s:.1f} s simulated ({real:.2f} s real)"
        tail = f"history {outcome.history_hash[:16]}"
        n = len(outcome.attempt_ids)
        console.print(summary_line(sc.spec.name, "sim", result, n, timing, tail))
        if not result.ok:
            console.print(f"  evidence: {run_dir / 'journal.json'}", markup=False)
        for v in result.violations[:10]:
            console.print(format_violation(v), markup=False)
        if not result.ok:
            worst = EXIT_VIOLATION
    write_junit(out / "junit.xml", suites)
    console.print(f"outputs: {out}", markup=False)
    return worst


def seeds_progress_line(name: str, done: int, total: int, failing: int, took: float) -> str:
    """The log's progress line of `chaos sim` (no bar off a terminal)."""
    return f"chaos sim {name}: {done}/{total} seeds, {failing} failing, {took:.1f} s"


def _refused(loaded: list[LoadedScenario]) -> bool:
    """Say in one line why the simulator cannot run a scenario on its system
    (`chaos.systems.refusal`)."""
    from chaos.systems import refusal

    for sc in loaded:
        problem = refusal(sc, sc.spec.system, "sim")
        if problem is not None:
            print(problem, file=sys.stderr)
            return True
    return False


def explore_all(loaded: list[LoadedScenario], args: argparse.Namespace, console: Console) -> int:
    """`chaos sim A.yaml B.yaml ...`: each scenario explored in turn, the worst exit code.
    With several scenarios, `--report DIR` writes each one's report to DIR/<name>. With
    `--cluster`, one session (and its version check) serves them all; a cluster that
    cannot serve says so in one line, exit 3."""
    address = getattr(args, "cluster", None)
    if address is None:
        return _explore_each(loaded, args, console, None)
    from chaos.cluster import ClusterError, connect, parse_address

    try:
        parse_address(address)
    except ValueError as exc:
        print(f"chaos sim: --cluster: {exc}", file=sys.stderr)
        return EXIT_INPUT
    try:
        with connect(address) as session:
            return _explore_each(loaded, args, console, session)
    except ClusterError as exc:
        print(f"chaos sim: {exc}", file=sys.stderr)
        return EXIT_STACK


def _explore_each(
    loaded: list[LoadedScenario],
    args: argparse.Namespace,
    console: Console,
    session: ClusterSession | None,
) -> int:
    worst = EXIT_OK
    report = getattr(args, "report", None)
    for sc in loaded:
        one = args
        if report is not None and len(loaded) > 1:
            one = argparse.Namespace(**{**vars(args), "report": Path(report) / sc.spec.name})
        worst = max(worst, explore_command(sc, one, console, session))
    return worst


def explore_command(
    loaded: LoadedScenario,
    args: argparse.Namespace,
    console: Console,
    cluster: ClusterSession | None = None,
) -> int:
    """Explore one scenario's seeds (on `cluster` when given), then report and shrink."""
    if _refused([loaded]):
        return EXIT_INPUT
    data = document(loaded)
    if args.all_failpoints:
        return _all_failpoints(data, args, console, cluster)
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
    ticker = Ticker(enabled=not console.is_terminal)
    done = 0
    with bar:
        task = bar.add_task("seeds", total=len(seeds), info="")

        def seen(r: SeedResult) -> None:
            nonlocal done
            done += 1
            if not r.ok:
                failures.append(r)
            bar.update(task, advance=1, info=f"{len(failures)} failing")
            ticker.tick(
                lambda took: seeds_progress_line(
                    loaded.spec.name, done, len(seeds), len(failures), took
                )
            )

        report = getattr(args, "report", None)
        exploration = explore(
            data, seeds, args.jobs, args.mutant, seen, measure=bool(report), cluster=cluster
        )
    took = time.monotonic() - started
    n = len(exploration.results)
    console.print(
        f"{loaded.spec.name} (sim): {n} seeds in {took:.1f} s "
        f"({n / max(took, 1e-9):.0f} seeds/s), {len(failures)} failing"
        + (f" with mutant {args.mutant}" if args.mutant else "")
        + _unknown_text(exploration.results),
        markup=False,
    )
    for r in sorted(failures, key=lambda r: r.seed):
        console.print(f"  seed {r.seed}: {', '.join(r.failed)}: {r.message}", markup=False)
    if report:
        from chaos.explore import swarm
        from reports.sweep import build_sweep_report, faults_of

        measures = [
            {
                **r.measures,
                "seed": r.seed,
                "failed": list(r.failed),
                "message": r.message,
                "faults": faults_of(swarm(data, r.seed)),
            }
            for r in exploration.results
            if r.measures is not None
        ]
        # the seed is a swarm variant: exploring that one seed again replays it exactly
        replay = (
            f"python -m chaos sim {shlex.quote(loaded.source)} --seeds 1 --first-seed {{seed}}"
            + (f" --mutant {shlex.quote(args.mutant)}" if args.mutant else "")
        )
        target = build_sweep_report(loaded.spec.name, measures, Path(report), replay)
        console.print(f"report: {target / 'report.html'} ({len(measures)} seeds)", markup=False)
    if failures and args.shrink:
        first = min(failures, key=lambda r: r.seed)
        _shrink_and_write(data, first, loaded, args, console, cluster)
    return EXIT_VIOLATION if failures else EXIT_OK


def _unknown_text(results: list[SeedResult]) -> str:
    """`, 3 seeds with unknown verdicts (retry_delays_respected x3)`: a verdict that judged
    nothing proved nothing, so the summary says so (nothing when every verdict judged)."""
    counts: dict[str, int] = {}
    for r in results:
        for name in r.unknown:
            counts[name] = counts.get(name, 0) + 1
    if not counts:
        return ""
    seeds = sum(1 for r in results if r.unknown)
    shown = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
    return f", {seeds} seed{'' if seeds == 1 else 's'} with unknown verdicts ({shown})"


def _shrink_and_write(
    data: dict[str, Any],
    failure: SeedResult,
    loaded: LoadedScenario,
    args: argparse.Namespace,
    console: Console,
    cluster: ClusterSession | None = None,
) -> Path:
    """Shrink the failing seed's variant and write it as a regression scenario. On a
    cluster each round's candidates run there, as many at once as it has threads
    (`explore.shrink`'s `run_many`): the same scenario as one by one here, in fewer
    rounds of waiting, some candidates run for nothing (said in the last line)."""
    from chaos.explore import ShrinkStats, swarm

    invariant = failure.failed[0]
    variant = swarm(data, failure.seed)
    ticker = Ticker(enabled=not console.is_terminal)
    stats = ShrinkStats()
    ran = 0

    def tick(count: int) -> None:
        nonlocal ran
        ran += count
        ticker.tick(
            lambda took: (
                f"chaos sim {loaded.spec.name} --shrink: seed {failure.seed}, "
                f"{ran} simulations, {took:.1f} s"
            )
        )

    def counted(candidate: dict[str, Any], mutant: str | None) -> SeedResult:
        result = simulate(candidate, mutant)
        tick(1)
        return result

    with console.status(f"shrinking seed {failure.seed}...", spinner="dots"):
        if cluster is None:
            small = shrink(variant, invariant, args.mutant, run=counted, stats=stats)
        else:
            from chaos.cluster import simulate_on

            def on_cluster(documents: list[dict[str, Any]], mutant: str | None) -> list[SeedResult]:
                results = simulate_on(cluster, documents, mutant)
                tick(len(documents))
                return results

            small = shrink(
                variant,
                invariant,
                args.mutant,
                run_many=on_cluster,
                width=cluster.threads,
                stats=stats,
            )
    name = f"{loaded.spec.name}-{invariant}-s{failure.seed}".replace("_", "-")
    if args.mutant:
        name += f"-{args.mutant}".replace("_", "-")
    description = (
        f"Shrunk from seed {failure.seed} of {loaded.spec.name}"
        + (f" with mutant {args.mutant}" if args.mutant else "")
        + f": breaks {invariant}. {failure.message}"
    )
    path = write_regression(small, args.regressions, name, description)
    where = ""
    if cluster is not None:
        spared = stats.run - stats.decisive
        where = f" on the cluster ({stats.run} run, {spared} of them past the candidate kept)"
    console.print(
        f"shrunk to {len(small.get('faults', []))} fault(s) in {stats.decisive} simulations"
        f"{where}; replay with: python -m chaos run {shlex.quote(str(path))} --mode sim"
        + (f" --mutant {shlex.quote(args.mutant)}" if args.mutant else ""),
        markup=False,
    )
    return path


def crash_variant(data: dict[str, Any], seed: int, failpoint: str, hit: int) -> dict[str, Any]:
    """The scenario `data` with its faults replaced by one crash of every worker at `hit`
    of `failpoint`. Its minimum counts (set for its own run) no longer describe that run: a
    crash may leave an invariant fewer cases (a delayed retry the sweeper re-publishes is
    not judged as one), so each invariant it lists must judge at least one case."""
    variant = copy.deepcopy(data)
    variant["seed"] = seed
    variant["faults"] = [{"failpoint": failpoint, "action": "crash", "hit": hit, "workers": "all"}]
    exercised = variant.get("exercised")
    if isinstance(exercised, dict):
        variant["exercised"] = dict.fromkeys(exercised, 1)
    return variant


def _crashes(work: tuple[dict[str, Any], str, int, str | None]) -> list[tuple[int, SeedResult]]:
    """`failpoint_crashes` of one failpoint, in a process of the pool."""
    return failpoint_crashes(*work)


def failpoint_crashes(
    data: dict[str, Any],
    failpoint: str,
    seed: int,
    mutant: str | None,
    on_result: Callable[[SeedResult], None] | None = None,
) -> list[tuple[int, SeedResult]]:
    """A crash of every worker at hit 1, 2, ... of `failpoint` (`crash_variant`), one
    simulation each, each next hit tried only while the last one fired (the run reaches
    that failpoint fewer times than a hit that did not fire), at most `MAX_HITS`: every
    hit tried and its result, the last one's that did not fire too. A sequence decided hit
    by hit, but independent of any other failpoint's: `--cluster` runs one failpoint's
    sequence a task (`chaos.cluster.map_on`), on a worker, the same as here."""
    tried: list[tuple[int, SeedResult]] = []
    for hit in range(1, MAX_HITS + 1):
        result = simulate(crash_variant(data, seed, failpoint, hit), mutant)
        tried.append((hit, result))
        if on_result:
            on_result(result)
        if not result.crashed:
            break  # this failpoint is hit fewer times than `hit`
    return tried


def _all_failpoints(
    data: dict[str, Any],
    args: argparse.Namespace,
    console: Console,
    cluster: ClusterSession | None = None,
) -> int:
    """A crash at every hit of every failpoint of the run, one simulation each; on
    `cluster`, the failpoints' sequences run there (the same results, in the same order)."""
    seed = args.first_seed if args.first_seed else int(data.get("seed", 0))
    failures: list[tuple[str, int, SeedResult]] = []
    tried = 0
    started = time.monotonic()
    ticker = Ticker(enabled=not console.is_terminal)
    label = data.get("name", "scenario")
    now = ""

    def tick(count: int) -> None:
        nonlocal tried
        tried += count
        ticker.tick(
            lambda took: (
                f"chaos sim {label} --all-failpoints: {tried} crash "
                f"points so far (now {now}), {len(failures)} failing, {took:.1f} s"
            )
        )

    def failed(name: str, hits: list[tuple[int, SeedResult]]) -> None:
        failures.extend((name, hit, r) for hit, r in hits if r.crashed and not r.ok)

    names = list(FAILPOINTS)
    if cluster is None:
        work = ((data, name, seed, args.mutant) for name in names)
        jobs = getattr(args, "jobs", None) or 0
        for name, hits in zip(names, map_processes(_crashes, work, jobs), strict=True):
            now = name
            failed(name, hits)
            tick(len(hits))
    else:
        from chaos.cluster import map_on

        def seen(batch: list[Any], sequences: list[Any]) -> None:
            nonlocal now
            now = batch[-1]
            for name, hits in zip(batch, sequences, strict=True):
                failed(name, hits)  # counted now, listed below in the failpoints' order
            tick(sum(len(hits) for hits in sequences))

        sequences = map_on(
            cluster, failpoint_crashes, data, names, seed, args.mutant, on_batch=seen
        )
        failures.clear()
        for name, hits in zip(names, sequences, strict=True):
            failed(name, hits)
    console.print(
        f"{label} (sim): {tried} crash points tried in {time.monotonic() - started:.1f} s, "
        f"{len(failures)} failing",
        markup=False,
    )
    for name, hit, r in failures:
        console.print(f"  {name} hit {hit}: {', '.join(r.failed)}: {r.message}", markup=False)
    return EXIT_VIOLATION if failures else EXIT_OK
