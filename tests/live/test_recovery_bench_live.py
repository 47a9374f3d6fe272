"""`bench/recovery_seconds.py` still measures what it says: one round of the `pg` design on a
private PostgreSQL, two real workers, the first rule's owner SIGKILLed mid-rule and the rule
seen starting again on the survivor, handed over by its sweeper. No time bound is asserted
(CI shares a busy machine); a short lease keeps the round to a few seconds."""

from __future__ import annotations

from pathlib import Path

from bench.recovery_seconds import measure_round
from bench.rules_per_second import private_postgres
from engine.plan import load_plan
from tests.live.test_postgres_live import pytestmark  # noqa: F401  (a private PostgreSQL)

ROOT = Path(__file__).resolve().parents[2]
SHORT = {"stale_ms": 1000, "heartbeat_ms": 250, "sweep_ms": 250}


def test_one_round_sees_the_killed_workers_rule_start_again_on_the_survivor(
    tmp_path: Path,
) -> None:
    with private_postgres() as pg:
        got = measure_round("pg", tmp_path, pg, SHORT, phase=0.5)
    assert got.design == "pg"
    assert got.rule in load_plan(ROOT / "plans" / "tiny.yaml").rules
    assert got.reason == "stale_heartbeat"  # the sweeper's path, not a redelivery
    assert got.claimed_s is not None and 0 < got.claimed_s <= got.seconds
    assert got.lapsed_s < got.seconds  # nobody took the rule before its lease ran out
