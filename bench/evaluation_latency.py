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
    """`engine.worker` with its awaited effects timed; the sums written at exit."""
    from engine.runtime import drive
    from engine.worker import main

    total: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()

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
                total[key] += time.perf_counter() - t0
                count[key] += 1

        return run

    for effect_type, handler in list(drive._LATER.items()):
        drive._LATER[effect_type] = timed(effect_type.__name__, handler)

    @atexit.register
    def _dump() -> None:
        Path(os.environ[_OUT_ENV]).write_text(json.dumps({k: [count[k], total[k]] for k in total}))

    return main(argv)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--evaluations", type=int, default=600)
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
                    ["--max-evaluations", "64"],
                    engine_root=ROOT,
                    module=("bench.evaluation_latency", "--worker"),
                )
            )
        finally:
            os.environ.pop(_OUT_ENV, None)
        sums = json.loads(out.read_text())
    n = args.evaluations
    print(
        f"{rate.rules} rules at {rate.per_s:.0f} /s; the worker's CPU a rule "
        f"{rate.cpu_s / rate.rules * 1e6:.0f} us; an evaluation's awaited effects:"
    )
    print(f"  {'effect':40s} {'a eval':>7s} {'ms each':>8s} {'ms a eval':>10s}")
    for key, (calls, seconds) in sorted(sums.items(), key=lambda kv: -kv[1][1]):
        each, per_eval = seconds / calls * 1e3, seconds / n * 1e3
        print(f"  {key:40s} {calls / n:7.2f} {each:8.2f} {per_eval:10.2f}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(_timed_worker(sys.argv[2:]))
    sys.exit(main())
