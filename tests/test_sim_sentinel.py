"""Redis behind Sentinel in the simulator (`sim.sentinel`): the replica promoted after the
primary's death, the loss of what it had not received, and `WAIT` (the engine's
`wait_replicas`) keeping that loss away from anything the engine took as written."""

from __future__ import annotations

import random
from pathlib import Path

import simpy

from chaos.insim import run_scenario
from chaos.scenario import scenario_from_dict
from sim.redis import SimRedis
from sim.sentinel import ELECTION_S, SimSentinel

ROOT = Path(__file__).resolve().parents[1]


def topology(down_after_s: float = 0.5) -> tuple[simpy.Environment, SimRedis, SimSentinel]:
    env = simpy.Environment()
    redis = SimRedis(env, running_index="r", retries_index="q", ttl_s=60, lease_ms=600)
    return env, redis, SimSentinel(env, redis, random.Random(1), down_after_s, boot_s=0.05)


def test_the_replica_is_promoted_after_down_after_and_an_election() -> None:
    env, redis, sentinel = topology()
    sentinel.kill_primary()
    back = env.process(sentinel.wait_back())
    env.run(back)
    lo, hi = ELECTION_S
    assert 0.5 + lo <= env.now <= 0.5 + hi and back.value is True and redis.up
    env.process(sentinel.restart_killed())  # the old primary rejoins as a replica
    env.run(env.now + 1)
    sentinel.kill_primary()  # so a second death fails over again
    back = env.process(sentinel.wait_back())
    env.run(back)
    assert back.value is True
    sentinel.kill_primary()  # no replica left: down until the killed server is back
    env.run(env.now + 5)
    assert not redis.up
    env.process(sentinel.restart_killed())
    back = env.process(sentinel.wait_back())
    env.run(back)
    assert back.value is False and redis.up


def test_an_old_primary_back_before_the_sentinels_decide_serves_again() -> None:
    env, redis, sentinel = topology(down_after_s=2.0)
    sentinel.kill_primary()
    env.process(sentinel.restart_killed())
    back = env.process(sentinel.wait_back())
    env.run(back)
    assert back.value is False and env.now < 2.0
    env.run(10.0)
    assert redis.up and sentinel.replicas == 1  # nobody promoted, later or ever


def test_a_failover_loses_what_the_primary_applied_in_its_last_lag() -> None:
    env, redis, sentinel = topology()
    redis.lag_s = 0.2

    def write(key: str) -> None:
        redis.apply(redis._set, (key, 1, None))  # one write, as a script's SET makes it

    write("old")
    env.run(1.0)
    write("recent")
    env.run(1.1)
    sentinel.kill_primary()
    env.run(env.process(sentinel.wait_back()))
    assert "old" in redis.data and "recent" not in redis.data and sentinel.lost_writes == 1


def scenario(wait_replicas: int):  # type: ignore[no-untyped-def]
    return scenario_from_dict(
        {
            "name": "sentinel_failover",
            "seed": 12,
            "plan": str(ROOT / "plans" / "code_review.yaml"),
            "evaluations": 4,
            "workers": 2,
            "agent": {"latency_ms": 200000},
            "engine": {"wait_replicas": wait_replicas},
            "redis": {"topology": "sentinel", "down_after_ms": 500},
            "faults": [
                {"after": {"event": "rule_finished", "count": 12}}
                | {"action": "kill_redis", "restart_after_s": 3.0}
            ],
            "not_checked": ["retry_delays_respected"],
            "deadline_s": 60,
        },
        "sentinel_failover.yaml",
    )


def test_without_wait_a_failover_reruns_finished_rules_and_wait_prevents_it() -> None:
    """The loss live runs showed (a promoted replica 0.2 s behind: every evaluation
    resumed, finished rules run again): found within 300 seeds without `WAIT`, and
    never on the same seeds with it."""
    bare, waiting = scenario(0), scenario(1)
    failing = [s for s in range(300) if not run_scenario(bare, seed=s).result.ok]
    assert failing, "no seed lost a finished result"
    for seed in failing:
        broken = run_scenario(bare, seed=seed).result
        assert broken.verdicts["no_completed_rerun"] == "fail"
        assert run_scenario(waiting, seed=seed).result.ok, seed
