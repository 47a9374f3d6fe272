"""One mutant, one fresh interpreter, one verdict: `python chaos/mutate/worker.py JOB.json`.

Run as a script, not as `-m chaos.mutate.worker`: importing the `chaos` package first
could import the very module to mutate before the hook is in place. The hook (a
`sys.meta_path` finder) hands the import system the mutated source in place of the
file's, compiled under the file's own name (tracebacks point at the real lines), with no
bytecode cache read or written. The worker then runs the scenarios in the simulator, in
order, and stops at the first failure: the first scenario that fails kills the mutant. A
refused scenario (`# refused: LINE` on its first line) fails when it loads, or when it is
refused with another line.

The job (JSON): `root` (the checkout), `scenarios` (paths), `explore` (seeds per
scenario), `skip` (`[scenario, seed]` pairs that fail without any mutant), `module`,
`path` and `source` (the mutant; absent for the baseline), `result` (where the verdict
goes), and for the baseline `targets` (module names) and `coverage` (the files whose
executed lines it reports: a mutant on lines the unmutated suite never runs cannot change
what it does, so it survives without being run). The verdict (JSON): `status` (killed,
crashed, survived; the baseline: every failure rather than the first), `scenario`,
`seed`, `detail`, `mutated` (whether the mutated module was imported at all).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import traceback
from types import CodeType
from typing import Any


class _MutantLoader(importlib.machinery.SourceFileLoader):
    """The original file's loader, with the mutant's source and no bytecode cache."""

    def __init__(self, fullname: str, path: str, source: str) -> None:
        super().__init__(fullname, path)
        self.source = source

    def get_source(self, fullname: str) -> str:
        return self.source

    def get_code(self, fullname: str) -> CodeType:
        return compile(self.source, self.path, "exec", dont_inherit=True)


class _MutantFinder(importlib.abc.MetaPathFinder):
    def __init__(self, module: str, path: str, source: str) -> None:
        self.module, self.path, self.source = module, os.path.realpath(path), source
        self.loaded = False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.module:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None or os.path.realpath(spec.origin) != self.path:
            return None  # another file of that name comes first on sys.path: `mutated` false
        spec.loader = _MutantLoader(fullname, spec.origin, self.source)
        self.loaded = True
        return spec


def _failed(result: Any) -> str:
    names = [k for k, v in result.verdicts.items() if v == "fail"]
    if result.budget_failures:
        names.append("budgets")
    if result.exercise_failures:
        names.append("exercised")
    first = result.violations[0].message if result.violations else ""
    text = ", ".join(names) or "not ok"
    return f"{text}: {first}" if first else text


def _crash() -> str:
    """The exception's type and message and the innermost frame of the checkout, of the
    first exception of the chain (simpy raises a copy of a process's, its cause): one line."""
    exc = sys.exc_info()[1]
    while exc is not None and exc.__cause__ is not None:  # simpy re-raises a copy
        exc = exc.__cause__
    kind, tb = type(exc), exc.__traceback__ if exc is not None else None
    frames = traceback.extract_tb(tb)
    root = os.getcwd() + os.sep  # the checkout: its innermost frame says more than a library's
    ours = [f for f in frames if f.filename.startswith(root)] or frames
    where = f" at {os.path.relpath(ours[-1].filename)}:{ours[-1].lineno}" if ours else ""
    text = f"{kind.__name__}: {exc}"
    return " ".join(text.split())[:300] + where


def judge(job: dict[str, Any]) -> dict[str, Any]:
    """Run the scenarios (then the exploration) until one fails."""
    from chaos.explore import document, simulate, swarm
    from chaos.insim import run_scenario
    from chaos.scenario import expected_refusal, load_scenario, refusal_problem

    baseline = "module" not in job
    failures: list[dict[str, Any]] = []

    def fail(status: str, scenario: str, seed: int | None, detail: str) -> dict[str, Any] | None:
        entry = {"status": status, "scenario": scenario, "seed": seed, "detail": detail}
        failures.append(entry)
        return None if baseline else entry

    refused = [p for p in job["scenarios"] if expected_refusal(p) is not None]
    for path in refused:  # each must be refused, with its own line
        try:
            problem = refusal_problem(path)
        except Exception:
            got = fail("crashed", path, None, _crash())
        else:
            got = None if problem is None else fail("killed", path, None, problem)
        if got:
            return got
    loaded = [load_scenario(p) for p in job["scenarios"] if p not in refused]
    for sc in loaded:
        try:
            outcome = run_scenario(sc)
        except Exception:
            got = fail("crashed", str(sc.path), None, _crash())
        else:
            ok = outcome.result.ok
            got = None if ok else fail("killed", str(sc.path), None, _failed(outcome.result))
        if got:
            return got
    skip = {(s, n) for s, n in job.get("skip", [])}
    for sc in loaded:
        if not job.get("explore"):
            break
        data = document(sc)
        for seed in range(job["explore"]):
            if (str(sc.path), seed) in skip:
                continue
            try:
                r = simulate(swarm(data, seed))
            except Exception:
                got = fail("crashed", str(sc.path), seed, _crash())
            else:
                detail = f"{', '.join(r.failed)}: {r.message}"
                got = None if r.ok else fail("killed", str(sc.path), seed, detail)
            if got:
                return got
    if baseline:
        return {"status": "baseline", "failures": failures}
    return {"status": "survived", "scenario": None, "seed": None, "detail": ""}


def main(argv: list[str]) -> int:
    with open(argv[1], encoding="utf-8") as f:
        job = json.load(f)
    sys.path.insert(0, job["root"])  # the checkout, where the script's own folder was
    os.chdir(job["root"])
    finder = None
    if "module" in job:
        with open(job["source"], encoding="utf-8") as f:
            source = f.read()
        finder = _MutantFinder(job["module"], job["path"], source)
        sys.meta_path.insert(0, finder)
    cov = None
    if job.get("coverage"):  # the baseline: which lines of the targets the suite runs
        import coverage

        cov = coverage.Coverage(data_file=None, include=job["coverage"], config_file=False)
        cov.start()
    try:
        verdict = judge(job)
    except Exception:  # a scenario the mutated engine cannot even load: no verdict
        verdict = {"status": "crashed", "scenario": None, "seed": None, "detail": _crash()}
    if cov is not None:
        cov.stop()
        data = cov.get_data()
        verdict["lines"] = {path: sorted(data.lines(path) or []) for path in job["coverage"]}
    verdict["mutated"] = finder.loaded if finder is not None else None
    if finder is not None and not finder.loaded:
        # the scenarios never imported it, or another file of that name shadows it
        verdict = {**verdict, "status": "not_imported"}
    if "targets" in job:  # the baseline: which of them the scenarios import, from where
        verdict["imported"] = {
            name: getattr(sys.modules.get(name), "__file__", None) for name in job["targets"]
        }
    tmp = job["result"] + ".part"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(verdict, f)
    os.replace(tmp, job["result"])  # whole or absent: a killed worker leaves no half verdict
    return 0


if __name__ == "__main__":
    del sys.path[0]  # this script's folder: the checkout's root takes its place in main
    sys.exit(main(sys.argv))
