"""The simulated network (`sim.network`): Toxiproxy's toxics on each worker's links.

The clients alone first (a Redis client and a broker connection through a proxy, on a
bare simpy clock), then whole scenarios with network faults through `run_scenario`.
Each test pins one consequence that a wrong model would get wrong.
"""

from __future__ import annotations

import random
from collections.abc import Generator
from typing import Any

import simpy

from chaos.insim import run_scenario
from chaos.proxy import model
from chaos.scenario import scenario_from_dict
from engine.runtime.store import runs_key
from sim.broker import WORK_QUEUE, BrokerClient, Delivery, SimBroker
from sim.network import Network, size_of
from sim.redis import RedisClient, SimRedis

LATENCY = (0.001, 0.001)


def _redis() -> tuple[simpy.Environment, SimRedis, Network]:
    env = simpy.Environment()
    redis = SimRedis(env, running_index="r", retries_index="q", ttl_s=3600, lease_ms=600)
    return env, redis, Network(env, 7, model)


def _toxic(kind: str, stream: str = "downstream", toxicity: float = 1.0, **attrs: int) -> dict:
    return {"type": kind, "stream": stream, "toxicity": toxicity, "attributes": attrs}


def _timed(env: simpy.Environment, call: Generator, out: list[Any]) -> None:
    def run() -> Generator:
        value = yield from call
        out.append((env.now, value))

    env.process(run())


# --- Redis through a proxy ----------------------------------------------------------------


def test_a_calm_link_changes_nothing() -> None:
    """No toxic, no cut: the same draws and the same times as a client with no link."""
    times = []
    for linked in (False, True):
        env, redis, net = _redis()
        link = net.link(0, "redis") if linked else None
        client = RedisClient(env, redis, random.Random(1), (0.001, 0.003), link=link)
        out: list[Any] = []
        for _ in range(3):
            _timed(env, client.call(redis.ping), out)
        env.run()
        times.append(out)
    assert times[0] == times[1]


def test_latency_delays_only_that_workers_calls() -> None:
    env, redis, net = _redis()
    net.link(0, "redis").add(_toxic("latency", latency=200))
    slow = RedisClient(env, redis, random.Random(1), LATENCY, link=net.link(0, "redis"))
    fast = RedisClient(env, redis, random.Random(2), LATENCY, link=net.link(1, "redis"))
    got: list[Any] = []
    _timed(env, slow.call(redis.ping), got)
    _timed(env, fast.call(redis.ping), got)
    env.run()
    (t_fast, _), (t_slow, _) = got
    assert t_fast < 0.01
    assert t_slow >= 0.2


def test_a_reply_lost_downstream_was_applied_and_the_retry_runs_it_again() -> None:
    env, redis, net = _redis()
    link = net.link(0, "redis")
    link.add(_toxic("timeout", "downstream", timeout=0))
    client = RedisClient(env, redis, random.Random(1), LATENCY, link=link, read_timeout_s=2.0)
    got: list[Any] = []
    _timed(env, client.call(redis.mark_started, "a1", [("r", 1)]), got)
    env.run(until=1.0)
    assert redis.get(runs_key("a1", "r")) == {"1": 1}  # applied; its reply vanished
    assert got == []
    link.remove("timeout_downstream")  # that closes the connection the timeout broke
    env.run(until=1.5)
    assert got[0][1] == ([2], None)  # failed at once, retried on a new connection: twice
    assert link.count == 2


def test_a_reply_lost_is_waited_for_read_timeout_s() -> None:
    env, redis, net = _redis()
    link = net.link(0, "redis")
    link.add(_toxic("timeout", "downstream", timeout=0))
    client = RedisClient(env, redis, random.Random(1), LATENCY, link=link, read_timeout_s=2.0)
    got: list[Any] = []
    _timed(env, client.call(redis.mark_started, "a1", [("r", 1)]), got)
    env.run(until=1.9)
    link.update({"name": "timeout_downstream", "toxicity": 0.0})  # lets replies by again
    env.run(until=5)
    t, value = got[0]
    assert value == ([2], None)  # a new connection after the read timeout: it ran twice
    assert 2.0 <= t < 2.1


def test_a_request_lost_upstream_is_never_applied() -> None:
    env, redis, net = _redis()
    link = net.link(0, "redis")
    link.add(_toxic("timeout", "upstream", timeout=0))
    client = RedisClient(env, redis, random.Random(1), LATENCY, link=link, read_timeout_s=1.0)
    _timed(env, client.call(redis.mark_started, "a1", [("r", 1)]), [])
    env.run(until=3.5)
    assert redis.get(runs_key("a1", "r")) is None


def test_limit_data_closes_after_n_bytes_and_the_next_connection_gets_n_more() -> None:
    env, redis, net = _redis()
    link = net.link(0, "redis")
    per_call = size_of(("a1", [("r", 1)]))
    link.add(_toxic("limit_data", "upstream", bytes=2 * per_call + per_call // 2))
    client = RedisClient(env, redis, random.Random(1), LATENCY, link=link)
    got: list[Any] = []

    def three() -> Generator:
        for _ in range(3):
            got.append((yield from client.call(redis.mark_started, "a1", [("r", 1)])))

    env.process(three())
    env.run(until=5)
    assert [g[0] for g in got] == [[1], [2], [3]]  # the third, cut short, was not applied
    assert link.count == 2  # the third went again, on a new connection


def test_reset_peer_resets_after_its_timeout() -> None:
    env, redis, net = _redis()
    link = net.link(0, "redis")
    link.add(_toxic("reset_peer", "upstream", timeout=500))
    client = RedisClient(env, redis, random.Random(1), LATENCY, link=link)
    got: list[Any] = []
    _timed(env, client.call(redis.ping), got)
    env.run(until=0.4)
    assert got == [] and link.count == 1
    link.remove("reset_peer_upstream")  # armed: the reset comes anyway
    env.run(until=2)
    assert got and 0.5 <= got[0][0] < 0.6 and link.count == 2


def test_a_cut_redis_link_refuses_until_restored() -> None:
    env, redis, net = _redis()
    link = net.link(0, "redis")
    link.cut()
    client = RedisClient(env, redis, random.Random(1), LATENCY, link=link)
    got: list[Any] = []
    _timed(env, client.call(redis.ping), got)
    env.run(until=3)
    assert got == []
    link.restore()
    env.run(until=5)
    assert got and got[0][1] == "PONG"


# --- the broker through a proxy -----------------------------------------------------------


def _broker(heartbeat_s: float = 2.0) -> tuple[simpy.Environment, SimBroker, Network, Any]:
    env = simpy.Environment()
    broker = SimBroker(env, random.Random(0), LATENCY, {})
    net = Network(env, 7, model)
    held: list[Delivery] = []
    client = BrokerClient(
        env,
        broker,
        "w0",
        spawn=env.process,
        link=net.link(0, "broker"),
        heartbeat_s=heartbeat_s,
        read_timeout_s=3.0,
    )

    def boot() -> Generator:
        assert (yield from client.connect())
        client.consume(WORK_QUEUE, 4, held.append)

    env.process(boot())
    env.run(until=0.1)
    broker.publish_arrive("", WORK_QUEUE, {"name": "a"}, "a")
    env.run(until=0.2)
    assert [d.body["name"] for d in held] == ["a"]
    return env, broker, net, (client, held)


def test_a_cut_broker_link_requeues_at_once_and_reconnects_once_restored() -> None:
    env, broker, net, (_, held) = _broker()
    net.link(0, "broker").cut()
    assert [m.body["name"] for m in broker.queues[WORK_QUEUE].messages] == ["a"]
    env.run(until=3)  # reconnects are refused every 0.5 s meanwhile
    assert len(held) == 1
    net.link(0, "broker").restore()
    env.run(until=4)
    assert [(d.body["name"], d.redelivered) for d in held] == [("a", False), ("a", True)]


def test_a_half_open_upstream_is_noticed_by_the_broker_after_two_to_three_heartbeats() -> None:
    env, broker, net, (client, held) = _broker(heartbeat_s=2.0)
    first = client.conn
    net.link(0, "broker").add(_toxic("timeout", "upstream", timeout=0))
    assert client.settle(held[0])  # the ACK goes into the blackhole
    env.run(until=0.2 + 4 - 0.01)  # not before two intervals
    assert first is not None and first.open and first.unacked
    env.run(until=0.2 + 6 + 0.01)  # by three: the broker closed it, the ACK lost
    assert not first.open
    assert [m.body["name"] for m in broker.queues[WORK_QUEUE].messages] == ["a"]


def test_a_half_open_downstream_is_noticed_by_the_client_after_its_heartbeat_bound() -> None:
    env, broker, net, (client, _) = _broker(heartbeat_s=2.0)
    first = client.conn
    net.link(0, "broker").add(_toxic("timeout", "downstream", timeout=0))
    env.run(until=0.2 + 9 - 0.01)  # aiormq: nothing received for (H + 1) * 3 s
    assert first is not None and first.open and first.unacked
    env.run(until=0.2 + 10 + 0.01)  # at its next tick: it closes, the broker requeues
    assert not first.open
    assert [m.body["name"] for m in broker.queues[WORK_QUEUE].messages] == ["a"]


# --- whole scenarios ----------------------------------------------------------------------

BASE: dict[str, Any] = {
    "name": "net",
    "seed": 3,
    "plan": "../plans/code_review.yaml",
    "evaluations": 4,
    "workers": 2,
    "agent": {"latency_ms": 1_000_000},
    "deadline_s": 120,
    "not_checked": ["retry_delays_respected"],
}


def _run(faults: list[dict[str, Any]], seed: int | None = None) -> Any:
    doc = {**BASE, "faults": faults}
    return run_scenario(scenario_from_dict(doc, "net.yaml", "scenarios"), seed)


def test_a_cut_redis_link_loses_the_lease_and_the_late_writes_are_fenced() -> None:
    outcome = _run(
        [{"at_s": 0.5, "action": "cut_link", "link": "redis", "workers": [0], "for_s": 2.5}]
    )
    assert outcome.result.ok, outcome.result
    history = outcome.history
    held = {
        e["attempt_id"]
        for e in history
        if e["ev"] == "evaluation_started" and e["src"] == "sim-w0-1"
    }
    restored = next(e["t"] for e in history if e["ev"] == "link_restored")
    taken = {
        e["attempt_id"]
        for e in history
        if e["ev"] == "sweeper_resumed" and e["src"] == "sim-w1-1" and e["t"] < restored
    }
    assert held and taken == held  # its leases went stale while it was cut off
    # Once back, its first answer from Redis is a refusal by the fence: its heartbeat's
    # renewal (the token is no longer the current one) or a late write's `LeaseLost`,
    # whichever went first in its batches; nothing it wrote after the cut landed.
    fenced = {
        e["attempt_id"]
        for e in history
        if e["ev"] == "evaluation_abandoned"
        and e["src"] == "sim-w0-1"
        and e["reason"].startswith(("LeaseLost", "lease lost"))
        and e["t"] >= restored
    }
    assert fenced == held
    landed = [e for e in history if e["ev"] == "result_persisted" and e["src"] == "sim-w0-1"]
    assert all(e["t"] < restored for e in landed)


def test_toxicity_draws_follow_the_seed() -> None:
    faults = [
        {
            "at_s": 0.5,
            "action": "add_toxic",
            "link": "redis",
            "workers": "all",
            "toxic": {
                "type": "latency",
                "toxicity": 0.5,
                "attributes": {"latency": 50, "jitter": 40},
            },
            "for_s": 2,
        }
    ]
    a, b, c = _run(faults, 1), _run(faults, 1), _run(faults, 2)
    assert a.history_hash == b.history_hash
    assert a.history_hash != c.history_hash


def test_toxicity_is_decided_per_connection_from_the_seed() -> None:
    def decisions(seed: int) -> list[bool]:
        env = simpy.Environment()
        link = Network(env, seed, model).link(0, "redis")
        link.add(_toxic("latency", toxicity=0.5, latency=10))
        conns = [link.open(None) for _ in range(32)]
        return [c.met["latency_downstream"].on for c in conns if c is not None]

    assert decisions(1) == decisions(1)
    assert decisions(1) != decisions(2)
    assert 4 < sum(decisions(1)) < 28
