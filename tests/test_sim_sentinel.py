"""Redis behind Sentinel in the simulator (`sim.sentinel`): the replica promoted after the
primary's death, the loss of what it had not received, and `WAIT` (the engine's
`wait_replicas`) keeping that loss away from anything the engine took as written."""

from __future__ import annotations

import random
from collections.abc import Generator
from pathlib import Path
from typing import Any

import simpy

from chaos.insim import run_scenario
from chaos.scenario import load_scenario
from sim.redis import RedisClient, SimRedis
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


def _client(env: simpy.Environment, redis: SimRedis, wait: int = 0) -> RedisClient:
    return RedisClient(
        env, redis, random.Random(2), (0.001, 0.001), wait_replicas=wait, wait_timeout_s=0.3
    )


def _outcome(env: simpy.Environment, step: Generator) -> list[Any]:
    """Run `step` as a process; its reply (or error) and when it came."""
    out: list[Any] = []

    def proc() -> Generator:
        try:
            out.append((yield from step))
        except ConnectionError as exc:
            out.append(exc)
        out.append(env.now)

    env.process(proc())
    return out


def test_a_paused_primary_answers_what_waited_once_it_resumes() -> None:
    env, redis, sentinel = topology(down_after_s=2.0)
    sentinel.pause_primary()
    got = _outcome(env, _client(env, redis).call(redis._set, "k", 1, None))
    env.run(1.0)
    assert got == [] and "k" not in redis.data  # neither answered nor refused, nor applied
    assert sentinel.resume_primary() is False  # back before the sentinels decided
    env.run(5.0)
    assert got[0] is None and 1.0 <= got[1] < 1.01 and redis.data["k"] == 1
    assert not sentinel.promoted and sentinel.replicas == 1


def test_a_primary_paused_past_the_failover_answers_from_data_nobody_keeps() -> None:
    """The zombie of sentinel_paused_primary: what waited in the old primary's buffers is
    applied and acknowledged when it wakes, on its own copy, and the new primary never
    holds it; a client that WAITs for a replica is told it did not count."""
    env, redis, sentinel = topology(down_after_s=0.5)
    redis.lag_s = 0.0
    redis.apply(redis._set, ("before", 1, None))
    env.run(0.1)
    sentinel.pause_primary()
    plain = _outcome(env, _client(env, redis).call(redis._set, "acked", 1, None))
    waiting = _client(env, redis, wait=1)  # WAIT ends each batch of the store's scripts
    waited = _outcome(env, waiting.call(redis._set, "waited", 1, None, batched=True))
    env.run(3.0)
    assert sentinel.promoted and plain == [] and waited == []  # the replica promoted
    after = _outcome(env, _client(env, redis).call(redis._set, "new", 1, None))
    env.run(3.1)
    assert after[0] is None and redis.data["new"] == 1  # new requests reach the new primary
    assert sentinel.resume_primary() is True
    env.run(5.0)
    assert plain[0] is None  # acknowledged...
    assert "acked" not in redis.data and "waited" not in redis.data  # ...and gone
    assert isinstance(waited[0], ConnectionError)  # WAIT found no replica: not counted
    assert redis.data["before"] == 1 and sentinel.replicas == 1  # it rejoined as a replica


def test_no_failover_without_a_majority_of_sentinels() -> None:
    env, redis, sentinel = topology(down_after_s=0.5)
    sentinel.kill_sentinel()
    sentinel.kill_sentinel()
    sentinel.kill_primary()
    back = env.process(sentinel.wait_back())
    env.run(30.0)
    assert not back.triggered and not redis.up  # one sentinel cannot elect a leader
    rejoin = env.process(sentinel.restart_killed())  # waits for the failover, as live
    env.run(31.0)
    assert not rejoin.triggered and not redis.up
    sentinel.restart_sentinel()  # a majority again: the failover goes ahead
    env.run(back)
    lo, hi = ELECTION_S
    assert 31.0 + 0.5 + lo <= env.now <= 31.0 + 0.5 + hi and back.value is True
    env.run(rejoin)
    assert sentinel.replicas == 1


def test_min_replicas_to_write_refuses_writes_once_no_replica_acknowledges() -> None:
    """redis.min_replicas_to_write: the primary refuses a write (nothing of it applied)
    once its replica has been cut off past min-replicas-max-lag (acknowledgements come
    every second), and while it has no replica at all; reads go on."""
    env = simpy.Environment()
    redis = SimRedis(env, running_index="r", retries_index="q", ttl_s=60, lease_ms=600)
    sentinel = SimSentinel(env, redis, random.Random(1), 0.5, 0.05, min_replicas_lag_s=1.0)
    client = _client(env, redis)
    first = _outcome(env, client.call(redis._set, "k", 1, None))
    env.run(0.5)
    assert first[0] is None
    sentinel.partition(True)
    env.run(1.5)  # cut 1 s ago: within the lag, still taken (and lost if it fails over)
    within = _outcome(env, client.call(redis._set, "k", 2, None))
    env.run(2.0)
    assert within[0] is None and redis.data["k"] == 2
    env.run(3.0)  # cut 2.5 s ago: past lag + the second between acknowledgements
    refused = _outcome(env, client.call(redis._set, "k", 3, None))
    read = _outcome(env, client.call(redis.get, "k"))
    env.run(3.5)
    assert isinstance(refused[0], ConnectionError) and "NOREPLICAS" in str(refused[0])
    assert read[0] == 2 and redis.data["k"] == 2
    sentinel.partition(False)
    again = _outcome(env, client.call(redis._set, "k", 4, None))
    env.run(4.0)
    assert again[0] is None and redis.data["k"] == 4


def test_the_paused_primary_is_answered_by_either_mitigation_and_fails_without_both() -> None:
    """sentinel_paused_primary: the old primary acknowledges, on data nobody keeps, what
    waited while it slept. WAIT alone (mutant no_restore) or the results written back
    before the announcement alone (mutant no_wait) keeps the announcement true; without
    both (mutant unmitigated) evaluations are announced with results Redis has lost."""
    loaded = load_scenario(ROOT / "scenarios" / "sentinel_paused_primary.yaml")
    assert run_scenario(loaded).result.ok
    assert run_scenario(loaded, mutant="no_wait").result.ok
    assert run_scenario(loaded, mutant="no_restore").result.ok
    broken = run_scenario(loaded, mutant="unmitigated").result
    assert broken.verdicts["matches_reference"] == "fail"
