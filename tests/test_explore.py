"""Exploration in the simulator finds every mutant, and a failure shrinks to a replayable file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from chaos.explore import (
    SeedResult,
    concrete,
    document,
    load_document,
    load_variant,
    shrink,
    simulate,
    swarm,
)
from chaos.mutants import MUTANTS
from chaos.scenario import load_scenario
from tests.cli_helpers import chaos
from tests.test_chaos_runs import CATCHES

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "scenarios"


def data_of(name: str) -> dict:
    return document(load_scenario(SCENARIOS / f"{name}.yaml"))


#: Checks an explored variant leaves out (`chaos.explore.swarm`): whether a drawn fault
#: fires there is chance, not a promise. Their mutants are caught by the scenario itself.
NOT_EXPLORED = {"faults_fired"}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_every_mutant_is_found_within_1000_seeds(mutant: str) -> None:
    data = data_of(CATCHES[mutant])
    breaks = MUTANTS[mutant].breaks
    if breaks in NOT_EXPLORED:
        variant = swarm(data, 0)
        assert breaks in variant["not_checked"] and breaks not in variant.get("exercised", {})
        assert breaks in simulate(data, mutant).failed  # the scenario as written catches it
        return
    for seed in range(1000):
        result = simulate(swarm(data, seed), mutant)
        if breaks in result.failed:
            return
    pytest.fail(f"{mutant} not found in 1000 seeds of {CATCHES[mutant]}")


#: Network scenarios with teeth: the mutant each must also find (not only its own scenario).
NETWORK_CATCHES = {"no_fencing": "split_brain"}  # slow replies: a start allowed seconds ago


@pytest.mark.parametrize("mutant", sorted(NETWORK_CATCHES))
def test_a_network_scenario_finds_its_mutant_within_1000_seeds(mutant: str) -> None:
    data = data_of(NETWORK_CATCHES[mutant])
    breaks = MUTANTS[mutant].breaks
    for seed in range(1000):
        if breaks in simulate(swarm(data, seed), mutant).failed:
            return
    pytest.fail(f"{mutant} not found in 1000 seeds of {NETWORK_CATCHES[mutant]}")


@pytest.mark.parametrize(
    "name",
    [
        "crash_after_ack",
        "worker_kill_storm",
        "delay_tiers",
        "crash_in_write_window",
        "split_brain",
        "redis_partition",
        "amqp_blackhole",
    ],
)
def test_the_real_engine_survives_its_swarm(name: str) -> None:
    data = data_of(name)
    failing = [r for r in (simulate(swarm(data, s)) for s in range(40)) if not r.ok]
    assert not failing, failing[:3]


def test_swarm_draws_within_the_scenario_bounds() -> None:
    data = data_of("worker_kill_storm")
    variants = [swarm(data, s) for s in range(40)]
    assert variants[0] == swarm(data, 0)  # a seed is a variant, always the same one
    counts = {len(v["faults"]) for v in variants}
    assert counts == {0, 1}  # the one fault, kept or not
    for v in variants:
        for fault in v["faults"]:
            assert 1 <= fault["count"] <= 6 and fault["random_at_s"] == [0.2, 2.5]


def test_a_shrunk_regression_explores_as_its_source_did() -> None:
    """A shrunk scenario leaves `faults_fired` out already (its variant did): the swarm does
    not list it twice, which made every seed of it an invalid variant."""
    path = SCENARIOS / "regressions" / "cancel-before-a-status-write-cancel-respected-s50.yaml"
    data = document(load_scenario(path))
    assert "faults_fired" in data["not_checked"]
    variants = [swarm(data, s) for s in range(3)]
    assert all(v["not_checked"].count("faults_fired") == 1 for v in variants)
    results = [simulate(v) for v in variants]
    assert not any("invalid_variant" in r.failed for r in results), results


def test_concrete_schedule_replays_the_same_run() -> None:
    variant = swarm(data_of("worker_kill_storm"), 4)
    written = concrete(variant)
    assert all("random_at_s" not in f and f["target"] != "random" for f in written["faults"])
    from chaos.explore import load_document
    from chaos.insim import run_scenario

    def events(data: dict) -> list[dict]:  # fault names differ; nothing else may
        history = run_scenario(load_document(data), seed=data["seed"]).history
        return [{k: v for k, v in e.items() if k != "fault"} for e in history]

    assert events(written) == events(variant)


@pytest.mark.parametrize(
    ("name", "seed"),
    [
        ("split_brain", 0),
        ("sentinel_failover_with_partition", 0),
        ("sentinel_quorum_lost", 1),
        ("sentinel_paused_primary", 2),
        ("cancel_midway", 3),
        ("paused_worker", 1),
    ],
)
def test_every_kind_of_fault_writes_out_concrete(name: str, seed: int) -> None:
    """A shrunk regression is written from `concrete`: network faults keep their link,
    workers and toxic, pauses their pause, and nothing a firing does not take is written."""
    from chaos.explore import load_document
    from chaos.insim import run_scenario

    variant = data_of(name)
    variant["seed"] = seed
    written = concrete(variant)
    assert run_scenario(load_document(written), seed=seed).history  # it loads, and runs
    events = run_scenario(load_document(variant), seed=seed).history
    fired = [e["action"] for e in events if e["ev"] == "fault_fired"]
    again = run_scenario(load_document(written), seed=seed).history
    assert [e["action"] for e in again if e["ev"] == "fault_fired"] == fired


def test_shrinking_keeps_the_failure_and_drops_the_rest() -> None:
    calls: list[int] = []

    def fake(candidate: dict, mutant: str | None) -> SeedResult:
        calls.append(1)
        # fails while the kill at the earliest time is kept and it still has 2+ workers
        kills = [f for f in candidate["faults"] if f.get("action") == "kill_worker"]
        fails = any(f.get("target") == 0 for f in kills) and candidate.get("workers", 1) >= 2
        return SeedResult(0, not fails, ("no_completed_rerun",) if fails else ())

    data = data_of("worker_kill_storm")
    data["faults"][0]["count"] = 4
    small = shrink(swarm(data, 3) | {"faults": concrete(data)["faults"]}, "no_completed_rerun",
                   run=fake)  # fmt: skip
    assert len(small["faults"]) == 1 and small["faults"][0]["target"] == 0
    assert small["workers"] == 2 and small["faults"][0]["at_s"] == 0.0
    assert calls


def test_chaos_sim_finds_shrinks_and_writes_a_replayable_regression(tmp_path: Path) -> None:
    found = chaos(
        "sim", "scenarios/crash_after_ack.yaml", "--seeds", "20", "--jobs", "2",
        "--mutant", "no_redis_results", "--shrink", "--regressions", str(tmp_path),
    )  # fmt: skip
    assert found.returncode == 1, found.stdout + found.stderr
    assert "no_completed_rerun" in found.stdout
    [written] = tmp_path.glob("*.yaml")
    replay = chaos("run", str(written), "--mode", "sim", "--mutant", "no_redis_results",
                   "--out", str(tmp_path / "a"))  # fmt: skip
    assert replay.returncode == 1, replay.stdout
    clean = chaos("run", str(written), "--mode", "sim", "--out", str(tmp_path / "b"))
    assert clean.returncode == 0, clean.stdout
    quiet = chaos("sim", "scenarios/crash_after_ack.yaml", "--seeds", "20", "--jobs", "1")
    assert quiet.returncode == 0 and "0 failing" in quiet.stdout


def test_all_failpoints_enumerates_every_crash_point() -> None:
    out = chaos("sim", "scenarios/crash_in_write_window.yaml", "--all-failpoints")
    assert out.returncode == 0, out.stdout + out.stderr
    tried = int(out.stdout.split(" crash points tried")[0].split()[-1])
    assert tried > 40  # 13 rules: dozens of hits of the rule-level failpoints


def test_all_failpoints_on_processes_tries_the_same_crash_points_as_in_one() -> None:
    """`--jobs` is honoured (it was ignored): the failpoints' sequences on two processes
    give the same crash points tried and the same failing ones, in the same order."""

    def lines(jobs: str) -> list[str]:
        args = ("sim", "scenarios/crash_in_write_window.yaml", "--all-failpoints")
        out = chaos(*args, "--mutant", "no_redis_results", "--jobs", jobs)
        assert out.returncode == 1, out.stdout + out.stderr
        said = out.stdout.splitlines()
        first, *rest = [line for line in said if "(sim)" in line or " hit " in line]
        return [first.split(" in ")[0], first.split(" s, ")[1], *rest]  # the time left out

    one = lines("1")
    assert lines("2") == one and len(one) > 2, one[:3]


def test_a_crash_variant_asks_each_listed_invariant_for_a_case_not_the_scenario_s_count() -> None:
    """transient_llm_errors asks for 6 judged delayed retries; a crash after retry 1 is
    published and before the delivery it holds is ACKed leaves 5 (the retry re-published by
    the sweeper is not judged as one): its own minimums failed that variant with no engine
    fault. The variant now asks each invariant for one case, and a variant whose
    invariant judged none still fails."""
    from chaos.simcli import crash_variant

    data = data_of("transient_llm_errors")
    variant = crash_variant(data, 5, "after_retry_publish_before_ack", 1)
    assert variant["exercised"] == dict.fromkeys(data["exercised"], 1)
    assert simulate(variant).ok
    old = {**variant, "exercised": data["exercised"]}
    assert simulate(old).failed == ("exercised",)
    none = crash_variant(data_of("crash_after_ack"), 1, "after_ack", 1)
    none["exercised"] = {"retries_acked": 1}  # no delayed retry in that scenario
    assert simulate(none).failed == ("exercised",)


def test_a_variant_that_cannot_load_is_a_failure_not_a_pass() -> None:
    from chaos.explore import simulate

    result = simulate({"name": "broken", "seed": 3, "plans": "not a list"})
    assert not result.ok and result.failed == ("invalid_variant",)
    assert result.message.startswith("invalid variant:")


def test_a_variant_validated_once_is_the_variant_validated_for_each_seed() -> None:
    """`load_variant` validates a variant once and copies it for another seed that draws
    it: the copy equals what validating it would give, and the cache did serve it."""
    data = data_of("crash_after_ack")
    served = 0
    for seed in range(16):
        variant = swarm(data, seed)
        got, want = load_variant(variant), load_document(variant)
        assert got.spec == want.spec and got.spec.seed == seed
        assert got.spec.model_fields_set == want.spec.model_fields_set
        assert (got.agent, got.retry_policy, got.plans) == (
            want.agent,
            want.retry_policy,
            want.plans,
        )
        served += got.plans[0][0] is load_variant(swarm(data, seed + 1000)).plans[0][0]
    assert served  # some seeds drew a variant already validated


_COLLECTED = """
import gc, sys
from chaos.explore import _one, document, tune_for_seeds
from chaos.scenario import load_scenario

data = document(load_scenario(sys.argv[1]))
if sys.argv[2] == "tuned":
    tune_for_seeds()
else:
    gc.disable()  # only what `_one` collects itself is collected
_one((data, 0, None, False))
print(gc.collect())
"""


@pytest.mark.parametrize("process", ["tuned", "caller"])
def test_a_seed_process_collects_each_seed_s_cycles_as_it_ends(process: str) -> None:
    """A process tuned for seeds (the pool's, a cluster worker's) collects a seed's cyclic
    garbage (its generators and events) as the seed ends, while it is still in the cache;
    a caller's own process (`--jobs 1`) is left to its own collector."""
    out = subprocess.run(
        [sys.executable, "-c", _COLLECTED, str(SCENARIOS / "crash_after_ack.yaml"), process],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    left = int(out.stdout.split()[-1])
    if process == "tuned":
        assert left == 0
    else:
        assert left > 100  # the seed's cycles, there to be collected
