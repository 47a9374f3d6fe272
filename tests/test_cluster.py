"""`chaos sim --cluster`: on a real Dask LocalCluster (no mocks), the same per-seed results
as the process pool, the same failing seeds under a mutant, refusals in one line, and
nothing left running. Every wait is for an event (workers registered, a process ended)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chaos import stack
from chaos.cluster import (
    CONNECT_TIMEOUT_S,
    ClusterError,
    ClusterSession,
    batch_size,
    check_versions,
    connect,
    fingerprint,
)
from chaos.explore import SeedResult, ShrinkStats, document, explore, shrink, swarm
from chaos.scenario import load_scenario
from tests.cli_helpers import ROOT, chaos

pytestmark = pytest.mark.slow  # LocalClusters of worker processes, CLI runs in subprocesses

#: How long the scheduler may take to forget what a client cancelled: `Client.cancel` only
#: sends the release, which a busy scheduler handles a moment later (seen in CI).
RELEASE_PATIENCE_S = 30.0


def _kept_on(client: Any) -> dict[str, Any]:
    """What the cluster still holds of ours, once the releases sent have been handled (or
    the patience ran out: then it is kept for good, and the test fails)."""
    deadline = time.monotonic() + RELEASE_PATIENCE_S
    while (held := client.who_has()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return held


SCENARIO = ROOT / "scenarios" / "crash_after_ack.yaml"
SEEDS = range(24)
MUTANT = "no_redis_results"  # found within 20 seeds of crash_after_ack (test_explore)


def _children() -> set[int]:
    """This process's live children (zombies are gone already or about to be reaped)."""
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True) if p.is_running()}


def _owned_by(pid: int) -> list[int]:
    """Marked processes whose owner was the process `pid` (dead or alive)."""
    return [
        p
        for p, env in stack._marked_processes()
        if env.get(stack.OWNER_ENV, "").startswith(f"{pid}:")
    ]


@contextlib.contextmanager
def _test_cluster(workers: int) -> Iterator[str]:
    """A LocalCluster of the test's own, on 127.0.0.1: what a user's cluster is to us."""
    import dask
    import distributed

    scratch = tempfile.mkdtemp(prefix="test-cluster-")
    with dask.config.set({"temporary-directory": scratch}):  # the scheduler's too
        cluster = distributed.LocalCluster(
            n_workers=workers,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=None,
            scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},  # 8787 left free
            local_directory=scratch,
        )
    try:
        yield cluster.scheduler_address
    finally:
        cluster.close()
        shutil.rmtree(scratch, ignore_errors=True)


def test_local_cluster_gives_the_pool_s_results_seed_by_seed() -> None:
    data = document(load_scenario(SCENARIO))
    pool = explore(data, SEEDS, jobs=2)
    pool_mutant = explore(data, SEEDS, jobs=2, mutant=MUTANT)
    assert [r.seed for r in pool.results] == list(SEEDS)
    before = _children()  # the pool's resource tracker outlives it, as it should
    seen: list[int] = []
    with connect("local:2") as session:
        assert session.threads == 2
        on = explore(data, SEEDS, on_result=lambda r: seen.append(r.seed), cluster=session)
        on_mutant = explore(data, SEEDS, mutant=MUTANT, cluster=session)
        assert not _kept_on(session.client)  # nothing of ours kept on the cluster
    assert sorted(seen) == list(SEEDS)  # each seed streamed once
    assert on.results == pool.results  # hashes, verdicts, messages: in seed order
    assert [r.history_hash for r in on.results] == [r.history_hash for r in pool.results]
    assert all(r.history_hash for r in on.results)
    failing = [r.seed for r in on_mutant.failures]
    assert failing and failing == [r.seed for r in pool_mutant.failures]
    assert on_mutant.results == pool_mutant.results
    assert _children() <= before  # the LocalCluster's processes are gone
    assert not list(Path(tempfile.gettempdir()).glob(f"chaos-dask-{os.getpid()}_*"))


def test_the_command_finds_and_shrinks_the_same_failures_as_jobs(tmp_path: Path) -> None:
    common = ("sim", str(SCENARIO), "--seeds", "20", "--mutant", MUTANT, "--shrink")
    jobs = chaos(*common, "--jobs", "2", "--regressions", str(tmp_path / "jobs"))
    cluster = chaos(*common, "--cluster", "local:2", "--regressions", str(tmp_path / "cluster"))
    assert jobs.returncode == cluster.returncode == 1, cluster.stderr

    def failing(out: str) -> list[str]:
        return [ln for ln in out.splitlines() if ln.startswith("  seed ")]

    assert failing(cluster.stdout) and failing(cluster.stdout) == failing(jobs.stdout)
    written = sorted(p.name for p in (tmp_path / "cluster").glob("*.yaml"))
    assert written == sorted(p.name for p in (tmp_path / "jobs").glob("*.yaml"))
    assert (tmp_path / "cluster" / written[0]).read_text() == (
        tmp_path / "jobs" / written[0]
    ).read_text()
    [shrunk] = [ln for ln in cluster.stdout.splitlines() if ln.startswith("shrunk to ")]
    assert " on the cluster (" in shrunk  # its candidates ran there, not here
    [here] = [ln for ln in jobs.stdout.splitlines() if ln.startswith("shrunk to ")]
    assert shrunk.split(" simulations")[0] == here.split(" simulations")[0]
    assert "Traceback" not in cluster.stderr


def test_an_unreachable_scheduler_is_one_line_exit_3() -> None:
    run = chaos("sim", str(SCENARIO), "--seeds", "5", "--cluster", "tcp://127.0.0.1:1")
    assert run.returncode == 3
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "tcp://127.0.0.1:1" in lines[0], run.stderr
    assert f"{CONNECT_TIMEOUT_S:.0f} s" in lines[0]


def test_a_worker_running_other_code_is_refused_by_name() -> None:
    """One worker's fingerprint function replaced in that worker's process (as another
    checkout's would answer): the command names it, not the other, and runs nothing."""
    import distributed

    with _test_cluster(2) as address:
        client = distributed.Client(address, set_as_default=False)
        try:
            client.wait_for_workers(2)
            odd, same = sorted(client.nthreads())

            def other_code() -> None:
                import chaos.cluster

                chaos.cluster.fingerprint = lambda dirs=None: "0" * 64

            client.run(other_code, workers=[odd])
            run = chaos("sim", str(SCENARIO), "--seeds", "5", "--cluster", address)
            assert run.returncode == 3
            lines = run.stderr.strip().splitlines()
            assert len(lines) == 1 and odd in lines[0] and same not in lines[0], run.stderr
            assert "another version" in lines[0]
            assert run.stdout == ""  # no seed ran
            assert not _kept_on(client)  # and nothing stayed on the cluster
            with pytest.raises(ClusterError, match=odd):  # the same check, in process
                check_versions(ClusterSession(client, address))
        finally:
            client.close()


def test_a_batch_from_a_worker_running_other_code_stops_the_run() -> None:
    """A worker that passed the check at connect (or joined after it) and then answers a
    batch with another fingerprint: the run stops in a ClusterError naming it."""
    data = document(load_scenario(SCENARIO))
    with _test_cluster(2) as address, connect(address) as session:
        odd = sorted(session.client.nthreads())[0]

        def other_code() -> None:
            import chaos.cluster

            chaos.cluster._process_fingerprint = lambda: "0" * 64

        session.client.run(other_code, workers=[odd])
        with pytest.raises(ClusterError, match=f"worker {odd} of {address}"):
            explore(data, SEEDS, cluster=session)
        assert not _kept_on(session.client)


def test_the_fingerprint_follows_the_source(tmp_path: Path) -> None:
    """Honest on real files: a copy of the packages fingerprints as the original does, and
    one byte changed in one file changes it."""
    import chaos.cluster

    dirs = chaos.cluster._package_dirs()
    copies = []
    for name, root in dirs:
        shutil.copytree(root, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
        copies.append((name, tmp_path / name))
    assert fingerprint(copies) == fingerprint(dirs) == fingerprint()
    target = tmp_path / "engine" / "policy.py"
    target.write_text(target.read_text() + "\n")
    assert fingerprint(copies) != fingerprint(dirs)


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (("--cluster", "local:2", "--jobs", "2"), ("--jobs 2", "--cluster", "expected")),
        (("--jobs", "0", "--cluster", "local:2"), ("--jobs 0", "--cluster", "expected")),
        (("--all-failpoints", "--shrink"), ("--all-failpoints", "--shrink", "expected")),
        (("--all-failpoints", "--seeds", "5"), ("--all-failpoints", "--seeds", "expected")),
        (("--seeds", "5", "--all-failpoints", "--report", "REPORT"), ("--seeds, --report",)),
    ],
)
def test_contradictory_options_are_one_line_exit_2(
    tmp_path: Path, given: tuple[str, ...], named: tuple[str, ...]
) -> None:
    """Options that contradict each other (`--jobs 0`, the default's value, included) are
    refused before anything starts: one line naming them and what was expected, exit 2,
    nothing run or written (no cluster started, no regression, no report)."""
    argv = [str(tmp_path / "report") if a == "REPORT" else a for a in given]
    out = tmp_path / "out"
    run = chaos("sim", str(SCENARIO), *argv, "--out", str(out), "--regressions", str(out))
    assert run.returncode == 2, run.stdout + run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("chaos sim: "), run.stderr
    assert all(n in lines[0] for n in named), lines[0]
    assert run.stdout == ""
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def session() -> Iterator[ClusterSession]:
    """One LocalCluster of 2 workers (`_test_cluster`) and our session on it, for the
    module's in-process comparisons: both closed at the end, a failing test's too."""
    with _test_cluster(2) as address, connect(address) as on:
        yield on


def _nothing_here(*_args: object, **_kwargs: object) -> SeedResult:
    """In place of this process's `simulate`: a simulation asked of the cluster must not
    run here (the workers' own modules are untouched)."""
    raise AssertionError("simulated in the client's process, not on the cluster")


#: A shrink of several rounds (116 simulations one by one): a mutant's failing seed of the
#: regression scenario written for it.
SHRUNK = ("regressions/cancel-read-before-a-call-quiet-state-s4", "cancel_read_unheard", 14)


@pytest.mark.parametrize(("budget", "width"), [(200, 2), (40, 3)])
def test_shrinking_on_the_cluster_keeps_what_shrinking_here_keeps(
    session: ClusterSession, budget: int, width: int
) -> None:
    """The candidates of each round run on the cluster `width` at once; the shrunk
    scenario, and the simulations its decisions took, are those of one by one here, also
    when the budget stops it midway (40 of 116)."""
    from chaos.cluster import simulate_on

    name, mutant, seed = SHRUNK
    data = document(load_scenario(ROOT / "scenarios" / f"{name}.yaml"))
    variant = swarm(data, seed)
    [invariant] = explore(data, [seed], jobs=1, mutant=mutant).results[0].failed[:1]
    here = ShrinkStats()
    alone = shrink(variant, invariant, mutant, budget=budget, stats=here)
    there = ShrinkStats()
    batched = shrink(
        variant,
        invariant,
        mutant,
        run=_nothing_here,
        budget=budget,
        run_many=lambda docs, m: simulate_on(session, docs, m),
        width=width,
        stats=there,
    )
    assert batched == alone
    assert there.decisive == here.decisive == here.run
    assert there.run >= there.decisive
    # several rounds when the budget lets it end (116 simulations at this writing); 40 stops
    # it midway, its last batch cut to the budget
    assert 40 < here.decisive < budget if budget == 200 else here.decisive == budget
    assert not _kept_on(session.client)  # no candidate or result kept on the cluster


def test_all_failpoints_on_the_cluster_gives_the_same_crash_points(
    session: ClusterSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--all-failpoints` on the cluster (each failpoint's hits a sequence there): the same
    crash points tried, the same failing ones in the same order, as one by one here."""
    import argparse
    import io

    from rich.console import Console

    import chaos.simcli
    from chaos.cli import NO_WRAP_WIDTH

    data = document(load_scenario(ROOT / "scenarios" / "crash_in_write_window.yaml"))
    args = argparse.Namespace(first_seed=0, mutant=MUTANT)

    def lines(cluster: ClusterSession | None) -> list[str]:
        out = io.StringIO()
        console = Console(file=out, highlight=False, soft_wrap=True, width=NO_WRAP_WIDTH)
        code = chaos.simcli._all_failpoints(data, args, console, cluster)
        assert code == 1
        first, *rest = out.getvalue().splitlines()
        return [first.split(" in ")[0], first.split(" s, ")[1], *rest]  # the time left out

    here = lines(None)
    monkeypatch.setattr(chaos.simcli, "simulate", _nothing_here)
    there = lines(session)
    assert there == here and len(here) > 2, here[:3]
    assert not _kept_on(session.client)


def test_without_dask_chaos_imports_and_cluster_says_how_to_install() -> None:
    blocked = (
        "import sys; sys.modules['dask'] = sys.modules['distributed'] = None\n"
        "import chaos.cli, chaos.explore, chaos.simcli, chaos.cluster\n"
        "sys.exit(chaos.cli.main(sys.argv[1:], exiting=True))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", blocked, "sim", str(SCENARIO), "--cluster", "local:2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 3
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install -e '.[cluster]'" in lines[0], run.stderr


def test_an_interrupted_run_leaves_nothing_behind() -> None:
    """SIGINT once the cluster's workers run seeds (a progress line seen): exit 130, one
    line, no process of the run and no scratch dir left."""
    import signal

    command = ["sim", str(SCENARIO), "--seeds", "1000000", "--cluster", "local:2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "chaos", *command],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # the first progress line (5 s): seeds are running
        assert first.startswith("chaos sim crash_after_ack: "), first
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert rest.strip().splitlines()[-1].startswith("chaos sim: interrupted (SIGINT)"), rest
    assert not _owned_by(proc.pid)
    assert not list(Path(tempfile.gettempdir()).glob(f"chaos-dask-{proc.pid}_*"))


@pytest.mark.parametrize(
    ("seeds", "threads", "size"),
    [(20, 2, 3), (200, 2, 25), (10_000, 2, 200), (1_000_000, 100, 200), (3, 64, 1)],
)
def test_batches_give_each_thread_several(seeds: int, threads: int, size: int) -> None:
    assert batch_size(seeds, threads) == size
