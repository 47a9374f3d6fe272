"""What the engine's Redis scripts cost inside Redis, per evaluation: counted, then timed.

    python bench/script_cost.py [--evaluations 300] [--rounds 5]
    python bench/script_cost.py --against /path/to/other/checkout [--rounds 5]
    python bench/script_cost.py --callgrind [--evaluations 100] [--rounds 1]

`bench/rules_per_second.py` is partly held by Redis's CPU: an evaluation runs 21 EVALSHAs
and, inside them, some 175 `redis.call`s. This runs the real worker (code_review.yaml, a
zero-latency agent, 64 evaluations at once) on a private `redis-server` on a free port,
where nobody else's commands land, with heartbeat and sweeper far apart so that only the
evaluations' own scripts run. A few evaluations first load the worker's scripts (compiling
one costs more than running it a hundred times); then the server's statistics are reset,
the evaluations submitted, and once the last has left the running index (`done`, after
evaluation.completed) it prints per evaluation:
- the EVALSHAs and the commands they ran inside Redis, by command (`INFO commandstats`):
  the same every run for this plan;
- the time Redis says its scripts took (`usec` of `cmdstat_evalsha`) and Redis's CPU
  (`used_cpu_user` + `used_cpu_sys` of `INFO cpu`): timings, so noisy on a shared machine;
  rounds are repeated and their medians printed;
- with `--callgrind`, the server runs under valgrind's callgrind and the instructions it
  executed per evaluation are counted too (steady to 0.2 % between runs; slow: use fewer
  evaluations). The one figure a busy machine does not move.

With `--against`, the engine of another checkout (a `git worktree` of the commit before a
change) runs on the same private server in rounds interleaved with this one's.

What it found (2026-12-02, Redis 7.0.15; the scripts' instructions measured one by one the
same way, with `return 1` and one command added at a time): running a script at all costs
about 10k instructions, each of its KEYS and ARGV 1.4k more (a result write's 14 are 20k),
a `redis.call` GET 3.4k, EXPIRE or PEXPIRE 6.6k, HINCRBY 7.8k, SET with EX or PX 10.7k to
13.6k (Redis rewrites it to PXAT), and `cjson.decode` of code_review.yaml's plan (2 kB with
its descriptions) 175k. An MGET of three keys costs 9.3k, about what three GETs do, so
merging a script's reads saves next to nothing (reading the fence, the lease and the
state in one MGET, through a shared function, measured 4k more a script, not less): the
writes that write nothing and the plan's decoding were what to cut. Per evaluation, main
9507016 against branch `lua` (3 interleaved rounds of 100 evaluations under callgrind; 7
of 300 without): instructions 2,627k -> 2,168k (-17.5 %); commands inside the scripts 176
-> 152 (SET 51 -> 19, ZREM 27 -> 14, PEXPIRE 0 -> 19, EXISTS 0 -> 2); Redis's time in
scripts, median, 537 -> 444 us and its CPU 610 -> 531 us (-13 %, a busy machine). By
script (instructions, 64 evaluations driven through `RedisStore`): `done` 352k -> 67k
(the plan decoded only when a retries index exists), `finish` 217k -> 149k (one EXISTS
instead of 13 `SET NX` that wrote nothing), a result write 100k -> 93k and a pass mark
69k -> 61k (the lease renewed with PEXPIRE, `terminal` without building strings for a
state not in the list, only the shared functions used defined); `begin` unchanged at
about 293k (its 37 KEYS and ARGV alone are 85k).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aio_pika  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402

from chaos.systems.redis_rabbitmq.stack import RedisServer  # noqa: E402
from chaos.workers import WorkerProcess  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.plan import load_plan  # noqa: E402
from engine.submit import EngineClient  # noqa: E402

#: Evaluations run before the count: the worker loads its scripts as it first runs them.
WARM_UP = 8
#: Heartbeat, lease and sweeps far beyond a run: only the evaluations' own scripts run.
QUIET = [
    "--max-evaluations",
    "64",
    "--heartbeat-ms",
    "600000",
    "--stale-ms",
    "3600000",
    "--sweep-ms",
    "600000",
]


@dataclass
class Cost:
    """One round of one engine, per evaluation."""

    evaluations: int
    calls: dict[str, float] = field(default_factory=dict)  # command -> calls an evaluation
    script_us: float = 0.0  # Redis's own time inside EVALSHA
    cpu_us: float = 0.0  # Redis's CPU, user + system
    instructions: float | None = None  # under callgrind

    @property
    def evalsha(self) -> float:
        return self.calls.get("evalsha", 0.0)

    @property
    def inner(self) -> float:
        return sum(v for k, v in self.calls.items() if k != "evalsha")


class CallgrindRedis(RedisServer):
    """A private `redis-server` under callgrind, whose counts are read between dumps."""

    def argv(self) -> list[str]:
        assert self._dir is not None
        out = self._dir / "callgrind.out.%p"
        return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *super().argv()]

    def instructions(self) -> int:
        """Instructions executed since the last call (a dump resets the counters)."""
        assert self._dir is not None and self.pid is not None
        before = set(self._dir.glob("callgrind.out.*"))
        subprocess.run(["callgrind_control", "-d", str(self.pid)], check=True, capture_output=True)
        new = sorted(
            set(self._dir.glob("callgrind.out.*")) - before, key=lambda p: p.stat().st_mtime
        )
        text = new[-1].read_text(errors="replace")
        found = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
        assert found, "no totals in the callgrind dump"
        return int(found.group(1))


async def _stats(r: aioredis.Redis) -> tuple[dict[str, tuple[int, int]], float]:
    """(command -> (calls, usec)), and Redis's CPU seconds so far."""
    stats = await r.info("commandstats")
    cmds = {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in stats.items()}
    cpu = await r.info("cpu")
    return cmds, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


async def one_round(
    server: RedisServer, evaluations: int, tmp: Path, root: Path | None, plan_path: Path
) -> Cost:
    plan = load_plan(plan_path)
    ns = f"sc{uuid.uuid4().hex[:6]}."
    config = EngineConfig(namespace=ns, redis_url=server.url)
    worker = WorkerProcess(
        ["--namespace", ns, "--agent", json.dumps({"latency_ms": 0}), *QUIET],
        env={"REDIS_URL": server.url},
        log_path=tmp / f"worker-{ns}log",
        cwd=root,
    )
    warm = [f"{ns}warm{i}" for i in range(WARM_UP)]
    ids = [f"{ns}{i}" for i in range(evaluations)]
    running = config.name("engine:running")
    r = aioredis.Redis.from_url(server.url, decode_responses=True)
    try:
        async with EngineClient(config) as client:
            ch = client.broker.channel
            assert ch is not None and client.broker.events is not None
            events = await ch.declare_queue(exclusive=True)
            await events.bind(client.broker.events, "evaluation.completed")
            pending: set[str] = set()
            all_done = asyncio.Event()

            async def on_event(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                pending.discard(json.loads(message.body)["attempt_id"])
                if not pending:
                    all_done.set()

            async def run(batch: list[str]) -> None:
                all_done.clear()
                pending.update(batch)
                await asyncio.gather(*(client.submit(plan, a) for a in batch))
                try:
                    await asyncio.wait_for(all_done.wait(), timeout=600)
                except TimeoutError:
                    raise SystemExit(f"timed out; worker log: {worker.log_path}") from None
                # `done` follows evaluation.completed: wait for the last to leave the index
                while await r.zcard(running):
                    await asyncio.sleep(0.01)

            await events.consume(on_event, no_ack=True)
            worker.start()
            deadline = time.monotonic() + 120
            while not worker.is_ready():
                if time.monotonic() > deadline or not worker.alive:
                    raise SystemExit(f"the worker did not start: {worker.log_path}")
                await asyncio.sleep(0.05)
            await run(warm)  # the scripts loaded (compiled) before the count
            await r.config_resetstat()
            if isinstance(server, CallgrindRedis):
                await asyncio.to_thread(server.instructions)  # zero the counters
            _, cpu0 = await _stats(r)
            await run(ids)
            cmds, cpu1 = await _stats(r)
            counted = None
            if isinstance(server, CallgrindRedis):
                counted = await asyncio.to_thread(server.instructions)
            await asyncio.to_thread(worker.terminate)  # first: it would declare its queue again
            for name in [client.broker.work_queue_name, *client.broker.delay_queues.values()]:
                await ch.queue_delete(name)
            for name in ("evaluation.events", "evaluation.control"):
                await ch.exchange_delete(f"{ns}{name}")
        await r.flushall()
    finally:
        worker.terminate()
        await r.aclose()
    for own in ("info", "config|resetstat", "zcard"):  # the measure's own
        cmds.pop(own, None)
    n = evaluations
    return Cost(
        evaluations=n,
        calls={k: c / n for k, (c, _) in cmds.items()},
        script_us=cmds.get("evalsha", (0, 0))[1] / n,
        cpu_us=(cpu1 - cpu0) * 1e6 / n,
        instructions=None if counted is None else counted / n,
    )


@contextlib.contextmanager
def _server(callgrind: bool) -> Iterator[RedisServer]:
    server = CallgrindRedis(start_timeout=120) if callgrind else RedisServer()
    with server:
        yield server


def _show(label: str, costs: list[Cost]) -> None:
    med = statistics.median
    commands = sorted({k for c in costs for k in c.calls}, key=lambda k: -costs[-1].calls.get(k, 0))
    by_cmd = ", ".join(f"{k.upper()} {med(c.calls.get(k, 0) for c in costs):.2f}" for k in commands)
    print(f"{label}: per evaluation (medians of {len(costs)} rounds)")
    evalsha, inner = med(c.evalsha for c in costs), med(c.inner for c in costs)
    print(f"  EVALSHA {evalsha:.2f}, inner calls {inner:.1f}")
    print(f"  by command: {by_cmd}")
    print(
        f"  Redis's time in scripts {med(c.script_us for c in costs):.1f} us "
        f"(rounds {', '.join(f'{c.script_us:.0f}' for c in costs)}); "
        f"Redis's CPU {med(c.cpu_us for c in costs):.1f} us "
        f"(rounds {', '.join(f'{c.cpu_us:.0f}' for c in costs)})"
    )
    if costs[0].instructions is not None:
        ins = [c.instructions or 0.0 for c in costs]
        rounds = ", ".join(f"{i / 1000:.1f}k" for i in ins)
        print(f"  Redis's instructions {med(ins) / 1000:.1f} k (rounds {rounds})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--evaluations", type=int, default=300, help="per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--plan", type=Path, default=ROOT / "plans" / "code_review.yaml")
    p.add_argument("--against", type=Path, help="another checkout whose engine to compare with")
    p.add_argument("--callgrind", action="store_true", help="count Redis's instructions too")
    args = p.parse_args()
    engines: list[tuple[str, Path | None]] = [("this engine", None)]
    if args.against is not None:
        engines.append((str(args.against), args.against.resolve()))
    costs: dict[str, list[Cost]] = {label: [] for label, _ in engines}
    with tempfile.TemporaryDirectory() as tmp, _server(args.callgrind) as server:
        for i in range(args.rounds):  # interleaved: both see the same machine's moods
            for label, root in engines:
                cost = asyncio.run(one_round(server, args.evaluations, Path(tmp), root, args.plan))
                costs[label].append(cost)
                print(
                    f"round {i + 1}, {label}: EVALSHA {cost.evalsha:.2f}, inner {cost.inner:.1f}, "
                    f"scripts {cost.script_us:.1f} us, CPU {cost.cpu_us:.1f} us"
                    + (
                        ""
                        if cost.instructions is None
                        else f", {cost.instructions / 1000:.1f} k instr"
                    )
                    + " an evaluation",
                    flush=True,
                )
    for label, _ in engines:
        _show(label, costs[label])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
