"""Is the checker linear in the history? Its time per event on histories 1x, 10x and 100x
as long, as ratios against the 1x one measured in the same run.

    python bench/checker_scaling.py [--scenario scenarios/worker_kill_storm.yaml] [--rounds 3]

One scenario simulated with its evaluations multiplied by 1, 10 and 100 (the same faults,
so more work under them, not more faults), each history checked alone (the simulation not
timed) `--rounds` times, the best round kept: a checker linear in the history prints
ratios near 1.0 per event; a quadratic one 10 and 100. The checker on one process
(`chaos.checker.shared` would judge the longest on two): its growth, not the second core.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import chaos.checker.shared  # noqa: E402
from chaos.checker import check  # noqa: E402
from chaos.explore import document, load_document  # noqa: E402
from chaos.insim.run import SimRun  # noqa: E402
from chaos.scenario import load_scenario  # noqa: E402

SCALES = (1, 10, 100)


def checked(path: Path, scale: int, rounds: int) -> tuple[int, float, str]:
    """(events, the best round's seconds to check them, the verdicts in one word)."""
    data = document(load_scenario(path))
    for plan in data["plans"]:
        plan["evaluations"] = plan.get("evaluations", 1) * scale
    data["deadline_s"] = data.get("deadline_s", 60) * scale
    sim = SimRun(load_document(data, f"{path} x{scale}"), seed=0)
    outcome = sim.run()
    spec = sim.check_spec()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        result = check(outcome.history, outcome.final, spec)
        best = min(best, time.perf_counter() - t0)
    failed = [k for k, v in result.verdicts.items() if v == "fail"]
    return len(outcome.history), best, ("fail: " + ", ".join(failed)) if failed else "pass"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default=str(ROOT / "scenarios" / "worker_kill_storm.yaml"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    chaos.checker.shared.ALLOWED = False
    base = None
    for scale in SCALES:
        n, took, verdict = checked(Path(args.scenario), scale, args.rounds)
        per = took / n
        base = base or per
        print(
            f"x{scale:<4} {n:9,d} events  checked in {took:8.3f} s  "
            f"{per * 1e6:7.1f} us/event  ratio {per / base:5.2f}  ({verdict})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
