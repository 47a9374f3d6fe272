"""Duplicated LLM cost, read from a run's history, split by cause: the one definition
every output reads (the summary line, the journal, the report, `summary.md`,
`metrics.json`, the budgets, `compare` and sweeps).

What the run paid is the tokens of every call it recorded (`rule_finished`, `rule_failed`);
a call cut short by a crash records none. A call is (attemptId, ruleId, attempt, try):
the fake agent draws its tokens from exactly that, so the same call costs the same
whoever makes it. The fault-free reference (`chaos.reference`) makes each of its calls
once. So, with `Figures`:

    paid = reference - not_run + duplicated,   duplicated = the sum of its causes

- the first paid instance of a call the reference makes is the reference's;
- every later instance of a call is duplicated, for the cause of the execution that made
  it (`RERUN_CAUSES`);
- a call the reference never makes is duplicated as `extra_calls`;
- a call of the reference that this run never made (an evaluation cancelled, or left
  unfinished) is `not_run`: not a saving by faults, reported beside the figure.

Without faults, cancels or unfinished work, `not_run` is 0 and duplicated = paid minus
the fault-free reference's bill. An execution is one attempt of a rule run by one
process: its first `rule_started` (`try_no` 1) and the immediate retries that follow it
there; the first of an attempt is what a fault-free run pays, every later one is a rerun,
and its cause (`CAUSES`) is read from the execution before it and from how the
evaluation came back.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from reports.history import as_int, event_time

#: Why a rerun ran, or why a call was paid beyond the fault-free bill, in the order the
#: outputs list them; the same names everywhere (summary line, journal, report, budgets).
CAUSE_TEXT: dict[str, str] = {
    "write_window": "the execution before finished its call, but no result was written yet "
    "(a crash between the call and the write): the engine's promise kept",
    "redelivery": "the execution before never finished, and the evaluation came back as a "
    "redelivered message (its worker died before the ACK)",
    "sweeper_resume": "the execution before never finished, and the sweeper re-published "
    "the evaluation (its worker died, or stalled past its lease, after the ACK)",
    "in_flight": "the execution before never finished, and the evaluation came back "
    "another way (a lease lost, a pause, a message forwarded)",
    "lost_state": "a result had been written, and the store lost it (a restart that lost "
    "writes, a promoted standby that lacked them)",
    "resume": "a result had been written, and a resume from an earlier checkpoint deleted "
    "it (`engine.submit --resume --from-checkpoint`): asked for, not a fault's cost",
    "mutant": "a result had been written, and the run's engine is a mutant",
    "after_completion": "a result had been written, and nothing explains the rerun (a bug: "
    "no_completed_rerun fails it)",
    "extra_calls": "calls the fault-free reference never makes (a fault turned a call into "
    "a failure, and its retries are calls of their own)",
}
CAUSES = tuple(CAUSE_TEXT)
#: The causes of a rerun (an execution); `extra_calls` is a cause of calls only.
RERUN_CAUSES = CAUSES[:-1]
#: What `not_run_tokens` means, for legends.
NOT_RUN_TEXT = (
    "calls the fault-free reference makes that this run never made (an evaluation "
    "cancelled, or left unfinished): not a saving by faults, so not subtracted from "
    "the duplicated tokens"
)
#: Where the fault-free bill came from (`Figures.reference_from`).
FROM_REFERENCE = "the fault-free reference"
FROM_FIRST_CALLS = "the first paid instance of each call (no reference recorded)"

CallKey = tuple[str, str, int, int]  # attemptId, ruleId, attempt, try


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
class Call:
    """One paid call: its key, its tokens, and the execution that made it."""

    key: CallKey
    tokens: int
    execution: Execution | None


@dataclass
class Cost:
    executions: list[Execution] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    tokens_total: int = 0

    @property
    def reruns(self) -> list[Execution]:
        return [x for x in self.executions if x.cause is not None]


@dataclass(frozen=True)
class Figures:
    """What a run's faults cost, by the one definition (the module's docstring).
    `duplicated_by_cause` adds up to `duplicated_tokens` exactly; `reruns_by_cause` to
    `reruns`."""

    tokens_total: int
    reference_tokens: int
    reference_from: str
    not_run_tokens: int
    duplicated_by_cause: dict[str, int]
    reruns_by_cause: dict[str, int]

    @property
    def duplicated_tokens(self) -> int:
        return sum(self.duplicated_by_cause.values())

    @property
    def reruns(self) -> int:
        return sum(self.reruns_by_cause.values())

    @property
    def duplicated_ratio(self) -> float:
        """Duplicated tokens over the fault-free bill (0 when the bill is 0)."""
        return (
            round(self.duplicated_tokens / self.reference_tokens, 6)
            if self.reference_tokens
            else 0.0
        )

    def usd(self, price_per_1k: float) -> float:
        return round(self.duplicated_tokens / 1000 * price_per_1k, 6)

    def to_stats(self, price_per_1k: float) -> dict[str, Any]:
        """The figures as the checker's stats (flat: the budgets read them by name)."""
        return {
            "tokens_total": self.tokens_total,
            "reference_tokens": self.reference_tokens,
            "reference_from": self.reference_from,
            "not_run_tokens": self.not_run_tokens,
            "duplicated_tokens": self.duplicated_tokens,
            "duplicated_ratio": self.duplicated_ratio,
            "duplicated_usd": self.usd(price_per_1k),
            "duplicated_by_cause": dict(self.duplicated_by_cause),
            "reruns": self.reruns,
            "reruns_by_cause": dict(self.reruns_by_cause),
        }

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any]) -> Figures | None:
        """The figures a checker recorded (None: a journal from before them)."""
        dup, runs = stats.get("duplicated_by_cause"), stats.get("reruns_by_cause")
        if not isinstance(dup, Mapping) or not isinstance(runs, Mapping):
            return None
        return cls(
            int(stats.get("tokens_total") or 0),
            int(stats.get("reference_tokens") or 0),
            str(stats.get("reference_from") or FROM_REFERENCE),
            int(stats.get("not_run_tokens") or 0),
            {c: int(dup.get(c, 0)) for c in CAUSES},
            {c: int(runs.get(c, 0)) for c in RERUN_CAUSES},
        )


def figures(
    history: list[dict[str, Any]],
    mutant: str | None = None,
    reference_calls: Mapping[CallKey, int] | None = None,
    reference_tokens: int | None = None,
    cost: Cost | None = None,
) -> Figures:
    """The figures of one run. `reference_calls`: the fault-free reference's calls and
    their tokens (the split is then exact); else `reference_tokens`, its bill alone (what
    the run paid beyond it is `extra_calls`, what it fell short `not_run`); else neither:
    the bill is the first paid instance of each call. `cost`: `duplicated_cost` of the
    history, when the caller has it already."""
    cost = cost or duplicated_cost(history, mutant)
    duplicated = dict.fromkeys(CAUSES, 0)
    reruns = dict.fromkeys(RERUN_CAUSES, 0)
    for x in cost.reruns:
        reruns[x.cause or "in_flight"] += 1
    by_key: dict[CallKey, list[Call]] = defaultdict(list)
    for c in cost.calls:
        by_key[c.key].append(c)
    first: dict[CallKey, int] = {}
    for key, calls in by_key.items():
        # the reference's instance: the first execution's when it paid, else the first paid
        kept = next((c for c in calls if c.execution and c.execution.cause is None), calls[0])
        first[key] = kept.tokens
        for c in calls:
            if c is not kept:
                cause = c.execution.cause if c.execution and c.execution.cause else "in_flight"
                duplicated[cause] += c.tokens
    not_run = 0
    if reference_calls is not None:
        bill, source = sum(reference_calls.values()), FROM_REFERENCE
        for key, tokens in first.items():
            duplicated["extra_calls"] += tokens - reference_calls.get(key, 0)
        not_run = sum(t for key, t in reference_calls.items() if key not in first)
    elif reference_tokens is not None:
        bill, source = reference_tokens, FROM_REFERENCE
        beyond = sum(first.values()) - bill
        duplicated["extra_calls"] = max(beyond, 0)
        not_run = max(-beyond, 0)
    else:
        bill, source = sum(first.values()), FROM_FIRST_CALLS
    return Figures(cost.tokens_total, bill, source, not_run, duplicated, reruns)


def mutant_of(history: list[dict[str, Any]]) -> str | None:
    """The mutant the run's engine ran with, from the runner's `run_started`."""
    for e in history:
        if e.get("ev") == "run_started":
            return e.get("mutant") or None
    return None


#: The events that say how many acknowledged writes the store lost (`lost_writes`): a
#: restart of a Redis that lost its last writes, a failover to a standby that lacked some.
LOSING = ("service_restarted", "redis_failover")


def lost_writes(history: Iterable[Mapping[str, Any]]) -> int | None:
    """The acknowledged writes the run's store lost, as its restarts and failovers counted
    them; None when none counted (a design or a fault that cannot tell)."""
    counted = [
        as_int(e.get("lost_writes"))
        for e in history
        if e.get("ev") in LOSING and e.get("lost_writes") is not None
    ]
    return sum(counted) if counted else None


#: The events `duplicated_cost` reads.
_READ = frozenset(
    {
        "rule_started",
        "rule_finished",
        "rule_failed",
        "result_persisted",
        "service_restarted",
        "redis_failover",
        "sweeper_resumed",
        "delivered",
        "resume_written",
    }
)


def duplicated_cost(history: list[dict[str, Any]], mutant: str | None = None) -> Cost:
    """Every execution and paid call of a run, each rerun with its cause (`mutant`: the
    run's, else read from its `run_started`)."""
    mutant = mutant or mutant_of(history)
    cost = Cost()
    current: dict[tuple[str, str, int, str], Execution] = {}  # the open one, per process
    by_attempt: dict[tuple[str, str, int], list[Execution]] = defaultdict(list)
    written: dict[tuple[str, str], float] = {}  # the first result_persisted of a rule
    lost_at: list[float] = []  # restarts of Redis that lost writes
    discarded: dict[tuple[str, str], float] = {}  # results a resume deleted, when
    comebacks: dict[tuple[str, str], list[tuple[float, str]]] = defaultdict(list)
    for e in history:
        ev = e.get("ev")
        if ev not in _READ:  # most events: passed over at once (the checker runs this each seed)
            continue
        t = event_time(e)
        a, r, src = str(e.get("attempt_id")), str(e.get("rule_id")), str(e.get("src"))
        if ev == "rule_started":
            n = as_int(e.get("attempt"), 1)
            key = (a, r, n, src)
            if as_int(e.get("try_no"), 1) == 1 or key not in current:
                x = Execution(a, r, n, src, t)
                earlier = by_attempt[a, r, n]
                if earlier:
                    x.cause = _cause(earlier[-1], x, written, lost_at, comebacks, mutant, discarded)
                earlier.append(x)
                current[key] = x
                cost.executions.append(x)
        elif ev in ("rule_finished", "rule_failed"):
            n = as_int(e.get("attempt"), 1)
            ran = current.get((a, r, n, src))
            tokens = as_int(e.get("tokens"))
            cost.tokens_total += tokens
            cost.calls.append(Call((a, r, n, as_int(e.get("try_no"), 1)), tokens, ran))
            if ran is not None:
                ran.tokens += tokens
                ran.end = t
                ran.finished = ran.finished or ev == "rule_finished"
        elif ev == "result_persisted":
            written.setdefault((a, r), t)
        elif ev == "resume_written":
            for gone in e.get("discarded") or ():
                discarded.setdefault((a, str(gone)), t)
        elif ev in LOSING and as_int(e.get("lost_writes")) > 0:
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
    discarded: dict[tuple[str, str], float],
) -> str:
    done = written.get((x.attempt_id, x.rule_id))
    if done is not None and done <= x.start:
        if any(done <= t <= x.start for t in lost_at):
            return "lost_state"
        gone = discarded.get((x.attempt_id, x.rule_id))
        if gone is not None and done <= gone <= x.start:
            return "resume"
        return "mutant" if mutant else "after_completion"
    if before.finished:
        return "write_window"
    # the latest way back in, from the end: a broken engine redelivered without end has
    # thousands, and the one wanted is nearly always the last
    back = comebacks.get((x.attempt_id, x.src), [])
    for i in range(len(back) - 1, -1, -1):  # (not `reversed`: mypyc cannot compile it here)
        t, how = back[i]
        if before.start <= t <= x.start:
            return how
    return "in_flight"
