"""The engine's core as a DBOS workflow on a private PostgreSQL: its evaluations end as the
fault-free reference says, and a worker SIGKILLed in step 2 and relaunched under its
executor id resumes with step 1 run once (the second document's L3 proof, on DBOS)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from dbos import DBOSClient

from chaos.systems.core_workflow import ReadyProcess
from chaos.systems.dbos.worker import READY_LINE, URL_ENV
from chaos.systems.dbos.workflow import CALLS_ENV, enqueue
from chaos.systems.pg_store.postgres import PostgresServer
from tests.live.test_postgres_live import pytestmark  # noqa: F401  (a private PostgreSQL)
from tests.live.test_temporal_live import _as_outcome, _expected, _jobs

ROOT = Path(__file__).resolve().parents[2]
#: How long a wait for an event that must come may last: only a broken design uses it up.
PATIENCE_S = 120.0


@pytest.fixture
def system_db() -> Iterator[str]:
    """The URL of a system database on a PostgreSQL of the test's own (DBOS creates it)."""
    with PostgresServer() as server:
        yield server.url(database="chaos_dbos")


class Worker(ReadyProcess):
    """A DBOS worker process under an executor id; each call appends a line to `calls`."""

    def __init__(
        self, url: str, executor_id: str, calls: Path, env: dict[str, str] | None = None
    ) -> None:
        env = {URL_ENV: url, CALLS_ENV: str(calls), **(env or {})}
        super().__init__(
            "chaos.systems.dbos.worker", ["--executor-id", executor_id], READY_LINE, env
        )


def _outcome(ended: dict[str, Any]) -> dict[str, Any]:
    return _as_outcome(SimpleNamespace(**ended))


def _calls(path: Path) -> Counter[str]:
    """Agent calls per rule, as the steps logged them."""
    if not path.exists():
        return Counter()
    return Counter(line.split()[1] for line in path.read_text().splitlines())


def test_evaluations_end_as_the_reference_says(
    system_db: str, workers: list[Any], tmp_path: Path
) -> None:
    """static_analysis fails for good after its retries (durable sleeps between attempts):
    exactly its dependents are skipped, the rest as without faults."""
    loaded, seed, jobs = _jobs("permanent_failure_prunes")
    workers.append(Worker(system_db, "slot-0", tmp_path / "calls.txt"))
    client = DBOSClient(system_database_url=system_db)
    try:
        handles = [enqueue(client, job) for job in jobs]
        ends = {h.get_workflow_id(): _outcome(h.get_result()) for h in handles}
    finally:
        client.destroy()
    assert ends == _expected(loaded, seed)


def test_worker_killed_in_step_2_resumes_with_step_1_run_once(
    system_db: str, workers: list[Any], tmp_path: Path
) -> None:
    """The worker SIGKILLed while step 2's call is in flight and relaunched under the same
    executor id (DBOS recovers its own executor's workflows at launch): step 1 ran once,
    step 2 twice, and the result is the fault-free one."""
    loaded, seed, jobs = _jobs("worker_killed_in_step_2")
    for job in jobs:  # 2 s a call: the kill lands while step 2's call is in flight
        job.time_scale *= 10
    calls = tmp_path / "calls.txt"
    workers.append(Worker(system_db, "slot-0", calls))
    client = DBOSClient(system_database_url=system_db)
    try:
        (handle,) = [enqueue(client, job) for job in jobs]
        deadline = time.monotonic() + PATIENCE_S
        while not _calls(calls)["step_2"]:  # step 2's call has started
            assert time.monotonic() < deadline, "step 2 never started"
            time.sleep(0.01)
        workers[0].kill()
        workers.append(Worker(system_db, "slot-0", calls))
        ended = _outcome(handle.get_result())
    finally:
        client.destroy()
    assert {handle.get_workflow_id(): ended} == _expected(loaded, seed)
    assert _calls(calls) == {"step_1": 1, "step_2": 2, "step_3": 1}


@pytest.mark.parametrize(
    ("failpoint", "calls"),
    [
        # the answer came and died with the worker before DBOS recorded the step: run again
        ("rule_after_call_before_write=crash,rule=step_1", {"step_1": 2}),
        ("rule_before_call=crash,rule=step_2", {"step_2": 1}),  # the call was never made
    ],
)
def test_the_engines_failpoints_crash_inside_the_step(
    system_db: str, workers: list[Any], tmp_path: Path, failpoint: str, calls: dict[str, int]
) -> None:
    """`rule_before_call` and `rule_after_call_before_write`, armed as a worker's are: the
    worker dies there, its relaunch runs that call again and nothing else."""
    loaded, seed, jobs = _jobs("worker_killed_in_step_2")
    log = tmp_path / "calls.txt"
    workers.append(Worker(system_db, "slot-0", log, {"ENGINE_FAILPOINTS": failpoint}))
    client = DBOSClient(system_database_url=system_db)
    try:
        (handle,) = [enqueue(client, job) for job in jobs]
        workers[0].proc.wait()  # it crashes at the failpoint
        assert workers[0].proc.returncode == -signal.SIGKILL
        workers.append(Worker(system_db, "slot-0", log))
        ended = _outcome(handle.get_result())
    finally:
        client.destroy()
    assert {handle.get_workflow_id(): ended} == _expected(loaded, seed)
    assert _calls(log) == {"step_1": 1, "step_2": 1, "step_3": 1} | calls


def test_a_postgres_killed_and_restarted_loses_nothing(workers: list[Any], tmp_path: Path) -> None:
    """DBOS's one service SIGKILLed mid-run (calls under way) and restarted on its data: the
    worker reconnects and the evaluations end as without faults."""
    loaded, seed, jobs = _jobs("permanent_failure_prunes")
    calls = tmp_path / "calls.txt"
    with PostgresServer() as server:
        url = server.url(database="chaos_dbos")
        workers.append(Worker(url, "slot-0", calls))
        client = DBOSClient(system_database_url=url)
        try:
            handles = [enqueue(client, job) for job in jobs]
            deadline = time.monotonic() + PATIENCE_S
            while sum(_calls(calls).values()) < 5:  # work under way
                assert time.monotonic() < deadline, "no call ever started"
                time.sleep(0.01)
            server.kill()
            server.start()
            ends = {h.get_workflow_id(): _outcome(h.get_result()) for h in handles}
        finally:
            client.destroy()
    assert ends == _expected(loaded, seed)


def test_the_bench_measures_dbos(system_db: str, tmp_path: Path) -> None:
    """`bench/durable_designs.py`'s DBOS side still measures what it says: every evaluation
    completes, and the killed worker's call starts again once it is relaunched (no time
    bound asserted: CI shares a busy machine)."""
    from bench.durable_designs import dbos_rate, dbos_recovery

    assert dbos_rate(system_db, 5, tmp_path) > 0
    assert dbos_recovery(system_db, tmp_path) > 0


def test_a_worker_with_no_database_says_so_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "chaos.systems.dbos.worker", "--executor-id", "slot-0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=PATIENCE_S,
        env={**os.environ, URL_ENV: "postgresql://nobody:secret@127.0.0.1:1/chaos_dbos"},
    )
    assert done.returncode == 3
    assert done.stderr.startswith("dbos worker: cannot launch on EAI_DBOS_URL: ")
    assert len(done.stderr.splitlines()) == 1
    assert "secret" not in done.stderr  # the URL's credentials are never printed
