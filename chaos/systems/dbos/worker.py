"""`python -m chaos.systems.dbos.worker --executor-id ID [--history FILE]`: one DBOS worker
of the harness's evaluations, its system database named by `EAI_DBOS_URL` (credentials only
there), recording what it does in the engine's history vocabulary.

A slot keeps its executor id across restarts: DBOS recovers, at launch, the workflows its
own executor left unfinished, and nothing else (another worker's only when an operator asks
DBOS's recovery for that executor id)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading

#: Printed on stdout once the worker is launched: a test or a runner waits for it, not for
#: time (the runner for " ready: ", the engine's workers' word).
READY_LINE = "dbos worker ready:"
URL_ENV = "EAI_DBOS_URL"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.systems.dbos.worker")
    parser.add_argument("--executor-id", required=True)
    parser.add_argument("--history", help="append the event history (JSON lines) to this file")
    parser.add_argument("--worker-id", help="this worker's name in the history")
    parser.add_argument(
        "--concurrency",
        type=int,
        help="evaluations a worker runs at once (the queue's worker_concurrency)",
    )
    args = parser.parse_args(argv)
    url = os.environ.get(URL_ENV)
    if not url:
        print(f"dbos worker: {URL_ENV} is not set", file=sys.stderr)
        return 3
    from dbos import DBOS

    from chaos.systems.core_workflow import open_recorder, record, stopping
    from chaos.systems.dbos import workflow

    open_recorder(args.history, args.worker_id or f"w{os.getpid()}-{args.executor_id}")

    DBOS(
        config={
            "name": workflow.APP_NAME,
            "system_database_url": url,
            "executor_id": args.executor_id,
            "application_version": workflow.APP_VERSION,
            "log_level": "WARNING",
        }
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log = logging.getLogger("dbos")
    level = log.level
    log.setLevel(logging.CRITICAL)  # a failed launch is said below in one line, not traced
    try:
        DBOS.launch()
        DBOS.register_queue(
            workflow.QUEUE_NAME,
            worker_concurrency=args.concurrency or workflow.WORKER_CONCURRENCY,
            polling_interval_sec=0.1,
        )
    except Exception as exc:  # an unreachable database, refused credentials: one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"dbos worker: cannot launch on {URL_ENV}: {first}", file=sys.stderr)
        with contextlib.suppress(Exception):
            DBOS.destroy()
        return 3
    log.setLevel(level)
    record("worker_started", sweeper=False)
    print(f"{READY_LINE} executor {args.executor_id}", flush=True)
    stop.wait()
    stopping()
    for attempt_id in sorted(workflow.RUNNING):  # pending under this executor id: its
        # relaunch recovers them
        record("evaluation_abandoned", attempt_id=attempt_id, reason="worker stopping")
    DBOS.destroy()
    record("worker_stopped", metrics={})
    return 0


if __name__ == "__main__":
    sys.exit(main())
