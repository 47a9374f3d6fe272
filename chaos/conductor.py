"""The run, written once: what the runner does and when, carried out by both runners.

A run starts the workers, waits until they are ready, binds the harness's consumer of
`evaluation.completed`, submits the evaluations, fires the scenario's faults (the
*generator*'s schedule, planned from the seed; the *nemesis* firing them at their times
and on history events), supervises the workers (`chaos.supervision`), waits until every
evaluation is terminal and announced and its announcement delivered, stops everything and
reads the final state. `Conductor` decides all of it and names each thing done as an act
(`chaos.acts`); the live runner carries the acts out on processes, Redis and RabbitMQ
(`chaos.runner`), the simulated one on simpy (`chaos.insim.run`). What one mode does, the
other does in the same order, so the simulator explores the runner that ships.

Every fault's `fault_fired` carries a `fault_id`; its `fault_healed` carries it again once
the runner has undone it (a worker restarted and ready, a service back, a pause over, a
cancel written). The checker reads fault windows from these, not from guesses.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from chaos import acts
from chaos.acts import FAILS_OVER, Step
from chaos.checker.holding import CLOSING
from chaos.poison import NAMELESS, poison
from chaos.scenario import (
    EventTriggers,
    LoadedScenario,
    PlannedFault,
    RunnerFault,
    fault_schedule,
)
from chaos.supervision import Exited, Healed, Slot, Start, fired, supervise
from chaos.systems import SYSTEMS
from engine.plan import Plan

#: The harness's durable queue of `evaluation.completed` (in the run's namespace), bound
#: to `evaluation.started` and `evaluation.pass_result` too: one queue, so that an
#: evaluation's announcements reach the consumer in the order the broker took them.
COMPLETED_QUEUE = "chaos.completed"
STARTED_KEY = "evaluation.started"
PASS_KEY = "evaluation.pass_result"
#: The routing keys the harness's consumer binds, each recorded (`events_consumer_bound`),
#: and what a delivery of each is recorded as.
RECEIVED_AS = {
    "evaluation.completed": "completed_received",
    STARTED_KEY: "started_received",
    PASS_KEY: "pass_received",
}
EVENT_KEYS = tuple(RECEIVED_AS)
#: How often the runner supervises the workers and looks whether the run has settled.
POLL_S = 0.05
#: How often it reads new history events (event-triggered faults, deliveries at the end).
EVENT_POLL_S = 0.02
#: How long the end of a run waits for the consumer to hold every announced evaluation.
DELIVERY_PATIENCE_S = 10.0
#: SIGTERM to SIGKILL: a `restart_worker` fault's, and the end of the run's.
RESTART_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 3.0


class Holdings:
    """Which evaluations each worker process holds in memory, by pid, as its history says:
    from its `evaluation_started` to the event that ends the hold (`holding.CLOSING`).

    A run that stopped while a live worker still held an evaluation would never see what
    that worker does next: the old owner of a taken-over evaluation, cut off or slowed
    down, acts when its link comes back, and that is the moment a scenario is about."""

    def __init__(self) -> None:
        self._held: dict[Any, set[str]] = defaultdict(set)

    def feed(self, events: Iterable[dict[str, Any]]) -> None:
        for e in events:
            ev = e.get("ev")
            if ev == "evaluation_started":
                self._held[e.get("pid")].add(str(e.get("attempt_id")))
            elif ev in CLOSING:
                self._held[e.get("pid")].discard(str(e.get("attempt_id")))

    def held(self, pids: Iterable[Any]) -> int:
        """How many evaluations the processes `pids` hold."""
        return sum(len(self._held.get(pid, ())) for pid in pids)

    def holders(self, pids: Iterable[Any]) -> dict[str, list[Any]]:
        """Which of the processes `pids` hold each evaluation held."""
        out: dict[str, list[Any]] = defaultdict(list)
        for pid in pids:
            for attempt_id in sorted(self._held.get(pid, ())):
                out[attempt_id].append(pid)
        return dict(out)


@dataclass
class Progress:
    """What the display shows while a scenario runs."""

    scenario: str
    total: int
    terminal: int = 0
    workers_alive: int = 0
    faults_fired: int = 0
    elapsed_s: float = 0.0
    note: str = ""


def delivered(
    body: Any, message_id: str | None, redelivered: bool, delivery_mode: Any = None
) -> dict[str, Any]:
    """What the consumer records of a delivery of an `evaluation.*` event (`RECEIVED_AS`),
    before it acknowledges it: with its delivery mode (2: persistent), as the publisher
    set it."""
    attempt_id = body.get("attempt_id") if isinstance(body, dict) else None
    return {
        "attempt_id": attempt_id,
        "message_id": message_id,
        "body": body,
        "redelivered": redelivered,
        "delivery_mode": delivery_mode,
    }


class Conductor:
    """One run's plan. `attempt_ids` and `plans` are the ids as the run's engine sees them
    (live on a shared Redis they carry the run's prefix)."""

    def __init__(
        self,
        loaded: LoadedScenario,
        seed: int,
        mutant: str | None,
        plans: dict[str, Plan],
    ) -> None:
        self.spec = spec = loaded.spec
        self.seed = seed
        self.mutant = mutant
        self.plans = plans
        self.attempt_ids: tuple[str, ...] = tuple(plans)
        self.schedule: list[PlannedFault] = fault_schedule(spec, random.Random(seed))
        self.slots: list[Slot[Any]] = [
            Slot(i, loaded.failpoint_specs(i, list(self.attempt_ids))) for i in range(spec.workers)
        ]
        self.cancelled: set[str] = set()
        self.progress = Progress(spec.name, len(self.attempt_ids))
        self._timed = sorted(
            (f for f in self.schedule if f.at_s is not None), key=lambda f: f.at_s or 0.0
        )
        self._timed_left = len(self._timed)  # not yet fired to the end
        self._fault_ids = itertools.count(1)  # fault_fired / worker_exited -> fault_healed
        self._later = 0  # steps spawned to run later (a resume, a restart) not yet done
        # toxics and cuts on the links, each (link, worker, toxic name or "" for a cut) to
        # the fault that put it there: that fault heals when the last of its is undone
        self._on_links: dict[tuple[str, int, str], int] = {}
        self._network = False  # a network fault fired: the links are reset at the end
        self._t0 = 0.0  # the first submit: faults' `at_s` and the deadline count from it
        # the harness's own time bringing killed services back (a restart's `took_s`: on a
        # loaded machine a PostgreSQL's crash recovery alone may take most of a deadline):
        # not the engine's, so the deadline is that much later
        self._restarts_s = 0.0
        self._restarting: list[float] = []  # when each restart under way began
        # poison messages published and not seen rejected yet: by the attempt id they name,
        # and a count of those that name none
        self._poison: set[str] = set()
        self._nameless_poison = 0
        self._stale_copies_act = SYSTEMS[self.spec.system].stale_copies_act

    # --- the run ------------------------------------------------------------------------

    def run(self) -> Step:
        """The whole run; the final state is returned."""
        spec = self.spec
        started = yield acts.Now()
        yield acts.Record(
            "run_started", {"scenario": spec.name, "seed": self.seed, "mutant": self.mutant}
        )
        for slot in self.slots:
            yield from self._start(slot)
        yield acts.WaitReady(tuple(self.slots))
        yield acts.Connect()
        yield acts.BindConsumer()
        self._t0 = yield acts.Now()
        for attempt_id in self.attempt_ids:
            plan = self.plans[attempt_id]
            yield acts.Record("submitted", {"attempt_id": attempt_id, "plan": plan.id})
            yield acts.Submit(attempt_id, plan)
        yield acts.Spawn(self._timed_faults())
        yield acts.Spawn(self._event_faults())
        yield from self._wait_settled()
        if self.progress.terminal == len(self.attempt_ids):
            # the moment no lease should be left on what is over: `quiet_state` reads it
            held = yield acts.Leases(self.attempt_ids)
            if held is not None:
                yield acts.Record("leases_at_settle", {"held": held})
        yield from self._wait_delivered()
        yield acts.StopSpawned()
        if self._network:
            yield acts.ResetLinks()
            yield acts.Record("links_reset", {})
        yield acts.Disconnect()
        for slot in self.slots:
            if slot.proc is not None:
                yield acts.TerminateWorker(slot, STOP_TIMEOUT_S)
        yield acts.CloseConsumer()
        final = yield acts.ReadFinal()
        ended = yield acts.Now()
        yield acts.Record("run_finished", {"duration_s": round(ended - started, 3)})
        return final

    def _wait_settled(self) -> Step:
        """Until every evaluation is terminal and announced (stopping a worker between the
        two would cut the history short, not break the engine), no live worker holds one
        in memory any more (`Holdings`), every poison message published has been rejected
        (`poison_rejected` judges how), and no timed fault, restart or heal is pending (a
        restarted worker not ready yet would leave its fault's window open to the end);
        or the deadline, later by the time the harness took to restart killed services."""
        progress = self.progress
        holdings, cursor = Holdings(), None
        while True:
            yield from self._supervise()
            progress.terminal = yield acts.Settled(self.attempt_ids)
            events, cursor = yield acts.Tail(cursor)
            holdings.feed(events)
            self._poison_seen(events)
            now = yield acts.Now()
            progress.elapsed_s = now - self._t0
            yield acts.Show()
            pending_faults = self._timed_left > 0 and any(
                f.at_s is not None and f.at_s > progress.elapsed_s for f in self._timed
            )
            alive_slots = [s for s in self.slots if s.proc is not None and s.proc.alive]
            restarting = (
                self._later > 0
                or any(s.restart_at is not None for s in self.slots)
                or any(s.heals for s in alive_slots)  # restarted, not ready yet: not healed
            )
            alive = [s.proc.pid for s in alive_slots]
            # a stale copy of a taken-over evaluation may act later, unless the design's
            # server refuses it (a workflow engine's): then nothing is worth waiting for
            holding = holdings.held(alive) if self._stale_copies_act else 0
            settled = progress.terminal == len(self.attempt_ids)
            poisoned = bool(self._poison) or self._nameless_poison > 0
            if settled and not (pending_faults or restarting or holding or poisoned):
                return
            restarts_s = self._restarts_s + sum(now - began for began in self._restarting)
            if now >= self._t0 + self.spec.deadline_s + restarts_s:
                progress.note = "deadline passed"
                # what kept the run from settling: `quiet_state` judges an evaluation over
                # and announced that a living worker still held in memory
                yield acts.Record(
                    "deadline_passed",
                    {"terminal": progress.terminal, "held": holdings.holders(alive)},
                )
                return
            yield acts.Sleep(POLL_S)

    def _poison_seen(self, events: Iterable[dict]) -> None:
        """Strike off the poison messages a worker rejected (`poison_rejected` judges how)."""
        for e in events:
            if e.get("ev") == "message_rejected":
                named = e.get("attempt_id")
                if isinstance(named, str):
                    self._poison.discard(named)
                elif e.get("reason") == "malformed":
                    self._nameless_poison = max(self._nameless_poison - 1, 0)

    def _wait_delivered(self) -> Step:
        """Until the consumer holds an `evaluation.completed` of every evaluation announced,
        or `DELIVERY_PATIENCE_S` passed: deliveries trail the publisher's confirm a little."""
        until = (yield acts.Now()) + DELIVERY_PATIENCE_S
        while (yield acts.Now()) < until:
            announced = yield acts.Announced(self.attempt_ids)
            received = yield acts.Received()
            if announced <= received:
                return
            yield acts.Sleep(EVENT_POLL_S)

    # --- supervision --------------------------------------------------------------------

    def _start(self, slot: Slot[Any]) -> Step:
        """A worker for `slot`: its failpoints are armed in its first incarnation only."""
        failpoints = slot.failpoints if slot.incarnation == 0 else ""
        proc = yield acts.StartWorker(slot, failpoints)
        if slot.incarnation:
            yield acts.Record("worker_restarted", {"worker": slot.index, "pid": proc.pid})
        slot.started(proc)

    def _supervise(self) -> Step:
        """Restart workers that crashed (a failpoint) or were killed, when it is time."""
        spec = self.spec
        delay = spec.restart_delay_s if spec.restart_crashed_workers else None
        now = yield acts.Now()
        for d in supervise(self.slots, now, self._fault_ids, delay):
            match d:
                case Healed(fault_id=fault_id):
                    yield from self._healed(fault_id)
                case Exited(slot=Slot(proc=proc)):
                    yield acts.Record("worker_exited", d.record(proc.returncode, proc.pid))
                case Start(slot=slot):
                    yield from self._start(slot)
        self.progress.workers_alive = sum(1 for s in self.slots if s.proc and s.proc.alive)

    def _healed(self, fault_id: int) -> Step:
        yield acts.Record("fault_healed", {"fault_id": fault_id})

    # --- faults -------------------------------------------------------------------------

    def _timed_faults(self) -> Step:
        for fault in self._timed:
            delay = self._t0 + (fault.at_s or 0.0) - (yield acts.Now())
            if delay > 0:
                yield acts.Sleep(delay)
            yield from self._fire(fault)
            self._timed_left -= 1

    def _event_faults(self) -> Step:
        triggers = EventTriggers(self.schedule)
        cursor = None
        while not triggers.done:
            yield acts.Sleep(EVENT_POLL_S)
            events, cursor = yield acts.Tail(cursor)
            for ev in events:
                for fault in triggers.feed(ev):
                    if fault.delay_s:  # a repetition: `every_s` after the one before
                        yield from self._after(fault.delay_s, self._fire(fault))
                    else:
                        yield from self._fire(fault)

    def _after(self, delay_s: float, step: Step) -> Step:
        """Run `step` `delay_s` from now, alongside; the run does not settle before."""

        def later() -> Step:
            try:
                yield acts.Sleep(delay_s)
                yield from step
            finally:
                self._later -= 1

        self._later += 1
        yield acts.Spawn(later())

    def _fire(self, fault: PlannedFault) -> Step:
        """Fire one fault (`chaos.supervision.fired` says what its record holds)."""
        self.progress.faults_fired += 1
        fault_id = next(self._fault_ids)
        yield acts.Record("fault_fired", fired(fault, fault_id))
        match fault.action:
            case "kill_worker":
                yield from self._kill(self.slots[fault.target], fault.restart_after_s, fault_id)
            case "restart_worker":
                slot = self.slots[fault.target]
                if slot.proc is not None:
                    yield acts.TerminateWorker(slot, RESTART_TIMEOUT_S)
                slot.restart((yield acts.Now()), fault_id)
            case "pause_worker":
                yield from self._pause(self.slots[fault.target], fault.pause_s or 0.0, fault_id)
            case _ if fault.service is not None and fault.how != "pause":
                name, how = fault.service, fault.how
                graceful = how in ("stop", "restart")
                killed = yield acts.KillService(name, graceful=graceful)
                signal = {"signal": "SIGTERM"} if graceful else {}
                counted = {k: v for k, v in killed.items() if k != FAILS_OVER}
                yield acts.Record("service_killed", {"service": name, **signal, **counted})
                if killed.get(FAILS_OVER):
                    # the system promotes a replica by itself (Sentinel): the fault heals
                    # then; the killed primary, restarted later, rejoins as a replica
                    yield from self._after(0.0, self._failover(fault_id))
                    if fault.restart_after_s is not None:
                        yield from self._after(fault.restart_after_s, self._restart(name, None))
                elif fault.restart_after_s is not None:
                    yield from self._after(fault.restart_after_s, self._restart(name, fault_id))
            case _ if fault.service is not None:  # a pause
                yield from self._pause_service(fault.service, fault.pause_s or 0.0, fault_id)
            case "kill_sentinel":
                yield acts.KillSentinel(fault.target)
                yield acts.Record("sentinel_killed", {"sentinel": fault.target})
                if fault.restart_after_s is None:
                    yield from self._healed(fault_id)  # two of three still make the quorum
                else:
                    yield from self._after(
                        fault.restart_after_s, self._restart_sentinel(fault.target, fault_id)
                    )
            case "add_toxic" | "update_toxic" | "remove_toxic" | "cut_link":
                yield from self._on_link(fault, fault_id)
            case "cancel":
                attempt_id = self.attempt_ids[fault.target]
                self.cancelled.add(attempt_id)
                yield acts.Record("cancel_requested", {"attempt_id": attempt_id})
                state = yield acts.Cancel(attempt_id)
                yield acts.Record("cancel_written", {"attempt_id": attempt_id, "state": state})
                yield from self._healed(fault_id)
            case "resume":
                attempt_id = self.attempt_ids[fault.target]
                spec = self.spec.faults[fault.fault]
                assert isinstance(spec, RunnerFault)
                yield acts.Record(
                    "resume_requested", {"attempt_id": attempt_id, "checkpoint": spec.checkpoint}
                )
                answer = yield acts.Resume(attempt_id, spec.checkpoint)
                yield acts.Record("resume_written", {"attempt_id": attempt_id, **answer})
                yield from self._healed(fault_id)
            case "publish_poison":
                spec = self.spec.faults[fault.fault]
                assert isinstance(spec, RunnerFault)
                for kind in spec.poison_kinds:
                    # named after the run's first evaluation: its prefix keeps it the run's
                    attempt_id = f"{self.attempt_ids[0]}-poison-{fault_id}-{kind}"
                    message_id = f"{attempt_id}:poison"
                    if kind in NAMELESS:
                        self._nameless_poison += 1
                    else:
                        self._poison.add(attempt_id)
                    yield acts.PublishRaw(poison(kind, attempt_id), message_id)
                    yield acts.Record(
                        "poison_published",
                        {
                            "kind": kind,
                            "attempt_id": None if kind in NAMELESS else attempt_id,
                            "message_id": message_id,
                        },
                    )
                yield from self._healed(fault_id)

    def _on_link(self, fault: PlannedFault, fault_id: int) -> Step:
        """A network fault: a toxic added (removed `for_s` later), changed or removed, or
        the link cut (restored `for_s` later). Adding and cutting stay open until undone;
        a change or a removal is an instant (a removal heals the fault that added)."""
        spec = self.spec.faults[fault.fault]
        assert isinstance(spec, RunnerFault) and spec.link is not None
        link = spec.link
        workers = tuple(range(self.spec.workers)) if spec.workers == "all" else spec.workers
        pids = [p.pid for w in workers if (p := self.slots[w].proc) is not None]
        where = {"link": link, "workers": list(workers), "pids": pids}
        self._network = True
        match fault.action:
            case "add_toxic":
                assert spec.toxic is not None
                yield acts.AddToxic(link, workers, spec.toxic)
                yield acts.Record("toxic_added", {**where, "toxic": spec.toxic.wire()})
                self._put(link, workers, spec.toxic.name, fault_id)
                if spec.for_s is not None:
                    yield from self._after(
                        spec.for_s, self._remove_toxic(link, workers, spec.toxic.name)
                    )
            case "update_toxic":
                assert spec.toxic is not None
                yield acts.UpdateToxic(link, workers, spec.toxic)
                yield acts.Record("toxic_updated", {**where, "toxic": spec.toxic.wire()})
                yield from self._healed(fault_id)
            case "remove_toxic":
                assert spec.toxic is not None
                yield from self._remove_toxic(link, workers, spec.toxic.name)
                yield from self._healed(fault_id)
            case "cut_link":
                yield acts.CutLink(link, workers)
                yield acts.Record("link_cut", where)
                self._put(link, workers, "", fault_id)
                if spec.for_s is not None:
                    yield from self._after(spec.for_s, self._restore_link(link, workers))

    def _put(self, link: str, workers: tuple[int, ...], name: str, fault_id: int) -> None:
        for w in workers:
            self._on_links[(link, w, name)] = fault_id

    def _taken(self, link: str, workers: tuple[int, ...], name: str) -> Step:
        """Forget what `name` ("": the cut) held on these links; heal the faults of which
        nothing is left."""
        ids = {self._on_links.pop((link, w, name), None) for w in workers} - {None}
        for fault_id in sorted(i for i in ids if i not in self._on_links.values()):
            yield from self._healed(fault_id)

    def _remove_toxic(self, link: str, workers: tuple[int, ...], name: str) -> Step:
        yield acts.RemoveToxic(link, workers, name)
        yield acts.Record("toxic_removed", {"link": link, "workers": list(workers), "name": name})
        yield from self._taken(link, workers, name)

    def _restore_link(self, link: str, workers: tuple[int, ...]) -> Step:
        yield acts.RestoreLink(link, workers)
        yield acts.Record("link_restored", {"link": link, "workers": list(workers)})
        yield from self._taken(link, workers, "")

    def _kill(self, slot: Slot[Any], restart_after_s: float | None, fault_id: int) -> Step:
        """SIGKILL; the fault heals once a restarted worker is ready (never without one)."""
        proc = slot.proc
        if proc is None or not proc.alive:
            yield from self._healed(fault_id)  # nothing to kill: nothing broken
            return
        yield acts.KillWorker(slot)
        yield acts.Record("worker_killed", {"worker": slot.index, "pid": proc.pid})
        slot.killed((yield acts.Now()), restart_after_s, fault_id)

    def _pause(self, slot: Slot[Any], pause_s: float, fault_id: int) -> Step:
        proc = slot.proc
        if proc is None or not proc.alive:
            yield from self._healed(fault_id)  # nothing to pause: nothing broken
            return
        yield acts.PauseWorker(slot, pause_s)
        yield acts.Record("worker_paused", {"worker": slot.index, "pid": proc.pid})

        def resume() -> Step:
            if slot.proc is proc and proc.alive:
                yield acts.ResumeWorker(slot)
                yield acts.Record("worker_resumed", {"worker": slot.index, "pid": proc.pid})
            yield from self._healed(fault_id)

        yield from self._after(pause_s, resume())

    def _pause_service(self, name: str, pause_s: float, fault_id: int) -> Step:
        """A service stopped for `pause_s`; the fault heals once it runs again (Redis
        behind Sentinel: the replica may have been promoted meanwhile, `service_resumed`
        says)."""
        yield acts.PauseService(name, pause_s)
        yield acts.Record("service_paused", {"service": name})

        def resume() -> Step:
            promoted = yield acts.ResumeService(name)
            yield acts.Record("service_resumed", {"service": name, "promoted": promoted})
            yield from self._healed(fault_id)

        yield from self._after(pause_s, resume())

    def _restart_sentinel(self, index: int, fault_id: int) -> Step:
        yield acts.RestartSentinel(index)
        yield acts.Record("sentinel_restarted", {"sentinel": index})
        yield from self._healed(fault_id)

    def _restart(self, name: str, fault_id: int | None) -> Step:
        """Bring a killed service back; it heals `fault_id` (None: a failover healed it)."""
        began = yield acts.Now()
        self._restarting.append(began)
        found = yield acts.RestartService(name)  # what the system counted of the restart
        took = (yield acts.Now()) - began
        self._restarting.remove(began)
        self._restarts_s += took
        yield acts.Record("service_restarted", {"service": name, **found, "took_s": round(took, 3)})
        if fault_id is not None:
            yield from self._healed(fault_id)

    def _failover(self, fault_id: int) -> Step:
        found = yield acts.AwaitFailover()  # whether promoted, or what the system counted
        fields = dict(found) if isinstance(found, dict) else {"promoted": found}
        yield acts.Record("redis_failover", fields)
        yield from self._healed(fault_id)
