"""A long history judged on two processes: the invariants shared out between them, as
Jepsen's `compose` runs its checkers in parallel.

Each invariant reads the indexed history (`Context`) and writes only stats of its own, so
the invariants may run in any order, in any process: each runs with a stats dict of its
own (`Ran`), and `merged_stats` puts them back in the registry's order, whichever process
ran them, so the result is the one a single process gives. A forked child shares the
history copy-on-write (nothing is pickled on the way in), takes invariants from a shared
counter as the parent does, and sends back what it found, pickled, on a pipe; an
invariant it did not send back (it died, or failed) the parent runs itself. Ctrl-C is the
parent's: it kills the child and goes on with the interrupt; a parent killed outright
takes the child with it (`chaos.lifetime`).

Only for long histories (`LONG`: the fork and the way back cost milliseconds), with a
second core to run on, never from a process with other threads (a fork copies only the
calling one: a lock another thread held would stay held), and never where the caller
already keeps every core busy (`ALLOWED`: the exploration's pool and cluster workers)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from chaos.checker.context import Context
from chaos.checker.invariants import Invariant
from chaos.checker.records import Violation
from chaos.lifetime import die_with_parent

#: From how many events a history is judged on two processes: a 10,000-evaluation run
#: has 600,000; an explored seed a few hundred.
LONG = 100_000
#: False in processes that share the machine's cores with siblings already (the
#: exploration's pool, a cluster's workers): one process each is all they should take.
ALLOWED = True


@dataclass
class Ran:
    """One invariant's outcome: cases judged, violations, seconds, and its own stats."""

    judged: int
    found: list[Violation]
    seconds: float
    stats: dict[str, Any] = field(default_factory=dict)


def run_invariants(cx: Context, invariants: Sequence[Invariant]) -> dict[str, Ran]:
    """Each invariant's `Ran`, by name: on two processes when `shared` says so."""
    if shared(len(cx.events)):
        return _on_two(cx, invariants)
    return {inv.name: _run(cx, inv) for inv in invariants}


def shared(events: int) -> bool:
    """Whether a history of `events` is judged on two processes here."""
    return (
        ALLOWED
        and events >= LONG
        and hasattr(os, "fork")
        and threading.active_count() == 1
        and len(os.sched_getaffinity(0)) >= 2
    )


def merged_stats(base: dict[str, Any], ran: dict[str, Ran], order: Sequence[str]) -> None:
    """Each invariant's stats into `base`, in `order`: as one process running them in that
    order leaves them (a dict two invariants fill, `unknown_parts`, merged)."""
    for name in order:
        for key, value in ran[name].stats.items():
            old = base.get(key)
            if isinstance(old, dict) and isinstance(value, dict):
                old.update(value)
            else:
                base[key] = value


def _run(cx: Context, inv: Invariant) -> Ran:
    kept, cx.stats = cx.stats, {}
    t0 = time.perf_counter()
    try:
        judged, found = inv.check(cx)
        return Ran(int(judged), found, time.perf_counter() - t0, cx.stats)
    finally:
        cx.stats = kept


def _on_two(cx: Context, invariants: Sequence[Invariant]) -> dict[str, Ran]:
    turn = multiprocessing.get_context("fork").Value("i", 0)

    def taken() -> Invariant | None:
        with turn.get_lock():
            i = turn.value
            turn.value = i + 1
        return invariants[i] if i < len(invariants) else None

    def share() -> dict[str, Ran]:
        out: dict[str, Ran] = {}
        while (inv := taken()) is not None:
            out[inv.name] = _run(cx, inv)
        return out

    read, write = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: its share, pickled into the pipe, and gone
        code = 1
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's to handle
            die_with_parent(parent)
            os.close(read)
            with os.fdopen(write, "wb") as pipe:
                pipe.write(pickle.dumps(share(), protocol=pickle.HIGHEST_PROTOCOL))
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    theirs: dict[str, Ran] = {}
    with os.fdopen(read, "rb") as pipe:
        try:
            mine = share()
            data = pipe.read()
            _, status = os.waitpid(pid, 0)
        except BaseException:  # an invariant's error, Ctrl-C: the child goes first
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise
    if status == 0 and data:
        theirs = pickle.loads(data)
    ran = {**mine, **theirs}
    for inv in invariants:  # what the child took and did not send back
        if inv.name not in ran:
            ran[inv.name] = _run(cx, inv)
    return ran
