"""`python -m chaos`: run, explore, validate and list scenarios.

    python -m chaos run scenarios/crash_after_ack.yaml [--mode auto|live|containers|sim]
                        [--seed N]
                        [--out DIR] [--mutant NAME]
    python -m chaos sim scenarios/crash_after_ack.yaml --seeds 1000 [--jobs J] [--shrink]
                        [--cluster tcp://HOST:PORT | local:W]
    python -m chaos validate scenarios/*.yaml
    python -m chaos list
    python -m chaos clean     # stop and delete what a SIGKILLed run left behind
    python -m chaos images build   # Redis and RabbitMQ images from this machine's own
    python -m chaos docs [--check]  # docs/reference/, written from the code
    python -m chaos coverage [SCENARIO...] [--seeds 50] [--json FILE]  # branches reached
    python -m chaos mutate [--paths P ...] [--jobs J]   # mutants of the engine vs the suite
    python -m chaos compile [--status]  # the checker compiled for explorations (mypyc)

Exit codes: 0 every invariant holds, 1 a violation or a budget exceeded, 2 invalid input,
3 the stack could not be started (containers mode: no Docker engine answers), 4 the harness
failed in a scenario (one `ERROR` line; the other scenarios still run), 130 / 143
interrupted by SIGINT / SIGTERM (at any moment: everything the command started is stopped
first; one line on stderr). `clean` exits 0, or 1 when a process would not die. A live run
starts with the same reaping as `clean`: only what belongs to a dead runner is touched,
never a live one's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table

from chaos import stack  # stdlib only: the signal handler must not import anything
from engine.config import OneLineParser
from engine.policy import MAX_SEED

EXIT_OK, EXIT_VIOLATION, EXIT_INPUT, EXIT_STACK = 0, 1, 2, 3
EXIT_HARNESS = 4  # a fault injector of the harness failed in a scenario: no verdict
NO_WRAP_WIDTH = 100_000  # the console width off a terminal: wider than any line printed


#: The most seeds one `chaos sim` explores: a million runs is hours, not a typo's billions.
MAX_SEEDS = 1_000_000
#: The seeds `chaos sim` explores when `--seeds` is not given.
DEFAULT_SEEDS = 100


def _sim_contradiction(args: argparse.Namespace) -> str | None:
    """What of `chaos sim`'s options contradict each other, in one line naming the flags
    and what was expected (None when nothing does): a flag silently ignored would run
    something else than what its user asked for."""
    if args.cluster is not None and args.jobs is not None:
        return (
            f"--jobs {args.jobs} and --cluster exclude each other: expected "
            "--jobs J (processes on this machine) or --cluster ADDRESS (the cluster's "
            "workers), not both"
        )
    if args.all_failpoints:
        ignored = [
            flag
            for flag, given in (
                ("--seeds", args.seeds is not None),
                ("--shrink", args.shrink),
                ("--report", args.report is not None),
            )
            if given
        ]
        if ignored:
            return (
                f"--all-failpoints with {', '.join(ignored)}: expected --all-failpoints alone "
                "(one run's crash points, its seed --first-seed or the scenario's: no seeds "
                "explored, nothing shrunk, no report) or seeds without --all-failpoints"
            )
    return None


def _within(least: int, most: int) -> Callable[[str], int]:
    """An argparse type: a whole number in [least, most], or argparse's one-line error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number; got {text[:40]!r}"
            ) from None
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(
                f"expected a whole number within [{least}, {most}]; got {text[:40]}"
            )
        return value

    return parse


def _system_option(parser: argparse.ArgumentParser) -> None:
    from chaos.systems import SYSTEMS

    parser.add_argument(
        "--system",
        choices=sorted(SYSTEMS),
        help="the durable design under test, instead of each scenario's system: "
        "(python -m chaos list)",
    )


def _with_system(loaded: list[Any], args: argparse.Namespace) -> tuple[list[Any], bool]:
    """The scenarios on `--system` when given, and whether each can run on its system in
    the mode asked (a refusal said in one line: file, field, system)."""
    from chaos.systems import on_system, refusal

    loaded = [on_system(sc, getattr(args, "system", None)) for sc in loaded]
    mode = "sim" if args.command == "sim" or getattr(args, "mode", "") == "sim" else "live"
    mutant = getattr(args, "mutant", None)
    for sc in loaded:
        problem = refusal(sc, sc.spec.system, mode)
        if problem is None and mutant is not None:
            from chaos.mutants import refusal as mutant_refusal

            problem = mutant_refusal(mutant, sc.spec.system)
            problem = problem and f"{sc.path}: {problem}"
        if problem is not None:
            print(problem, file=sys.stderr)
            return loaded, False
    return loaded, True


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m chaos", description=OneLineParser.summary(__doc__))
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    run = sub.add_parser("run", help="run scenarios and check their invariants")
    run.add_argument("scenarios", nargs="+", metavar="SCENARIO", help="scenario files (YAML)")
    run.add_argument(
        "--mode",
        choices=["auto", "live", "containers", "sim"],
        default="auto",
        help="auto: live when redis-server and RabbitMQ are here, else the simulator; "
        "containers: live, Redis and RabbitMQ in containers (a Docker engine)",
    )
    run.add_argument("--seed", type=_within(0, MAX_SEED), help="override every scenario's seed")
    _system_option(run)
    run.add_argument("--out", type=Path, help="output folder (default out/<time>)")
    run.add_argument("--mutant", help="run the workers with this deliberately broken behaviour")
    run.add_argument("--quiet", action="store_true", help="no progress display")
    run.add_argument(
        "--report", action="store_true", help="also write what the faults cost (OUT/report)"
    )
    run.add_argument("--price-per-1k", type=_price, help="USD per 1,000 tokens in the report")
    _baseline_options(run)
    sim = sub.add_parser("sim", help="explore many seeds in the simulator, shrink failures")
    sim.add_argument(
        "scenarios", nargs="+", metavar="SCENARIO", help="scenario files (YAML), each explored"
    )
    sim.add_argument(  # default None: --all-failpoints must tell a --seeds given (DEFAULT_SEEDS)
        "--seeds", type=_within(1, MAX_SEEDS), help=f"how many seeds (default {DEFAULT_SEEDS})"
    )
    sim.add_argument(
        "--first-seed",
        type=_within(0, MAX_SEED),
        default=0,
        help="explore seeds from this one on (default 0)",
    )
    # default None, not 0: a --jobs 0 given must be told from none (`_sim_contradiction`;
    # argparse's exclusive groups take a value equal to the default for no value)
    sim.add_argument("--jobs", type=_within(0, 256), help="processes (default 0: every core)")
    sim.add_argument(
        "--cluster",
        metavar="ADDRESS",
        help="explore on a Dask cluster: tcp://HOST:PORT of a scheduler, or local:W for W "
        "worker processes on this machine (docs/cluster.md)",
    )
    sim.add_argument("--mutant", help="explore a deliberately broken engine")
    _system_option(sim)
    sim.add_argument("--shrink", action="store_true", help="shrink the first failure found")
    sim.add_argument(
        "--report",
        type=Path,
        metavar="DIR",
        help="what the faults cost over the seeds: report.html, summary.md, metrics.json "
        "(DIR/<name> for each of several scenarios)",
    )
    sim.add_argument(
        "--out",
        type=Path,
        help="output folder: --shrink writes OUT/regressions/ there (default out/sim-<time>)",
    )
    sim.add_argument(
        "--all-failpoints",
        action="store_true",
        help="instead of seeds: a crash at each failpoint hit of one run",
    )
    sim.add_argument(
        "--regressions",
        type=Path,
        metavar="DIR",
        help="where --shrink writes the failing case instead of OUT/regressions (e.g. "
        "scenarios/regressions, to keep it in the gate)",
    )
    rep = sub.add_parser("report", help="what the faults of finished runs cost, plotted")
    rep.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's folder, or --out's")
    rep.add_argument("--out", type=Path, help="report folder (default: RUN_DIR/report)")
    rep.add_argument("--price-per-1k", type=_price, help="USD per 1,000 tokens (default 0.01)")
    _baseline_options(rep)
    cmp = sub.add_parser(
        "compare",
        help="both memories vs RabbitMQ only vs the source documents as written, side by side",
    )
    cmp.add_argument("scenarios", nargs="+", metavar="SCENARIO", help="scenario files (YAML)")
    cmp.add_argument(
        "--mode",
        choices=["auto", "live", "containers", "sim"],
        default="auto",
        help="as run's --mode (sim: --seeds runs of each scenario per design)",
    )
    cmp.add_argument(
        "--seeds", type=_within(1, MAX_SEEDS), default=20, help="sim: seeds per design (20)"
    )
    cmp.add_argument("--out", type=Path, help="output folder (default out/compare-<time>)")
    _system_option(cmp)
    cmp.add_argument(
        "--designs",
        choices=["memories", "sentinel", "standby", "durable"],
        default="memories",
        help="memories: both memories, RabbitMQ only, the source documents as written (default); "
        "sentinel: the answers to lost writes behind Sentinel, alone, together and none; "
        "standby: PostgreSQL alone failing over to a synchronous or an asynchronous standby; "
        "durable: each durable design this machine can run (python -m chaos list)",
    )
    val = sub.add_parser("validate", help="check scenario files without running them")
    val.add_argument("scenarios", nargs="+", metavar="SCENARIO", help="scenario files (YAML)")
    lst = sub.add_parser("list", help="scenarios, invariants, failpoints and mutants")
    lst.add_argument(
        "--long", action="store_true", help="whole descriptions (default: one line each)"
    )
    sub.add_parser("clean", help="stop and delete what killed runs left (their runner is dead)")
    comp = sub.add_parser(
        "compile", help="compile the checker for explorations' processes (mypyc; cached)"
    )
    comp.add_argument(
        "--status", action="store_true", help="say whether a build of this source exists"
    )
    img = sub.add_parser("images", help="containers mode's images, built from this machine's")
    img.add_argument(
        "action", choices=["build"], help="build: the chaos-redis and chaos-rabbitmq images"
    )
    docs = sub.add_parser(
        "docs", help="write docs/reference/ from the code: scenarios, fields, invariants, ..."
    )
    docs.add_argument("--check", action="store_true", help="exit 1 if a page is out of date")
    prx = sub.add_parser("proxy", help="a seeded Toxiproxy-compatible server, until interrupted")
    prx.add_argument("--host", default="127.0.0.1", help="API address (default 127.0.0.1)")
    prx.add_argument("--port", type=_within(0, 65535), default=8474, help="API port (8474)")
    prx.add_argument("--seed", type=_within(0, MAX_SEED), default=0, help="draws' seed (0)")
    cov = sub.add_parser("coverage", help="the protocol's branches the scenarios reach (sim)")
    cov.add_argument("scenarios", nargs="*", metavar="SCENARIO", help="default: the suite")
    cov.add_argument(
        "--seeds", type=_within(0, MAX_SEEDS), default=50, help="explored a scenario (50)"
    )
    cov.add_argument(
        "--first-seed", type=_within(0, MAX_SEED), default=0, help="explore from this seed (0)"
    )
    cov.add_argument("--jobs", type=_within(0, 256), default=0, help="processes (every core)")
    cov.add_argument(
        "--json", type=Path, default=Path("out/coverage.json"), help="(out/coverage.json)"
    )
    cov.add_argument(
        "--strict", action="store_true", help="exit 1 on a branch unreached and not documented"
    )
    from chaos.mutate.command import add_parser as add_mutate

    add_mutate(sub, _within)
    return p


def main(argv: list[str] | None = None, *, exiting: bool = False) -> int:
    """Run one command. SIGINT or SIGTERM at any moment, even during start-up or clean-up,
    stops everything it started and returns 130 or 143 with one line on stderr.

    `exiting`: the process ends right after (`python -m chaos`): the signals are then
    ignored instead of handed back, since everything is stopped and the interpreter resets
    its handlers to the defaults while it exits (a late Ctrl-C would kill it mid-exit).
    """
    previous = _catch_signals()  # first: before anything is started
    name = _Guard.name = _command_name(argv)
    try:
        try:
            code = _main(argv)
        finally:
            _Guard.armed = False  # from here on a signal is only noted
    except BaseException as exc:
        if _Guard.signum is None and not isinstance(exc, KeyboardInterrupt):
            raise
        code = _interrupted(name)
    else:
        if _Guard.signum is not None:  # it came as the command was returning
            code = _interrupted(name)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if exiting else handler)
        if _Guard.watchdog is not None:  # unwound in time
            _Guard.watchdog.cancel()
    return code


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "sim":
        problem = _sim_contradiction(args)
        if problem is not None:  # before anything is read, started or written
            print(f"chaos sim: {problem}", file=sys.stderr)
            return EXIT_INPUT
        args.seeds = DEFAULT_SEEDS if args.seeds is None else args.seeds
        args.jobs = 0 if args.jobs is None else args.jobs
    console = make_console()
    if args.command == "clean":
        return _clean(console)
    if args.command == "compile":
        return _compile(console, args.status)
    if args.command == "images":
        return _images(console)
    if args.command == "list":
        return _list(console, args.long)
    if args.command == "report":
        return _report(args.runs, args.out, args.price_per_1k, console, args)
    if args.command == "docs":
        return _docs(args.check, console)
    if args.command == "proxy":
        from chaos.proxy.server import serve

        return serve(args.host, args.port, args.seed)
    if args.command == "coverage":
        from chaos.coverage import coverage_command

        return coverage_command(args)
    if args.command == "mutate":
        from chaos.mutate.command import mutate_command

        return mutate_command(args, console)
    loaded, errors = _load_all(args.scenarios)
    for line in errors:  # every bad file, before anything runs
        print(line, file=sys.stderr)
    if args.command == "validate":
        for sc in loaded:
            console.print(f"{sc.path}: ok ({sc.spec.name})", markup=False)
        return EXIT_INPUT if errors else EXIT_OK
    if errors:
        return EXIT_INPUT
    loaded, runnable = _with_system(loaded, args)
    if not runnable:
        return EXIT_INPUT
    if args.command == "sim":
        if args.mutant is not None and _bad_mutant(args.mutant):
            return EXIT_INPUT
        from chaos.simcli import explore_all

        if args.regressions is None:
            now = datetime.now(UTC).strftime("sim-%Y%m%dT%H%M%SZ")
            args.regressions = (args.out or Path("out") / now) / "regressions"
        return explore_all(loaded, args, console)
    if args.command == "compare":
        out = args.out or Path("out") / datetime.now(UTC).strftime("compare-%Y%m%dT%H%M%SZ")
        return _compare(loaded, out, args, console)
    if args.mutant is not None and _bad_mutant(args.mutant):
        return EXIT_INPUT
    if args.baseline is not None and (bad := _bad_baseline(args.baseline, loaded)):
        print(f"chaos run: {bad}", file=sys.stderr)
        return EXIT_INPUT
    out = args.out or Path("out") / datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    code = _run(loaded, out, args, console)
    against = None
    if args.baseline is not None and code in (EXIT_OK, EXIT_VIOLATION):
        try:
            against = _against([out], args)
        except ValueError as exc:  # ReportError: e.g. no scenario in common, by mode
            print(f"chaos run: {exc}", file=sys.stderr)
            return EXIT_INPUT
        code = max(code, _regressions(against, loaded, console, out / "junit.xml"))
    if code in (EXIT_OK, EXIT_VIOLATION, EXIT_HARNESS):
        _summary_md(out, args.price_per_1k, against)
    if args.report and code in (EXIT_OK, EXIT_VIOLATION):
        reported = _report([out], out / "report", args.price_per_1k, console, args, against)
        code = max(code, reported)
    return code


def _summary_md(out: Path, price: float | None, against: dict[str, Any] | None = None) -> None:
    """OUT/summary.md, verdicts first, then cost: a CI job's summary without `--report`."""
    from reports import ReportError, find_runs
    from reports.build import write_summary

    try:
        runs = find_runs([out])
    except ReportError:  # no scenario ran to a verdict: nothing to sum up
        return
    write_summary(runs, out / "summary.md", price, against)


def _baseline_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="an earlier run's folder: set each scenario's cost, recovery and retry latency "
        "beside it (matched by scenario name and mode) and flag what got worse",
    )
    parser.add_argument(
        "--tolerance",
        type=_ratio,
        default=0.10,
        help="with --baseline: how much a figure may grow over the baseline's before it is "
        "flagged, as a ratio of it (default 0.1: 10 %%)",
    )


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and value < 1e6):
        raise argparse.ArgumentTypeError(f"expected a ratio >= 0 (0.1: 10 %); got {text[:40]}")
    return value


def _bad_baseline(path: Path, loaded: list[Any]) -> str | None:
    """Why `--baseline` cannot be compared with these scenarios (None: it can), before
    anything runs: no run in it, or none of these scenarios' names."""
    from reports import ReportError, find_runs

    try:
        base = find_runs([path])
    except ReportError as exc:
        return f"--baseline {exc}"
    names = {sc.spec.name for sc in loaded}
    if not names & {r.scenario for r in base}:
        found = ", ".join(sorted({r.scenario for r in base}))
        return f"--baseline {path}: no scenario in common (it holds {found})"
    return None


def _against(paths: list[Path], args: argparse.Namespace) -> dict[str, Any]:
    """The runs under `paths` against `--baseline` (`reports.baseline.against`)."""
    from reports import ReportError, find_runs
    from reports.baseline import against

    try:
        base = find_runs([args.baseline])
    except ReportError as exc:
        raise ReportError(f"--baseline {exc}") from None
    return against(find_runs(list(paths)), base, args.tolerance, args.price_per_1k)


def _said(against: dict[str, Any], console: Console) -> None:
    from reports.baseline import sentence

    console.print(f"baseline: {sentence(against['rows'], against['tolerance'])}", markup=False)


def _regressions(
    against: dict[str, Any], loaded: list[Any], console: Console, junit: Path | None = None
) -> int:
    """Print what got worse; exit 1 when a figure grew beyond `max_regression_ratio`, which
    the JUnit file says too (a `baseline` suite: a failing case each, or one passing)."""
    from chaos.journal import append_junit_suite
    from reports.baseline import over_budget

    _said(against, console)
    limits = {sc.spec.name: sc.spec.budgets.max_regression_ratio for sc in loaded}
    failures = over_budget(against["rows"], limits)
    for line in failures:
        console.print(f"FAIL baseline: {line}", markup=False)
    if junit is not None and junit.is_file() and any(v is not None for v in limits.values()):
        cases = [(line.split(":", 1)[0], line) for line in failures]
        append_junit_suite(junit, "baseline", cases or [("max_regression_ratio", None)])
    return EXIT_VIOLATION if failures else EXIT_OK


def _compare(loaded: list[Any], out: Path, args: argparse.Namespace, console: Console) -> int:
    """`chaos compare`: each design's runs under OUT/<its key>, then the table. Exit 1 when
    the engine as shipped broke an invariant (the other designs are meant to)."""
    from chaos.explore import document, load_document
    from chaos.systems import on_system
    from chaos.systems.redis_rabbitmq.services import Services
    from reports import find_runs
    from reports.compare import DESIGNS, compare, table_md, write_comparison

    if out.exists() and any(out.iterdir()):
        print(f"--out: {out} exists and is not empty; expected a new folder", file=sys.stderr)
        return EXIT_INPUT
    designs = DESIGNS[args.designs]
    if args.designs == "sentinel":
        single = [sc.path for sc in loaded if sc.spec.redis.topology != "sentinel"]
        if single:
            print(
                f"{single[0]}: redis.topology: expected sentinel (--designs sentinel)",
                file=sys.stderr,
            )
            return EXIT_INPUT
    live = args.mode in ("live", "containers") or (
        args.mode == "auto" and Services.available() is None
    )
    if args.designs == "durable":
        designs = _runnable(designs, loaded, "live" if live else "sim", console)
        if not designs:
            return EXIT_INPUT
    runs = {}
    for design in designs:
        folder = out / design.key
        variants = [on_system(sc, design.system) for sc in loaded]
        if design.redis or design.postgres:  # the scenario itself changed: its servers'
            variants = []
            for sc in [on_system(s, design.system) for s in loaded]:
                data = document(sc)
                for section, settings in (("redis", design.redis), ("postgres", design.postgres)):
                    if settings:
                        data[section] = {**data.get(section, {}), **dict(settings)}
                variants.append(load_document(data, source=str(sc.path)))
        if live:
            mode = "containers" if args.mode == "containers" else "live"
            one = argparse.Namespace(mode=mode, seed=None, mutant=design.mutant, quiet=True)
            code = _run(variants, folder, one, console)
            if code not in (EXIT_OK, EXIT_VIOLATION):
                return code
        else:
            from chaos.insim import outputs, run_scenario

            for sc in variants:
                for seed in range(args.seeds):
                    outcome = run_scenario(sc, seed, design.mutant)
                    outputs(outcome, folder / f"{sc.spec.name}-s{seed}")
        runs[design.key] = find_runs([folder])
    rows = compare(runs, designs)
    title = {
        "memories": "The source documents' argument, measured",
        "sentinel": "Lost writes, answered",
        "standby": "A PostgreSQL failover, with and without a synchronous standby",
        "durable": "The durable designs on the same faults",
    }
    names = [sc.spec.name for sc in loaded]
    write_comparison(rows, out, names, title[args.designs], args.designs)
    console.print(table_md(rows, args.designs), markup=False)
    console.print(f"comparison: {out / 'compare.md'}, {out / 'compare.html'}", markup=False)
    return EXIT_VIOLATION if rows[0].failed else EXIT_OK


def _runnable(designs: Any, loaded: list[Any], mode: str, console: Console) -> Any:
    """The durable designs that run in `mode` on this machine (each one left out said in a
    line); every scenario must apply to each of them (else one line, and none)."""
    from chaos.systems import on_system, refusal, system

    kept = []
    for design in designs:
        sut = system(design.system)
        if (sut.live if mode == "live" else sut.sim) is None:
            console.print(f"chaos compare: {sut.name} does not run {mode} yet: left out")
            continue
        for sc in loaded:
            problem = refusal(on_system(sc, sut.name), sut.name, mode)
            if problem is None and mode == "live":  # what its live adapter cannot take
                own = sut.stack_class().own()
                problem = sut.live_refusal(on_system(sc, sut.name), own)
            if problem is not None:
                print(f"{problem} (--designs durable: every design takes it)", file=sys.stderr)
                return ()
        kept.append(design)
    return tuple(kept)


def _price(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and value < 1e6):
        raise argparse.ArgumentTypeError(f"expected a price >= 0 (USD); got {text[:40]}")
    return value


def _report(
    paths: list[Path],
    out: Path | None,
    price: float | None,
    console: Console,
    args: argparse.Namespace | None = None,
    against: dict[str, Any] | None = None,
) -> int:
    """`chaos report`: one line and exit 2 for a path that holds no readable run (or a
    `--baseline` that holds none, or no scenario in common)."""
    from reports import ReportError, build_report, find_runs

    try:
        runs = find_runs(list(paths))
        if against is None and args is not None and args.baseline is not None:
            against = _against(list(paths), args)
            _said(against, console)
    except ReportError as exc:
        print(f"chaos report: {exc}", file=sys.stderr)
        return EXIT_INPUT
    target = out or Path(paths[0]) / "report"
    build_report(runs, target, price, against)
    console.print(f"report: {target / 'report.html'} ({len(runs)} run(s))", markup=False)
    return EXIT_OK


# --- interrupts and leftovers -------------------------------------------------------------

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_COMMANDS = (
    *("run", "sim", "report", "compare", "validate", "list", "clean", "proxy", "images"),
    *("docs", "coverage", "mutate", "compile"),
)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM. A KeyboardInterrupt, so asyncio and every `except Exception` let
    it through and each `finally` on the way out runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Guard:
    """What the handler knows: whether it may still raise, and the first signal seen."""

    armed = False
    signum: int | None = None
    stderr: TextIO | None = None  # the real one, kept for the last line
    name = "chaos"  # the command, for the last line
    said = threading.Lock()  # held by whoever prints the last line (once)
    watchdog: threading.Timer | None = None


#: How long the unwinding after a signal may take before the process stops everything
#: and exits anyway: a task that swallows its cancellation (a robust AMQP connection
#: reconnecting to a killed broker) must not keep an interrupted run alive.
UNWIND_LIMIT_S = 15.0


def _catch_signals() -> dict[int, Any]:
    """Install the handlers and return the ones they replace. A signal the caller ignores
    (a background job of a script) stays ignored; off the main thread Python delivers
    none, so nothing is installed."""
    _Guard.armed, _Guard.signum, _Guard.stderr = True, None, None
    _Guard.said, _Guard.watchdog = threading.Lock(), None
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for sig in _SIGNALS:
        handler = signal.getsignal(sig)
        if handler is not signal.SIG_IGN and handler is not None:
            previous[sig] = signal.signal(sig, _on_signal)
    return previous


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """The first signal kills what the run started at once (nothing of an interrupted run
    is kept) and unwinds the command. Any later one is only noted: the clean-up that
    follows must not itself be interrupted (a second Ctrl-C used to end in a traceback
    from the middle of it, leaving processes behind)."""
    if _Guard.signum is not None or _inside_a_handler(frame):
        return
    _Guard.signum = signum
    _Guard.watchdog = threading.Timer(UNWIND_LIMIT_S, _unwound_too_long)
    _Guard.watchdog.daemon = True
    _Guard.watchdog.start()
    if not _Guard.armed:
        return
    _quiet()
    stack.kill_owned()
    raise Interrupted(signum)


def _inside_a_handler(frame: FrameType | None) -> bool:
    """Whether this signal interrupts the handler of an earlier one before it could note
    it: Python runs handlers with no signal blocked, so a SIGTERM that lands right after
    a SIGINT runs at the first instruction of the SIGINT's handler, and would otherwise
    decide in its place."""
    while frame is not None:
        if frame.f_code is _on_signal.__code__:
            return True
        frame = frame.f_back
    return False


def _unwound_too_long() -> None:
    os._exit(_interrupted(_Guard.name))


def _quiet() -> None:
    """After an interrupt only its one line is news: the connection errors, unretrieved
    task exceptions and warnings of the unwinding are not printed."""
    if _Guard.stderr is None:
        _Guard.stderr = sys.stderr
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (for the rest of the process)
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")
    sys.unraisablehook = lambda _unraisable: None
    threading.excepthook = lambda _args: None


def _interrupted(name: str) -> int:
    """Stop whatever the unwinding left (workers, services, anything carrying this
    process's owner mark, its temp dirs) and say so in one line; 128 + the signal."""
    signum = _Guard.signum or signal.SIGINT
    _quiet()
    workers = sys.modules.get("chaos.workers")  # not imported: no worker was started
    for stop in (getattr(workers, "stop_all", None), stack.stop_all):
        if stop is not None:
            with contextlib.suppress(Exception):  # the sweep below is the last word
                stop()
    reaped = stack.stop_owned()
    containers = sys.modules.get(
        "chaos.systems.redis_rabbitmq.containers"
    )  # not imported: none was started
    if containers is not None:
        with contextlib.suppress(Exception):
            containers.remove_owned()
    what = signal.Signals(signum).name
    if reaped.survivors:
        line = f"{name}: interrupted ({what}); still running: {reaped.survivors}"
    else:
        line = f"{name}: interrupted ({what}); everything it started is stopped"
    if _Guard.said.acquire(blocking=False):  # the main thread or the watchdog, not both
        print(line, file=_Guard.stderr or sys.__stderr__, flush=True)
    return 128 + signum


def _command_name(argv: list[str] | None) -> str:
    words = sys.argv[1:] if argv is None else argv
    command = next((w for w in words if not w.startswith("-")), "")
    return f"chaos {command}" if command in _COMMANDS else "chaos"


def _clean(console: Console) -> int:
    """`chaos clean`: stop and delete what runs whose runner died (SIGKILL, OOM, a CI
    timeout) left behind: services, workers, pool processes, temp dirs."""
    reaped = stack.reap_dead_owners()
    console.print(f"chaos clean: {reaped.summary()}", markup=False)
    with contextlib.suppress(ImportError):  # the docker package is an extra
        _remove_dead_containers(console)
    return EXIT_VIOLATION if reaped.survivors else EXIT_OK


def _compile(console: Console, status: bool) -> int:
    """`chaos compile`: the checker compiled with mypyc for this source (`chaos.compiled`),
    built once into the cache; `--status`: whether explorations will load one."""
    from chaos import compiled

    if status:
        build = compiled.fresh_build()
        off = os.environ.get(compiled.SWITCH_ENV) == "0"
        said = (f"built for this source: {build}" if build else "no build for this source") + (
            f" ({compiled.SWITCH_ENV}=0: explorations run the source)" if off and build else ""
        )
        console.print(f"chaos compile: {said}", markup=False)
        return EXIT_OK
    t0 = time.monotonic()
    try:
        build = compiled.build()
    except compiled.CompileError as exc:
        print(f"chaos compile: {exc}", file=sys.stderr)
        return EXIT_STACK
    n = len(compiled.modules())
    console.print(
        f"chaos compile: {n} modules in {build} ({time.monotonic() - t0:.0f} s); "
        "explorations load them until the source changes",
        markup=False,
    )
    return EXIT_OK


def _bad_mutant(name: str) -> bool:
    from chaos.mutants import MUTANTS, design_mutants

    known = [*MUTANTS, *design_mutants()]
    if name in known:
        return False
    from engine.validation import did_you_mean

    names = ", ".join(sorted(known))
    tip = did_you_mean(name, known)
    print(f"--mutant: unknown mutant {name!r}{tip}; expected one of {names}", file=sys.stderr)
    return True


def _load_all(paths: list[str]) -> tuple[list[Any], list[str]]:
    """The scenarios that load, and one error line per file that does not: a user fixing
    files learns of every bad one at once, not one per attempt."""
    from chaos.scenario import ScenarioError, load_scenario

    out = []
    errors = []
    for path in paths:
        try:
            out.append(load_scenario(path))
        except ScenarioError as exc:
            errors.append(str(exc))
    return out, errors


def _toxics() -> list[tuple[str, str]]:
    """Each Toxiproxy toxic type with its attributes, from the one table of them."""
    from chaos.proxy.model import ATTRIBUTES

    rows = []
    for name, model in ATTRIBUTES.items():
        doc = " ".join((model.__doc__ or "").split())
        rows.append((name, f"{doc} (attributes: {', '.join(model.model_fields)})"))
    return rows


def _docs(check: bool, console: Console) -> int:
    """The generated reference pages: written, or (`--check`) compared with what is there."""
    from chaos import docsgen

    if check:
        for rel in (out := docsgen.stale()):
            print(f"{rel} is out of date: run `{docsgen.COMMAND}`", file=sys.stderr)
        return EXIT_VIOLATION if out else EXIT_OK
    for rel in docsgen.write():
        console.print(f"wrote {rel}", markup=False)
    return EXIT_OK


#: `chaos list`'s descriptions without --long: cut to this many characters, on a word.
BRIEF_CHARS = 96


def brief(text: str, limit: int = BRIEF_CHARS) -> str:
    """One line of a description: its first sentence, cut on a word to `limit` characters."""
    flat = " ".join(text.split())
    first = flat.split(". ", 1)[0].rstrip(".")
    if len(first) <= limit:
        return first
    return first[: limit - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."


def _systems_table(console: Console, long: bool) -> Table:
    """The durable designs a scenario can run on (`system:`, `--system`), each with what it
    can take: the services a fault stops, the links a network fault cuts, the modes, and
    the invariants that do not apply to it."""
    from chaos.systems import DEFAULT_SYSTEM, SYSTEMS

    table = Table(title="systems (system:, --system)", **_table_style(console))
    columns = ("name", "services (kill/stop/pause/restart_service)", "links", "settings")
    for column in (*columns, "modes", "n/a"):
        table.add_column(column)
    for sut in SYSTEMS.values():
        services = "\n".join(f"{n}: {what}" if long else n for n, what in sut.services.items())
        modes = ", ".join(m for m, where in (("live", sut.live), ("sim", sut.sim)) if where)
        cannot = [f"sim: no {k}" for k in sut.not_simulated]
        na = "\n".join(f"{k}: {why}" if long else k for k, why in sut.not_applicable.items())
        name = sut.name + (" (default)" if sut.name == DEFAULT_SYSTEM else "")
        if long:
            name += f"\n{sut.summary}"
        settings = ", ".join(f"{section}:" for section in sut.settings) or "none"
        table.add_row(
            name,
            services,
            ", ".join(sut.links),
            settings,
            "; ".join([modes, *cannot]),
            na or "none",
        )
    return table


def _list(console: Console, long: bool = False) -> int:
    from chaos.checker import INVARIANTS
    from chaos.mutants import MUTANTS, design_mutants
    from engine.failpoints import FAILPOINTS

    root = Path(__file__).resolve().parents[1] / "scenarios"
    table = Table(title="scenarios", show_lines=False, **_table_style(console))
    table.add_column("file")
    table.add_column("description")
    from chaos.scenario import ScenarioError, load_scenario

    for path in [*sorted(root.glob("*.yaml")), *sorted(root.glob("*/*.yaml"))]:
        if path.parent.name in ("refused", "examples"):
            continue
        try:
            desc = load_scenario(path).spec.description
            desc = " ".join(desc.split()) if long else brief(desc)
        except ScenarioError as exc:
            desc = f"[red]invalid: {exc}"
        table.add_row(str(path.relative_to(root.parent)), desc)
    console.print(table)
    console.print(_systems_table(console, long))
    for title, rows in (
        ("invariants", INVARIANTS.items()),
        ("failpoints", FAILPOINTS.items()),
        (
            "mutants",
            [
                *((m.name, f"breaks {m.breaks}: {m.description}") for m in MUTANTS.values()),
                *(
                    (name, f"breaks {breaks} on {system}: {doc}")
                    for name, (system, breaks, doc) in design_mutants().items()
                ),
            ],
        ),
        ("toxics (add_toxic, update_toxic, remove_toxic on link redis or broker)", _toxics()),
    ):
        t = Table(title=title, **_table_style(console))
        t.add_column("name")
        t.add_column("meaning")
        for name, meaning in rows:
            t.add_row(name, meaning if long else brief(meaning))
        console.print(t)
    return EXIT_OK


def _run(loaded: list[Any], out: Path, args: argparse.Namespace, console: Console) -> int:
    from chaos.systems import system
    from chaos.systems.redis_rabbitmq.services import ServicesUnavailable

    containers = args.mode == "containers"
    # each design's services, in the order the scenarios name them
    designs = [system(name) for name in dict.fromkeys(sc.spec.system for sc in loaded)]
    problem = _containers_problem() if containers else None
    for sut in designs:
        problem = problem or sut.stack_class().available()
    if args.mode == "sim" or (args.mode == "auto" and problem is not None):
        if args.mode == "auto":
            print(f"chaos run: live mode {problem}; running in the simulator instead")
        from chaos.simcli import run_in_sim

        if out.exists() and any(out.iterdir()):
            print(f"--out: {out} exists and is not empty; expected a new folder", file=sys.stderr)
            return EXIT_INPUT
        return run_in_sim(loaded, out, args, console)
    if problem is not None:
        print(f"chaos run: {problem}", file=sys.stderr)
        return EXIT_STACK
    for sc in loaded:
        sut = system(sc.spec.system)
        problem = sut.live_refusal(sc, sut.stack_class().own(containers))
        if problem:
            print(problem, file=sys.stderr)
            return EXIT_INPUT
    if out.exists() and any(out.iterdir()):
        print(f"--out: {out} exists and is not empty; expected a new folder", file=sys.stderr)
        return EXIT_INPUT
    # The client's reconnect chatter during a broker restart is expected, not news.
    for name in ("aio_pika", "aiormq"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    reaped = stack.reap_dead_owners()  # what a SIGKILLed run left; a live one's is kept
    if reaped.pids or reaped.dirs:
        console.print(f"chaos run: left by a killed run: {reaped.summary()}", markup=False)
    if containers:
        _remove_dead_containers(console)
    services: dict[str, Any] = {}
    try:
        where = " in containers" if containers else ""
        for sut in designs:
            what = " and ".join(sut.services)
            with console.status(f"starting {what} ({sut.name}){where}...", spinner="dots"):
                try:
                    services[sut.name] = sut.stack_class().start(containers=containers)
                except ServicesUnavailable as exc:
                    print(f"chaos run: cannot start the stack: {exc}", file=sys.stderr)
                    return EXIT_STACK
        return asyncio.run(_run_all(loaded, services, out, args, console))
    finally:
        # Also on an error or an interrupt (then `main` sweeps whatever this one missed).
        for started in services.values():
            started.stop()
        from chaos.workers import stop_all as stop_workers

        stop_workers()
        stack.stop_all()
        if containers:  # by label: whatever the services lost track of
            from chaos.systems.redis_rabbitmq.containers import remove_owned

            remove_owned()


async def _run_all(
    loaded: list[Any],
    services: dict[str, Any],
    out: Path,
    args: argparse.Namespace,
    console: Console,
) -> int:
    """Each scenario on the services of its system (`services`, by system name)."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    from chaos.journal import (
        Ticker,
        format_violation,
        fresh_run_dir,
        suite_name,
        write_junit,
        write_outputs,
    )
    from chaos.runner import HarnessError, RunRefused, ScenarioRun

    out.mkdir(parents=True, exist_ok=True)
    suites = []
    worst = EXIT_OK
    for sc in loaded:
        run_dir = fresh_run_dir(out, sc.spec.name)
        bar = Bar(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
            disable=args.quiet or not console.is_terminal,
            transient=True,
        )
        try:
            run = ScenarioRun(
                sc, services[sc.spec.system], run_dir, seed=args.seed, mutant=args.mutant
            )
        except RunRefused as exc:
            print(str(exc), file=sys.stderr)
            return EXIT_INPUT
        task = bar.add_task(sc.spec.name, total=len(run.attempt_ids), info="")
        ticker = Ticker(enabled=not args.quiet and not console.is_terminal)

        def show(p: Any, task: Any = task, bar: Any = bar, ticker: Ticker = ticker) -> None:
            info = f"workers {p.workers_alive} faults {p.faults_fired} {p.note}"
            bar.update(task, completed=p.terminal, info=info)
            ticker.tick(lambda took: live_progress_line(p, took))

        run.on_progress = show
        started = time.monotonic()
        try:
            with bar:
                outcome = await run.run()
        except HarnessError as exc:  # no verdict for this one; the others still run
            await _ensure_services(services[sc.spec.system])
            run_dir.mkdir(parents=True, exist_ok=True)
            evidence = run_dir / "harness_error.txt"
            evidence.write_text("".join(traceback.format_exception(exc)), encoding="utf-8")
            spent = time.monotonic() - started
            console.print(
                f"ERROR {sc.spec.name} ({_live_mode(args)}): {exc} ({spent:.1f} s)", markup=False
            )
            console.print(f"  evidence: {evidence}", markup=False)
            worst = max(worst, EXIT_HARNESS)
            suites.append((suite_name(sc.spec.name, _live_mode(args), run.seed), str(exc), spent))
            continue
        await _ensure_services(services[sc.spec.system])
        result = outcome.result
        extra = {**outcome.extra, "mode": _live_mode(args)}
        write_outputs(run_dir, sc.spec.name, outcome.history, result, extra)
        suites.append(
            (suite_name(sc.spec.name, _live_mode(args), run.seed), result, outcome.duration_s)
        )
        (run_dir / "history.raw.jsonl").unlink(missing_ok=True)  # merged into history.jsonl
        _summary(console, sc.spec.name, outcome, time.monotonic() - started, _live_mode(args))
        if not result.ok:
            console.print(f"  evidence: {run_dir / 'journal.json'}", markup=False)
        for v in result.violations[:10]:
            console.print(format_violation(v), markup=False)
        if not result.ok:
            worst = max(worst, EXIT_VIOLATION)
    write_junit(out / "junit.xml", suites)
    console.print(f"outputs: {out}", markup=False)
    return worst


async def _ensure_services(services: Any) -> None:
    """A scenario may leave a service killed; the next one needs it back."""
    for name in sorted(services.killable):
        svc = services.service(name)
        if not svc.alive:
            await asyncio.to_thread(svc.restart)


def _summary(console: Console, name: str, outcome: Any, took: float, mode: str) -> None:
    """One line per scenario: mode, faults fired, reruns by kind (`summary_line`)."""
    from chaos.journal import summary_line

    n = len(outcome.attempt_ids)
    console.print(summary_line(name, mode, outcome.result, n, f"in {took:.1f} s"))


def _live_mode(args: argparse.Namespace) -> str:
    return "containers" if args.mode == "containers" else "live"


def _containers_problem() -> str | None:
    """None when containers mode can run here, else why not (one line)."""
    from chaos.systems.redis_rabbitmq.containers import engine_problem

    return engine_problem()


def _remove_dead_containers(console: Console) -> None:
    from chaos.systems.redis_rabbitmq.containers import remove_dead_owners

    removed = remove_dead_owners()
    if removed:
        console.print(f"chaos: containers left by a killed run removed: {removed}", markup=False)


def _images(console: Console) -> int:
    """`chaos images build`: the local Redis and RabbitMQ images
    (`chaos.systems.redis_rabbitmq.images`)."""
    from chaos.systems.redis_rabbitmq.containers import engine_problem
    from chaos.systems.redis_rabbitmq.images import build

    problem = engine_problem()
    if problem is not None:
        print(f"chaos images: {problem}", file=sys.stderr)
        return EXIT_STACK
    for service in ("redis", "rabbitmq"):
        try:
            tag = build(service)
        except stack.StackError as exc:
            print(f"chaos images: {exc}", file=sys.stderr)
            return EXIT_STACK
        console.print(f"chaos images: built {tag}", markup=False)
    return EXIT_OK


def live_progress_line(p: Any, took: float) -> str:
    """The log's progress line of a live scenario (`chaos.runner.Progress` `p`)."""
    faults = f"{p.faults_fired} fault{'s' if p.faults_fired != 1 else ''} fired"
    note = f", {p.note}" if p.note else ""
    return (
        f"chaos run {p.scenario} (live): {p.terminal}/{p.total} evaluations terminal, "
        f"{p.workers_alive} workers alive, {faults}{note}, {took:.1f} s"
    )


def _table_style(console: Console) -> dict[str, Any]:
    """Boxes on a terminal; in a log, plain aligned columns (no box-drawing characters)."""
    if console.is_terminal:
        return {}
    return {"box": None, "pad_edge": False, "title_justify": "left"}


def make_console() -> Console:
    """Lines are soft-wrapped: rich never cuts a path or a replay command with a newline
    (on a terminal, the terminal folds it and a copy stays whole). Off a terminal (a pipe,
    a file, a CI log) rich would also size tables to 80 columns: there the width is one no
    line reaches, and no escape code is written (no colour system)."""
    console = Console(highlight=False, emoji=False, soft_wrap=True)
    if console.is_terminal:
        return console
    return Console(highlight=False, emoji=False, soft_wrap=True, width=NO_WRAP_WIDTH)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(exiting=True))
