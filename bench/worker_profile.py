"""Where one live worker's time goes, by area, while `rules_per_second.py` drives it.

    python bench/worker_profile.py [--evaluations 1000] [--rate 500] [--top 25]

One engine round of `bench/rules_per_second.py` (code_review.yaml, a zero-latency agent)
with py-spy (`pip install py-spy`; it reads the worker's memory, so it needs ptrace
rights: root, or `kernel.yama.ptrace_scope` 0) sampling the worker process. Each sample
is charged to the innermost frame that belongs to an area (redis-py, aio-pika/aiormq/
pamqp, the core, the shell, the driver, the store...), what is left to the event loop;
the shares are printed with what they are in microseconds of the worker's CPU a rule.

py-spy samples wall time: a worker preempted inside a `send()` on a busy machine (the
broker or Redis woken on its core) is charged to that write, so the event loop's writes
read larger than their CPU on a busy machine; the worker's own user/system split is
printed too.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import rules_per_second as bench  # noqa: E402
from chaos import workers  # noqa: E402

#: Areas, first match from the innermost frame outwards (a substring of "file:function").
AREAS: list[tuple[str, tuple[str, ...]]] = [
    ("redis-py", ("/redis/", "hiredis")),
    ("aio-pika, aiormq, pamqp", ("aio_pika/", "aiormq/", "pamqp/")),
    ("prometheus_client", ("prometheus_client/",)),
    ("engine.core", ("engine/core/",)),
    ("engine.shell", ("engine/shell/",)),
    ("engine.runtime.store", ("engine/runtime/store.py", "engine/keys.py")),
    ("engine.runtime.autopipeline", ("engine/runtime/autopipeline.py",)),
    ("engine.runtime (driver, broker)", ("engine/runtime/",)),
    ("fake agent", ("engine/agent.py",)),
    ("engine, other", ("engine/",)),
    ("event loop: socket writes", ("streams.py:StreamWriter.write",)),
    ("event loop: the rest", ("asyncio/", "uvloop/")),
]
_FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>.*):\d+\)$")


def breakdown(raw: Path) -> tuple[int, collections.Counter[str]]:
    """Samples of the running loop (start-up and shutdown left out), by area."""
    areas: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not any("runners.py" in f for f in frames):
            continue
        n = int(count)
        total += n
        area = "event loop: the rest"
        for frame in reversed(frames):
            m = _FRAME.match(frame)
            key = f"{m['file']}:{m['fn']}" if m else frame
            hit = next((a for a, pats in AREAS if any(p in key for p in pats)), None)
            if hit is not None:
                area = hit
                break
        areas[area] += n
    return total, areas


def _user_sys(pid: int) -> tuple[int, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--evaluations", type=int, default=1000)
    p.add_argument("--rate", type=int, default=500, help="py-spy samples a second")
    p.add_argument("--top", type=int, default=0, help="also the N hottest functions")
    args = p.parse_args()
    if shutil.which("py-spy") is None:
        print("worker_profile: py-spy not found (pip install py-spy)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "worker.raw"
        spies: list[subprocess.Popen[bytes]] = []
        pids: list[int] = []
        ticks: list[tuple[int, int]] = []
        start = workers.WorkerProcess.start
        cpu_s = bench._cpu_s

        def spied(self: workers.WorkerProcess) -> workers.WorkerProcess:
            started = start(self)
            pids.append(self.pid)
            spy = ["py-spy", "record", "--pid", str(self.pid), "--format", "raw"]
            spy += ["--rate", str(args.rate), "--nonblocking", "--full-filenames", "-o", str(raw)]
            spies.append(subprocess.Popen(spy, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            return started

        def cpu_and_split(pid: int) -> float:
            ticks.append(_user_sys(pid))
            return cpu_s(pid)

        workers.WorkerProcess.start = spied  # type: ignore[method-assign]
        bench._cpu_s = cpu_and_split
        try:
            rate = asyncio.run(
                bench.rule_rate(
                    bench.ROOT / "plans" / "code_review.yaml",
                    args.evaluations,
                    Path(tmp),
                    ["--max-evaluations", "64"],
                )
            )
        finally:
            workers.WorkerProcess.start = start  # type: ignore[method-assign]
            bench._cpu_s = cpu_s
            for spy in spies:
                try:
                    spy.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    spy.kill()
        if not raw.exists():
            err = spies[0].stderr.read().decode() if spies and spies[0].stderr else ""
            print(f"worker_profile: py-spy recorded nothing: {err.strip()[:300]}", file=sys.stderr)
            return 1
        total, areas = breakdown(raw)
        top = collections.Counter[str]()
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if "runners.py" in stack:
                top[stack.split(";")[-1]] += int(count)
    us = rate.cpu_s / rate.rules * 1e6
    (u0, s0), (u1, s1) = ticks[0], ticks[1]
    tck = os.sysconf("SC_CLK_TCK")
    user, system = (u1 - u0) / tck / rate.rules * 1e6, (s1 - s0) / tck / rate.rules * 1e6
    print(
        f"{rate.rules} rules at {rate.per_s:.0f} /s; the worker's CPU a rule {us:.0f} us "
        f"({user:.0f} user, {system:.0f} system); Redis scripts a rule "
        f"{rate.scripts / rate.rules:.2f}; {total} samples"
    )
    for area, n in areas.most_common():
        print(f"  {area:34s} {100 * n / total:5.1f} %  {us * n / total:5.0f} us")
    for frame, n in top.most_common(args.top):
        print(f"  {100 * n / total:5.1f} %  {frame}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
