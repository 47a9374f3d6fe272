"""The fault plan: a scenario's runner faults expanded into firings, and which of the
event-triggered ones a history fires. Pure, so the live runner and the simulator carry out
the same plan."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chaos.scenario.schema import (
    LINK_ACTIONS,
    SENTINELS,
    WORKER_ACTIONS,
    AfterEvent,
    Scenario,
    service_action,
)

if TYPE_CHECKING:
    from chaos.scenario.loaded import LoadedScenario


# --- the fault schedule ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlannedFault:
    """One concrete firing of a runner fault.

    Time-triggered: `at_s` seconds after the run starts. Event-triggered: `delay_s` seconds
    after the `after` event (then `at_s` is None). `target` is resolved (never 'random').
    """

    fault: int  # index in Scenario.faults
    repetition: int  # 0-based, up to count - 1
    name: str
    action: str
    target: int
    at_s: float | None
    after: AfterEvent | None
    delay_s: float
    restart_after_s: float | None
    pause_s: float | None = None
    #: A fault on a service: which, and how (kill, stop, pause, restart).
    service: str | None = None
    how: str | None = None

    @property
    def label(self) -> str:
        """How the history names this firing: the fault's name, `#N` for repetition N > 0."""
        return self.name if self.repetition == 0 else f"{self.name}#{self.repetition}"


def fault_schedule(
    scenario: Scenario | LoadedScenario, rng: random.Random | None = None
) -> list[PlannedFault]:
    """Expand the runner faults into firings: timed ones by time, then event-triggered ones.

    Deterministic for a given `rng` state (default `random.Random(scenario.seed)`): faults
    are drawn in file order, each repetition drawing its time, then its target.
    """
    spec = scenario if isinstance(scenario, Scenario) else scenario.spec
    rng = random.Random(spec.seed) if rng is None else rng
    total = spec.total_evaluations
    out: list[PlannedFault] = []
    for i, fault in spec.runner_faults:
        for rep in range(fault.count):
            at: float | None = None
            delay = 0.0
            if fault.at_s is not None:
                at = fault.at_s + rep * (fault.every_s or 0.0)
            elif fault.random_at_s is not None:
                at = rng.uniform(*fault.random_at_s)
            else:
                delay = rep * (fault.every_s or 0.0)
            target = fault.target
            if target == "random":  # only worker actions, cancel and kill_sentinel take one
                target = rng.randrange(
                    spec.workers
                    if fault.action in WORKER_ACTIONS
                    else SENTINELS
                    if fault.action == "kill_sentinel"
                    else total
                )
            pause = fault.pause_s
            if isinstance(pause, tuple):
                pause = rng.uniform(*pause)
            out.append(
                PlannedFault(
                    fault=i,
                    repetition=rep,
                    name=fault.name or f"faults[{i}]",
                    action=fault.action,
                    target=target,
                    at_s=at,
                    after=fault.after,
                    delay_s=delay,
                    restart_after_s=(
                        None
                        if fault.action in ("cancel", "pause_redis", "pause_service")
                        or fault.action in LINK_ACTIONS
                        else 0.0
                        if fault.action == "restart_service"
                        else fault.restart_after_s
                    ),
                    pause_s=pause,
                    service=on[0] if (on := service_action(fault)) else None,
                    how=on[1] if on else None,
                )
            )
    out.sort(key=lambda p: (p.at_s is None, p.at_s or 0.0, p.fault, p.repetition))
    return out


class EventTriggers:
    """Which `after`-triggered faults of a schedule fire, fed the history one event at a time.

    Pure, so the live runner (tailing the history file) and the simulator (reading its
    event list) fire exactly the same faults on the same events.
    """

    def __init__(self, schedule: Sequence[PlannedFault]) -> None:
        self._waiting = [f for f in schedule if f.after is not None]
        self._counts = [0] * len(self._waiting)
        self._done = [False] * len(self._waiting)

    @property
    def done(self) -> bool:
        return all(self._done)

    def feed(self, event: Mapping[str, Any]) -> list[PlannedFault]:
        """The faults whose trigger this event completes (each fires once)."""
        fired = []
        for i, fault in enumerate(self._waiting):
            trig = fault.after
            if self._done[i] or trig is None or event.get("ev") != trig.event:
                continue
            if trig.rule is not None and event.get("rule_id") != trig.rule:
                continue
            self._counts[i] += 1
            if self._counts[i] >= trig.count:
                self._done[i] = True
                fired.append(fault)
        return fired
