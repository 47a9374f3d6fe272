"""Speed of the simulator, as ratios against simpy's raw event rate measured in this run.

    python bench/sim_speed.py [--seeds 2000] [--jobs 0]

Prints: simpy's raw rate (a process yielding timeouts, nothing else), simulated evaluations
per second of the example plan under faults (one process), the seeds per second of
`chaos sim` on a one-evaluation, 13-rule scenario with a crash (every core), and the time
10,000 such seeds would take (target: at most 20 s on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import simpy  # noqa: E402

from chaos.explore import document, explore, load_document, swarm  # noqa: E402
from chaos.insim import run_scenario  # noqa: E402
from chaos.scenario import load_scenario  # noqa: E402


def simpy_rate(n: int = 300_000) -> float:
    env = simpy.Environment()

    def ticker(env: simpy.Environment) -> object:
        for _ in range(n):
            yield env.timeout(1)

    env.process(ticker(env))
    t0 = time.perf_counter()
    env.run()
    return n / (time.perf_counter() - t0)


def evaluations_rate(seconds: float = 3.0) -> tuple[float, float]:
    """Simulated evaluations per second, and history events per second, under faults."""
    names = ["crash_after_ack", "worker_kill_storm", "transient_llm_errors"]
    loaded = [load_scenario(ROOT / "scenarios" / f"{n}.yaml") for n in names]
    evaluations = events = 0
    seed = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for sc in loaded:
            outcome = run_scenario(sc, seed=seed)
            evaluations += len(outcome.attempt_ids)
            events += len(outcome.history)
        seed += 1
    took = time.perf_counter() - t0
    return evaluations / took, events / took


def seeds_rate(seeds: int, jobs: int) -> float:
    data = document(load_scenario(ROOT / "scenarios" / "crash_after_ack.yaml"))
    data["plans"][0]["evaluations"] = 1
    load_document(swarm(data, 0))  # fail here, not in a pool, if the variant is invalid
    t0 = time.perf_counter()
    explore(data, range(seeds), jobs=jobs)
    return seeds / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=2000)
    p.add_argument("--jobs", type=int, default=0, help="processes (default: every core)")
    args = p.parse_args()
    raw = simpy_rate()
    evals, events = evaluations_rate()
    rate = seeds_rate(args.seeds, args.jobs)
    cores = args.jobs or os.cpu_count() or 1
    print(f"simpy raw event rate (timeouts, one process):     {raw:12,.0f} events/s")
    print(f"simulated evaluations under faults (one process): {evals:12,.0f} evaluations/s")
    print(f"  history events recorded:                        {events:12,.0f} events/s")
    print(f"  ratio history events / raw simpy events:        {events / raw:12.3f}")
    print(f"chaos sim seeds, 13-rule scenario, {cores} processes: {rate:10,.0f} seeds/s")
    projected = 10_000 / rate
    verdict = "OK" if projected <= 20 else "OVER TARGET"
    print(f"10,000 seeds would take {projected:.1f} s (target <= 20 s on 2 cores) {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
