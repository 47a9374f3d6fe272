"""Large scenarios in the simulator: one run each, timed whole (loading, simulating,
checking), against issue 30's goal of 30 s each.

    python bench/sim_large.py [--only chain|wide|many] [--evaluations 10000]

- `chain`: a 5,000-rule chain listed last rule first (each rule depends on the next one
  in the file), one evaluation: what a decision costs when the plan is long;
- `wide`: `plans/wide.yaml` (55 rules), 40 evaluations on 3 workers, a crash after a
  result write and a fifth of the calls failing: a heavy seed of an exploration;
- `many`: `plans/code_review.yaml`, 10,000 evaluations on 4 workers (`--evaluations`).

The scenarios are written to a temporary directory, removed at the end; the seed is 1.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chaos.insim import run_scenario  # noqa: E402
from chaos.scenario import load_scenario  # noqa: E402

GOAL_S = 30.0


def _chain(n: int = 5000) -> dict:
    rules = [
        {
            "id": f"r{i}",
            "description": "a link",
            **({"depends_on": [f"r{i + 1}"]} if i < n - 1 else {}),
        }
        for i in range(n)
    ]
    return {
        "plan": "reversed_chain",
        "description": f"{n} rules",
        "passes": [{"id": "p", "rules": rules}],
    }


def scenarios(evaluations: int) -> dict[str, tuple[dict, dict | None]]:
    """name -> (the scenario, its own plan if it has one)."""
    base = {"seed": 1, "time_scale": 0.01, "deadline_s": 80000.0}
    return {
        "chain": (
            {
                **base,
                "name": "chain",
                "description": "a reversed 5,000-rule chain",
                "plans": [{"path": "reversed_chain.yaml", "evaluations": 1}],
                "agent": {"latency_ms": 100},
            },
            _chain(),
        ),
        "wide": (
            {
                **base,
                "name": "wide",
                "description": "55 rules, 40 evaluations",
                "plans": [{"path": str(ROOT / "plans" / "wide.yaml"), "evaluations": 40}],
                "workers": 3,
                "agent": {"latency_ms": 30000, "error_rate": 0.2},
                "faults": [{"failpoint": "rule_after_write", "hit": 3}],
                "not_checked": ["retry_delays_respected"],
            },
            None,
        ),
        "many": (
            {
                **base,
                "name": "many",
                "description": f"{evaluations} evaluations",
                "plans": [
                    {"path": str(ROOT / "plans" / "code_review.yaml"), "evaluations": evaluations}
                ],
                "workers": 4,
                "agent": {"latency_ms": 2000, "error_rate": 0.1},
            },
            None,
        ),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("chain", "wide", "many"))
    ap.add_argument("--evaluations", type=int, default=10_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sim-large-") as tmp:
        for name, (scenario, plan) in scenarios(args.evaluations).items():
            if args.only and name != args.only:
                continue
            if plan is not None:
                (Path(tmp) / "reversed_chain.yaml").write_text(yaml.safe_dump(plan))
            path = Path(tmp) / f"{name}.yaml"
            path.write_text(yaml.safe_dump(scenario))
            t0 = time.perf_counter()
            outcome = run_scenario(load_scenario(path))
            took = time.perf_counter() - t0
            failed = [k for k, v in outcome.result.verdicts.items() if v == "fail"]
            events = len(outcome.history)
            verdict = "met" if took <= GOAL_S else "NOT MET"
            print(
                f"{name:6} {events:9,d} events in {took:7.1f} s ({events / took:8,.0f} "
                f"events/s; goal {GOAL_S:.0f} s: {verdict})"
                + (f"  failed: {', '.join(failed)}" if failed else "")
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
