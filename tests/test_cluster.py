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
from collections.abc import Iterator
from pathlib import Path

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
from chaos.explore import document, explore
from chaos.scenario import load_scenario

pytestmark = pytest.mark.slow  # LocalClusters of worker processes, CLI runs in subprocesses

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "crash_after_ack.yaml"
SEEDS = range(24)
MUTANT = "no_redis_results"  # found within 20 seeds of crash_after_ack (test_explore)


def chaos(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chaos", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )


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
        assert not session.client.who_has()  # nothing of ours kept on the cluster
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
            assert not client.who_has()  # and nothing stayed on the cluster
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
        assert not session.client.who_has()


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


def test_cluster_and_jobs_together_is_exit_2() -> None:
    run = chaos("sim", str(SCENARIO), "--cluster", "local:2", "--jobs", "2")
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "--cluster" in lines[0] and "--jobs" in lines[0]


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
