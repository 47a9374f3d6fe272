"""Who held an evaluation when: the *sessions* of each worker process, shared by the
invariants that must judge a process only by what it could know (`cancel_respected`,
`reruns_explained`).

A session opens at a process's `evaluation_started` (its `begin` read Redis between the
`delivered` before it and that event) and closes at the first of: its `evaluation_terminal`,
`parked`, `evaluation_abandoned`, `terminal_dropped`, or the death of the process (its own
`crash` or `worker_stopped`, the runner's `worker_killed` of its pid).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from chaos.checker.context import event_time, proc_of

Proc = tuple[str, Any]

#: Events of a process that end its hold on an evaluation.
CLOSING = frozenset({"evaluation_terminal", "parked", "evaluation_abandoned", "terminal_dropped"})


@dataclass
class Session:
    """One process's hold on one evaluation, from `evaluation_started` to its end."""

    proc: Proc
    started: dict
    delivered: dict | None  # the delivery whose `begin` opened it (None: not recorded)
    end: dict | None = None  # the closing event, a death included (None: held to the end)
    events: list[dict] = field(default_factory=list)

    @property
    def t0(self) -> float:
        return event_time(self.started)

    @property
    def t1(self) -> float:
        return math.inf if self.end is None else event_time(self.end)

    @property
    def begun_after(self) -> float:
        """When the `begin` that opened it ran at the earliest."""
        return event_time(self.delivered) if self.delivered is not None else self.t0


#: Events that settle a delivery that opened no session.
SETTLED_ALONE = frozenset(
    {
        "forwarded",
        "forward_failed",
        "terminal_dropped",
        "duplicate_dropped",
        "message_rejected",
        "delivery_failed",
    }
)


def deaths(events: Iterable[dict]) -> dict[Proc | int, list[dict]]:
    """Every death, keyed by process (its own `crash`, `worker_stopped`) and by pid (the
    runner's `worker_killed`)."""
    out: dict[Proc | int, list[dict]] = defaultdict(list)
    for e in events:
        ev = e.get("ev")
        if ev in ("crash", "worker_stopped"):
            out[proc_of(e)].append(e)
        elif ev == "worker_killed" and isinstance(e.get("pid"), int):
            out[e["pid"]].append(e)
    return out


#: Why a process abandons what it holds when it is stopped gracefully.
STOPPING = "worker stopping"


def stop_starts(events: Iterable[dict]) -> dict[Proc, dict]:
    """Each process stopped gracefully, keyed to the first event of its stop: its
    `worker_stopping`, or its first `evaluation_abandoned` because the worker is stopping
    (an engine that records no `worker_stopping`). From then on it hands work back."""
    out: dict[Proc, dict] = {}
    for e in events:
        ev = e.get("ev")
        if ev == "worker_stopping" or (
            ev == "evaluation_abandoned" and e.get("reason") == STOPPING
        ):
            proc = proc_of(e)
            if proc not in out or event_time(e) < event_time(out[proc]):
                out[proc] = e
    return out


def death_of(dead: Mapping[Proc | int, list[dict]], proc: Proc, after: float) -> dict | None:
    """The first death of `proc` at or after `after`."""
    found = [e for e in dead.get(proc, []) if event_time(e) >= after]
    pid = proc[1]
    if isinstance(pid, int):
        found += [e for e in dead.get(pid, []) if event_time(e) >= after]
    return min(found, key=event_time, default=None)


def sessions(evs: list[dict], dead: Mapping[Proc | int, list[dict]]) -> list[Session]:
    """The sessions of every process over one evaluation's events (in time order).

    A process sets up one delivery of an evaluation at a time, in arrival order (a FIFO
    guard): the `begin` of a session read Redis after the earliest delivery still pending
    when it opened. A delivery settled without a session (forwarded, dropped) is the
    earliest pending one; deliveries while a session is open go to the evaluation in memory.
    """
    out: list[Session] = []
    open_: dict[Proc, tuple[Session, dict | None, float]] = {}  # with its death, and when
    pending: dict[Proc, list[dict]] = defaultdict(list)

    def opened(proc: Proc, e: dict, delivered: dict | None) -> None:
        s = Session(proc, e, delivered)
        died = death_of(dead, proc, s.t0)  # once a session, not once an event
        open_[proc] = (s, died, math.inf if died is None else event_time(died))
        out.append(s)

    for e in evs:
        ev, proc = e.get("ev"), proc_of(e)
        if proc[0] == "runner":
            continue
        held = open_.get(proc)
        if held is not None and held[2] < event_time(e):
            held[0].end = held[1]
            del open_[proc]
            held = None
        if held is None:
            if ev == "delivered":
                pending[proc].append(e)
            elif ev in SETTLED_ALONE and pending[proc]:
                pending[proc].pop(0)
            elif ev == "evaluation_started":
                first = pending[proc][0] if pending[proc] else None
                pending[proc].clear()
                opened(proc, e, first)
            continue
        current = held[0]
        if ev == "evaluation_started":  # a second begin without a close: the first ended
            current.end = e
            opened(proc, e, None)
            continue
        current.events.append(e)
        if ev in CLOSING:
            current.end = e
            del open_[proc]
    for current, died, _ in open_.values():
        current.end = died
    return out


def session_at(all_sessions: list[Session], proc: Proc, t: float) -> Session | None:
    """The session of `proc` open at `t` (the latest one opened at or before it)."""
    best = None
    for s in all_sessions:
        if s.proc == proc and s.t0 <= t <= s.t1:
            best = s
    return best
