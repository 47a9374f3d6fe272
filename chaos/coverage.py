"""`python -m chaos coverage`: which branches of the protocol the scenarios reach.

The protocol is the engine's pure core (`engine/core/`), its one shell (`engine/shell/`)
and the store's Python references (the `SimRedis` methods named in `sim.redis.REFERENCES`,
each proven equal to its Lua script). A branch no scenario reaches is a path of the protocol
no run of the harness has judged: a bug there passes everything. This measures branch
coverage (coverage.py, `branch=True`) of those files under the simulated suite (each
scenario once, its own seed) plus a short exploration (`--seeds N` swarm variants of each
scenario, as `chaos sim` draws them), prints per file the branches reached and lists every
branch no run reached (`file:line -> line`, the target `exit` when the branch leaves the
function), and writes the same as JSON.

The runs are spread over `--jobs` fresh interpreters, each started under coverage before
it imports anything of the engine (so module-level lines count too), and their data is
combined. A branch is also named by its function and the source of both ends (`key`),
which survives edits elsewhere in the file: `docs/coverage.md` lists the branches no
scenario can reach by that key, and a branch left unreached that it does not list is
reported as `unexplained` (exit 1 with `--strict`).
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import tokenize
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: What is measured: folders (every .py in them) and single files, relative to the root.
PROTOCOL_DIRS = ("engine/core", "engine/shell")
REFERENCE_FILE = "sim/redis.py"
DOCS = ROOT / "docs" / "coverage.md"
EXIT_OK, EXIT_GAP, EXIT_INPUT = 0, 1, 2


@dataclass(frozen=True)
class Branch:
    """One branch: from a line to another (`to` < 0: out of the function)."""

    path: str  # relative to the root
    start: int
    to: int
    function: str  # the innermost function's qualified name ("" at module level)
    key: str  # function and source of both ends: stable across edits elsewhere

    def where(self) -> str:
        return f"{self.path}:{self.start} -> {'exit' if self.to < 0 else self.to}"


@dataclass
class FileCoverage:
    path: str
    reached: list[Branch] = field(default_factory=list)
    unreached: list[Branch] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.reached) + len(self.unreached)

    def percent(self) -> float:
        return 100.0 * len(self.reached) / self.total if self.total else 100.0


@dataclass
class Measurement:
    files: list[FileCoverage]
    runs: int  # simulated runs measured
    seconds: float

    @property
    def reached(self) -> int:
        return sum(len(f.reached) for f in self.files)

    @property
    def total(self) -> int:
        return sum(f.total for f in self.files)

    def percent(self) -> float:
        return 100.0 * self.reached / self.total if self.total else 100.0

    def unreached(self) -> list[Branch]:
        return [b for f in self.files for b in f.unreached]

    def to_json(self, accepted: dict[str, str] | None = None) -> dict[str, Any]:
        accepted = accepted or {}
        return {
            "runs": self.runs,
            "seconds": round(self.seconds, 1),
            "branches": self.total,
            "reached": self.reached,
            "percent": round(self.percent(), 2),
            "files": {
                f.path: {
                    "branches": f.total,
                    "reached": len(f.reached),
                    "percent": round(f.percent(), 2),
                    "unreached": [
                        {
                            "where": b.where(),
                            "function": b.function,
                            "key": b.key,
                            "why": accepted.get(b.key),
                        }
                        for b in f.unreached
                    ],
                    "reached_branches": [{"where": b.where(), "key": b.key} for b in f.reached],
                }
                for f in self.files
            },
        }


# --- what is measured -------------------------------------------------------------------------


def protocol_files(root: Path = ROOT) -> list[str]:
    """The measured files, relative to `root`, sorted."""
    files = [
        str(p.relative_to(root)) for d in PROTOCOL_DIRS for p in sorted((root / d).glob("*.py"))
    ]
    return [*files, REFERENCE_FILE]


def _reference_methods() -> frozenset[str]:
    """The `SimRedis` methods that are the store's references (`sim.redis.REFERENCES`), read
    from the source so that this module imports nothing of the engine."""
    tree = ast.parse((ROOT / REFERENCE_FILE).read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "REFERENCES"
        ):
            value = ast.literal_eval(node.value)  # type: ignore[arg-type]
            return frozenset(f"SimRedis.{name}" for name in value.values())
    raise LookupError(f"{REFERENCE_FILE}: no REFERENCES table")


def _functions(source: str) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function, outer ones first."""
    out: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                out.append((first, child.end_lineno or child.lineno, name))
                visit(child, f"{name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def _innermost(functions: list[tuple[int, int, str]], line: int) -> str:
    best = ""
    for first, last, name in functions:
        if first <= line <= last:
            best = name  # nested ones come after their parent
    return best


def _text(lines: list[str], n: int) -> str:
    """Line `n`'s code, its comment and spacing left out (`exit`: out of the function)."""
    if not 0 < n <= len(lines):
        return "exit"
    line = lines[n - 1]
    try:
        for tok in tokenize.generate_tokens(io.StringIO(line).readline):
            if tok.type == tokenize.COMMENT:
                line = line[: tok.start[1]]
                break
    except (tokenize.TokenError, SyntaxError):  # a line of a longer statement: as it reads
        pass
    return " ".join(line.split())


def _branches(path: str, arcs: Iterable[Sequence[int]], root: Path) -> list[Branch]:
    """`arcs` as branches: every branch of the file, reached or not, so that two with the
    same code in one function get their rank (`#2`) from their order in the file, whichever
    of them a run reached."""
    source = (root / path).read_text()
    lines = source.splitlines()
    functions = _functions(source)
    out = []
    seen: dict[str, int] = {}
    for start, to in sorted(arcs, key=lambda a: (a[0], a[1] if a[1] > 0 else 1 << 30)):
        function = _innermost(functions, start)
        key = f"{path}::{function}::{_text(lines, start)} -> {_text(lines, to)}"
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:  # the same code twice in one function: told apart by its rank
            key += f" #{seen[key]}"
        out.append(Branch(path, start, to, function, key))
    return out


def analyse(report: dict[str, Any], root: Path = ROOT) -> list[FileCoverage]:
    """coverage.py's JSON report, narrowed to the protocol: in `sim/redis.py`, the
    reference methods only (and what they define inside)."""
    references = _reference_methods()
    by_path = {
        os.path.relpath(name, root) if os.path.isabs(name) else name: data
        for name, data in report.get("files", {}).items()
    }
    files = []
    for path in protocol_files(root):
        data = by_path.get(path)
        fc = FileCoverage(path)
        if data is None:  # never imported: nothing of it ran; its branches are unknown
            files.append(fc)
            continue
        reached = {tuple(a) for a in data.get("executed_branches", [])}
        every = _branches(path, [*reached, *map(tuple, data.get("missing_branches", []))], root)
        fc.reached = [b for b in every if (b.start, b.to) in reached]
        fc.unreached = [b for b in every if (b.start, b.to) not in reached]
        if path == REFERENCE_FILE:

            def wanted(b: Branch) -> bool:
                return any(
                    b.function == r or b.function.startswith(f"{r}.<locals>.") for r in references
                )

            fc.reached = [b for b in fc.reached if wanted(b)]
            fc.unreached = [b for b in fc.unreached if wanted(b)]
        files.append(fc)
    return files


# --- running ----------------------------------------------------------------------------------


#: What a measuring interpreter runs: coverage starts before anything of the engine loads.
_CHILD = """
import json, sys
import coverage
units, data_file, include = json.loads(sys.argv[1])
cov = coverage.Coverage(
    data_file=data_file, data_suffix=True, branch=True, include=include, config_file=False
)
cov.start()
from chaos.coverage import run_units
try:
    failed = run_units(units)
finally:
    cov.stop()
    cov.save()
print(json.dumps(failed))
"""


def run_units(units: list[list[Any]]) -> list[str]:
    """Run each unit: `["run", path]` the scenario once, `["explore", path, first, n]` its
    swarm variants of those seeds. Returns what failed (a measurement still counts it)."""
    from chaos.explore import _one, document
    from chaos.insim import run_scenario
    from chaos.scenario import load_scenario

    failed = []
    for unit in units:
        loaded = load_scenario(unit[1])
        if unit[0] == "run":
            if not run_scenario(loaded).result.ok:
                failed.append(f"{unit[1]}")
        else:
            data = document(loaded)
            for seed in range(unit[2], unit[2] + unit[3]):
                if not _one((data, seed, None, False)).ok:
                    failed.append(f"{unit[1]} seed {seed}")
    return failed


def _units(paths: Sequence[str], seeds: int, first_seed: int) -> list[list[Any]]:
    units: list[list[Any]] = [["run", p] for p in paths]
    step = 25  # seeds a unit: small enough to spread over the jobs
    for p in paths:
        for first in range(first_seed, first_seed + seeds, step):
            units.append(["explore", p, first, min(step, first_seed + seeds - first)])
    return units


def measure(
    paths: Sequence[str], seeds: int = 0, first_seed: int = 0, jobs: int = 1
) -> tuple[Measurement, list[str]]:
    """Measure the protocol's branch coverage under `paths` run once each and `seeds`
    explored variants of each, on `jobs` interpreters. Returns it and the failed runs."""
    import coverage

    started = time.monotonic()
    units = _units(paths, seeds, first_seed)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(units)))
    include = [str(ROOT / p) for p in protocol_files()]
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="chaos-coverage-") as tmp:
        data_file = str(Path(tmp) / ".coverage")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        children = [
            subprocess.Popen(
                [sys.executable, "-c", _CHILD, json.dumps([units[i::jobs], data_file, include])],
                stdout=subprocess.PIPE,
                cwd=os.getcwd(),
                env=env,
                text=True,
            )
            for i in range(jobs)
        ]
        try:
            for child in children:
                out, _ = child.communicate()
                if child.returncode != 0:
                    raise RuntimeError(f"a measuring process ended with {child.returncode}")
                failed += json.loads(out.strip().splitlines()[-1])
        finally:  # an interrupt or a failed child: none is left running
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
        cov = coverage.Coverage(data_file=data_file, branch=True, config_file=False)
        cov.combine([tmp], keep=True)
        report_file = Path(tmp) / "report.json"
        cov.json_report(outfile=str(report_file), include=include)
        report = json.loads(report_file.read_text())
    runs = len(paths) + seeds * len(paths)
    return Measurement(analyse(report), runs, time.monotonic() - started), failed


# --- the documented list ----------------------------------------------------------------------

#: A row of docs/coverage.md's tables: `| where | key | path | status |`.
_ROW = re.compile(
    r"^\|\s*`(?P<where>[\w/.]+\.py:\d+ -> (?:\d+|exit))`\s*\|\s*`(?P<key>[^`]+)`\s*\|"
    r"(?P<rest>.*)\|\s*$"
)


def documented(path: Path = DOCS) -> dict[str, tuple[str, str]]:
    """key -> (where it was, the rest of its row) for every branch docs/coverage.md names."""
    out: dict[str, tuple[str, str]] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        m = _ROW.match(line.strip())
        if m:
            out[m["key"].replace("\\|", "|")] = (m["where"], m["rest"].strip())
    return out


def reached_by(path: Path = DOCS) -> dict[str, list[str]]:
    """key -> the scenarios docs/coverage.md says reach it (its `reached by` rows)."""
    out: dict[str, list[str]] = {}
    for key, (_, rest) in documented(path).items():
        if "reached by" in rest:
            out[key] = re.findall(r"`(scenarios/[^`]+\.yaml)`", rest)
    return out


def unreachable(path: Path = DOCS) -> dict[str, str]:
    """key -> why, for the branches docs/coverage.md says no scenario can reach."""
    return {key: rest for key, (_, rest) in documented(path).items() if "reached by" not in rest}


# --- the command ------------------------------------------------------------------------------


def print_measurement(m: Measurement, accepted: dict[str, str], out: Any = None) -> list[Branch]:
    """The per-file table and the unreached branches; returns those docs do not explain."""
    out = out or sys.stdout
    width = max(len(f.path) for f in m.files)
    print(f"{'file':<{width}}  branches  reached  percent", file=out)
    for f in m.files:
        print(
            f"{f.path:<{width}}  {f.total:8d}  {len(f.reached):7d}  {f.percent():6.1f} %", file=out
        )
    print(f"{'total':<{width}}  {m.total:8d}  {m.reached:7d}  {m.percent():6.1f} %", file=out)
    unexplained = []
    if m.unreached():
        print("\nunreached branches:", file=out)
    for b in m.unreached():
        why = accepted.get(b.key)
        if why is None:
            unexplained.append(b)
        tail = f"  (documented: {why[:70]})" if why else "  (not in docs/coverage.md)"
        print(f"  {b.where()}  {b.function}{tail}", file=out)
    print(
        f"\n{m.reached}/{m.total} branches reached ({m.percent():.1f} %) by {m.runs} runs "
        f"in {m.seconds:.0f} s; {len(unexplained)} unreached and not documented",
        file=out,
    )
    return unexplained


#: The scenarios `chaos coverage` runs by default: every folder the simulator can run, the
#: PostgreSQL designs' too (their outbox and job queue are paths of the one shell).
SUITE = ("scenarios", "scenarios/regressions", "scenarios/pg_store", "scenarios/pg")


def coverage_command(args: Any) -> int:
    """`chaos coverage`: measure, print, write the JSON; exit 1 with `--strict` when a
    branch is unreached that docs/coverage.md does not list as unreachable."""
    paths = args.scenarios or sorted(
        str(p) for folder in SUITE for p in Path(folder).glob("*.yaml")
    )
    for p in paths:
        if not Path(p).is_file():
            print(f"{p}: expected a scenario file", file=sys.stderr)
            return EXIT_INPUT
    m, failed = measure(paths, args.seeds, args.first_seed, args.jobs)
    accepted = unreachable()
    unexplained = print_measurement(m, accepted)
    for f in failed[:10]:
        print(f"failed (measured all the same): {f}", file=sys.stderr)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(m.to_json(accepted), indent=1) + "\n")
    print(f"json: {args.json}")
    return EXIT_GAP if args.strict and unexplained else EXIT_OK
