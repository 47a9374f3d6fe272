"""`python -m chaos.systems.temporal.worker --address HOST:PORT [--history FILE]`: one
Temporal worker of the harness's evaluations (a process a scenario may SIGKILL, pause or
restart), recording what it does in the engine's history vocabulary."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import uuid
from datetime import timedelta

from temporalio.client import Client
from temporalio.worker import Worker

from chaos.systems.core_workflow import STOPPING, open_recorder, record
from chaos.systems.temporal.server import NAMESPACE
from chaos.systems.temporal.workflow import (
    OWN_QUEUE,
    TASK_QUEUE,
    EvaluationWorkflow,
    call_rule,
)

#: Printed on stdout once the worker polls (then its queues): a test or a runner waits for it,
#: not for time (the runner for " ready: ", the engine's workers' word).
READY_LINE = "temporal worker ready:"
#: Tasks a worker takes on at once. The SDK's defaults (hundreds) let a busy worker start more
#: calls than its event loop can heartbeat within the 1 s timeout: they time out, are
#: retried, and load it further (seen here with 100 evaluations on a loaded machine).
MAX_CONCURRENT = 32


class WorkerRefused(Exception):
    """The worker cannot serve: said in one line, exit 3."""


async def serve(address: str, task_queue: str = TASK_QUEUE, worker_id: str = "") -> None:
    """Poll `task_queue` for workflow and activity tasks, and a queue of this worker's own
    for the level-1 retries of the calls it answered (`SAME_WORKER_WAIT`)."""
    try:
        client = await Client.connect(address, namespace=NAMESPACE)
    except Exception as exc:  # nothing answers there: one line
        raise WorkerRefused(f"cannot reach a Temporal server at {address}: {exc}") from None
    worker = Worker(
        client,
        task_queue=task_queue,
        workflows=[EvaluationWorkflow],
        activities=[call_rule],
        max_concurrent_activities=MAX_CONCURRENT,
        max_concurrent_workflow_tasks=MAX_CONCURRENT,
        # the SDK's 10 s default adds itself to every recovery after a worker's death: a
        # workflow task stuck on the dead worker's sticky queue waits that long
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=1),
    )
    OWN_QUEUE[0] = own_queue = f"{task_queue}@{worker_id or os.getpid()}"
    own = Worker(
        client,
        task_queue=own_queue,
        activities=[call_rule],
        max_concurrent_activities=MAX_CONCURRENT,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with worker, own:
        record("worker_started", sweeper=False)
        print(f"{READY_LINE} task queues {task_queue} and {own_queue}", flush=True)
        await stop.wait()
        STOPPING[0] = True
        record("worker_stopping")
    record("worker_stopped", metrics={})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.systems.temporal.worker")
    parser.add_argument("--address", required=True, help="the dev server's host:port")
    parser.add_argument("--task-queue", default=TASK_QUEUE)
    parser.add_argument("--history", help="append the event history (JSON lines) to this file")
    parser.add_argument("--worker-id", help="this worker's name in the history")
    args = parser.parse_args(argv)
    worker_id = args.worker_id or f"w{os.getpid()}-{uuid.uuid4().hex[:6]}"
    open_recorder(args.history, worker_id)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(args.address, args.task_queue, worker_id))
    except WorkerRefused as exc:
        print(f"temporal worker: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
