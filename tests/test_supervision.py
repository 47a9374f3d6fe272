"""The runner's supervision, decided once (`chaos.supervision`): what a poll does about
each worker slot, without processes. Both runners carry these decisions out."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from chaos.supervision import Exited, Healed, Slot, Start, supervise


@dataclass
class Proc:
    alive: bool = True
    ready: bool = False
    pid: int = 42
    returncode: int | None = None

    def is_ready(self) -> bool:
        return self.ready


def poll(slots: list[Slot[Proc]], now: float, delay: float | None = 1.0) -> list[object]:
    """One supervision poll, carried out as a runner would: a start gives a new process."""
    ids = itertools.count(100)
    done: list[object] = []
    for d in supervise(slots, now, ids, delay):
        done.append(d)
        if isinstance(d, Start):
            d.slot.started(Proc())
    return done


def test_a_crash_is_noted_once_and_restarted_after_the_delay_then_heals_when_ready() -> None:
    slot = Slot[Proc](0, "fp")
    slot.started(Proc())
    assert poll([slot], now=0.0) == []  # alive, nothing owed
    slot.proc.alive = False  # a crash: nobody stopped it
    [exited] = poll([slot], now=1.0)
    assert isinstance(exited, Exited) and exited.slot is slot
    assert exited.record(-9, 42) == {"worker": 0, "code": -9, "pid": 42, "fault_id": 100}
    assert poll([slot], now=1.5) == []  # noted once; its restart is due at 2.0
    [start] = poll([slot], now=2.0)
    assert start == Start(slot) and slot.incarnation == 2 and slot.restart_at is None
    assert poll([slot], now=2.1) == []  # not ready yet: the fault stays open
    slot.proc.ready = True
    assert poll([slot], now=2.2) == [Healed(100)]
    assert poll([slot], now=2.3) == []  # healed once


def test_without_restarts_a_crash_is_noted_and_never_restarted() -> None:
    slot = Slot[Proc](1, "")
    slot.started(Proc(alive=False))
    assert [type(d) for d in poll([slot], now=5.0, delay=None)] == [Exited]
    assert poll([slot], now=500.0, delay=None) == []


def test_a_killed_worker_is_no_crash_and_restarts_when_the_fault_says() -> None:
    slot = Slot[Proc](2, "")
    slot.started(Proc())
    slot.proc.alive = False
    slot.killed(now=3.0, restart_after_s=0.5, fault_id=7)  # the runner killed it
    assert poll([slot], now=3.2) == []
    assert poll([slot], now=3.5) == [Start(slot)]
    slot.proc.ready = True
    assert poll([slot], now=3.6) == [Healed(7)]
    never = Slot[Proc](3, "")
    never.started(Proc(alive=False))
    never.killed(now=3.0, restart_after_s=None, fault_id=8)  # killed for good
    assert poll([never], now=99.0) == [] and never.heals == []
