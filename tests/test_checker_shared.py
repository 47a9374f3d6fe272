"""How the checker runs: a long history judged on two processes (`chaos.checker.shared`)
gives what one process gives (verdicts, cases, violations with their evidence, stats in
their order), also when the child fails, and only where it may fork; the collector paused
for a check."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import chaos.checker.shared as shared
from chaos.checker import REGISTRY, CheckResult, Context, check, collector_paused
from chaos.checker.invariants import Invariant
from chaos.insim import run_scenario
from chaos.scenario import load_scenario
from tests.test_chaos_runs import SCENARIOS

ROOT = Path(__file__).resolve().parents[1]

two_cores = pytest.mark.skipif(
    not hasattr(os, "fork") or len(os.sched_getaffinity(0)) < 2, reason="needs fork, 2 cores"
)


@pytest.fixture(scope="module")
def broken() -> tuple[list[dict], Any, Any]:
    """What a run with violations to find (a mutant's) hands its check."""
    import chaos.insim.run as insim

    given: list[tuple] = []
    real = insim.check

    def keep(*args: Any) -> CheckResult:
        given.append(args)
        return real(*args)

    insim.check = keep
    try:
        outcome = run_scenario(
            load_scenario(SCENARIOS / "crash_after_ack.yaml"), mutant="ignore_dag"
        )
    finally:
        insim.check = real
    assert not outcome.result.ok
    return given[0]


def _judged(
    given: tuple[list[dict], Any, Any], monkeypatch: pytest.MonkeyPatch, *, two: bool
) -> CheckResult:
    monkeypatch.setattr(shared, "LONG", 0 if two else 10**12)
    # a thread an earlier test of the session left would forbid the fork (as it should)
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    return check(*given)


def _same(a: CheckResult, b: CheckResult) -> None:
    assert a.verdicts == b.verdicts and a.cases == b.cases
    assert a.violations == b.violations
    assert list(a.stats.items()) == list(b.stats.items())  # in the same order too


@two_cores
def test_two_processes_judge_as_one(broken: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    forks: list[int] = []
    fork = os.fork
    monkeypatch.setattr(os, "fork", lambda: forks.append(1) or fork())
    one = _judged(broken, monkeypatch, two=False)
    assert not forks
    two = _judged(broken, monkeypatch, two=True)
    assert forks == [1]
    _same(one, two)
    assert one.violations  # there was something to find, and both found it
    plain = Context(*broken)  # the invariants run one after the other on one stats dict
    for inv in REGISTRY:
        inv.check(plain)
    assert list(two.stats.items())[: len(plain.stats)] == list(plain.stats.items())


@two_cores
def test_what_the_child_did_not_send_back_the_parent_runs(
    broken: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = _judged(broken, monkeypatch, two=False)
    parent = os.getpid()

    def dies_in_the_child(inv: Invariant) -> Invariant:
        def check(cx: Any) -> Any:
            if os.getpid() != parent:
                os._exit(3)  # the child dies half-way through its share
            return inv.check(cx)

        return Invariant(inv.name, inv.meaning, check, inv.needs_history)

    monkeypatch.setattr("chaos.checker.REGISTRY", tuple(dies_in_the_child(i) for i in REGISTRY))
    _same(one, _judged(broken, monkeypatch, two=True))


@two_cores
def test_never_with_other_threads_or_when_not_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as alone:
        alone.setattr(threading, "active_count", lambda: 1)
        assert shared.shared(shared.LONG)
        assert not shared.shared(shared.LONG - 1)
        alone.setattr(shared, "ALLOWED", False)
        assert not shared.shared(shared.LONG)
    done = threading.Event()
    other = threading.Thread(target=done.wait)
    other.start()
    try:
        assert not shared.shared(shared.LONG)  # a fork would copy only this thread
    finally:
        done.set()
        other.join()


_CHILD = """
import os, sys, time
from chaos.lifetime import die_with_parent
parent = os.getpid()
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    die_with_parent(parent)
    os.write(write, b"1")
    time.sleep(120)
    os._exit(0)
os.read(read, 1)  # the child asked to die with us
print(pid, flush=True)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_forked_checker_dies_with_its_parent() -> None:
    """A parent killed outright (SIGKILL: no `finally` runs) leaves no child computing."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        child = int(proc.stdout.readline())
        assert not _gone(child)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30  # patience only: the kernel's signal is immediate
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    gone = _gone(child)
    if not gone:  # the test failed: leave nothing behind all the same
        os.kill(child, signal.SIGKILL)
    assert gone


def test_the_collector_is_paused_for_a_check_and_left_as_it_was() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # a check within a simulated run
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # a caller's own setting is kept
    finally:
        gc.enable()
    try:
        with collector_paused():
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.isenabled()
