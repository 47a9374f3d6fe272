"""What each fault touched: the process, the service or the link it broke, and when.

A fault explains what happened to an execution only if it touched that execution: the
process that ran it (its pause, a failpoint that froze or stalled it, a network fault on
its own link), or a service it used (a Redis or broker kill, stop or pause, a Sentinel
failover, a fault on the replication link). A fault elsewhere in the run (another worker
paused, a link of another process cut) explains nothing about it.

Shared by the checks that excuse a gap or a repeat only by a fault of their own execution
(`reruns_explained`, `leases_renewed`, `leases_respected`, `writes_fenced`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from chaos.checker.context import event_time, proc_of, stall_ends
from engine.failpoints import TIMED_ACTIONS

#: What a service is to the engine, whatever the design names it: its store (Redis,
#: PostgreSQL, the link a replica replicates over) or its broker.
STORE, BROKER = "store", "broker"
_ROLE = {"redis": STORE, "postgres": STORE, "replication": STORE, "broker": BROKER}


def role(service: str) -> str:
    """The role of a service or link named in a history (an unknown name stands for itself)."""
    return _ROLE.get(service, service)


#: Runner fault actions on a service: which one, by its role.
_SERVICE_OF = {
    "kill_redis": STORE,
    "stop_redis": STORE,
    "pause_redis": STORE,
    "kill_sentinel": STORE,
    "kill_broker": BROKER,
    "stop_broker": BROKER,
    "pause_broker": BROKER,
}
#: Runner fault actions on a service named by the record (`kill_service`...).
_ON_A_SERVICE = frozenset({"kill_service", "stop_service", "pause_service", "restart_service"})
#: Runner fault actions on the network, and the runner's record of where each acted.
_LINK_ACTIONS = frozenset({"add_toxic", "update_toxic", "remove_toxic", "cut_link"})
_WHERE = frozenset({"toxic_added", "toxic_updated", "toxic_removed", "link_cut", "link_restored"})
#: Runner fault actions that touch nothing of another execution: a worker's death is
#: judged as a death (`chaos.checker.holding.deaths`), a cancel is no fault, and a poison
#: message touches no evaluation (`poison_rejected` judges it).
_NOT_A_FAULT = frozenset({"kill_worker", "restart_worker", "cancel", "resume", "publish_poison"})


@dataclass(frozen=True)
class Touch:
    """A fault open from `start` to `end` (run seconds) that touched the processes `pids`
    (None: every one) through `service`, its role (`STORE`, `BROKER`; None: whatever they
    use)."""

    start: float
    end: float
    pids: frozenset[Any] | None
    service: str | None
    label: str

    def touches(self, pid: Any, services: Iterable[str] | None = None) -> bool:
        if self.pids is not None and pid not in self.pids:
            return False
        return services is None or self.service is None or self.service in services


def touches(events: list[dict]) -> list[Touch]:
    """Every fault of a history sorted by time, with what it touched."""
    end_of_run = max(map(event_time, events), default=0.0)
    healed: dict[Any, float] = {}
    for e in events:
        if e.get("ev") == "fault_healed" and e.get("fault_id") is not None:
            healed.setdefault(e["fault_id"], event_time(e))
    stalled = stall_ends(events)
    out: list[Touch] = []
    down: dict[str, float] = {}
    # faults waiting for the runner's record of where they acted, in firing order
    pending: dict[str, list[tuple[float, float, str]]] = {"link": [], "pause": []}
    for e in events:
        ev, t = e.get("ev"), event_time(e)
        if ev == "fault_fired":
            action = str(e.get("action"))
            fid = e.get("fault_id")
            end = max(t, healed.get(fid, end_of_run) if fid is not None else t)
            label = str(e.get("fault") or action)
            if action in _NOT_A_FAULT:
                continue
            if action in _SERVICE_OF:
                out.append(Touch(t, end, None, _SERVICE_OF[action], label))
            elif action in _ON_A_SERVICE:  # any system's service, named
                out.append(Touch(t, end, None, role(str(e.get("service"))), label))
            elif action in _LINK_ACTIONS:
                pending["link"].append((t, end, label))
            elif action == "pause_worker":
                pending["pause"].append((t, end, label))
            else:  # a fault of the run this module does not know: it touches everything
                out.append(Touch(t, end, None, None, label))
        elif ev in _WHERE and pending["link"]:
            t0, end, label = pending["link"].pop(0)
            link = str(e.get("link"))
            pids = e.get("pids")
            scope = frozenset(pids) if isinstance(pids, list) and link != "replication" else None
            out.append(Touch(t0, end, scope, role(link), label))
        elif ev == "worker_paused" and pending["pause"]:
            t0, end, label = pending["pause"].pop(0)
            out.append(Touch(t0, end, frozenset({e.get("pid")}), None, label))
        elif ev == "service_killed":
            down.setdefault(str(e.get("service")), t)
        elif ev == "service_restarted":
            service = str(e.get("service"))
            out.append(Touch(down.pop(service, t), t, None, role(service), f"{service} down"))
        elif ev == "failpoint_fired" and e.get("action") in TIMED_ACTIONS:
            pid = proc_of(e)[1]
            out.append(Touch(t, stalled[id(e)], frozenset({pid}), None, f"{e['action']}@fp"))
        elif ev in ("consumer_timeout", "channel_closed"):
            pid = proc_of(e)[1] if proc_of(e)[0] != "runner" else None
            scope = None if pid is None else frozenset({pid})
            out.append(Touch(t, t, scope, BROKER, str(ev)))
    for t0, end, label in (*pending["link"], *pending["pause"]):  # where unknown: anywhere
        out.append(Touch(t0, end, None, None, label))
    for service, t0 in down.items():
        out.append(Touch(t0, math.inf, None, service, f"{service} down"))
    return sorted(out, key=lambda w: (w.start, w.end))


def touching(
    windows: list[Touch],
    pid: Any,
    t0: float,
    t1: float,
    slack: float = 0.0,
    services: Iterable[str] | None = None,
) -> Touch | None:
    """The first fault open at some moment of [t0, t1] (each extended by `slack`, the
    clients' reconnect time) that touched process `pid` or a service of `services`."""
    for w in windows:
        if w.start > t1:
            break
        if w.end + slack >= t0 and w.touches(pid, services):
            return w
    return None


def by_proc(events: Iterable[Mapping[str, Any]], *kinds: str) -> dict[tuple[str, Any], list]:
    """The events of these kinds, by process, in time order."""
    out: dict[tuple[str, Any], list] = {}
    for e in events:
        if e.get("ev") in kinds:
            out.setdefault(proc_of(e), []).append(e)
    return out
