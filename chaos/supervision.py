"""The runner's supervision, decided once for the live runner and the simulated one.

Each worker index of a run is a `Slot`: its failpoints (armed in its first incarnation
only), the process of its current incarnation, and what the runner owes it: a restart at
a given time, the faults that heal once that restart is ready. `supervise` decides, at
each poll, what the runner does about them; the runners carry the decisions out (a
`worker_exited`, a `fault_healed`, a new process) on processes or on simulated ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from chaos.scenario.schema import GENERIC_SERVICE_ACTIONS

if TYPE_CHECKING:
    from chaos.scenario import PlannedFault


class Process(Protocol):
    """A worker process as the runner sees it: a live one (`chaos.workers`) or a
    simulated one (`sim.worker`)."""

    @property
    def pid(self) -> int: ...

    @property
    def alive(self) -> bool: ...

    @property
    def returncode(self) -> int | None: ...

    def is_ready(self) -> bool:
        """Whether it has said it is ready (no waiting)."""
        ...


P = TypeVar("P", bound=Process)


@dataclass
class Slot(Generic[P]):
    index: int
    failpoints: Any  # as the runner passes them to a worker
    proc: P | None = None  # the current incarnation
    incarnation: int = 0
    restart_at: float | None = None  # the runner's clock: a pending restart
    stopped_on_purpose: bool = False  # the runner stopped it: no `worker_exited`
    heals: list[int] = field(default_factory=list)  # fault ids healed once it is ready again

    def started(self, proc: P) -> None:
        self.proc = proc
        self.incarnation += 1
        self.restart_at = None
        self.stopped_on_purpose = False

    def killed(self, now: float, restart_after_s: float | None, fault_id: int) -> None:
        """Killed by a fault: it heals once a restarted worker is ready (never without)."""
        self.stopped_on_purpose = True
        if restart_after_s is not None:
            self.restart_at = now + restart_after_s
            self.heals.append(fault_id)

    def restart(self, now: float, fault_id: int) -> None:
        """Stopped by a fault that restarts it at once."""
        self.stopped_on_purpose = True
        self.restart_at = now
        self.heals.append(fault_id)


@dataclass(frozen=True)
class Healed:
    fault_id: int


@dataclass(frozen=True)
class Exited:
    """A worker the runner did not stop is gone (a crash): a fault window opens."""

    slot: Slot[Any]
    fault_id: int

    def record(self, code: int | None, pid: int) -> dict[str, Any]:
        """The fields of its `worker_exited`, with the process's exit code and pid."""
        return {"worker": self.slot.index, "code": code, "pid": pid, "fault_id": self.fault_id}


@dataclass(frozen=True)
class Start:
    slot: Slot[Any]


def supervise(
    slots: Iterable[Slot[P]],
    now: float,
    fault_ids: Iterator[int],
    restart_delay_s: float | None,
) -> Iterator[Healed | Exited | Start]:
    """What to do now, in order: faults healed by a ready restart, crashes to note (and to
    restart after `restart_delay_s`, None: never), workers to start. Each decision is
    carried out before the next is drawn."""
    for slot in slots:
        proc = slot.proc
        if proc is not None and proc.alive:
            if slot.heals and proc.is_ready():
                for fault_id in slot.heals:
                    yield Healed(fault_id)
                slot.heals.clear()
            continue
        if slot.restart_at is None and not slot.stopped_on_purpose and proc is not None:
            # a crash: a fault window from the worker's `crash` to the restart's "ready"
            fault_id = next(fault_ids)
            yield Exited(slot, fault_id)
            slot.stopped_on_purpose = True  # noted once
            if restart_delay_s is not None:
                slot.restart_at = now + restart_delay_s
                slot.heals.append(fault_id)
        if slot.restart_at is not None and now >= slot.restart_at:
            yield Start(slot)


def fired(fault: PlannedFault, fault_id: int) -> dict[str, Any]:
    """The fields of a fault's `fault_fired`; its `fault_healed` carries the same id once
    the runner has undone it (a worker restarted and ready, a service back, a cancel
    sent); a fault never undone stays open."""
    fields = {
        "fault": fault.label,
        "action": fault.action,
        "target": fault.target,
        "fault_id": fault_id,
    }
    if fault.action in GENERIC_SERVICE_ACTIONS:  # the aliases (kill_redis...) name theirs
        fields["service"] = fault.service
    return fields
