"""Did a speed change leave the judgement alone? Every verdict, case count, stat and
violation (with its evidence's seqs) and the history's hash, over the shipped scenarios
and under every mutant, written to a file, then compared with another checkout's.

    python bench/same_judgement.py OUT.json [--seeds 6] [--mutant-seeds 2]
    python bench/same_judgement.py OUT.json --against BEFORE.json

`tests/test_golden_histories.py` proves the histories byte-identical; this proves what the
checker made of them identical too: run it on the commit before a change (an export of it,
with PYTHONPATH pointing there) and after, then compare. The mutants run on four scenarios
that exercise the checker's hardest parts (a crash, a cancel, retries, a kill storm).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chaos.insim import run_scenario  # noqa: E402
from chaos.mutants import MUTANTS  # noqa: E402
from chaos.scenario import load_scenario  # noqa: E402

MUTANT_SCENARIOS = ("crash_after_ack", "cancel_midway", "transient_llm_errors", "worker_kill_storm")


def judged(path: Path, seed: int, mutant: str | None = None) -> dict[str, Any]:
    """What the checker made of one simulated run (its error if the run raised)."""
    try:
        outcome = run_scenario(load_scenario(path), seed=seed, mutant=mutant)
    except Exception as exc:  # a difference too: kept, compared
        return {"error": repr(exc)}
    r = outcome.result
    return {
        "history": outcome.history_hash,
        "verdicts": r.verdicts,
        "cases": r.cases,
        "stats": json.loads(json.dumps(r.stats, default=str, sort_keys=True)),
        "violations": [
            [v.invariant, v.attempt_id, v.rule_id, v.message, [e.get("seq") for e in v.timeline]]
            for v in r.violations
        ],
    }


def everything(seeds: int, mutant_seeds: int) -> dict[str, Any]:
    shipped = [  # every scenario the simulator runs (a workflow engine's it refuses)
        p
        for folder in ("", "regressions/", "pg/", "pg_store/")
        for p in sorted(ROOT.glob(f"scenarios/{folder}*.yaml"))
    ]
    out = {f"{p.relative_to(ROOT)} {s}": judged(p, s) for p in shipped for s in range(seeds)}
    for name in MUTANT_SCENARIOS:
        p = ROOT / "scenarios" / f"{name}.yaml"
        for m in sorted(MUTANTS):
            for s in range(mutant_seeds):
                out[f"{p.relative_to(ROOT)} {s} {m}"] = judged(p, s, m)
    return out


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """One line per run judged differently (or present in one file only)."""
    out = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if a == b:
            continue
        if not isinstance(a, dict) or not isinstance(b, dict):
            out.append(f"{key}: only in {'the new' if a is None else 'the old'} file")
            continue
        parts = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        out.append(f"{key}: {', '.join(parts)} differ")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="where this checkout's judgement is written")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--mutant-seeds", type=int, default=2)
    ap.add_argument("--against", type=Path, help="a judgement written by another checkout")
    args = ap.parse_args()
    before = None
    if args.against is not None:
        try:
            before = json.loads(args.against.read_text())
        except (OSError, ValueError) as exc:
            ap.error(f"--against {args.against}: expected a judgement this script wrote ({exc})")
    now = everything(args.seeds, args.mutant_seeds)
    args.out.write_text(json.dumps(now, sort_keys=True))
    print(f"{len(now)} runs judged, written to {args.out}")
    if before is None:
        return 0
    diff = differences(before, now)
    for line in diff[:50]:
        print(line)
    print(f"{len(diff)} of {len(now)} runs judged differently" if diff else "the same judgement")
    return 1 if diff else 0


if __name__ == "__main__":
    raise SystemExit(main())
