"""Reading a recorded history: when an event happened, in what order, and when something
was broken. The history's own vocabulary, shared by the checker (`chaos.checker`), which
judges a run, and the reports, which show what it cost; nothing here judges."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from engine.failpoints import TIMED_ACTIONS

#: A `fault_fired`'s `action`, by what it acts on: one worker (its `target` a worker's
#: index), an index (a worker, an evaluation for a cancel, a sentinel), the network.
WORKER_ACTIONS: frozenset[str] = frozenset({"kill_worker", "restart_worker", "pause_worker"})
TARGETED_ACTIONS: frozenset[str] = WORKER_ACTIONS | {"cancel", "resume", "kill_sentinel"}
LINK_ACTIONS: frozenset[str] = frozenset({"add_toxic", "update_toxic", "remove_toxic", "cut_link"})


@dataclass(frozen=True)
class FaultWindow:
    """When something was broken, from the runner's own records: a `fault_fired` (or the
    runner's `worker_exited` after a crash, from the `crash` itself) opens it, the
    `fault_healed` with the same `fault_id` closes it; a `freeze` or `stall` failpoint is
    broken for its `stall_ms`. Never healed: open until the last
    event of the run. A record without a `fault_id` (a history from before the ids) is an
    instant."""

    start: float
    end: float
    label: str

    def overlaps(self, t0: float, t1: float, recovery_s: float = 0.0) -> bool:
        return self.start <= t1 and self.end + recovery_s >= t0


def event_time(e: Mapping[str, Any]) -> float:
    t = e.get("t")
    if type(t) is float:  # nearly always: the checks ask hundreds of times a run
        return t
    return float(t) if isinstance(t, int | float) else 0.0


def sort_key(e: Mapping[str, Any]) -> tuple[float, str, int]:
    """Wall time, then source and per-source sequence (exact order within a process)."""
    t, src, seq = e.get("t"), e.get("src", ""), e.get("seq")
    if type(t) is not float:
        t = float(t) if isinstance(t, int | float) else 0.0
    return (
        t,
        src if type(src) is str else str(src),
        seq if type(seq) is int or isinstance(seq, int) else 0,
    )


def as_int(value: Any, default: int = 0) -> int:
    if type(value) is int:
        return value
    return value if isinstance(value, int) and not isinstance(value, bool) else default


#: The events `fault_windows` reads (every other one is passed over at once).
_WINDOW_EVENTS = frozenset({"crash", "fault_fired", "failpoint_fired", "worker_exited"})
#: Every kind `fault_windows` reads, the heals and the stalls' ends with them.
WINDOW_KINDS = _WINDOW_EVENTS | {"fault_healed", "failpoint_released"}


def stall_ends(events: Iterable[Mapping[str, Any]]) -> dict[int, float]:
    """When each stall or freeze ended, by the `id` of its `failpoint_fired` (events in
    time order): a stall with `until` at its `failpoint_released` (the first of the same
    process, failpoint, rule and evaluation after it), any other, or one whose process died
    first, `stall_ms` after it fired."""
    out: dict[int, float] = {}
    waiting: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for e in events:
        ev = e.get("ev")
        if ev == "failpoint_fired" and e.get("action") in TIMED_ACTIONS:
            out[id(e)] = event_time(e) + as_int(e.get("stall_ms")) / 1000
            if e.get("until") is not None:
                waiting.setdefault(_stall_of(e), []).append(e)
        elif ev == "failpoint_released":
            fired = waiting.get(_stall_of(e))
            if fired:
                out[id(fired.pop(0))] = event_time(e)
    return out


def _stall_of(e: Mapping[str, Any]) -> tuple[Any, ...]:
    return (e.get("src"), e.get("pid"), e.get("failpoint"), e.get("rule"), e.get("attempt_id"))


def fault_windows(events: list[dict], end_of_run: float | None = None) -> list[FaultWindow]:
    """The fault windows of a history sorted by time (see `FaultWindow`); `end_of_run`: the
    time of its last event when the caller knows it (then `events` may be only those of
    `WINDOW_KINDS`), else worked out here."""
    if end_of_run is None:
        end_of_run = max(map(event_time, events), default=0.0)
    healed: dict[Any, float] = {}
    crashes: dict[Any, Mapping[str, Any]] = {}  # by pid: its crash not yet seen exit
    for e in events:
        if e.get("ev") == "fault_healed" and e.get("fault_id") is not None:
            healed.setdefault(e["fault_id"], event_time(e))
    stalled = stall_ends(events)
    out: list[FaultWindow] = []
    for e in events:
        ev = e.get("ev")
        if ev not in _WINDOW_EVENTS:
            continue
        t, fid = event_time(e), e.get("fault_id")
        if ev == "crash":
            crashes[e.get("pid")] = e
        elif ev == "fault_fired":
            label = str(e.get("fault") or e.get("action") or "fault")
            end = t if fid is None else healed.get(fid, end_of_run)
            out.append(FaultWindow(t, max(end, t), label))
        elif ev == "failpoint_fired" and e.get("action") in TIMED_ACTIONS:
            # a freeze stops the whole worker, a stall one task: either delays its steps
            end = stalled[id(e)]
            out.append(FaultWindow(t, end, f"{e['action']}@{e.get('failpoint')}"))
        elif ev == "worker_exited":
            crash = crashes.pop(e.get("pid"), None)
            start = event_time(crash) if crash is not None else t
            end = t if fid is None else healed.get(fid, end_of_run)
            out.append(FaultWindow(start, max(end, t), f"worker {e.get('worker')} exited"))
    for crash in crashes.values():  # no supervisor noted the exit: an instant
        t = event_time(crash)
        out.append(FaultWindow(t, t, f"crash@{crash.get('failpoint')}"))
    return sorted(out, key=lambda w: (w.start, w.end))
