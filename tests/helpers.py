"""Shared test helpers: plans in one line, scripted agents, and a toy shell for the core.

`Shell` is the smallest imperative shell the pure core can have (in the spirit of h11's
`tests/helpers.py`, which runs two pure cores against each other): a dict for Redis, two
lists for the retry queues of RabbitMQ, a list of agent calls in flight. It carries out
the actions of an `Evaluation` front to back, can crash just before any action (what was
not carried out yet is lost, in-flight calls too, unacked retry messages are redelivered)
and then starts a new `Evaluation` from a `Snapshot` of what it persisted, like
ReEvaluateUseCase. It checks the protocol as it goes (an ack for a message nobody
delivered, a status that goes backwards, a pass published twice) and records every
action it carried out, so tests can state invariants over the whole history.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.core import (
    AckRetry,
    Action,
    Evaluation,
    Finish,
    Park,
    PersistResult,
    PersistStatus,
    PublishPassResult,
    Recovered,
    RuleResult,
    RunRule,
    ScheduleRetry,
    SkipRules,
    Snapshot,
    parse_status,
    status_rank,
)
from engine.plan import Plan, Rule, load_plan, plan_from_dict
from engine.policy import RetryPolicy

PLANS_DIR = Path(__file__).resolve().parent.parent / "plans"

OK = "ok"
TRANSIENT = "transient"
PERMANENT = "permanent"  # a non-retryable error: straight to permanently_failed

#: What a fake agent returns for one call: OK, TRANSIENT or PERMANENT.
Agent = Callable[[RunRule], str]


def imports_of(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of each absolute import in a Python file."""
    import ast

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield node.lineno, node.module or ""


def example_plan(name: str) -> Plan:
    return load_plan(PLANS_DIR / f"{name}.yaml")


def make_plan(passes: Mapping[str, Mapping[str, Any]], plan_id: str = "t") -> Plan:
    """`make_plan({"p1": {"a": [], "b": ["a"]}, "p2": {"c": {"depends_on": ["b"], ...}}})`."""
    return plan_from_dict(
        {
            "plan": plan_id,
            "passes": [
                {
                    "id": pid,
                    "rules": [
                        {"id": rid, **(spec if isinstance(spec, Mapping) else {"depends_on": spec})}
                        for rid, spec in rules.items()
                    ],
                }
                for pid, rules in passes.items()
            ],
        }
    )


def _digest(*parts: object) -> int:
    key = ":".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


def result_for(rule_id: str, attempt: int = 1) -> RuleResult:
    """The fake agent's answer: the verdict depends on the rule only (rules are idempotent)."""
    h = _digest("verdict", rule_id)
    verdict = ("pass", "fail", "needs_review")[h % 3]
    return RuleResult(
        rule_id, verdict, score=(h % 101) / 100, tokens=100 + h % 900, attempt=attempt
    )


def agent(default: str = OK, **per_rule: str | Callable[[int, int], str]) -> Agent:
    """A stateless scripted agent: per rule an outcome, or a function (attempt, try_no)."""

    def call(run: RunRule) -> str:
        spec = per_rule.get(run.rule_id, default)
        return spec(run.attempt, run.try_no) if callable(spec) else spec

    return call


def hashed_agent(seed: int, p_transient: float = 0.3, p_permanent: float = 0.05) -> Agent:
    """Random-looking but a pure function of (seed, rule, attempt, try): a crash and a
    rerun of the same call get the same outcome, so a recovered run can be compared with
    a fault-free one."""

    def call(run: RunRule) -> str:
        x = _digest(seed, run.rule_id, run.attempt, run.try_no) % 10_000 / 10_000
        if x < p_permanent:
            return PERMANENT
        return TRANSIENT if x < p_permanent + p_transient else OK

    return call


def feed(ev: Evaluation, run: RunRule, outcome: str) -> list[Action]:
    """Give the evaluation the outcome of one agent call."""
    if outcome == OK:
        return ev.rule_succeeded(run.rule_id, result_for(run.rule_id, run.attempt))
    return ev.rule_failed(run.rule_id, f"{outcome} error", retryable=outcome == TRANSIENT)


class Crash(Exception):
    """The worker process died: whatever was not carried out yet is lost."""


@dataclass
class Shell:
    """A toy shell: carries out an evaluation's actions, crashes on demand, recovers."""

    plan: Plan
    agent: Agent
    policy: RetryPolicy | None = None
    max_parallel: int = 4
    #: crash just before carrying out the action with this (global, 0-based) index
    crash_at: Iterable[int] = ()
    #: a heartbeat sweeper re-publishes the retry of a `failed_attempt_N` rule that has
    #: none (a crash between PersistStatus and ScheduleRetry); off, such a rule waits forever
    sweeper: bool = True
    #: on Park, drop the evaluation and rebuild it from Redis when a retry message arrives
    evict_on_park: bool = False
    #: cancel the evaluation after this many steps (one step: one call or one message)
    cancel_after: int | None = None
    #: picks which call completes or which message arrives next; None: FIFO, calls first
    rng: random.Random | None = None
    attempt_id: str = "attempt-1"

    # Redis
    results: dict[str, RuleResult] = field(default_factory=dict)
    statuses: dict[str, str] = field(default_factory=dict)
    published: set[str] = field(default_factory=set)
    final: Finish | None = None  # the final status, persisted with Finish
    # RabbitMQ: retry messages waiting in a delay queue, and delivered but not acked
    queued: list[tuple[str, int]] = field(default_factory=list)
    delivered: list[tuple[str, int]] = field(default_factory=list)
    # the worker
    evaluation: Evaluation | None = None
    inflight: list[RunRule] = field(default_factory=list)
    generation: int = 0
    # the history
    executed: list[tuple[int, Action]] = field(default_factory=list)
    outcomes: list[tuple[RunRule, str]] = field(default_factory=list)
    cancelled_at: int | None = None  # index in `executed` when cancel() was called
    max_inflight: int = 0
    crashes: int = 0

    def __post_init__(self) -> None:
        self._crash_points = set(self.crash_at)

    # --- views of the history ---------------------------------------------------------------

    @property
    def actions(self) -> list[Action]:
        return [a for _, a in self.executed]

    def of_type(self, kind: type) -> list[Any]:
        return [a for a in self.actions if isinstance(a, kind)]

    @property
    def calls(self) -> list[RunRule]:
        return self.of_type(RunRule)

    def snapshot(self) -> Snapshot:
        return Snapshot(dict(self.results), dict(self.statuses), frozenset(self.published))

    # --- running ------------------------------------------------------------------------------

    def run(self, max_steps: int = 20_000) -> Shell:
        self._boot()
        steps = 0
        while self.inflight or self.queued:
            steps += 1
            if steps > max_steps:
                raise AssertionError("the evaluation makes no progress")
            try:
                if self.cancel_after is not None and steps == self.cancel_after:
                    self._cancel()
                elif self.inflight and (not self.queued or self._coin()):
                    self._complete_call()
                else:
                    self._deliver_message()
            except Crash:
                self._recover()
        return self

    def _coin(self) -> bool:
        return self.rng is None or self.rng.random() < 0.7

    def _pick(self, items: list[Any]) -> Any:
        return items.pop(0 if self.rng is None else self.rng.randrange(len(items)))

    def _boot(self, due: Mapping[str, int] | None = None) -> None:
        """(Re)build the evaluation from what Redis remembers and start it."""
        try:
            self.evaluation = Evaluation(
                self.plan,
                self.attempt_id,
                self.policy,
                snapshot=self.snapshot(),
                due=due,
                max_parallel=self.max_parallel,
            )
            self._execute(self.evaluation.start())
        except Crash:
            self._recover()

    def _complete_call(self) -> None:
        run = self._pick(self.inflight)
        outcome = self.agent(run)
        self.outcomes.append((run, outcome))
        assert self.evaluation is not None
        self._execute(feed(self.evaluation, run, outcome))

    def _deliver_message(self) -> None:
        msg = self._pick(self.queued)
        self.delivered.append(msg)
        if self.evaluation is None and self.final is None:
            self._boot(due={msg[0]: msg[1]})  # the retry message wakes a parked evaluation
        elif self.evaluation is None:
            self._execute([AckRetry(*msg)])  # the evaluation is over: drop the message
        else:
            self._execute(self.evaluation.retry_due(*msg))

    def _cancel(self) -> None:
        if self.final is not None:
            return
        if self.evaluation is None:  # parked: rebuild it from Redis only to cancel it
            self.evaluation = Evaluation(
                self.plan, self.attempt_id, self.policy, snapshot=self.snapshot()
            )
        self.cancelled_at = len(self.executed)
        self._execute(self.evaluation.cancel())

    def _recover(self) -> None:
        """The worker died: calls in flight are lost, unacked messages come back, and a
        new worker rebuilds the evaluation from Redis (ReEvaluateUseCase)."""
        self.crashes += 1
        self.generation += 1
        self.evaluation = None
        self.inflight.clear()
        self.queued[:0] = self.delivered
        self.delivered.clear()
        if self.final is not None:
            return  # the final status is durable: nobody re-evaluates a finished evaluation
        if self.sweeper:
            for rid, status in sorted(self.statuses.items()):
                n = parse_status(status)
                if n is not None and rid not in self.results and (rid, n + 1) not in self.queued:
                    self.queued.append((rid, n + 1))
        self._boot()

    def _execute(self, actions: list[Action]) -> None:
        evict = False
        for action in actions:
            if len(self.executed) in self._crash_points:
                self._crash_points.discard(len(self.executed))
                raise Crash
            self._apply(action)
            self.executed.append((self.generation, action))
            evict = evict or (isinstance(action, Park) and self.evict_on_park)
        if evict:
            assert not self.inflight, "parked with agent calls in flight"
            self.evaluation = None

    def _apply(self, action: Action) -> None:
        match action:
            case RunRule():
                self.inflight.append(action)
                self.max_inflight = max(self.max_inflight, len(self.inflight))
            case PersistResult(rule_id=rid, result=result):
                self.results[rid] = result
            case PersistStatus(rule_id=rid, status=status):
                old = self.statuses.get(rid)
                assert status_rank(status) > status_rank(old), f"{rid}: {old} -> {status}"
                self.statuses[rid] = status
            case ScheduleRetry(rule_id=rid, attempt=attempt):
                self.queued.append((rid, attempt))
            case AckRetry(rule_id=rid, attempt=attempt):
                assert (rid, attempt) in self.delivered, f"ack of an undelivered {action}"
                self.delivered.remove((rid, attempt))
            case PublishPassResult(pass_id=pid):
                assert pid not in self.published, f"pass {pid} published twice"
                self.published.add(pid)
            case Finish():
                assert self.final is None, "a second Finish"
                self.final = action
            case SkipRules() | Recovered() | Park():
                pass
            case _:  # pragma: no cover
                raise AssertionError(f"unknown action {action!r}")


def run_plan(plan: Plan, agent_fn: Agent | None = None, **kwargs: Any) -> Shell:
    """Run a plan to the end with a scripted agent (default: every call succeeds); the
    shell holds the whole history."""
    return Shell(plan, agent_fn or agent(), **kwargs).run()


def containers(node: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path of every dict and list inside a decoded document (for mutating fuzzers)."""
    out = [here] if isinstance(node, dict | list) else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += containers(v, (*here, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += containers(v, (*here, i))
    return out


def sweep_order(rule_ids: list[str], rules: Mapping[str, Rule]) -> list[str]:
    """Rules ordered by sweeps over `rule_ids`, each placing every rule whose dependencies
    among them are placed (quadratic: the definition the linear sorts are held to)."""
    local = set(rule_ids)
    placed: list[str] = []
    done: set[str] = set()
    while len(placed) < len(rule_ids):
        for rid in rule_ids:
            if rid not in done and all(d in done or d not in local for d in rules[rid].depends_on):
                placed.append(rid)
                done.add(rid)
    return placed


def reversed_chain(n: int, *, cycle: bool = False) -> dict[str, Any]:
    """One pass of `n` rules, each depending on the next one in the file (the worst case
    of a sweep: one rule per sweep); `cycle`: the last depends on the first."""
    rules: list[dict[str, Any]] = [
        {"id": f"r{i}", "depends_on": [f"r{i + 1}"] if i + 1 < n else []} for i in range(n)
    ]
    if cycle:
        rules[-1]["depends_on"] = ["r0"]
    return {"plan": "chain", "passes": [{"id": "only", "rules": rules}]}
