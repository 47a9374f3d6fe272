"""The broker's guarantees in the simulator, and engine bugs that end in a verdict.

The simulated broker models what RabbitMQ does with a transient message at a kill, with a
prefetch of 0 and with a publish to a queue nobody declared; an exception out of the
engine (or out of the simulation itself) is a failed `no_engine_error`, never a crash of
`chaos run --mode sim` or `chaos sim --seeds`. The named mutants of the invariants added
with these are in `tests/test_mutants.py` (sim) and `tests/test_chaos_runs.py` (live).
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import simpy

from chaos.checker import CheckSpec, FinalState, check
from chaos.insim import run_scenario
from chaos.scenario import load_scenario
from engine.config import EngineConfig
from sim.broker import WORK_QUEUE, BrokerClient, Delivery, SimBroker

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "scenarios"


def _broker(tiers: dict[tuple[int, int], tuple[str, float]] | None = None) -> SimBroker:
    return SimBroker(simpy.Environment(), random.Random(0), (0.001, 0.001), tiers or {})


# --- the model -------------------------------------------------------------------------------


def test_a_kill_loses_the_transient_messages_of_a_durable_queue() -> None:
    broker = _broker({(0, 0): ("t1", 5.0)})
    broker.publish_arrive("", WORK_QUEUE, {"n": 1}, "p1")
    broker.publish_arrive("", WORK_QUEUE, {"n": 2}, "t1", persistent=False)
    broker.publish_delay((0, 0), {"n": 3}, "t2", persistent=False)
    broker.publish_delay((0, 0), {"n": 4}, "p2")
    held: list[Delivery] = []
    conn = broker.connect("worker", None)
    broker.consume(conn, WORK_QUEUE, 1, held.append)  # "p1" delivered, unacknowledged
    broker.env.run(until=0.1)
    assert [d.message_id for d in held] == ["p1"]
    assert broker.kill() == 4  # what the node held: the unacknowledged one back in its queue
    assert broker.restart() == 2  # what it found on disk
    assert [m.message_id for m in broker.queues[WORK_QUEUE].messages] == ["p1"]
    assert [m.message_id for m in broker.queues["t1"].messages] == ["p2"]


def test_a_dead_lettered_message_keeps_its_delivery_mode() -> None:
    broker = _broker({(0, 0): ("t1", 1.0)})
    broker.publish_delay((0, 0), {"n": 1}, "t", persistent=False)
    broker.env.run(until=2.0)  # expired into the work queue, still transient
    [msg] = broker.queues[WORK_QUEUE].messages
    assert not msg.persistent
    broker.kill()
    broker.restart()
    assert not broker.queues[WORK_QUEUE].messages


def test_prefetch_0_is_no_limit() -> None:
    for prefetch, taken in ((2, 2), (0, 5)):
        broker = _broker()
        for n in range(5):
            broker.publish_arrive("", WORK_QUEUE, {"n": n}, str(n))
        held: list[Delivery] = []
        broker.consume(broker.connect("w", None), WORK_QUEUE, prefetch, held.append)
        broker.env.run(until=1.0)
        assert len(held) == taken


def test_a_publish_to_a_queue_nobody_declared_is_unroutable() -> None:
    broker = _broker({(0, 0): ("t1", 1.0)})
    # the default exchange with the name of no queue: RabbitMQ drops it (or returns it)
    assert broker.publish_arrive("", "evaluation.retry.nope", {}, "x") is False
    assert broker.publish_delay((7, 7), {}, "x") is False
    assert all(not q.messages for q in broker.queues.values())


def test_the_workers_prefetch_is_its_config() -> None:
    assert EngineConfig(max_evaluations=3).prefetch == 12
    assert BrokerClient.DELIVERY_MODE == 2  # the engine's (engine.runtime.wire)
    from engine.runtime import wire

    assert wire.DELIVERY_MODE == 2 and b"\x02" in wire._FIXED_PROPS


# --- the checks, on histories made by hand ---------------------------------------------------


def _check(events: list[dict[str, Any]], *names: str) -> dict[str, str]:
    seqs: dict[str, int] = {}
    for i, e in enumerate(events):
        e.setdefault("t", float(i))
        e.setdefault("src", "runner")
        e.setdefault("pid", 1)
        seqs[e["src"]] = e["seq"] = seqs.get(e["src"], 0) + 1  # no gap: a whole history
    result = check(events, FinalState(), CheckSpec(invariants=names))
    return {n: result.verdicts[n] for n in names}


def test_prefetch_respected_reads_the_peak_of_each_worker() -> None:
    def window(n: int, prefetch: int = 4) -> dict[str, Any]:
        return {
            "ev": "prefetch_window",
            "src": "w1",
            "pid": 7,
            "in_flight": n,
            "queue": WORK_QUEUE,
            "prefetch": prefetch,
            "max_evaluations": 1,
        }

    assert _check([window(1), window(4)], "prefetch_respected") == {"prefetch_respected": "pass"}
    assert _check([window(1), window(5)], "prefetch_respected") == {"prefetch_respected": "fail"}
    assert _check([window(1, 0)], "prefetch_respected") == {"prefetch_respected": "fail"}
    assert _check([window(1, 8)], "prefetch_respected") == {"prefetch_respected": "fail"}
    assert _check([], "prefetch_respected") == {"prefetch_respected": "unknown"}


def test_nothing_lost_on_restart_compares_the_counts() -> None:
    def restart(before: int, after: int) -> list[dict[str, Any]]:
        return [
            {"ev": "service_killed", "service": "broker", "messages": before},
            {"ev": "service_restarted", "service": "broker", "messages": after},
        ]

    name = "nothing_lost_on_restart"
    assert _check(restart(3, 3), name) == {name: "pass"}
    assert _check(restart(3, 2), name) == {name: "fail"}
    received = {"ev": "completed_received", "attempt_id": "a", "body": {}, "delivery_mode": 1}
    assert _check([received], name) == {name: "fail"}
    assert _check([{**received, "delivery_mode": 2}], name) == {name: "pass"}


def test_a_retry_waiting_at_a_broker_kill_must_come_back() -> None:
    name = "nothing_lost_on_restart"
    key = {"attempt_id": "a", "rule_id": "r", "attempt": 2}
    waiting = [
        {"ev": "retry_published", "src": "w1", "pid": 7, **key},
        {"ev": "fault_fired", "action": "kill_broker"},
        {"ev": "service_killed", "service": "broker"},
    ]
    back = {"ev": "delivered", "src": "w1", "pid": 7, "kind": "retry", "reason": None, **key}
    rescued = {**back, "reason": "lost_retry"}  # the sweeper's copy
    drained = {"ev": "queues_drained", "message_ids": []}
    assert _check([*waiting, back, drained], name) == {name: "pass"}
    assert _check([*waiting, rescued, drained], name) == {name: "fail"}
    still_queued = {"ev": "queues_drained", "message_ids": ["a:r:2"]}
    assert _check([*waiting, rescued, still_queued], name) == {name: "pass"}
    lost_on_purpose = {"ev": "retry_lost", **key}
    # the runner took it on purpose (`broker.dead_letter_loss`): not owed, nothing judged
    assert _check([*waiting, lost_on_purpose, rescued, drained], name) == {name: "unknown"}
    assert _check([*waiting, rescued], name) == {name: "unknown"}  # not drained: not judged


# --- engine bugs end in a verdict -------------------------------------------------------------


def test_an_exception_out_of_the_simulation_is_a_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    # A bug that raises where no engine step catches it (the broker's model, called from a
    # simulated frame's arrival): the run still ends, failed, with the traceback.
    def broken(self: SimBroker, *args: Any, **kwargs: Any) -> bool:
        raise KeyError("nowhere")

    monkeypatch.setattr(SimBroker, "publish_arrive", broken)
    outcome = run_scenario(load_scenario(SCENARIOS / "crash_right_after_ack.yaml"))
    assert outcome.result.verdicts["no_engine_error"] == "fail"
    [error] = [e for e in outcome.history if e["ev"] == "engine_error"]
    assert error["during"] == "simulation" and error["error"] == "KeyError: 'nowhere'"
    assert "sim/broker.py" in error["traceback"] or "publish_arrive" in error["traceback"]


def _chaos(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chaos", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize(
    ("mutant", "name"),
    [("raise_in_shell", "crash_right_after_ack"), ("retry_to_undeclared_queue", "delay_tiers")],
)
def test_an_engine_bug_is_a_verdict_on_the_command_line(
    mutant: str, name: str, tmp_path: Path
) -> None:
    scenario = str(SCENARIOS / f"{name}.yaml")
    run = _chaos(
        "run", scenario, "--mode", "sim", "--quiet", "--mutant", mutant,
        "--out", str(tmp_path / "run"), cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr  # a violation, not a traceback (exit 1 either way)
    assert "Traceback" not in run.stderr
    assert f"FAIL {name} (sim)" in run.stdout and "no_engine_error" in run.stdout
    journal = next((tmp_path / "run").glob("*/journal.json")).read_text()
    assert "engine_error" in journal and "Traceback (most recent call last)" in journal
    seeds = _chaos("sim", scenario, "--seeds", "3", "--jobs", "1", "--mutant", mutant, cwd=ROOT)
    assert seeds.returncode == 1, seeds.stderr
    assert "Traceback" not in seeds.stderr
    assert seeds.stdout.count("no_engine_error") >= 3  # every seed: a verdict
