"""Executions of a rule: what one process did with one attempt, from its first call to
its outcome. `no_completed_rerun` counts them; `retry_budget` counts their calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chaos.checker.context import as_int, proc_of


@dataclass
class Round:
    """One execution of one attempt of a rule in one process: a `rule_started` with try 1,
    its level-1 retries, their outcomes, and whether it wrote the result."""

    start: dict
    attempt: int
    proc: tuple[str, Any]
    starts: list[dict] = field(default_factory=list)
    outcomes: list[dict] = field(default_factory=list)
    persisted: bool = False

    @property
    def finished(self) -> bool:
        return any(e.get("ev") == "rule_finished" for e in self.outcomes)

    @property
    def tokens(self) -> int:
        return sum(as_int(e.get("tokens")) for e in self.outcomes)


def rounds_of(events: list[dict]) -> list[Round]:
    """The executions in the events of one (attemptId, ruleId), sorted by time."""
    rounds: list[Round] = []
    current: dict[tuple[str, Any], Round] = {}
    for e in events:
        ev = e.get("ev")
        if ev == "rule_started":
            proc, attempt = proc_of(e), as_int(e.get("attempt"), 1)
            rnd = current.get(proc)
            if as_int(e.get("try_no"), 1) == 1 or rnd is None or rnd.attempt != attempt:
                rnd = current[proc] = Round(e, attempt, proc)
                rounds.append(rnd)
            rnd.starts.append(e)
        elif ev == "rule_finished" or ev == "rule_failed":
            rnd = current.get(proc_of(e))
            if rnd is not None and rnd.attempt == as_int(e.get("attempt"), 1):
                rnd.outcomes.append(e)
        elif ev == "result_persisted":
            rnd = current.get(proc_of(e))
            if rnd is not None:
                rnd.persisted = True
    return rounds
