"""The baseline, then every mutant in its own interpreter, `jobs` at a time.

Each worker is a fresh `python chaos/mutate/worker.py` in its own session (process group),
carrying the harness's owner mark (`chaos.stack.OWNER_ENV`): a timeout SIGKILLs its group,
and an interrupt (the CLI's handler kills every marked process at once) or `chaos clean`
after a SIGKILL finds it. The jobs, sources and verdicts live in one temp dir,
`chaos-mutate-<owner>-*`, removed at the end, on an error and on Ctrl-C (and by
`chaos clean` if this process was SIGKILLed).

The baseline runs first, unmutated: every scenario of the suite must pass (else the
suite measures nothing and the command stops), exploration seeds that fail without a
mutant are skipped for every mutant, and the time it took sets the default timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.mutate.generate import Mutant

WORKER = Path(__file__).with_name("worker.py")
#: The default per-mutant timeout: this many times the baseline's time, at least MIN_TIMEOUT_S.
TIMEOUT_FACTOR = 10.0
MIN_TIMEOUT_S = 30.0


class BaselineError(Exception):
    """The unmutated engine fails the suite (or a target is never imported): one line."""


@dataclass
class Verdict:
    mutant: Mutant
    status: str  # killed, crashed, timeout, survived, not_imported, equivalent
    scenario: str | None = None
    seed: int | None = None
    detail: str = ""
    seconds: float = 0.0
    #: False: no line of the change runs in the unmutated suite, so it survived unrun
    reached: bool = True
    #: The worker's exit status, as `Popen.returncode` (None: no worker ran): negative, the
    #: signal that ended it; a timeout's is -SIGKILL, the pool's kill at the deadline.
    returncode: int | None = None


@dataclass
class Baseline:
    seconds: float
    skip: list[tuple[str, int]] = field(default_factory=list)
    imported: dict[str, str | None] = field(default_factory=dict)
    #: path (relative to the checkout) -> the lines the unmutated suite runs
    lines: dict[str, frozenset[int]] = field(default_factory=dict)

    def reached(self, m: Mutant) -> bool:
        """Whether the suite runs any line of the change (else it cannot tell it apart)."""
        ran = self.lines.get(m.path)
        return ran is None or not m.lines or any(line in ran for line in m.lines)


class Pool:
    """The temp dir and the live workers; `close` kills what is left and removes the dir."""

    def __init__(self, root: Path) -> None:
        from chaos.stack import MARKER_ENV, OWNER_ENV, owner_token

        self.root = root
        token = owner_token()
        self.dir = Path(tempfile.mkdtemp(prefix=f"chaos-mutate-{token.replace(':', '_')}-"))
        (self.dir / ".owner").write_text(token)
        self.env = {
            **os.environ,
            MARKER_ENV: f"mutate-{os.getpid()}",
            OWNER_ENV: token,
            "PYTHONPATH": os.pathsep.join(
                [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
        }
        self.live: set[subprocess.Popen[bytes]] = set()
        self.lock = threading.Lock()
        self.closed = False
        self.count = 0

    def run(
        self, job: dict[str, Any], timeout: float | None
    ) -> tuple[dict[str, Any] | None, float, int]:
        """Run one worker; (its verdict, or None on a timeout, the seconds it took, and
        its exit status: on a timeout, -SIGKILL, the pool's kill). A worker that died
        without a verdict gives `{"status": "crashed", ...}`."""
        with self.lock:
            if self.closed:
                raise KeyboardInterrupt
            self.count += 1
            name = self.dir / f"m{self.count}"
        result = Path(f"{name}.verdict.json")
        job = {**job, "root": str(self.root), "result": str(result)}
        if "source_text" in job:
            Path(f"{name}.py").write_text(job.pop("source_text"), encoding="utf-8")
            job["source"] = f"{name}.py"
        Path(f"{name}.job.json").write_text(json.dumps(job), encoding="utf-8")
        started = time.monotonic()
        with open(f"{name}.log", "wb") as log, self.lock:
            if self.closed:
                raise KeyboardInterrupt
            proc = subprocess.Popen(
                [sys.executable, str(WORKER), f"{name}.job.json"],
                cwd=self.root,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
            self.live.add(proc)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            return None, time.monotonic() - started, proc.returncode
        finally:
            with self.lock:
                self.live.discard(proc)
        took = time.monotonic() - started
        if result.exists():
            verdict = json.loads(result.read_text(encoding="utf-8"))
        else:
            if self.closed:
                raise KeyboardInterrupt
            tail = Path(f"{name}.log").read_text(errors="replace").strip().splitlines()[-1:]
            verdict = {
                "status": "crashed",
                "detail": f"worker exited {proc.returncode} without a verdict: "
                + (tail[0][:300] if tail else "no output"),
            }
        for suffix in (".job.json", ".py", ".log", ".verdict.json"):
            with contextlib.suppress(OSError):
                os.unlink(f"{name}{suffix}")
        return verdict, took, proc.returncode

    def close(self) -> None:
        with self.lock:
            self.closed = True
            live = list(self.live)
        for proc in live:
            _kill(proc)
        shutil.rmtree(self.dir, ignore_errors=True)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()


@contextlib.contextmanager
def pool(root: Path) -> Iterator[Pool]:
    p = Pool(root)
    try:
        yield p
    finally:
        p.close()


def baseline(
    p: Pool, scenarios: Sequence[str], explore: int, modules: Sequence[str], paths: Sequence[str]
) -> Baseline:
    """The suite on the unmutated engine: every scenario must pass; failing exploration
    seeds are returned to be skipped; which target modules the scenarios import, and which
    lines of the target files (`paths`, relative to the checkout) they run."""
    files = {str(p.root / path): path for path in paths}
    job = {
        "scenarios": list(scenarios),
        "explore": explore,
        "targets": list(modules),
        "coverage": list(files),
    }
    verdict, took, _ = p.run(job, None)
    assert verdict is not None
    if verdict.get("status") != "baseline":
        raise BaselineError(f"chaos mutate: the unmutated baseline failed: {verdict.get('detail')}")
    skip = []
    for failure in verdict["failures"]:
        if failure["seed"] is None:
            raise BaselineError(
                f"chaos mutate: {failure['scenario']} fails without any mutant "
                f"({failure['status']}: {failure['detail'][:200]}); expected a green suite"
            )
        skip.append((failure["scenario"], int(failure["seed"])))
    lines = {files[k]: frozenset(v) for k, v in verdict.get("lines", {}).items()}
    return Baseline(took, skip, verdict.get("imported", {}), lines)


def run_all(
    p: Pool,
    mutants: Sequence[Mutant],
    scenarios: Sequence[str],
    explore: int,
    skip: Sequence[tuple[str, int]],
    jobs: int,
    timeout: float,
    on_verdict: Callable[[Verdict], None] | None = None,
) -> list[Verdict]:
    """Every mutant against the suite, `jobs` at a time; verdicts in the mutants' order."""
    base = {"scenarios": list(scenarios), "explore": explore, "skip": [list(s) for s in skip]}

    def one(m: Mutant) -> Verdict:
        job = {**base, "module": m.module, "path": str(p.root / m.path), "source_text": m.source}
        verdict, took, code = p.run(job, timeout)
        if verdict is None:
            detail = f"no verdict within {timeout:.0f} s"
            return Verdict(m, "timeout", detail=detail, seconds=took, returncode=code)
        return Verdict(
            m,
            verdict["status"],
            verdict.get("scenario"),
            verdict.get("seed"),
            verdict.get("detail", ""),
            took,
            returncode=code,
        )

    verdicts: dict[str, Verdict] = {}
    # Results come through a queue, not `as_completed`: a Ctrl-C raised while that holds
    # the futures' locks leaves them held, and the workers' threads then never finish.
    done: queue.SimpleQueue[Future[Verdict]] = queue.SimpleQueue()
    executor = ThreadPoolExecutor(max_workers=jobs)
    try:
        for m in mutants:
            executor.submit(one, m).add_done_callback(done.put)
        for _ in mutants:
            v = done.get().result()
            verdicts[v.mutant.id] = v
            if on_verdict is not None:
                on_verdict(v)
    finally:
        p.close()  # kills the workers still running (an interrupt): their threads then end
        executor.shutdown(wait=True, cancel_futures=True)
    return [verdicts[m.id] for m in mutants]
