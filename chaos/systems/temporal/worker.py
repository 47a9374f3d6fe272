"""`python -m chaos.systems.temporal.worker --address HOST:PORT`: one Temporal worker of
the harness's evaluations (a process a scenario may SIGKILL, pause or restart)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from datetime import timedelta

from temporalio.client import Client
from temporalio.worker import Worker

from chaos.systems.temporal.server import NAMESPACE
from chaos.systems.temporal.workflow import TASK_QUEUE, EvaluationWorkflow, call_rule

#: Printed on stdout once the worker polls: a test or a runner waits for it, not for time.
READY_LINE = "temporal worker ready"
#: Tasks a worker takes on at once. The SDK's defaults (hundreds) let a busy worker start more
#: calls than its event loop can heartbeat within the 1 s timeout: they time out, are
#: retried, and load it further (seen here with 100 evaluations on a loaded machine).
MAX_CONCURRENT = 32


class WorkerRefused(Exception):
    """The worker cannot serve: said in one line, exit 3."""


async def serve(address: str, task_queue: str = TASK_QUEUE) -> None:
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
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with worker:
        print(READY_LINE, flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.systems.temporal.worker")
    parser.add_argument("--address", required=True, help="the dev server's host:port")
    parser.add_argument("--task-queue", default=TASK_QUEUE)
    args = parser.parse_args(argv)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(args.address, args.task_queue))
    except WorkerRefused as exc:
        print(f"temporal worker: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
