"""Where an evaluation's wall time goes in one live worker: each awaited effect, timed.

    python bench/evaluation_latency.py [--evaluations 600]

One engine round of `bench/rules_per_second.py` (code_review.yaml, a zero-latency agent,
64 evaluations at once) with the worker's asyncio driver timing every effect it awaits
(`engine.runtime.drive._LATER`): per evaluation, how many of each kind (store operations
by name, publishes by routing key), how long each took from the call to its reply, and
their sum. The worker's CPU a rule says whether it is CPU-bound; these say which round
trips an evaluation waits for in turn. `Acquire` counts the waits for the evaluation's
lock and for a slot among the worker's evaluations (deliveries beyond the slots wait
there, which is queueing, not latency).

`--idle` runs the worker on asyncio's own loop (uvloop's cannot be timed from Python) and
times each of its blocking waits for I/O, from the first `begin` to the last `done`: how
long the worker had nothing to run, and which service's reply ended each wait. With 64
evaluations at once the worker is the busier party, so its idle share is what a faster
Redis or RabbitMQ could give back, and its CPU a rule what a faster worker could.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_OUT_ENV = "BENCH_LATENCY_OUT"


def _timed_worker(argv: list[str]) -> int:
    """`engine.worker` with its awaited effects timed (and, on asyncio's loop, its waits
    for I/O); the sums written at exit."""
    from engine.runtime import drive
    from engine.worker import main

    total: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    span: list[float] = []  # the first begin's call, the last done's reply
    waits: list[tuple[float, float, str]] = []  # (start, length, what woke the worker)
    if "asyncio" in argv:
        _time_selects(waits)

    def timed(kind: str, handler: Any) -> Any:
        async def run(effect: Any, rt: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await handler(effect, rt)
            finally:
                key = kind
                if kind == "Store":
                    key = f"Store {effect.op}"
                elif kind == "PublishEvent":
                    key = f"PublishEvent {effect.routing_key}"
                t1 = time.perf_counter()
                total[key] += t1 - t0
                count[key] += 1
                if key == "Store begin" and not span:
                    span.append(t0)
                elif key == "Store done":
                    del span[1:]
                    span.append(t1)

        return run

    for effect_type, handler in list(drive._LATER.items()):
        drive._LATER[effect_type] = timed(effect_type.__name__, handler)

    @atexit.register
    def _dump() -> None:
        idle: collections.Counter[str] = collections.Counter()
        woken: collections.Counter[str] = collections.Counter()
        if len(span) == 2:
            for t0, dt, what in waits:
                if span[0] <= t0 and t0 + dt <= span[1]:
                    idle[what] += dt
                    woken[what] += 1
        out = {
            "effects": {k: [count[k], total[k]] for k in total},
            "span_s": span[1] - span[0] if len(span) == 2 else 0.0,
            "idle": {k: [woken[k], idle[k]] for k in idle},
        }
        Path(os.environ[_OUT_ENV]).write_text(json.dumps(out))

    return main(argv)


_SERVICES = {6379: "Redis", 5672: "RabbitMQ"}


def _time_selects(waits: list[tuple[float, float, str]]) -> None:
    """Time each wait of asyncio's selector that blocked (over 20 us), naming the peers
    whose data ended it (by port: the benchmark's Redis and RabbitMQ are the defaults)."""
    import selectors
    import socket

    peers: dict[int, str] = {}

    def peer(fd: int) -> str:
        if fd not in peers:
            try:
                with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as sock:
                    port = sock.getpeername()[1]
                peers[fd] = _SERVICES.get(port, str(port))
            except OSError:
                peers[fd] = "other"
        return peers[fd]

    select = selectors.EpollSelector.select

    def timed(self: selectors.EpollSelector, timeout: float | None = None) -> Any:
        t0 = time.perf_counter()
        events = select(self, timeout)
        dt = time.perf_counter() - t0
        if dt > 20e-6:
            what = "+".join(sorted({peer(key.fd) for key, _ in events})) or "a timer"
            waits.append((t0, dt, what))
        return events

    selectors.EpollSelector.select = timed  # type: ignore[method-assign]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--evaluations", type=int, default=600)
    p.add_argument(
        "--idle", action="store_true", help="asyncio's loop, its waits for I/O timed too"
    )
    args = p.parse_args()
    from bench import rules_per_second as bench

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "latency.json"
        os.environ[_OUT_ENV] = str(out)
        try:
            rate = asyncio.run(
                bench.rule_rate(
                    ROOT / "plans" / "code_review.yaml",
                    args.evaluations,
                    Path(tmp),
                    ["--max-evaluations", "64"]
                    + (["--event-loop", "asyncio"] if args.idle else []),
                    engine_root=ROOT,
                    module=("bench.evaluation_latency", "--worker"),
                )
            )
        finally:
            os.environ.pop(_OUT_ENV, None)
        measured = json.loads(out.read_text())
    sums = measured["effects"]
    n = args.evaluations
    print(
        f"{rate.rules} rules at {rate.per_s:.0f} /s; the worker's CPU a rule "
        f"{rate.cpu_s / rate.rules * 1e6:.0f} us; an evaluation's awaited effects:"
    )
    print(f"  {'effect':40s} {'a eval':>7s} {'ms each':>8s} {'ms a eval':>10s}")
    for key, (calls, seconds) in sorted(sums.items(), key=lambda kv: -kv[1][1]):
        each, per_eval = seconds / calls * 1e3, seconds / n * 1e3
        print(f"  {key:40s} {calls / n:7.2f} {each:8.2f} {per_eval:10.2f}")
    if args.idle:
        idle, span_s = measured["idle"], measured["span_s"]
        waited = sum(s for _, s in idle.values())
        print(
            f"the worker waited for I/O {waited:.2f} s of {span_s:.2f} s "
            f"({100 * waited / span_s:.0f} %), {waited / rate.rules * 1e6:.0f} us a rule; "
            "ended by:"
        )
        for what, (waits, seconds) in sorted(idle.items(), key=lambda kv: -kv[1][1]):
            print(
                f"  {what:20s} {waits:7d} waits {seconds / waits * 1e6:6.0f} us each "
                f"{seconds / rate.rules * 1e6:5.1f} us a rule"
            )
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(_timed_worker(sys.argv[2:]))
    sys.exit(main())
