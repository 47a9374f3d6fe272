"""The run's plan (`chaos.conductor`) on its own: its acts carried out by a toy interpreter
with a clock and no processes, Redis, broker or simpy. What a run does and when is decided
there once; these tests pin the decisions both runners carry out."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos import acts
from chaos.conductor import POLL_S, STOP_TIMEOUT_S, Conductor
from chaos.scenario import scenario_from_dict
from engine.shell.effects import Stepper

PLAN = str(Path(__file__).resolve().parents[1] / "plans" / "code_review.yaml")


@dataclass
class Proc:
    pid: int
    alive: bool = True
    returncode: int | None = None
    ready: Any = lambda: True  # whether it has booted, by the toy's clock

    def is_ready(self) -> bool:
        return self.alive and self.ready()


@dataclass
class Toy:
    """Carries a conductor's acts out on a clock: every evaluation settles (terminal,
    announced, delivered) at `settles_at`; a worker is ready as soon as it starts."""

    conductor: Conductor
    settles_at: float = 0.0
    now: float = 0.0
    records: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)
    acts: list[acts.Act] = field(default_factory=list)
    _queue: list[tuple[float, int, Stepper]] = field(default_factory=list)
    _seq: Any = field(default_factory=itertools.count)
    _pids: Any = field(default_factory=lambda: itertools.count(100))
    history: list[tuple[float, dict[str, Any]]] = field(default_factory=list)  # (t, event)
    boot_s: float = 0.0  # how long a restarted worker takes to be ready
    restart_s: float = 0.0  # how long a killed service takes to come back

    def run(self) -> Any:
        main = Stepper(self.conductor.run())
        self._at(0.0, main)
        while self._queue:
            self.now, _, stepper = heapq.heappop(self._queue)
            while (act := stepper.next()) is not None:
                self.acts.append(act)
                if isinstance(act, acts.Sleep):
                    self._at(self.now + act.seconds, stepper)
                    break
                if isinstance(act, acts.RestartService) and self.restart_s:
                    stepper.reply(self._carry(act))  # answered once the service is back
                    self._at(self.now + self.restart_s, stepper)
                    break
                stepper.reply(self._carry(act))
            if stepper is main and act is None:
                return main.value
        raise AssertionError("the run never ended")

    def _at(self, t: float, stepper: Stepper) -> None:
        heapq.heappush(self._queue, (t, next(self._seq), stepper))

    def _carry(self, act: acts.Act) -> Any:
        settled = self.now >= self.settles_at
        ids = set(self.conductor.attempt_ids)
        match act:
            case acts.Now():
                return self.now
            case acts.Record(event=event, fields=fields):
                self.records.append((round(self.now, 6), event, dict(fields)))
            case acts.Spawn(step=step):
                self._at(self.now, Stepper(step))
            case acts.StopSpawned():
                self._queue.clear()  # the main step is running, not queued
            case acts.StartWorker(slot=slot):
                ready_at = self.now + (self.boot_s if slot.incarnation else 0.0)
                return Proc(next(self._pids), ready=lambda: self.now >= ready_at)
            case acts.KillWorker(slot=slot) | acts.TerminateWorker(slot=slot):
                slot.proc.alive, slot.proc.returncode = False, -9
            case acts.Cancel():
                return "cancelled"
            case acts.RestartService() | acts.KillService():
                return {}  # what the record carries: nothing counted here
            case acts.Settled():
                return len(ids) if settled else 0
            case acts.Announced() | acts.Received():
                return ids if settled else set()
            case acts.Tail(cursor=cursor):
                seen = [e for t, e in self.history if t <= self.now]
                return seen[cursor or 0 :], len(seen)
            case acts.ReadFinal():
                return "final"
        return None

    def events(self) -> list[str]:
        return [event for _, event, _ in self.records]


def conductor(**fields: Any) -> Conductor:
    doc = {"name": "toy", "plan": PLAN, "evaluations": 2, "workers": 2, **fields}
    loaded = scenario_from_dict(doc, "toy.yaml")
    return Conductor(loaded, loaded.spec.seed, None, loaded.evaluations(loaded.spec.seed))


def test_a_run_without_faults_starts_submits_settles_and_stops_everything() -> None:
    toy = Toy(conductor(), settles_at=0.3)
    assert toy.run() == "final"
    assert toy.events() == ["run_started", "submitted", "submitted", "run_finished"]
    kinds = [type(a).__name__ for a in toy.acts if not isinstance(a, acts.Now | acts.Sleep)]
    assert kinds[:8] == [
        "Record", "StartWorker", "StartWorker", "WaitReady", "Connect", "BindConsumer",
        "Record", "Submit",
    ]  # fmt: skip
    stops = [a for a in toy.acts if isinstance(a, acts.TerminateWorker)]
    assert [a.timeout_s for a in stops] == [STOP_TIMEOUT_S, STOP_TIMEOUT_S]
    assert kinds[-7:] == [
        "StopSpawned", "Disconnect", "TerminateWorker", "TerminateWorker", "CloseConsumer",
        "ReadFinal", "Record",
    ]  # fmt: skip
    assert toy.records[-1][0] == 0.3  # settled at its first poll after 0.3 s


def test_a_killed_worker_restarts_after_its_delay_and_the_fault_heals_once_it_is_ready() -> None:
    c = conductor(
        faults=[{"at_s": 1.0, "action": "kill_worker", "target": 1, "restart_after_s": 0.5}]
    )
    toy = Toy(c, settles_at=2.0)
    toy.run()
    fired = [r for r in toy.records if r[1] in ("fault_fired", "worker_killed")]
    assert [(t, e) for t, e, _ in fired] == [(1.0, "fault_fired"), (1.0, "worker_killed")]
    [(t_restart, _, restarted)] = [r for r in toy.records if r[1] == "worker_restarted"]
    assert 1.5 <= t_restart < 1.5 + POLL_S + 1e-9 and restarted["pid"] == 102
    [(t_healed, _, healed)] = [r for r in toy.records if r[1] == "fault_healed"]
    assert healed == {"fault_id": fired[0][2]["fault_id"]} and t_healed > t_restart
    assert toy.records[-1][1] == "run_finished" and toy.records[-1][0] > t_healed


def test_a_worker_that_dies_by_itself_is_noted_once_and_restarted_after_restart_delay() -> None:
    c = conductor(restart_delay_s=0.2)
    toy = Toy(c, settles_at=1.0)
    original = toy._carry

    def carry(act: acts.Act) -> Any:  # worker 0 crashes at 0.4 s (a failpoint's crash)
        slot = c.slots[0]
        if toy.now >= 0.4 and slot.incarnation == 1 and slot.proc.alive:
            slot.proc.alive, slot.proc.returncode = False, 137
        return original(act)

    toy._carry = carry  # type: ignore[method-assign]
    toy.run()
    exited = [r for r in toy.records if r[1] == "worker_exited"]
    assert len(exited) == 1 and exited[0][2]["code"] == 137 and exited[0][2]["worker"] == 0
    [restarted] = [r for r in toy.records if r[1] == "worker_restarted"]
    assert restarted[0] >= exited[0][0] + 0.2
    [healed] = [r for r in toy.records if r[1] == "fault_healed"]
    assert healed[2]["fault_id"] == exited[0][2]["fault_id"]


def test_a_cancel_is_requested_written_and_healed_and_kept_for_the_checker() -> None:
    c = conductor(faults=[{"at_s": 0.1, "action": "cancel", "target": 1}])
    toy = Toy(c, settles_at=0.5)
    toy.run()
    target = c.attempt_ids[1]
    cancel = [(e, f) for _, e, f in toy.records if e.startswith("cancel") or e == "fault_healed"]
    assert cancel == [
        ("cancel_requested", {"attempt_id": target}),
        ("cancel_written", {"attempt_id": target, "state": "cancelled"}),
        ("fault_healed", {"fault_id": 1}),
    ]
    assert c.cancelled == {target}


def test_a_service_kill_restarts_later_and_the_run_waits_for_it() -> None:
    c = conductor(faults=[{"at_s": 0.1, "action": "kill_redis", "restart_after_s": 2.0}])
    toy = Toy(c, settles_at=0.0)
    toy.run()
    times = {e: t for t, e, _ in toy.records}
    assert times["service_killed"] == 0.1 and times["service_restarted"] == 2.1
    assert times["fault_healed"] == 2.1 and times["run_finished"] >= 2.1


def test_the_deadline_is_later_by_the_time_a_service_took_to_come_back() -> None:
    """A restart that takes the harness 8 s (a loaded machine's crash recovery) is not the
    engine's time: a 5 s deadline then passes at 13 s, not 5 s."""
    fault = {"at_s": 0.1, "action": "kill_redis", "restart_after_s": 0.5}
    never = Toy(conductor(deadline_s=5.0, faults=[fault]), settles_at=99.0, restart_s=8.0)
    never.run()
    times = {e: t for t, e, _ in never.records}
    assert times["service_restarted"] == 8.6
    assert [f["took_s"] for _, e, f in never.records if e == "service_restarted"] == [8.0]
    assert 13.0 <= times["deadline_passed"] < 13.0 + POLL_S + 1e-9
    late = Toy(conductor(deadline_s=5.0, faults=[fault]), settles_at=12.0, restart_s=8.0)
    late.run()  # settled within the deadline the restart moved
    assert "deadline_passed" not in late.events()
    assert 12.0 <= {e: t for t, e, _ in late.records}["run_finished"] < 12.0 + POLL_S + 1e-9


def test_a_timed_fault_still_to_come_holds_a_settled_run_open() -> None:
    c = conductor(faults=[{"at_s": 3.0, "action": "kill_worker", "target": 0}])
    toy = Toy(c, settles_at=0.0)
    toy.run()
    times = {e: t for t, e, _ in toy.records}
    assert times["fault_fired"] == 3.0 and times["run_finished"] >= 3.0


LATENCY = {"type": "latency", "attributes": {"latency": 200}}


def test_a_toxic_is_added_to_the_chosen_links_removed_after_for_s_and_healed_then() -> None:
    c = conductor(
        faults=[
            {"at_s": 0.5, "action": "add_toxic", "link": "redis", "workers": [1]}
            | {"toxic": LATENCY, "for_s": 1.0}
        ]
    )
    toy = Toy(c, settles_at=0.1)  # settled long before: the pending removal holds it open
    toy.run()
    net = [a for a in toy.acts if isinstance(a, acts.AddToxic | acts.RemoveToxic)]
    assert [(type(a).__name__, a.link, a.workers) for a in net] == [
        ("AddToxic", "redis", (1,)),
        ("RemoveToxic", "redis", (1,)),
    ]
    assert net[1].name == "latency_downstream"
    [(t_fired, _, fired)] = [r for r in toy.records if r[1] == "fault_fired"]
    [(t_removed, _, removed)] = [r for r in toy.records if r[1] == "toxic_removed"]
    [(t_healed, _, healed)] = [r for r in toy.records if r[1] == "fault_healed"]
    assert (t_fired, t_removed, t_healed) == (0.5, 1.5, 1.5)
    assert healed == {"fault_id": fired["fault_id"]} and fired["action"] == "add_toxic"
    assert removed == {"link": "redis", "workers": [1], "name": "latency_downstream"}
    end = [type(a).__name__ for a in toy.acts if isinstance(a, acts.ResetLinks | acts.Disconnect)]
    assert end == ["ResetLinks", "Disconnect"]  # the workers stop on a sound network


def test_a_cut_for_all_workers_is_restored_and_a_removal_heals_the_fault_that_added() -> None:
    c = conductor(
        faults=[
            {"at_s": 0.2, "action": "cut_link", "link": "broker", "for_s": 0.5},
            {"at_s": 0.3, "action": "add_toxic", "link": "redis", "toxic": LATENCY},
            {"at_s": 0.4, "action": "update_toxic", "link": "redis", "workers": [0]}
            | {"toxic": {**LATENCY, "attributes": {"latency": 500}}},
            {"at_s": 0.9, "action": "remove_toxic", "link": "redis", "workers": [0]}
            | {"toxic": LATENCY},
            {"at_s": 1.2, "action": "remove_toxic", "link": "redis", "workers": [1]}
            | {"toxic": LATENCY},
        ]
    )
    toy = Toy(c, settles_at=0.0)
    toy.run()
    cut = [a for a in toy.acts if isinstance(a, acts.CutLink | acts.RestoreLink)]
    assert [(type(a).__name__, a.workers) for a in cut] == [
        ("CutLink", (0, 1)),
        ("RestoreLink", (0, 1)),
    ]
    ids = {r[2]["fault"]: r[2]["fault_id"] for r in toy.records if r[1] == "fault_fired"}
    healed = [(t, r["fault_id"]) for t, e, r in toy.records if e == "fault_healed"]
    # the change and each removal are instants; the toxic on both workers heals only once
    # its last copy is gone, the cut when it is restored
    assert healed == [
        (0.4, ids["faults[2]"]),
        (0.7, ids["faults[0]"]),
        (0.9, ids["faults[3]"]),
        (1.2, ids["faults[1]"]),
        (1.2, ids["faults[4]"]),
    ]


def test_a_live_worker_still_holding_an_evaluation_holds_the_run_open_until_it_lets_go() -> None:
    """Every evaluation settled at 0.1 s, but the process with pid 100 (worker 0) still
    holds one in memory (an old owner cut off from Redis) until 1.0 s: the run waits for
    what it does then; a dead worker's holdings do not count."""
    c = conductor(faults=[{"at_s": 0.2, "action": "kill_worker", "target": 1}])
    aid = c.attempt_ids[0]
    toy = Toy(c, settles_at=0.1)
    toy.history = [
        (0.05, {"ev": "evaluation_started", "pid": 100, "attempt_id": aid}),
        (0.05, {"ev": "evaluation_started", "pid": 101, "attempt_id": aid}),
        (1.0, {"ev": "evaluation_abandoned", "pid": 100, "attempt_id": aid}),
    ]
    toy.run()
    [(t_end, _, _)] = [r for r in toy.records if r[1] == "run_finished"]
    assert 1.0 <= t_end < 1.0 + 2 * POLL_S  # not 0.1, when everything had settled

    toy = Toy(conductor(), settles_at=0.1)
    toy.history = [(0.05, {"ev": "evaluation_started", "pid": 555, "attempt_id": aid})]
    toy.run()  # a process that is no slot's: nothing to wait for
    assert toy.records[-1][0] < 0.1 + 2 * POLL_S


def test_a_run_waits_for_a_restarted_worker_to_be_ready_before_it_ends() -> None:
    """Everything settled at 1.6 s, but the worker restarted at 1.5 s is ready only at
    2.5 s: the run waits, so the kill's window closes (`fault_healed`) instead of staying
    open to the end and excusing whatever came after it."""
    c = conductor(
        faults=[{"at_s": 1.0, "action": "kill_worker", "target": 1, "restart_after_s": 0.5}]
    )
    toy = Toy(c, settles_at=1.6, boot_s=1.0)
    toy.run()
    [(t_healed, _, _)] = [r for r in toy.records if r[1] == "fault_healed"]
    assert 2.5 <= t_healed < 2.5 + POLL_S + 1e-9
    assert toy.records[-1][1] == "run_finished" and toy.records[-1][0] >= t_healed
