"""Redis behind Sentinel in the simulator (`sim.sentinel`): the replica promoted after the
primary's death, the loss of what it had not received, and `WAIT` (the engine's
`wait_replicas`) keeping that loss away from anything the engine took as written."""

from __future__ import annotations

import random
from pathlib import Path

import simpy

from chaos.insim import run_scenario
from chaos.scenario import load_scenario
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


def test_a_partition_then_a_failover_loses_acknowledged_writes_unless_the_engine_waits() -> None:
    """sentinel_failover_with_partition: the replica cut off, the primary acknowledging, then
    killed. Without WAIT (mutant no_wait) the writes of the cut are gone and finished rules
    run again; with it none of them counted, and nothing finished reruns."""
    loaded = load_scenario(ROOT / "scenarios" / "sentinel_failover_with_partition.yaml")
    assert loaded.spec.engine.wait_replicas == 1
    assert run_scenario(loaded).result.ok
    broken = run_scenario(loaded, mutant="no_wait").result
    assert broken.verdicts["no_completed_rerun"] == "fail"


def test_an_old_primary_back_after_it_was_declared_down_waits_for_the_failover() -> None:
    env, redis, sentinel = topology(down_after_s=0.5)
    sentinel.kill_primary()
    env.run(0.6)  # declared down, the promotion not done yet
    rejoin = env.process(sentinel.restart_killed())
    env.run(rejoin)
    assert sentinel.promoted and redis.up and sentinel.replicas == 1  # a replica, not a primary
