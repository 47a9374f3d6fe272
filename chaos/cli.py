"""`python -m chaos`: run, explore, validate and list scenarios.

    python -m chaos run scenarios/crash_after_ack.yaml [--mode auto|live|sim] [--seed N]
                        [--out DIR] [--mutant NAME]
    python -m chaos sim scenarios/crash_after_ack.yaml --seeds 1000 [--jobs J] [--shrink]
    python -m chaos validate scenarios/*.yaml
    python -m chaos list

Exit codes: 0 every invariant holds, 1 a violation or a budget exceeded, 2 invalid input,
3 the stack could not be started.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

EXIT_OK, EXIT_VIOLATION, EXIT_INPUT, EXIT_STACK = 0, 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m chaos", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run scenarios and check their invariants")
    run.add_argument("scenarios", nargs="+", metavar="SCENARIO")
    run.add_argument(
        "--mode",
        choices=["auto", "live", "sim"],
        default="auto",
        help="auto: live when redis-server and RabbitMQ are here, else the simulator",
    )
    run.add_argument("--seed", type=int, help="override every scenario's seed")
    run.add_argument("--out", type=Path, help="output folder (default out/<time>)")
    run.add_argument("--mutant", help="run the workers with this deliberately broken behaviour")
    run.add_argument("--quiet", action="store_true", help="no progress display")
    sim = sub.add_parser("sim", help="explore many seeds in the simulator, shrink failures")
    sim.add_argument("scenario", metavar="SCENARIO")
    sim.add_argument("--seeds", type=int, default=100, help="how many seeds (default 100)")
    sim.add_argument("--first-seed", type=int, default=0)
    sim.add_argument("--jobs", type=int, default=0, help="processes (default: every core)")
    sim.add_argument("--mutant", help="explore a deliberately broken engine")
    sim.add_argument("--shrink", action="store_true", help="shrink the first failure found")
    sim.add_argument(
        "--all-failpoints",
        action="store_true",
        help="instead of seeds: a crash at each failpoint hit of one run",
    )
    sim.add_argument(
        "--regressions",
        type=Path,
        default=Path("scenarios/regressions"),
        help="where --shrink writes the failing case (default scenarios/regressions)",
    )
    val = sub.add_parser("validate", help="check scenario files without running them")
    val.add_argument("scenarios", nargs="+", metavar="SCENARIO")
    sub.add_parser("list", help="scenarios, invariants, failpoints and mutants")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(stderr=False, highlight=False)
    if args.command == "list":
        return _list(console)
    loaded = _load_all(args.scenarios if args.command != "sim" else [args.scenario])
    if isinstance(loaded, str):
        print(loaded, file=sys.stderr)
        return EXIT_INPUT
    if args.command == "validate":
        for sc in loaded:
            console.print(f"{sc.path}: ok ({sc.spec.name})")
        return EXIT_OK
    if args.command == "sim":
        if args.mutant is not None and _bad_mutant(args.mutant):
            return EXIT_INPUT
        from chaos.simcli import explore_command

        return explore_command(loaded[0], args, console)
    if args.mutant is not None and _bad_mutant(args.mutant):
        return EXIT_INPUT
    out = args.out or Path("out") / datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return _run(loaded, out, args, console)


def _bad_mutant(name: str) -> bool:
    from chaos.mutants import MUTANTS

    if name in MUTANTS:
        return False
    names = ", ".join(sorted(MUTANTS))
    print(f"--mutant: unknown mutant {name!r}; expected one of {names}", file=sys.stderr)
    return True


def _load_all(paths: list[str]) -> list[Any] | str:
    from chaos.scenario import ScenarioError, load_scenario

    out = []
    for path in paths:
        try:
            out.append(load_scenario(path))
        except ScenarioError as exc:
            return str(exc)
    return out


def _list(console: Console) -> int:
    from chaos.checker import INVARIANTS
    from chaos.mutants import MUTANTS
    from engine.failpoints import FAILPOINTS

    root = Path(__file__).resolve().parents[1] / "scenarios"
    table = Table(title="scenarios", show_lines=False)
    table.add_column("file")
    table.add_column("description")
    from chaos.scenario import ScenarioError, load_scenario

    for path in [*sorted(root.glob("*.yaml")), *sorted(root.glob("regressions/*.yaml"))]:
        try:
            desc = load_scenario(path).spec.description.split("\n")[0]
        except ScenarioError as exc:
            desc = f"[red]invalid: {exc}"
        table.add_row(str(path.relative_to(root.parent)), desc)
    console.print(table)
    for title, rows in (
        ("invariants", INVARIANTS.items()),
        ("failpoints", FAILPOINTS.items()),
        ("mutants", ((m.name, f"{m.description} (breaks {m.breaks})") for m in MUTANTS.values())),
    ):
        t = Table(title=title)
        t.add_column("name")
        t.add_column("meaning")
        for name, meaning in rows:
            t.add_row(name, meaning)
        console.print(t)
    return EXIT_OK


def _run(loaded: list[Any], out: Path, args: argparse.Namespace, console: Console) -> int:
    from chaos.services import Services, ServicesUnavailable

    problem = Services.available()
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
    from chaos.runner import refusal

    killable = {
        n for n, var in (("redis", "REDIS_URL"), ("broker", "AMQP_URL")) if var not in os.environ
    }
    for sc in loaded:
        problem = refusal(sc, killable)
        if problem:
            print(problem, file=sys.stderr)
            return EXIT_INPUT
    if out.exists() and any(out.iterdir()):
        print(f"--out: {out} exists and is not empty; expected a new folder", file=sys.stderr)
        return EXIT_INPUT
    # The client's reconnect chatter during a broker restart is expected, not news.
    for name in ("aio_pika", "aiormq"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # SIGTERM behaves like Ctrl-C: everything started is stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    services: Services | None = None
    try:
        with console.status("starting Redis and RabbitMQ...", spinner="dots"):
            try:
                services = Services.start()
            except ServicesUnavailable as exc:
                print(f"chaos run: cannot start the stack: {exc}", file=sys.stderr)
                return EXIT_STACK
        return asyncio.run(_run_all(loaded, services, out, args, console))
    except KeyboardInterrupt:
        print("chaos run: interrupted; everything it started is stopped", file=sys.stderr)
        return 130
    finally:
        if services is not None:
            services.stop()
        from chaos.stack import stop_all
        from chaos.workers import stop_all as stop_workers

        stop_workers()
        stop_all()


async def _run_all(
    loaded: list[Any], services: Any, out: Path, args: argparse.Namespace, console: Console
) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    from chaos.journal import format_violation, write_junit, write_outputs
    from chaos.runner import RunRefused, ScenarioRun

    out.mkdir(parents=True, exist_ok=True)
    suites = []
    worst = EXIT_OK
    for sc in loaded:
        run_dir = out / sc.spec.name
        if run_dir.exists():
            run_dir = out / f"{sc.spec.name}-{len(suites)}"
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
            run = ScenarioRun(sc, services, run_dir, seed=args.seed, mutant=args.mutant)
        except RunRefused as exc:
            print(str(exc), file=sys.stderr)
            return EXIT_INPUT
        task = bar.add_task(sc.spec.name, total=len(run.attempt_ids), info="")

        def show(p: Any, task: Any = task, bar: Any = bar) -> None:
            info = f"workers {p.workers_alive} faults {p.faults_fired} {p.note}"
            bar.update(task, completed=p.terminal, info=info)

        run.on_progress = show
        started = time.monotonic()
        with bar:
            outcome = await run.run()
        await _ensure_services(services)
        result = outcome.result
        write_outputs(run_dir, sc.spec.name, outcome.history, result, outcome.extra)
        suites.append((sc.spec.name, result, outcome.duration_s))
        (run_dir / "history.raw.jsonl").unlink(missing_ok=True)  # merged into history.jsonl
        _summary(console, sc.spec.name, outcome, time.monotonic() - started)
        if not result.ok:
            console.print(f"  evidence: {run_dir / 'journal.json'}")
        for v in result.violations[:10]:
            console.print(format_violation(v), markup=False)
        if not result.ok:
            worst = EXIT_VIOLATION
    write_junit(out / "junit.xml", suites)
    console.print(f"outputs: {out}")
    return worst


async def _ensure_services(services: Any) -> None:
    """A scenario may leave a service killed; the next one needs it back."""
    for svc in (services.redis, services.broker):
        if svc is not None and not svc.alive:
            await asyncio.to_thread(svc.restart)


def _summary(console: Console, name: str, outcome: Any, took: float) -> None:
    result = outcome.result
    mark = "[green]PASS[/]" if result.ok else "[red]FAIL[/]"
    failed = [k for k, v in result.verdicts.items() if v == "fail"]
    stats = result.stats
    console.print(
        f"{mark} {name}: {len(outcome.attempt_ids)} evaluations in {took:.1f} s; "
        f"reruns {stats.get('reruns', 0)}, duplicated tokens {stats.get('duplicated_tokens', 0)}"
        + (f"; [red]broken: {', '.join(failed)}[/]" if failed else "")
        + (
            f"; [red]budgets: {'; '.join(result.budget_failures)}[/]"
            if result.budget_failures
            else ""
        )
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
