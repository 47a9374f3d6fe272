"""Mutants: deliberately broken engines, so that every invariant check is shown to fail.

A check that cannot fail proves nothing. Each mutant removes exactly one guarantee of the
engine by monkeypatching it inside a worker process, before the worker starts, and names
the invariant that should then break. The engine's own code paths never know about them:

    python -m chaos.mutants NAME [worker args...]

applies mutant NAME, then runs `engine.worker.main(worker args)`, so the runner starts a
mutated worker exactly like a normal one, with its argv prefixed. Each patch sits at the
narrowest seam the engine offers (a method of a core class, a module-level name the worker
looks up at start, the source of a Lua script before the store registers it) and fails
loudly if that seam is gone, rather than silently running the correct engine.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import orjson

import engine.worker
from chaos.checker import INVARIANTS
from engine.agent import FakeAgent
from engine.core import (
    AckRetry,
    Evaluation,
    Recovery,
    RuleState,
    SkipRules,
    Snapshot,
    classify,
)
from engine.plan import Plan
from engine.runtime import controller, orchestrator, store
from engine.runtime.broker import Broker
from engine.runtime.reevaluate import ReEvaluateUseCase

#: The invariants of the checker a mutant can name.
INVARIANT_NAMES = tuple(INVARIANTS)


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    description: str  # one line: the guarantee it removes
    breaks: str  # the invariant that should then fail
    patch: Callable[[], None]

    def apply(self) -> None:
        """Patch the engine in this process (once: a second call does nothing)."""
        if self.name not in _APPLIED:
            self.patch()
            _APPLIED.add(self.name)


_APPLIED: set[str] = set()


# --- Redis forgets -------------------------------------------------------------------------


def no_redis_results() -> None:
    """no_completed_rerun: only RabbitMQ remembers. `ReEvaluateUseCase` gives the core a
    snapshot without the stored results (and without the statuses of the rules that had
    one, which then look never run), so a resumed evaluation reruns its finished rules."""
    rebuild = ReEvaluateUseCase.rebuild

    def forgetful_rebuild(
        self: ReEvaluateUseCase, plan: Plan, attempt_id: str, snapshot: Snapshot, due: Any
    ) -> Evaluation:
        done = set(snapshot.results)
        statuses = {r: s for r, s in snapshot.statuses.items() if r not in done}
        blank = dataclasses.replace(snapshot, results={}, statuses=statuses)
        return rebuild(self, plan, attempt_id, blank, due)

    ReEvaluateUseCase.rebuild = forgetful_rebuild


def result_without_ttl() -> None:
    """state_keys_expire: rule results are written with a plain `SET NX`, without `EX`. The
    rest of the write script is unchanged (the first write still wins, the start counts
    still expire): the script source is replaced before `RedisStore.__init__` registers it."""
    with_ttl = "redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2])"
    if with_ttl not in store._WRITE_RESULT:
        raise RuntimeError("result_without_ttl: the result write script changed")
    store._WRITE_RESULT = store._WRITE_RESULT.replace(
        with_ttl, "redis.call('SET', KEYS[1], ARGV[1], 'NX')"
    )


def reset_attempts_on_recovery() -> None:
    """attempts_monotonic: recovery ignores `failed_attempt_N` and restarts a retrying rule
    at attempt 1. The rule still waits for its delayed retry (attempt N+1), and that message
    still resumes it, whether it rebuilds the evaluation (`due`) or reaches it in memory:
    the rule then runs as attempt 1 again, and the message is acked as usual."""
    init, retry_due = Evaluation.__init__, Evaluation.retry_due

    def forgetful_init(self: Evaluation, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._mutant_awaits = {}  # rule -> the attempt its retry message will carry
        for rid, (kind, _) in classify(self.plan, self.snapshot).items():
            if kind is Recovery.RETRYING:
                if self.state[rid] is RuleState.WAITING_RETRY:
                    self._mutant_awaits[rid] = self.attempt[rid]
                self.attempt[rid] = 1

    def lenient_retry_due(self: Evaluation, rule_id: str, attempt: int) -> list:
        if self._mutant_awaits.get(rule_id) != attempt or self.attempt.get(rule_id) != 1:
            return retry_due(self, rule_id, attempt)
        del self._mutant_awaits[rule_id]
        actions = retry_due(self, rule_id, 1)  # the message's attempt, as the core now counts
        if self._retry_tokens.get(rule_id) == 1:  # acked under the message's own attempt
            self._retry_tokens[rule_id] = attempt
        return [AckRetry(rule_id, attempt) if a == AckRetry(rule_id, 1) else a for a in actions]

    Evaluation.__init__ = forgetful_init
    Evaluation.retry_due = lenient_retry_due


# --- the hole after the ACK ----------------------------------------------------------------


def no_sweeper() -> None:
    """all_terminal: the seed's design as written. The worker's config always has
    `sweeper=False`, whatever flags and environment say, so an evaluation whose worker died
    after the ACK is never resumed."""
    config_from_args = engine.worker.config_from_args

    def without_sweeper(args: Any) -> Any:
        return dataclasses.replace(config_from_args(args), sweeper=False)

    engine.worker.config_from_args = without_sweeper


# --- the core's pruning --------------------------------------------------------------------


def prune_everything() -> None:
    """prune_only_dependents: a permanent failure skips every rule still pending, its
    dependents and the independent branches alike."""
    skip_dependents = Evaluation._skip_dependents

    def skip_every_pending(self: Evaluation, failed: list[str]) -> list:
        actions = skip_dependents(self, failed)
        rest = tuple(r for r in self.plan.order if self.state[r] is RuleState.PENDING)
        for rid in rest:
            self._move(rid, RuleState.SKIPPED)
        if rest:
            actions.append(SkipRules(rest, because_of=failed[0]))
        return actions

    Evaluation._skip_dependents = skip_every_pending


def prune_nothing() -> None:
    """prune_only_dependents: a permanently failed dependency counts as satisfied, so its
    dependents still run and nothing is skipped."""
    satisfied = (RuleState.SUCCEEDED, RuleState.PERMANENTLY_FAILED)

    def ready(self: Evaluation, rule_id: str) -> bool:
        return all(self.state[d] in satisfied for d in self.plan.rules[rule_id].depends_on)

    def skip_nothing(self: Evaluation, failed: list[str]) -> list:
        return []

    Evaluation._ready = ready
    Evaluation._skip_dependents = skip_nothing


# --- the agent -----------------------------------------------------------------------------


class _NondeterministicAgent(FakeAgent):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "nondeterministic": True})


def nondeterministic_agent() -> None:
    """idempotent_results: the worker's FakeAgent is built with `nondeterministic=True`, so
    a verdict also depends on a per-process salt and on (attempt, try, call): a rerun
    disagrees with the first run and with the fault-free reference."""
    engine.worker.FakeAgent = _NondeterministicAgent


# --- RabbitMQ ------------------------------------------------------------------------------


def per_message_ttl() -> None:
    """retry_delays_respected: every retry goes to one shared delay queue with a per-message
    TTL (the `expiration` property) instead of its tier's queue with a queue-level TTL.
    RabbitMQ expires messages only at the head of a queue, so a short retry waits behind a
    longer one. The shared queue still dead-letters to the work queue (the per-tier queues
    are still declared, and stay empty)."""
    declare = Broker.declare

    async def declare_shared(self: Broker) -> None:
        await declare(self)
        name = self.config.name("evaluation.retry.shared")
        await self._ch().declare_queue(
            name,
            durable=True,
            arguments={
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": self.work_queue_name,
            },
        )
        self.delay_queues = dict.fromkeys(self.delay_queues, name)

    async def publish_with_expiration(
        self: Broker, tier: int, bucket: int, body: dict[str, Any], message_id: str
    ) -> None:
        # The TTL the tier's queue would have had (see `Broker.declare`), on the message.
        ttl_ms = max(1, round(self.config.policy.delay_ms(tier, bucket) * self.config.time_scale))
        queue = self.delay_queues[(tier, bucket)]
        raw = orjson.dumps(body)
        await self._publish_raw(None, queue, raw, message_id, True, expiration_ms=ttl_ms)

    Broker.declare = declare_shared
    Broker.publish_retry = publish_with_expiration


def double_final_publish() -> None:
    """single_final_result: evaluation.completed is published twice, the second time with
    the same body (and the same flag, unindex and release after it). Both places that
    publish it, the orchestrator's finish and the controller's terminal redelivery, do."""
    publish_completed = orchestrator.publish_completed

    async def publish_twice(rt: Any, attempt_id: str, status: str, verdicts: dict) -> None:
        await publish_completed(rt, attempt_id, status, verdicts)
        await publish_completed(rt, attempt_id, status, verdicts)

    orchestrator.publish_completed = publish_twice
    controller.publish_completed = publish_twice


# --- the table -----------------------------------------------------------------------------


def _mutant(patch: Callable[[], None], breaks: str, description: str) -> Mutant:
    assert breaks in INVARIANT_NAMES, breaks
    return Mutant(patch.__name__, description, breaks, patch)


MUTANTS: dict[str, Mutant] = {
    m.name: m
    for m in (
        _mutant(
            no_redis_results,
            "no_completed_rerun",
            "recovery does not read rule results back: a resumed evaluation reruns finished rules",
        ),
        _mutant(
            no_sweeper,
            "all_terminal",
            "no sweeper, whatever the config: a crash after the ACK is never resumed",
        ),
        _mutant(
            prune_everything,
            "prune_only_dependents",
            "a permanent failure skips every pending rule, not only its dependents",
        ),
        _mutant(
            prune_nothing,
            "prune_only_dependents",
            "a permanently failed dependency counts as satisfied: its dependents still run",
        ),
        _mutant(
            nondeterministic_agent,
            "idempotent_results",
            "the fake agent's verdict changes from run to run and rerun to rerun",
        ),
        _mutant(
            reset_attempts_on_recovery,
            "attempts_monotonic",
            "recovery ignores failed_attempt_N: a retrying rule restarts at attempt 1",
        ),
        _mutant(
            per_message_ttl,
            "retry_delays_respected",
            "one delay queue with per-message TTLs: a short retry waits behind a longer one",
        ),
        _mutant(
            result_without_ttl,
            "state_keys_expire",
            "rule results are written without their TTL and never expire",
        ),
        _mutant(
            double_final_publish,
            "single_final_result",
            "evaluation.completed is published twice, with the same body",
        ),
    )
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    mutant = MUTANTS.get(args[0]) if args else None
    if mutant is None:
        problem = f"unknown mutant {args[0]!r}" if args else "no mutant given"
        names = ", ".join(MUTANTS)
        print(f"chaos.mutants: {problem}; valid: {names}", file=sys.stderr)
        return 2
    mutant.apply()
    return engine.worker.main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
