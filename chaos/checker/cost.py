"""Duplicated LLM cost, read from a run's history, split by cause.

An execution is one attempt of a rule run by one process: its first `rule_started`
(`try_no` 1) and the immediate retries that follow it there. The first execution of an
attempt is what a fault-free run pays; every later one is a rerun, and its calls' tokens
are duplicated cost (one of the two executions' work was thrown away). Its cause is read
from the execution before it and from how the evaluation came back:
- `write_window`: the one before finished its call, but no result was written yet;
- `redelivery`: the one before never finished, and the evaluation came back by a
  redelivered message (its worker died before the ACK);
- `sweeper_resume`: ... by the sweeper (its worker died after the ACK);
- `in_flight`: ... otherwise (a lease lost, a pause, a message forwarded);
- `lost_state`: a result had been written, and Redis lost it (a restart that lost writes);
- `mutant`: a result had been written, and the run's engine is a mutant;
- `after_completion`: a result had been written, and nothing explains the rerun (a bug:
  `no_completed_rerun` fails it).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from chaos.checker.context import as_int, event_time

CAUSES = (
    "write_window",
    "redelivery",
    "sweeper_resume",
    "in_flight",
    "lost_state",
    "mutant",
    "after_completion",
)


@dataclass
class Execution:
    attempt_id: str
    rule_id: str
    attempt: int
    src: str
    start: float
    end: float | None = None  # its last call's end
    tokens: int = 0
    finished: bool = False  # a `rule_finished`: its call returned a result
    cause: str | None = None  # None: the first execution of its attempt


@dataclass
class Cost:
    executions: list[Execution] = field(default_factory=list)
    tokens_total: int = 0

    @property
    def reruns(self) -> list[Execution]:
        return [x for x in self.executions if x.cause is not None]

    def by_cause(self) -> dict[str, int]:
        out = dict.fromkeys(CAUSES, 0)
        for x in self.reruns:
            out[x.cause or ""] += x.tokens
        return out

    @property
    def duplicated_tokens(self) -> int:
        return sum(x.tokens for x in self.reruns)

    @property
    def reference_tokens(self) -> int:
        """What the first executions cost: the fault-free run's bill."""
        return self.tokens_total - self.duplicated_tokens


def duplicated_cost(history: list[dict[str, Any]], mutant: str | None = None) -> Cost:
    cost = Cost()
    current: dict[tuple[str, str, int, str], Execution] = {}  # the open one, per process
    by_attempt: dict[tuple[str, str, int], list[Execution]] = defaultdict(list)
    written: dict[tuple[str, str], float] = {}  # the first result_persisted of a rule
    lost_at: list[float] = []  # restarts of Redis that lost writes
    comebacks: dict[tuple[str, str], list[tuple[float, str]]] = defaultdict(list)
    for e in history:
        ev, t = e.get("ev"), event_time(e)
        a, r, src = str(e.get("attempt_id")), str(e.get("rule_id")), str(e.get("src"))
        if ev == "rule_started":
            n = as_int(e.get("attempt"), 1)
            key = (a, r, n, src)
            if as_int(e.get("try_no"), 1) == 1 or key not in current:
                x = Execution(a, r, n, src, t)
                earlier = by_attempt[a, r, n]
                if earlier:
                    x.cause = _cause(earlier[-1], x, written, lost_at, comebacks, mutant)
                earlier.append(x)
                current[key] = x
                cost.executions.append(x)
        elif ev in ("rule_finished", "rule_failed"):
            x = current.get((a, r, as_int(e.get("attempt"), 1), src))
            tokens = as_int(e.get("tokens"))
            cost.tokens_total += tokens
            if x is not None:
                x.tokens += tokens
                x.end = t
                x.finished = x.finished or ev == "rule_finished"
        elif ev == "result_persisted":
            written.setdefault((a, r), t)
        elif ev == "service_restarted" and as_int(e.get("lost_writes")) > 0:
            lost_at.append(t)
        elif ev == "sweeper_resumed":
            comebacks[a, src].append((t, "sweeper_resume"))
        elif ev == "delivered" and e.get("redelivered") is True:
            comebacks[a, src].append((t, "redelivery"))
    return cost


def _cause(
    before: Execution,
    x: Execution,
    written: dict[tuple[str, str], float],
    lost_at: list[float],
    comebacks: dict[tuple[str, str], list[tuple[float, str]]],
    mutant: str | None,
) -> str:
    done = written.get((x.attempt_id, x.rule_id))
    if done is not None and done <= x.start:
        if any(done <= t <= x.start for t in lost_at):
            return "lost_state"
        return "mutant" if mutant else "after_completion"
    if before.finished:
        return "write_window"
    came = comebacks.get((x.attempt_id, x.src), ())
    ways = [how for t, how in came if before.start <= t <= x.start]
    return ways[-1] if ways else "in_flight"
