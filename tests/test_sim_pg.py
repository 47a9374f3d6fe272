"""The `pg` design in the simulator: the shell on PostgreSQL alone (`sim.pgqueue`).

Why: the late ACK of this design rests on visibility leases, delayed retries on a visible
time, forwards on a registry of consumers; each is proven here on the model alone, then
through whole scenarios judged by the live checker, and a model broken on purpose must be
caught by it. Everything runs on simulated time, with no service.
"""

from __future__ import annotations

import random
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import simpy
import yaml

from chaos.insim.run import SimOutcome, SimRun
from chaos.scenario import LoadedScenario, load_scenario, scenario_from_dict
from chaos.systems import refusal
from chaos.systems.pg.sim import PgSim, Primary, StandbyJobs
from engine.shell.effects import Unroutable
from reports.latency import result_write_waits
from sim.broker import WORK_QUEUE
from sim.pgqueue import PgQueueClient, SimJobs
from sim.redis import SimRedis

ROOT = Path(__file__).resolve().parents[1]
LEASE_MS = 600


def scenario(name: str, **changes: Any) -> LoadedScenario:
    """A shipped scenario, with `changes` to its document."""
    path = ROOT / "scenarios" / f"{name}.yaml"
    if not changes:
        return load_scenario(path)
    data = {**yaml.safe_load(path.read_text()), **changes}
    return scenario_from_dict(data, source=str(path))


def run(loaded: LoadedScenario, seed: int | None = None, adapter: type | None = None) -> SimOutcome:
    return SimRun(loaded, seed, system="pg", adapter=adapter).run()


def of(history: list[dict], ev: str, **match: Any) -> list[dict]:
    return [e for e in history if e["ev"] == ev and all(e.get(k) == v for k, v in match.items())]


def ok(outcome: SimOutcome) -> bool:
    """Whether the checker passed it; its violations shown when not."""
    for v in outcome.result.violations[:5]:
        print(v.invariant, v.message)
    return outcome.result.ok


# --- the queue alone --------------------------------------------------------------------------


def _db(lease_ms: int = LEASE_MS) -> tuple[simpy.Environment, SimRedis, SimJobs]:
    env = simpy.Environment()
    server = SimRedis(env, running_index="r", retries_index="q", ttl_s=3600, lease_ms=lease_ms)
    return env, server, SimJobs(env, random.Random(0), (0.0, 0.0), lease_ms)


def _at(env: simpy.Environment, s: float) -> None:
    env.run(until=s)


def test_a_delayed_retry_is_not_claimed_before_its_visible_time() -> None:
    env, _, jobs = _db()
    jobs.apply("renew", "w", [])
    jobs.apply("publish", WORK_QUEUE, "a:r:2", {"type": "retry"}, 50)
    assert jobs.apply("claim", "w", 10, 10) == [50]  # nothing yet; due at 50 ms
    _at(env, 0.049)
    assert jobs.apply("claim", "w", 10, 10) == [50]
    _at(env, 0.050)
    (_, token, message, queue), due = jobs.apply("claim", "w", 10, 10)
    assert (token, message.message_id, queue, due) == (1, "a:r:2", WORK_QUEUE, None)


def test_a_retry_is_delivered_no_sooner_than_published_plus_its_delay() -> None:
    outcome = run(scenario("delay_tiers"))
    assert ok(outcome)
    retries = of(outcome.history, "delivered", kind="retry")
    assert retries
    for e in retries:
        assert e["t"] * 1000 >= e["published_ms"] + e["delay_ms"], e


def test_a_lapsed_claim_comes_back_redelivered_and_its_old_ack_is_refused() -> None:
    env, _, jobs = _db()
    jobs.apply("publish", WORK_QUEUE, "m", {}, 0)
    ((seq, token, _, _), _) = jobs.apply("claim", "w0", 1, 1)
    _at(env, LEASE_MS / 1000)
    assert jobs.apply("claim", "w1", 1, 1) == [None]  # the lease still runs (to its last ms)
    _at(env, LEASE_MS / 1000 + 0.0015)  # the database's clock counts whole ms
    ((again, token2, _, _), _) = jobs.apply("claim", "w1", 1, 1)
    assert (again, token2) == (seq, 2)  # redelivered
    assert not jobs.apply("ack", seq, "w0", token)  # no longer its claim
    assert jobs.apply("ack", seq, "w1", token2)
    assert seq not in jobs.jobs


def _forward(env: simpy.Environment, client: PgQueueClient, holder: str) -> str:
    """What a forward to `holder` comes to: "routed" or "unroutable"."""
    box: list[str] = []

    def go() -> Generator[Any, Any, None]:
        try:
            yield from client.forward(f"worker.{holder}", {"type": "retry"}, "m")
            box.append("routed")
        except Unroutable:
            box.append("unroutable")

    env.process(go())
    env.run(until=env.now + 0.01)
    return box[0]


def test_a_forward_to_a_dead_or_stopped_holder_is_unroutable() -> None:
    env, server, jobs = _db()
    client = PgQueueClient(
        env, server, jobs, random.Random(0), (0.0, 0.0), "runner",
        delays_ms={}, renew_every_s=0.2, spawn=env.process,
    )  # fmt: skip
    jobs.apply("renew", "alive", [])
    jobs.apply("renew", "dead", [])
    jobs.apply("renew", "stopped", [])
    assert _forward(env, client, "dead") == "routed"
    jobs.apply("deregister", "stopped")
    assert _forward(env, client, "stopped") == "unroutable"
    _at(env, 0.5)
    jobs.apply("renew", "alive", [])  # its heartbeat; the dead one's row goes stale
    _at(env, LEASE_MS / 1000 + 0.02)
    assert _forward(env, client, "alive") == "routed"
    assert _forward(env, client, "dead") == "unroutable"
    # what went to the dead one before is work for anyone now; the live one's stays its own
    claimed = jobs.apply("claim", "other", 10, 10)[:-1]
    assert [q for *_, q in claimed] == ["worker.dead"]


def test_lost_commits_roll_the_queue_back_as_the_store() -> None:
    env, _, jobs = _db()
    jobs.lag_s = 0.2
    jobs.apply("publish", WORK_QUEUE, "kept", {}, 0)
    _at(env, 1.0)
    jobs.apply("publish", WORK_QUEUE, "lost", {}, 0)
    jobs.apply("event", "evaluation.completed", "lost:completed", {})
    assert jobs.lose_since(1.0 - 0.2) == 2
    assert [r.message.message_id for r in jobs.jobs.values()] == ["kept"]
    assert jobs.outbox == []


# --- whole scenarios --------------------------------------------------------------------------


def test_a_scenario_passes_on_pg_in_sim() -> None:
    outcome = run(scenario("crash_after_ack"))
    assert ok(outcome)
    assert outcome.extra["system"] == "pg"
    assert {e["queue"] for e in of(outcome.history, "events_consumer_bound")} == {"eai.run_events"}
    assert of(outcome.history, "completed_received")
    assert of(outcome.history, "queues_drained")[0]["message_ids"] == []


@pytest.mark.parametrize("name", ["pg_store/postgres_restart", "pg_store/postgres_partition"])
def test_one_seed_is_one_history(name: str) -> None:
    loaded = scenario(name)
    first, again, other = run(loaded, 3), run(loaded, 3), run(loaded, 4)
    assert first.history == again.history
    assert first.history_hash == again.history_hash
    assert first.history_hash != other.history_hash


def test_a_worker_killed_holding_a_job_lets_it_come_back_after_the_lease() -> None:
    """Worker 0 crashes holding a retry (its late ACK waits for the attempt's outcome) and
    is not restarted: only the lapse of its claim gives the job to worker 1, redelivered.
    Seed 23: one where both retries come to the worker that crashes (with two workers, the
    second may take one; then the failpoint's second hit never comes, `faults_fired`)."""
    sim = SimRun(
        scenario("crash_holding_a_retry", workers=2, restart_crashed_workers=False),
        23,
        system="pg",
    )
    outcome = sim.run()
    assert ok(outcome)
    history = outcome.history
    (crash,) = of(history, "crash")
    first = of(history, "delivered", src=crash["src"], kind="retry", attempt=2)[0]
    (again,) = of(history, "delivered", kind="retry", attempt=2, redelivered=True)
    assert again["src"] != crash["src"]
    # the claim held for its lease (renewed while its worker lived), and not much longer:
    # the other worker's claim loop polls every heartbeat
    lease_s, poll_s = sim.config.stale_ms / 1000, min(1.0, sim.config.heartbeat_ms / 1000)
    assert again["t"] - first["t"] >= lease_s - 0.002
    assert again["t"] - crash["t"] <= lease_s + poll_s + 0.01


class _EagerJobs(SimJobs):
    """A delayed retry visible at once: its tier's wait lost on the way (`visible_ms` now)."""

    def publish(self, queue: str, message_id: str | None, body: Any, delay_ms: int) -> bool:
        return super().publish(queue, message_id, body, 0)


class _EagerPgSim(PgSim):
    def __init__(self, run: SimRun) -> None:
        super().__init__(run)
        latency, lease_ms = self.options.redis_latency_s, self.config.stale_ms
        self.jobs = _EagerJobs(self.env, self.net_rng, latency, lease_ms)


def test_a_queue_that_loses_the_retry_delay_is_caught_by_the_checker() -> None:
    """The delay tiers are the queue's here: a model that makes a retry visible at once
    starts it before its tier (`retry_delays_respected`)."""
    loaded = scenario("delay_tiers")
    assert ok(run(loaded))
    broken = run(loaded, adapter=_EagerPgSim)
    assert not broken.result.ok
    assert "retry_delays_respected" in {v.invariant for v in broken.result.violations}


class _KillAtTheEvent(SimJobs):
    """Every worker SIGKILLed the moment the first `evaluation.completed` row lands."""

    kill: Any = None

    def event(self, topic: str, message_id: str | None, data: Any) -> bool:
        landed = super().event(topic, message_id, data)
        if topic == "evaluation.completed" and self.kill is not None:
            kill, self.kill = self.kill, None
            kill()
        return landed


class _KillingPgSim(PgSim):
    def __init__(self, run: SimRun) -> None:
        super().__init__(run)
        self.jobs = jobs = _KillAtTheEvent(
            self.env, self.net_rng, self.options.redis_latency_s, self.config.stale_ms
        )
        self.alive: list[Any] = []
        jobs.kill = lambda: [w.die(137) for w in self.alive if w.alive]

    def worker(self, index: int, incarnation: int, failpoints: str) -> Any:
        w = super().worker(index, incarnation, failpoints)
        self.alive.append(w)
        return w


def _completed_rows(outbox: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    monkeypatch.setattr(PgQueueClient, "outbox", outbox)
    made: list[_KillingPgSim] = []

    class Kept(_KillingPgSim):
        def __init__(self, run: SimRun) -> None:
            super().__init__(run)
            made.append(self)

    outcome = run(scenario("crash_after_ack", restart_crashed_workers=True), 1, adapter=Kept)
    assert of(outcome.history, "evaluation_terminal")
    rows: dict[str, int] = {}
    for _, topic, message_id, _data in made[0].jobs.outbox:
        if topic == "evaluation.completed":
            rows[message_id] = rows.get(message_id, 0) + 1
    return rows


def test_an_event_and_its_flag_land_together_so_a_kill_never_announces_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The outbox (migrations 0004 and 0005's `announce`): `evaluation.completed` is written
    by the final state's transaction, which flags it published, so a worker killed the
    moment the row lands has flagged it too, and its successor does not announce it again.
    Published apart from its flag (a broker's way), the same kill leaves it unflagged:
    announced twice."""
    together = _completed_rows(True, monkeypatch)
    assert together and set(together.values()) == {1}
    apart = _completed_rows(False, monkeypatch)
    assert 2 in apart.values()


def _applicable(system: str) -> list[str]:
    """The mutants `system` runs (not another design's part) whose catching scenario it can
    run in sim: the scenario's faults, links and settings are its own."""
    from chaos.mutants import refusal as mutant_refusal
    from chaos.systems import refusal
    from tests.test_chaos_runs import CATCHES

    return [
        m
        for m in sorted(CATCHES)
        if mutant_refusal(m, system) is None
        and refusal(scenario(CATCHES[m]), system, "sim") is None
    ]


@pytest.mark.parametrize(
    ("system", "mutant"),
    [(system, m) for system in ("pg", "pg-store") for m in _applicable(system)],
)
def test_a_mutant_is_caught_on_the_postgresql_designs_too(system: str, mutant: str) -> None:
    """The shell, the core and the store functions are shared: each mutant of them is caught
    on each PostgreSQL design by the scenario that catches it on its own, in sim."""
    from chaos.mutants import MUTANTS
    from tests.test_chaos_runs import CATCHES

    outcome = SimRun(scenario(CATCHES[mutant]), None, mutant, system=system).run()
    assert outcome.result.verdicts[MUTANTS[mutant].breaks] == "fail", outcome.result.verdicts


def test_the_postgresql_designs_run_nearly_every_mutant() -> None:
    """What neither design runs is another memory's part (Redis, RabbitMQ) or a scenario of
    a fault they do not have, named here so that a mutant dropped from the sweep shows.
    On `pg` an event is written by the change it announces: `evaluation.started` by begin
    (`started_after_ack` cannot happen), `evaluation.completed` by the final state (nothing
    is announced again, `results_only_reannounced`)."""
    from tests.test_chaos_runs import CATCHES

    left = set(CATCHES) - set(_applicable("pg"))
    assert len(_applicable("pg")) >= 43 and len(_applicable("pg-store")) >= 48
    outbox = {"started_after_ack", "results_only_reannounced"}
    assert {"cancel_read_unheard", "per_message_ttl", *outbox} <= left


# --- a failover to a standby (`postgres.standby`) ---------------------------------------------


def test_a_synchronous_standby_cut_off_holds_what_writes_and_answers_what_reads() -> None:
    """remote_apply: a transaction that wrote gets no reply while the standby is cut off,
    and the others do not see it; one that only read is answered. The standby back, what
    waited commits in order; the primary dead instead, it is gone."""
    env = simpy.Environment()
    primary = Primary(env, running_index="r", retries_index="q", ttl_s=3600, lease_ms=LEASE_MS)
    jobs = primary.jobs = StandbyJobs(env, random.Random(0), (0.0, 0.0), LEASE_MS)
    replies: list[Any] = []

    def serve(fn: Any, *args: Any) -> simpy.Event | None:
        return primary.serve(fn, args, lambda value, _: replies.append(value))

    primary.standby_cut()
    waited = serve(jobs.apply, "publish", WORK_QUEUE, "first", {}, 0)
    serve(jobs.apply, "publish", WORK_QUEUE, "second", {}, 0)
    assert waited is not None and not waited.triggered
    assert replies == [] and jobs.jobs == {} and primary.waiting() == 2
    assert serve(primary.ping) is None and replies == ["PONG"]  # a read: no xid, no wait
    assert serve(jobs.apply, "claim", "w", 10, 10) is None  # nothing to claim: a read
    primary.standby_back()
    env.run()
    assert waited.processed and replies == ["PONG", [None], True, True]
    assert [r.message.message_id for r in jobs.jobs.values()] == ["first", "second"]
    primary.standby_cut()
    lost = serve(jobs.apply, "publish", WORK_QUEUE, "third", {}, 0)
    primary.kill()
    env.run()
    assert lost is not None and lost.processed  # its client wakes: the connection is gone
    assert len(replies) == 4 and len(jobs.jobs) == 2 and primary.waiting() == 0


def _failover(outcome: SimOutcome) -> dict[str, Any]:
    (record,) = of(outcome.history, "redis_failover")
    return record


def test_an_asynchronous_standby_loses_what_its_primary_acknowledged_and_owners_restore_it() -> (
    None
):
    """As live: cut off, the standby misses a wave of results the engine was told were
    written; the promotion loses them (counted by the failover's record, as live counts
    them), and their owners, alive, write them back before the final state."""
    outcome = run(scenario("pg/postgres_failover"))
    assert ok(outcome)
    (killed,) = of(outcome.history, "service_killed")
    assert killed["unreplicated_commits"] > 0
    failover = _failover(outcome)
    assert failover["promoted"] is True
    assert failover["lost_writes"] == len(failover["lost_results"]) > 0
    restored = {
        (e["attempt_id"], rule)
        for e in of(outcome.history, "results_restored")
        for rule in e["rule_ids"]
    }
    assert {tuple(r) for r in failover["lost_results"]} <= restored
    assert outcome.result.stats["lost_writes"] == failover["lost_writes"]


def test_a_plain_kill_of_a_primary_whose_standby_keeps_up_loses_nothing() -> None:
    outcome = run(scenario("pg/postgres_failover", faults=[_kill_only()]))
    assert ok(outcome)
    assert _failover(outcome)["lost_writes"] == 0


def _kill_only() -> dict[str, Any]:
    path = ROOT / "scenarios" / "pg" / "postgres_failover.yaml"
    (kill,) = [f for f in yaml.safe_load(path.read_text())["faults"] if f["name"] == "primary_dies"]
    return kill


def test_a_synchronous_standby_loses_nothing_acknowledged_and_its_writes_wait() -> None:
    """remote_apply under the same faults: nothing the engine was told was written is lost;
    the cost is the result writes held from the cut until the failover."""
    outcome = run(scenario("pg/postgres_failover_sync"))
    assert ok(outcome)
    failover = _failover(outcome)
    assert failover["promoted"] is True and failover["lost_writes"] == 0
    assert failover["lost_results"] == [] and not of(outcome.history, "results_restored")
    asynchronous = run(scenario("pg/postgres_failover"))
    assert max(result_write_waits(outcome.history)) > 0.5
    assert max(result_write_waits(asynchronous.history)) < 0.1


@pytest.mark.parametrize("name", ["pg/postgres_failover", "pg/postgres_failover_sync"])
def test_a_failover_is_one_history_per_seed(name: str) -> None:
    loaded = scenario(name)
    first, again, other = run(loaded, 3), run(loaded, 3), run(loaded, 4)
    assert first.history_hash == again.history_hash
    assert first.history_hash != other.history_hash


def test_no_restore_is_caught_on_the_asynchronous_failover_in_sim() -> None:
    """As live: owners that announce without writing back what the promotion lost leave a
    final state that does not match the reference."""
    outcome = SimRun(scenario("pg/postgres_failover"), None, "no_restore").run()
    assert _failover(outcome)["lost_writes"] > 0
    assert outcome.result.verdicts["matches_reference"] == "fail"


def test_a_standby_is_refused_in_sim_where_it_is_not_modelled() -> None:
    """pg-store has no standby; one beside commits that are not synchronous has no model."""
    loaded = scenario("pg/postgres_failover")
    assert refusal(loaded, "pg", "sim") is None
    on_store = scenario("pg/postgres_failover", system="pg-store", faults=[_kill_only()])
    store = refusal(on_store, "pg-store", "sim")
    assert "postgres.standby: pg-store has no standby" in (store or "")
    lax = {"standby": "async", "synchronous_commit": False}
    assert "postgres.synchronous_commit" in (
        refusal(scenario("pg/postgres_failover", postgres=lax), "pg", "sim") or ""
    )


def test_a_failover_that_lost_a_pass_announced_in_the_cut_announces_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seed 72 of the asynchronous failover: a `pass_result` acknowledged while the standby
    was cut off is lost with the primary before the harness read it, with its flag. Its
    owner, restoring the lost results before its final state, announces its passes again
    (`passes_restored`); without that, pass_results_correct fails."""
    from chaos.explore import simulate, swarm
    from chaos.simcli import document
    from engine.shell.orchestrator import PassExecutionOrchestrator

    variant = swarm(document(scenario("pg/postgres_failover")), 72)
    assert simulate(variant).ok

    def silent(self: Any) -> Generator[Any, Any, None]:
        return
        yield

    monkeypatch.setattr(PassExecutionOrchestrator, "_announce_passes_again", silent)
    assert simulate(variant).failed == ("pass_results_correct",)
