"""The history indexed once for every invariant (`Context`), the fault windows, and the
helpers that build the evidence (a short timeline of recorded events)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from chaos.checker.events import Events
from chaos.checker.oracle import max_attempts_of
from chaos.checker.records import CheckSpec, EvaluationFinal, FinalState, Violation
from engine.core.results import RuleResult
from engine.plan import Plan, PlanError, plan_from_dict
from reports.cost import LOSING, lost_writes
from reports.history import WINDOW_KINDS
from reports.history import FaultWindow as FaultWindow
from reports.history import as_int as as_int
from reports.history import event_time as event_time
from reports.history import fault_windows as fault_windows
from reports.history import sort_key as sort_key
from reports.history import stall_ends as stall_ends

if TYPE_CHECKING:
    from chaos.checker.holding import Session
    from chaos.checker.rounds import Round
    from chaos.checker.touching import Touch

TERMINAL_STATES = frozenset({"completed", "partial", "failed", "cancelled"})
FINISHED_STATES = frozenset({"completed", "partial", "failed"})  # terminal, not cancelled
TIMELINE_LIMIT = 12
TTL_SLACK_S = 60
STATE_KEY_PREFIX = "attempt:"
#: Runner and worker events about faults: counted, and shown in evidence (the windows a
#: late retry is excused by come from `fault_windows`, on the runner's own records).
FAULT_EVENTS = frozenset(
    {
        "crash",
        "worker_killed",
        "worker_restarted",
        "service_killed",
        "service_restarted",
        "service_paused",
        "service_resumed",
        "sentinel_killed",
        "sentinel_restarted",
        "fault_fired",
    }
)

#: What `Context` keeps aside for the whole history's fault figures: `FAULT_EVENTS`, and
#: what `fault_windows`, `faults_fired` and `lost_writes` read.
_NOTED = FAULT_EVENTS | WINDOW_KINDS | {"failpoint_fired"} | frozenset(LOSING)


def proc_of(e: Mapping[str, Any]) -> tuple[str, Any]:
    return (str(e.get("src", "")), e.get("pid"))


class Context:
    """The history indexed once: by evaluation, by (evaluation, rule), faults apart."""

    def __init__(self, history: list[dict], final: FinalState, spec: CheckSpec) -> None:
        self.final = final
        self.spec = spec
        self.events = Events(
            sorted((e for e in history if type(e) is dict or isinstance(e, Mapping)), key=sort_key)
        )
        self.by_eval: dict[str, list[dict]] = defaultdict(Events)
        self.by_pair: dict[tuple[str, str], list[dict]] = defaultdict(Events)
        self._rounds: dict[tuple[str, str], list[Round]] = {}
        self._once: dict[Any, Any] = {}  # what several checks ask of the whole history
        self.faults: list[dict] = []
        self.submitted: dict[str, dict] = {}
        self.cancelled = set(spec.cancelled)
        by_eval, by_pair = self.by_eval, self.by_pair
        noted: list[dict] = []  # what the whole history's fault figures read (`_NOTED`)
        for e in self.events:
            ev = e.get("ev")
            if type(ev) is not str:  # a broken engine's record: `history_well_formed` says so
                ev = None
            a = e.get("attempt_id")
            if type(a) is str or isinstance(a, str):
                by_eval[a].append(e)
                r = e.get("rule_id")
                if type(r) is str or isinstance(r, str):
                    by_pair[(a, r)].append(e)
                if ev == "submitted":
                    self.submitted.setdefault(a, e)
                elif ev == "cancel_requested":
                    self.cancelled.add(a)
            if ev in _NOTED:
                noted.append(e)
                if ev in FAULT_EVENTS:
                    self.faults.append(e)
        self.plans: dict[str, Plan] = dict(spec.plans)
        for a, e in self.submitted.items():
            raw = e.get("plan")
            if a not in self.plans and isinstance(raw, Mapping):
                with contextlib.suppress(PlanError):  # a bad plan: nothing to judge it by
                    self.plans[a] = plan_from_dict(dict(raw), source=f"plan of {a}")
        self.evaluations = sorted(
            set(self.plans) | set(final.evaluations) | set(self.submitted) | set(self.by_eval)
        )
        # sorted by `sort_key`, whose first part is `event_time`: the last is the latest
        end = event_time(self.events[-1]) if self.events else 0.0
        self.fault_windows = fault_windows(noted, end)
        self.stats: dict[str, Any] = {
            "events": len(self.events),
            "evaluations": len(self.evaluations),
            "faults": len(self.faults),
            "crashes": sum(1 for e in self.faults if e.get("ev") == "crash"),
            "faults_fired": faults_fired(noted),
        }
        lost = lost_writes(noted)
        if lost is not None:  # the store counted what it lost (a restart, a failover)
            self.stats["lost_writes"] = lost

    def rounds(self, pair: tuple[str, str]) -> list[Round]:
        """`rounds_of` the pair's events, worked out once for every check that asks."""
        got = self._rounds.get(pair)
        if got is None:
            from chaos.checker.rounds import rounds_of  # it builds on this module

            got = self._rounds[pair] = rounds_of(self.by_pair.get(pair, []))
        return got

    def deaths(self) -> dict[Any, list[dict]]:
        """`holding.deaths` of the history, worked out once (read it, never change it)."""
        got = self._once.get("deaths")
        if got is None:
            from chaos.checker.holding import deaths  # it builds on this module

            got = self._once["deaths"] = deaths(self.events)
        return got

    def touches(self) -> list[Touch]:
        """`touching.touches` of the history, worked out once."""
        got = self._once.get("touches")
        if got is None:
            from chaos.checker.touching import touches  # it builds on this module

            got = self._once["touches"] = touches(self.events)
        return got

    def sessions(self, a: str) -> list[Session]:
        """`holding.sessions` of evaluation `a`, worked out once."""
        got = self._once.get(("sessions", a))
        if got is None:
            from chaos.checker.holding import sessions

            got = self._once[("sessions", a)] = sessions(self.by_eval.get(a, []), self.deaths())
        return got

    def final_of(self, a: str) -> EvaluationFinal | None:
        return self.final.evaluations.get(a)

    def result_of(self, a: str, r: str) -> RuleResult | None:
        fin = self.final_of(a)
        return None if fin is None else as_result(fin.results.get(r), r)

    def max_attempts(self, a: str, r: str) -> int:
        return max_attempts_of(self.plans.get(a), r, self.spec.policy)

    def faults_between(self, t0: float, t1: float) -> list[FaultWindow]:
        """The fault windows open at some moment of [t0, t1], each extended by the
        scenario's `fault_recovery_s` (clients reconnecting once a fault healed)."""
        rec = self.spec.fault_recovery_s
        return [w for w in self.fault_windows if w.overlaps(t0, t1, rec)]

    def fault_between(self, t0: float, t1: float) -> bool:
        return bool(self.faults_between(t0, t1))


def as_result(value: Any, rule_id: str) -> RuleResult | None:
    if value is None or isinstance(value, RuleResult):
        return value
    if isinstance(value, str | bytes):
        return RuleResult.from_json(value)
    if isinstance(value, Mapping):
        data = {"rule_id": rule_id, "tokens": 0, **value}
        fields = {f.name for f in dataclasses.fields(RuleResult) if f.init}
        return RuleResult(**{k: v for k, v in data.items() if k in fields})
    raise TypeError(f"result of {rule_id!r}: expected a RuleResult, got {type(value).__name__}")


def faults_fired(events: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """What was done to the run, by kind, for a summary: each runner `fault_fired` by its
    action (`kill_worker`, `cancel`...), each worker `crash` as `crash@<failpoint>`, each
    other failpoint that fired as `<action>@<failpoint>` (`freeze@before_final_publish`).
    Kills are counted once (their `worker_killed` / `service_killed` echo is not a second
    fault)."""
    out: dict[str, int] = {}
    for e in events:
        ev = e.get("ev")
        if ev == "fault_fired":
            kind = str(e.get("action") or e.get("fault") or "fault")
        elif ev == "crash":
            kind = f"crash@{e.get('failpoint') or 'unknown'}"
        elif ev == "failpoint_fired" and e.get("action") not in (None, "crash"):
            kind = f"{e.get('action')}@{e.get('failpoint') or 'unknown'}"
        else:
            continue
        out[kind] = out.get(kind, 0) + 1
    return dict(sorted(out.items()))


def timeline(
    key: Iterable[Mapping[str, Any]],
    context: Iterable[Mapping[str, Any]] = (),
    limit: int = TIMELINE_LIMIT,
) -> list[dict[str, Any]]:
    """The proof: every key event (up to `limit`), then the context events nearest in time
    to them, sorted by time."""
    seen: set[int] = set()
    keep: list[Mapping[str, Any]] = []
    for e in key:
        if id(e) not in seen:
            seen.add(id(e))
            keep.append(e)
    keep.sort(key=sort_key)
    if len(keep) > limit:  # the first and the last matter most
        keep = keep[: limit // 2] + keep[len(keep) - (limit - limit // 2) :]
    anchors = [event_time(e) for e in keep]
    rest = [e for e in context if id(e) not in seen]
    if anchors and rest and len(keep) < limit:
        rest.sort(key=lambda e: min(abs(event_time(e) - t) for t in anchors))
        keep += rest[: limit - len(keep)]
    elif not anchors:
        keep = sorted(rest, key=sort_key)[-limit:]
    return [dict(e) for e in sorted(keep, key=sort_key)]


def num(value: float | int) -> str:
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if value != int(value) else str(int(value))
    return str(value)


def listed(items: Iterable[str], most: int = 5) -> str:
    items = list(items)
    head = ", ".join(items[:most])
    return head if len(items) <= most else f"{head} and {len(items) - most} more"


def of(events: Iterable[dict], *kinds: str) -> list[dict]:
    """The events of these kinds, in their order."""
    if type(events) is Events:
        index = events._index
        if index is not None and len(kinds) == 1 and index[0] == len(events):
            return list(index[1].get(kinds[0], ()))  # `Events.of`, one call less
        return events.of(kinds)
    return [e for e in events if e.get("ev") in kinds]


#: What a check returns: (cases judged, violations). A case is one thing the invariant
#: looked at (a rule's pair of events, an evaluation, a retry, a key): zero cases judged is
#: "unknown", never "pass", since a check that saw nothing proved nothing.
Outcome = tuple[int, list["Violation"]]
