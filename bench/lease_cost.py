"""What a lease's length costs under the kill storm, now that leases are fenced.

    python bench/lease_cost.py [--seeds 200] [--leases 200,1000,5000]

For each lease (`stale_ms`, scaled time; the heartbeat and the sweeper run at a quarter of
it), the simulator runs `worker_kill_storm` over the same seeds and prints, per 1,000 rules
run: reruns, tokens spent on reruns, tokens duplicated (calls whose result was already
durable), and the finished rules started again (`completed_reruns`), with the number of
seeds that broke an invariant. With fencing, a short lease should cost reruns of calls in
flight only: `completed_reruns` and the failing seeds stay at zero at every length. The
figures are counts over seeded runs, not timings: they reproduce exactly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from chaos.explore import load_document  # noqa: E402
from chaos.insim import run_scenario  # noqa: E402

SCENARIO = ROOT / "scenarios" / "worker_kill_storm.yaml"
STATS = ("reruns", "duplicated_tokens", "completed_reruns")


def with_lease(lease_ms: int) -> dict:
    data = yaml.safe_load(SCENARIO.read_text(encoding="utf-8"))
    data["plan"] = str((SCENARIO.parent / data["plan"]).resolve())
    beat = max(20, lease_ms // 4)
    data["engine"] = {"stale_ms": lease_ms, "heartbeat_ms": beat, "sweep_ms": beat}
    data["name"] = f"worker_kill_storm_lease_{lease_ms}"
    return data


def measure(lease_ms: int, seeds: int) -> dict[str, float]:
    loaded = load_document(with_lease(lease_ms), source=f"lease {lease_ms} ms")
    totals = dict.fromkeys(STATS, 0)
    rules = failing = 0
    for seed in range(seeds):
        outcome = run_scenario(loaded, seed=seed)
        stats = outcome.result.stats
        rules += int(stats.get("calls", 0)) - int(stats.get("reruns", 0))
        for key in STATS:
            totals[key] += int(stats.get(key, 0))
        failing += not outcome.result.ok
    per = 1000 / max(rules, 1)
    return {**{k: v * per for k, v in totals.items()}, "rules": rules, "failing": failing}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--leases", default="200,1000,5000", help="stale_ms values, comma-separated")
    args = p.parse_args()
    print(f"worker_kill_storm, {args.seeds} seeds per lease; figures per 1,000 rules run")
    print(f"{'lease':>8} {'reruns':>8} {'dup tok':>8} {'done rerun':>10} fail")
    for lease in (int(x) for x in args.leases.split(",")):
        m = measure(lease, args.seeds)
        print(
            f"{lease:>6}ms {m['reruns']:8.1f} {m['duplicated_tokens']:8.0f} "
            f"{m['completed_reruns']:10.2f} "
            f"{m['failing']}/{args.seeds}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
