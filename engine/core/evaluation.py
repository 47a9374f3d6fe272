"""The decision core of one evaluation: rule states in, actions out.

No asyncio, no simpy, no clock, no I/O. The live runtime (`engine.runtime`) and the
simulator (`sim`) feed it the same inputs (a snapshot read from Redis, agent outcomes,
delayed retries coming due, a cancel) and carry out the actions it returns, so a bug
here is a bug in both, and neither shell can drift into testing another engine.

The rules it keeps, each a guarantee the checker proves on real histories:
1. A rule runs only when every dependency succeeded; at most `max_parallel` at once.
2. A rule with a result (in memory or loaded from Redis) is never run again.
3. Retry levels: a failed call is retried at once `immediate_retries` times (level 1);
   then `failed_attempt_N` is persisted and a delayed retry scheduled on tier N (level 2);
   attempt `max_attempts` failing is `permanently_failed` (level 3).
4. A permanent failure skips exactly its transitive dependents; every other rule goes on.
5. Attempt numbers only grow; a retry whose attempt is not the next one is stale.
6. A pass result is published once, when all its rules are terminal; `Finish` once.
7. After a cancel no rule starts and no retry fires.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from engine.core import dag
from engine.core.actions import (
    AckRetry,
    Action,
    Finish,
    Park,
    PersistResult,
    PersistStatus,
    PublishPassResult,
    Recovered,
    RunRule,
    ScheduleRetry,
    SkipRules,
)
from engine.core.recovery import Recovery, Snapshot, classify
from engine.core.results import RuleResult
from engine.core.states import (
    PERMANENTLY_FAILED,
    RULE_TRANSITIONS,
    TERMINAL_RULE_STATES,
    EvaluationStatus,
    RuleState,
    failed_attempt,
)
from engine.plan import Plan
from engine.policy import RetryPolicy

# The states as plain names: an enum member read through its class is a descriptor lookup
# each time, and `_advance` reads them for every rule of every input.
_PENDING = RuleState.PENDING
_RUNNING = RuleState.RUNNING
_WAITING = RuleState.WAITING_RETRY
_SUCCEEDED = RuleState.SUCCEEDED
_FAILED = RuleState.PERMANENTLY_FAILED
_SKIPPED = RuleState.SKIPPED
_RULE_STATES = tuple(RuleState)
_LOADED, _RETRYING, _RECOVERY_FAILED = Recovery.LOADED, Recovery.RETRYING, Recovery.FAILED
_EVALUATION_RUNNING = EvaluationStatus.RUNNING


class ProtocolError(RuntimeError):
    """The shell fed the core an input its state does not allow: a shell bug."""


class Evaluation:
    """One evaluation (`attemptId`) of a plan, rebuilt from what Redis remembers."""

    def __init__(
        self,
        plan: Plan,
        attempt_id: str,
        policy: RetryPolicy | None = None,
        *,
        snapshot: Snapshot | None = None,
        due: Mapping[str, int] | None = None,
        max_parallel: int = 4,
    ) -> None:
        if max_parallel < 1:
            raise ValueError("max_parallel must be >= 1")
        self.plan = plan
        self.attempt_id = attempt_id
        self.policy = policy or RetryPolicy()
        self.max_parallel = max_parallel
        self.snapshot = snapshot or Snapshot()
        self.status = EvaluationStatus.RUNNING
        self.state: dict[str, RuleState] = {}
        self.attempt: dict[str, int] = {}  # the attempt running or next to run
        self.tries: dict[str, int] = {}  # calls made in the current attempt
        self.results: dict[str, RuleResult] = {}
        self._retry_tokens: dict[str, int] = {}  # rule -> attempt a retry message asked for
        self._published: set[str] = set(self.snapshot.published_passes)
        self._started = False
        self._finished = False
        self._parked = False
        self._classification = classify(plan, self.snapshot)
        due = dict(due or {})
        unknown = sorted(set(due) - set(plan.rules)) if due else []
        if unknown:
            raise ProtocolError(f"due names unknown rule(s) {unknown}")
        for rid, (kind, n) in self._classification.items():
            self.tries[rid] = 0
            if kind is _LOADED:
                self.state[rid] = _SUCCEEDED
                self.results[rid] = self.snapshot.results[rid]
                self.attempt[rid] = self.results[rid].attempt
            elif kind is _RECOVERY_FAILED:
                self.state[rid] = _FAILED
                self.attempt[rid] = self.max_attempts(rid)
            elif kind is _RETRYING:
                self.attempt[rid] = n + 1
                if due.get(rid) == n + 1:
                    self.state[rid] = _PENDING
                    self._retry_tokens[rid] = n + 1
                else:
                    self.state[rid] = _WAITING
            else:
                self.state[rid] = _PENDING
                self.attempt[rid] = 1
        # A retry message that is not the next attempt of a waiting rule is stale: it is
        # acked at start (or cancel), exactly as `retry_due` acks one, never left unacked.
        self._stale_due = sorted((r, a) for r, a in due.items() if self._retry_tokens.get(r) != a)
        # Rules per state, kept by `_move`: `_advance` runs after every input and asks.
        self._count: dict[RuleState, int] = dict.fromkeys(_RULE_STATES, 0)
        for st in self.state.values():
            self._count[st] += 1
        # Rules of each pass not terminal yet, kept by `_move` too: a pass is announced when
        # its count reaches 0, without looking at its rules again at every input.
        self._passes_of: dict[str, list[str]] = {rid: [] for rid in self.state}
        self._open: dict[str, int] = {}
        for p in plan.passes:
            self._open[p.id] = 0
            for rid in p.rule_ids:
                self._passes_of[rid].append(p.id)
                if self.state[rid] not in TERMINAL_RULE_STATES:
                    self._open[p.id] += 1
        # Terminal rules when the passes were last looked at: a terminal state is never
        # left, so a pass can only become announceable when this count grows.
        self._terminal_seen = -1
        # The pending rules that may be ready, as places in `plan.order` (a heap: `_advance`
        # takes them in plan order): every pending rule at first, then each rule made
        # pending and the pending dependents of each rule that moved. A pending rule found
        # not ready leaves until one of its dependencies moves (readiness is a matter of
        # their states), so a decision looks at what may have changed, not at every rule:
        # a 5,000-rule chain was quadratic.
        self._maybe = [i for i, rid in enumerate(plan.order) if self.state[rid] is _PENDING]
        self._queued = set(self._maybe)

    # --- queries --------------------------------------------------------------------------

    def max_attempts(self, rule_id: str) -> int:
        return self.plan.rules[rule_id].max_attempts or self.policy.max_attempts

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def parked(self) -> bool:
        return self._parked

    def rules_in(self, *states: RuleState) -> list[str]:
        return [rid for rid in self.plan.order if self.state[rid] in states]

    # --- inputs ---------------------------------------------------------------------------

    def start(self) -> list[Action]:
        """First actions after (re)delivery: what was recovered, then what runs now."""
        if self._started:
            raise ProtocolError("start() called twice")
        self._started = True
        actions: list[Action] = []
        if not self.snapshot.empty:
            by_kind: dict[Recovery, list[str]] = {k: [] for k in Recovery}
            for rid, (kind, _) in self._classification.items():
                by_kind[kind].append(rid)
            actions.append(
                Recovered(
                    loaded=tuple(by_kind[Recovery.LOADED]),
                    retrying={r: self._classification[r][1] for r in by_kind[Recovery.RETRYING]},
                    failed=tuple(by_kind[Recovery.FAILED]),
                    fresh=tuple(by_kind[Recovery.FRESH]),
                )
            )
        actions.extend(self._ack_stale_due())
        if self._count[_FAILED]:
            actions.extend(self._skip_dependents(self.rules_in(_FAILED)))
        actions.extend(self._advance())
        return actions

    def rule_succeeded(self, rule_id: str, result: RuleResult) -> list[Action]:
        self._expect(rule_id, _RUNNING)
        self._move(rule_id, _SUCCEEDED)
        self.results[rule_id] = result
        actions: list[Action] = [PersistResult(rule_id, result)]
        if self._retry_tokens:
            actions.extend(self._ack_token(rule_id))
        actions.extend(self._advance())
        return actions

    def result_kept(self, rule_id: str, kept: RuleResult) -> None:
        """Another write of `rule_id`'s result came first (a retried script met its own
        write, a late writer won): the stored one is the rule's from now on."""
        if rule_id not in self.state:
            raise ProtocolError(f"unknown rule {rule_id!r}")
        self.results[rule_id] = kept

    def announced(self, verdicts: Mapping[str, str]) -> dict[str, str]:
        """What to announce of verdicts computed earlier (a `PublishPassResult`'s or a
        `Finish`'s, made in the same turn as a result write that then lost): each rule's
        verdict as it stands now, the kept one after `result_kept`."""
        results = self.results
        return {r: results[r].verdict if r in results else v for r, v in verdicts.items()}

    def stored_verdicts(self) -> dict[str, str]:
        """The verdicts of a terminal evaluation as its `Finish` announced them, read back
        from the snapshot this core was rebuilt from: each rule's result's verdict, else
        `permanently_failed`, else `skipped` (a dependent of one), by `_verdicts` as the
        `Finish` had them. An announcement made again (its announcer died between the
        final write and the publish) carries the first one's body, not the results alone.
        A cancel's rules that were running read back `pending`."""
        if self._count[_FAILED]:
            self._skip_dependents(self.rules_in(_FAILED))
        return self._verdicts()

    def rule_failed(self, rule_id: str, error: str, *, retryable: bool = True) -> list[Action]:
        """An agent call failed. Retry now, later, or give up: the three levels."""
        self._expect(rule_id, RuleState.RUNNING)
        if self.status is EvaluationStatus.CANCELLED:
            self._move(rule_id, RuleState.PENDING)
            return self._ack_token(rule_id)
        attempt = self.attempt[rule_id]
        if retryable and self.tries[rule_id] <= self.policy.immediate_retries:
            self.tries[rule_id] += 1
            self._move(rule_id, RuleState.RUNNING)
            return [RunRule(rule_id, attempt, self.tries[rule_id])]
        actions: list[Action] = []
        if retryable and attempt < self.max_attempts(rule_id):
            tier = self.policy.tier_for(attempt)
            bucket = self.policy.bucket_for(self.attempt_id, rule_id, attempt)
            delay = self.policy.delay_ms(tier, bucket)
            self._move(rule_id, RuleState.WAITING_RETRY)
            self.attempt[rule_id] = attempt + 1
            self.tries[rule_id] = 0
            actions.append(PersistStatus(rule_id, failed_attempt(attempt), error, delay))
            actions.append(ScheduleRetry(rule_id, attempt + 1, tier, bucket, delay))
            actions.extend(self._ack_token(rule_id))
        else:
            self._move(rule_id, RuleState.PERMANENTLY_FAILED)
            actions.append(PersistStatus(rule_id, PERMANENTLY_FAILED, error))
            actions.extend(self._ack_token(rule_id))
            actions.extend(self._skip_dependents([rule_id]))
        actions.extend(self._advance())
        return actions

    def retry_due(self, rule_id: str, attempt: int) -> list[Action]:
        """A delayed retry message arrived. A stale or duplicate one is acked and dropped."""
        if rule_id not in self.state:
            raise ProtocolError(f"unknown rule {rule_id!r}")
        fresh = (
            self.status is EvaluationStatus.RUNNING
            and self.state[rule_id] is RuleState.WAITING_RETRY
            and self.attempt[rule_id] == attempt
        )
        if not fresh:
            return [AckRetry(rule_id, attempt)]
        self._move(rule_id, RuleState.PENDING)
        self._retry_tokens[rule_id] = attempt
        self._parked = False
        if not self._started:  # like `due`: start() runs it, after Recovered and the skips
            return []
        return self._advance()

    def cancel(self) -> list[Action]:
        """`cancelled` is terminal: nothing starts after it, retries that arrive are dropped."""
        if self._finished:
            return []
        self.status = EvaluationStatus.CANCELLED
        self._finished = True
        actions: list[Action] = self._ack_stale_due()
        actions.extend(AckRetry(r, a) for r, a in sorted(self._retry_tokens.items()))
        self._retry_tokens.clear()
        actions.append(Finish(EvaluationStatus.CANCELLED, self._verdicts()))
        return actions

    # --- the rules ------------------------------------------------------------------------

    def _advance(self) -> list[Action]:
        if self._finished or self.status is not _EVALUATION_RUNNING:
            return []
        actions: list[Action] = []
        count = self._count
        if count[_PENDING] and count[_RUNNING] < self.max_parallel:
            plan, state, ready = self.plan, self.state, dag.ready
            order, maybe, queued = plan.order, self._maybe, self._queued
            while maybe and count[_RUNNING] < self.max_parallel:
                i = heapq.heappop(maybe)
                queued.discard(i)
                rid = order[i]
                if state[rid] is _PENDING and ready(plan, state, rid):
                    self._move(rid, _RUNNING)
                    self.tries[rid] = 1
                    actions.append(RunRule(rid, self.attempt[rid], 1))
        terminal = count[_SUCCEEDED] + count[_FAILED] + count[_SKIPPED]
        if terminal != self._terminal_seen:  # a rule became terminal: a pass may be done
            self._terminal_seen = terminal
            for p in self.plan.passes:
                if p.id in self._published:
                    continue
                if not self._open[p.id]:  # every rule of the pass is terminal
                    self._published.add(p.id)
                    outcome = dag.pass_outcome(p, self.state)
                    actions.append(
                        PublishPassResult(p.id, outcome, {r: self._verdict(r) for r in p.rule_ids})
                    )
        rules, succeeded = len(self.state), count[_SUCCEEDED]
        if terminal == rules:
            self._finished = True
            if succeeded == rules:
                self.status = EvaluationStatus.COMPLETED
            elif succeeded:
                self.status = EvaluationStatus.PARTIAL
            else:
                self.status = EvaluationStatus.FAILED
            actions.append(Finish(self.status, self._verdicts()))
        elif not count[_RUNNING] and not self._parked:
            # Nothing in flight and nothing startable (a ready rule would have started
            # above): only delayed retries are left, even if dependents of them are pending.
            self._parked = True
            actions.append(
                Park({r: self.attempt[r] for r in self.rules_in(RuleState.WAITING_RETRY)})
            )
        return actions

    def _skip_dependents(self, failed: list[str]) -> list[Action]:
        actions: list[Action] = []
        for rid in failed:
            skipped = dag.pruned(self.plan, self.state, rid)
            for r in skipped:
                self._move(r, RuleState.SKIPPED)
            if skipped:
                actions.append(SkipRules(skipped, because_of=rid))
        return actions

    def _ack_stale_due(self) -> list[Action]:
        stale, self._stale_due = self._stale_due, []
        return [AckRetry(r, a) for r, a in stale]

    def _ack_token(self, rule_id: str) -> list[Action]:
        token = self._retry_tokens.pop(rule_id, None)
        return [] if token is None else [AckRetry(rule_id, token)]

    def _verdict(self, rule_id: str) -> str:
        if rule_id in self.results:
            return self.results[rule_id].verdict
        return self.state[rule_id].value

    def _verdicts(self) -> dict[str, str]:
        return {r: self._verdict(r) for r in self.plan.order}

    def _expect(self, rule_id: str, state: RuleState) -> None:
        if rule_id not in self.state:
            raise ProtocolError(f"unknown rule {rule_id!r}")
        if self.state[rule_id] is not state:
            raise ProtocolError(
                f"rule {rule_id!r} is {self.state[rule_id].value}, expected {state.value}"
            )

    def _move(self, rule_id: str, to: RuleState) -> None:
        here = self.state[rule_id]
        if to not in RULE_TRANSITIONS[here]:
            raise ProtocolError(f"rule {rule_id!r}: {here.value} -> {to.value} is not allowed")
        self.state[rule_id] = to
        self._count[here] -= 1
        self._count[to] += 1
        if to is _PENDING:
            self._offer(rule_id)
        state = self.state
        for d in self.plan.dependents(rule_id):
            if state[d] is _PENDING:
                self._offer(d)
        if to in TERMINAL_RULE_STATES:  # entered once: a terminal state has no way out
            for pass_id in self._passes_of[rule_id]:
                self._open[pass_id] -= 1

    def _offer(self, rule_id: str) -> None:
        """`rule_id` may be ready now: `_advance` looks at it again."""
        i = self.plan.position[rule_id]
        if i not in self._queued:
            self._queued.add(i)
            heapq.heappush(self._maybe, i)
