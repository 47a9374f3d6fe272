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

import asyncio
import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import orjson

import engine.worker
from chaos.checker import INVARIANTS
from engine.agent import AgentError, FakeAgent
from engine.config import EngineConfig
from engine.core import (
    AckRetry,
    Evaluation,
    Recovery,
    RuleState,
    RunRule,
    Snapshot,
    classify,
    dag,
)
from engine.history import FileHistory
from engine.plan import Plan
from engine.policy import RetryPolicy
from engine.runtime import store
from engine.runtime.broker import Broker
from engine.runtime.drive import drive
from engine.shell import controller, heartbeat, orchestrator
from engine.shell import sweeper as shell_sweeper
from engine.shell.controller import EvaluationController
from engine.shell.effects import (
    CallAgent,
    Failpoint,
    PublishEvent,
    Record,
    Settle,
    Sleep,
    Step,
    Stepper,
    Store,
)
from engine.shell.reevaluate import ReEvaluateUseCase

#: The invariants of the checker a mutant can name.
INVARIANT_NAMES = tuple(INVARIANTS)


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    description: str  # one line: the guarantee it removes
    breaks: str  # the invariant that should then fail
    patch: Callable[[], None]
    #: The system under test whose part it breaks (`chaos.systems`; None: the shell or the
    #: core, which every design runs): a store's script or function breaks its design only;
    #: a memory's name (`rabbitmq`) each design that has it (`engine.config.SYSTEMS`).
    system: str | None = None

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


def overwrite_result() -> None:
    """idempotent_results: rule results are written blind, with a plain `SET ... EX` instead
    of `SET NX` and past the fence, so the last write wins and every write reports that it
    won. A late write by an execution that lost its lease (a frozen worker waking up in the
    write window) then replaces the result the owner wrote and announced first. The rest of
    the script is unchanged: the source is replaced before `RedisStore.__init__` registers
    it."""
    first_wins = "redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2])"
    refused = f"if other then return {{'{store.FENCED}', other}} end"
    if first_wins not in store._WRITE_RESULT or refused not in store._WRITE_RESULT:
        raise RuntimeError("overwrite_result: the result write script changed")
    store._WRITE_RESULT = store._WRITE_RESULT.replace(
        first_wins, "redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])"
    ).replace(refused, "")


def reset_attempts_on_recovery() -> None:
    """attempts_monotonic: recovery ignores `failed_attempt_N` and restarts a retrying rule
    at attempt 1. The rule still waits for its delayed retry (attempt N+1), and that message
    still resumes it, whether it rebuilds the evaluation (`due`) or reaches it in memory:
    the rule then runs as attempt 1 again, and the message is acked as usual (its
    `AckRetry` names the attempt the message carries)."""
    init, retry_due = Evaluation.__init__, Evaluation.retry_due

    def forgetful_init(self: Evaluation, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._mutant_awaits = {}  # rule -> the attempt its retry message will carry
        self._mutant_acks = {}  # rule -> the attempt of the message its attempt 1 holds
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
        if AckRetry(rule_id, 1) not in actions:  # taken: acked with attempt 1's outcome
            self._mutant_acks[rule_id] = attempt
        return [AckRetry(rule_id, attempt) if a == AckRetry(rule_id, 1) else a for a in actions]

    def acking_as_sent(method: Callable[..., list]) -> Callable[..., list]:
        def acting(self: Evaluation, *args: Any, **kwargs: Any) -> list:
            actions = method(self, *args, **kwargs)
            acks = self._mutant_acks
            for i, a in enumerate(actions):
                if isinstance(a, AckRetry) and a.attempt == 1 and a.rule_id in acks:
                    actions[i] = AckRetry(a.rule_id, acks.pop(a.rule_id))
            return actions

        return acting

    Evaluation.__init__ = forgetful_init
    Evaluation.retry_due = lenient_retry_due
    for name in ("start", "rule_succeeded", "rule_failed", "cancel"):
        setattr(Evaluation, name, acking_as_sent(getattr(Evaluation, name)))


# --- the hole after the ACK ----------------------------------------------------------------


def no_sweeper() -> None:
    """all_terminal: the seed's design as written. Every `EngineConfig` has `sweeper=False`
    (the worker's own, whatever its flags and environment say), so an evaluation whose
    worker died after the ACK is never resumed."""
    init = EngineConfig.__init__

    def without_sweeper(self: EngineConfig, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        object.__setattr__(self, "sweeper", False)

    EngineConfig.__init__ = without_sweeper  # type: ignore[method-assign]


def no_wait() -> None:
    """no_completed_rerun: Redis behind Sentinel without the engine's answer to its
    asynchronous replication. Every `EngineConfig` has `wait_replicas=0`, so a write the
    primary acknowledged counts as done before the replica holds it, and a failover that
    loses it makes a resumed evaluation run the finished rule again."""
    init = EngineConfig.__init__

    def without_wait(self: EngineConfig, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        object.__setattr__(self, "wait_replicas", 0)

    EngineConfig.__init__ = without_wait  # type: ignore[method-assign]


def no_restore() -> None:
    """matches_reference: the owner announces what it holds in memory without making sure
    Redis holds it too. `_confirm_final` hands `finish` no results and no permanent
    failures to write back, so after a failover (or a lossy restart) that lost results the
    owner had been told were written, the final state names rules Redis no longer has."""

    def without_restore(self: Any, action: Any, again: bool = False) -> Step:
        kept, _ = yield Store("finish", (self.attempt_id, action.status.value, {}, [], self.fence))
        return kept

    orchestrator.PassExecutionOrchestrator._confirm_final = without_restore  # type: ignore[method-assign]


def unmitigated() -> None:
    """no_completed_rerun: behind Sentinel with neither of the engine's answers to lost
    acknowledged writes (no WAIT, nothing restored before the announcement): what no_wait
    breaks, and an owner that lives on announces results Redis lost (matches_reference,
    sentinel_paused_primary in tests/test_sim_sentinel.py)."""
    no_wait()
    no_restore()


# --- the shared shell (engine.shell): one patch, live and in the simulator ---------------------


def sweep_wrong_attempt() -> None:
    """all_terminal: the sweeper re-publishes a lost retry for the attempt that failed, not
    the next one. The patch is of `engine.shell.sweeper.sweep`, the step both shells run, so
    it is applied the same way live and in the simulator."""
    from engine.shell import sweeper
    from engine.shell.effects import PublishWork

    sweep = sweeper.sweep

    def stale_attempt(config: Any, held: Any) -> Any:
        step = sweep(config, held)
        reply = None
        while True:
            try:
                effect = step.send(reply)
            except StopIteration as done:
                return done.value
            if isinstance(effect, PublishWork) and effect.body.get("type") == "retry":
                body = {**effect.body, "attempt": effect.body["attempt"] - 1}
                effect = PublishWork(body, effect.message_id)
            reply = yield effect

    sweeper.sweep = stale_attempt


# --- the core's pruning --------------------------------------------------------------------


def prune_everything() -> None:
    """prune_only_dependents: a permanent failure skips every rule still pending, its
    dependents and the independent branches alike (`engine.core.dag.pruned`)."""

    def every_pending(plan: Plan, state: Any, failed: str) -> tuple[str, ...]:
        return tuple(r for r in plan.order if state[r] is RuleState.PENDING)

    dag.pruned = every_pending


def prune_nothing() -> None:
    """prune_only_dependents: a permanently failed dependency counts as satisfied
    (`engine.core.dag.ready`), so its dependents still run and nothing is pruned."""
    satisfied = (RuleState.SUCCEEDED, RuleState.PERMANENTLY_FAILED)

    def ready(plan: Plan, state: Any, rule_id: str) -> bool:
        return all(state[d] in satisfied for d in plan.rules[rule_id].depends_on)

    dag.ready = ready
    dag.pruned = lambda plan, state, failed: ()


# --- the agent -----------------------------------------------------------------------------


def nondeterministic_agent() -> None:
    """idempotent_results: every FakeAgent is built with `nondeterministic=True`, so a
    verdict also depends on its process's salt and on (attempt, try, call): a rerun
    disagrees with the first run and with the fault-free reference."""
    init = FakeAgent.__init__

    def salted(self: FakeAgent, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **{**kwargs, "nondeterministic": True})

    FakeAgent.__init__ = salted  # type: ignore[method-assign]


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
    publish it, the orchestrator's finish and the controller's terminal redelivery, look it
    up in `engine.shell.orchestrator`."""
    publish_completed = orchestrator.publish_completed

    def publish_twice(*args: Any, **kwargs: Any) -> Step:
        yield from publish_completed(*args, **kwargs)
        return (yield from publish_completed(*args, **kwargs))

    orchestrator.publish_completed = publish_twice


# --- the core's graph and retry levels ----------------------------------------------------


def ignore_dag() -> None:
    """dag_order: every rule is ready at once, whatever its dependencies
    (`engine.core.dag.ready` answers yes), so a dependent starts beside the rules it
    depends on, before their results exist. Pruning is unchanged: a dependent still
    pending when a dependency fails for good is skipped."""
    dag.ready = lambda plan, state, rule_id: True


def no_immediate_retries() -> None:
    """retry_budget: level 1 is gone. The core's policy has `immediate_retries` 0 whatever
    the config says, so the first transient failure of an attempt writes `failed_attempt_N`
    and schedules a delayed retry (or gives up, at the last attempt). The worker's other
    settings, and the agent's numbering of calls, are unchanged."""
    init = Evaluation.__init__

    def without_level_1(self: Evaluation, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.policy = dataclasses.replace(self.policy, immediate_retries=0)

    Evaluation.__init__ = without_level_1


def give_up_early() -> None:
    """retry_budget: the last attempt is never made: `Evaluation.max_attempts` answers one
    less than the plan or the policy says (at least 1), so a rule whose attempt
    `max_attempts - 1` fails is written `permanently_failed`."""
    max_attempts = Evaluation.max_attempts

    def one_less(self: Evaluation, rule_id: str) -> int:
        return max(1, max_attempts(self, rule_id) - 1)

    Evaluation.max_attempts = one_less


def slow_tier() -> None:
    """retry_delays_respected: the retry after `failed_attempt_N` goes to the tier after the
    one the policy gives (the last tier stays the last): `RetryPolicy.tier_for` answers one
    tier more, so the core publishes it to the longer tier's queue with that tier's delay
    (and the retries index agrees)."""
    tier_for = RetryPolicy.tier_for

    def one_tier_later(self: RetryPolicy, failed_attempt: int) -> int:
        return min(tier_for(self, failed_attempt) + 1, len(self.tiers_ms) - 1)

    RetryPolicy.tier_for = one_tier_later


def ignore_rule_max_attempts() -> None:
    """matches_reference: a plan's per-rule `max_attempts` is ignored: `Evaluation.max_attempts`
    answers the policy's number for every rule, so a rule the plan lets retry longer ends
    permanently failed (and prunes its dependents), and one it gives fewer attempts is
    retried past them. The reference reads the plan with the checker's own code, so it
    does not move with the engine."""

    def policy_only(self: Evaluation, rule_id: str) -> int:
        return self.policy.max_attempts

    Evaluation.max_attempts = policy_only


def forget_permanent_failure() -> None:
    """attempts_monotonic: recovery forgets a permanent failure. `ReEvaluateUseCase` gives
    the core a snapshot without its `permanently_failed` statuses, so a resumed evaluation
    takes a rule given up on for one never run, and runs it again from attempt 1."""
    rebuild = ReEvaluateUseCase.rebuild

    def forgetful_rebuild(
        self: ReEvaluateUseCase, plan: Plan, attempt_id: str, snapshot: Snapshot, due: Any
    ) -> Evaluation:
        statuses = {r: s for r, s in snapshot.statuses.items() if s != "permanently_failed"}
        blank = dataclasses.replace(snapshot, statuses=statuses)
        return rebuild(self, plan, attempt_id, blank, due)

    ReEvaluateUseCase.rebuild = forgetful_rebuild


#: How long `hold_due_retry` holds a due retry back, in engine ms (scaled by time_scale):
#: half the 100 s of slack the check used to allow, so that only a proof catches it.
HOLD_DUE_RETRY_MS = 50_000


def hold_due_retry() -> None:
    """retry_delays_respected: a due retry is held back for nothing. Each delayed retry's
    rule, once its slot is granted, waits `HOLD_DUE_RETRY_MS` (engine time) before its
    first call: no slot was busy, nothing was resumed, no fault was open."""
    run_rule = orchestrator.PassExecutionOrchestrator._run_rule

    def held_back(
        self: orchestrator.PassExecutionOrchestrator, action: Any, execution: int
    ) -> Step:
        if action.attempt >= 2 and action.try_no == 1:
            yield Sleep(HOLD_DUE_RETRY_MS * self.config.time_scale / 1000)
        yield from run_rule(self, action, execution)

    orchestrator.PassExecutionOrchestrator._run_rule = held_back


def try_made_twice() -> None:
    """retry_budget: the shell makes a failed call again itself before the core hears of
    it: an attempt's first immediate retry (try 2), failed and retryable, is made once more
    (its `rule_started` recorded again: the same try number, the same execution), so the
    attempt makes one call more than `immediate_retries + 1`, with no fault between."""
    run_rule = orchestrator.PassExecutionOrchestrator._run_rule

    def once_more(
        self: orchestrator.PassExecutionOrchestrator, action: Any, execution: int
    ) -> Step:
        inner = run_rule(self, action, execution)
        started: Record | None = None
        again = action.try_no == 2
        reply: Any = None
        error: BaseException | None = None
        while True:
            try:
                effect = inner.send(reply) if error is None else inner.throw(error)
            except StopIteration as stop:
                return stop.value
            if isinstance(effect, Record) and effect.event == "rule_started":
                started = effect
            while True:  # the effect, and once the failed call made again
                try:
                    reply, error = (yield effect), None
                except GeneratorExit:
                    inner.close()
                    raise
                except BaseException as exc:
                    reply, error = None, exc
                redo = again and started is not None and isinstance(effect, CallAgent)
                if not (redo and isinstance(error, AgentError) and error.retryable):
                    break
                again = False
                yield started

    orchestrator.PassExecutionOrchestrator._run_rule = once_more


# --- the history ---------------------------------------------------------------------------

#: `drop_history_events` loses every DROP_EVERY-th event a worker records.
DROP_EVERY = 7


def history_drops(seq: int) -> bool:
    """Whether `drop_history_events` loses the event a worker numbers `seq` (the simulator
    asks the same)."""
    return seq % DROP_EVERY == 0


def drop_history_events() -> None:
    """history_complete: the worker's history writer loses every 7th event it records,
    still counting it: `FileHistory.record` advances `seq` and writes nothing, so the
    source's numbering has a gap where the event was."""
    record = FileHistory.record

    def lossy_record(self: FileHistory, ev: str, **fields: Any) -> None:
        if history_drops(self._seq + 1):
            self._seq += 1
            return
        record(self, ev, **fields)

    FileHistory.record = lossy_record


# --- cancels, announcements, indexes and leases ---------------------------------------------


def start_after_cancel() -> None:
    """cancel_respected: the owner ignores a cancel. The broadcast reaches its controller
    (`cancel_received`) but the orchestrator's `cancel` does nothing, and the terminal state
    its writes read back from Redis is not looked at (no `cancel_seen`): it goes on starting
    rules and scheduling retries to the end, then loses the final state to the cancel's."""
    owner = orchestrator.PassExecutionOrchestrator
    look = owner._look

    def blind_look(self: Any, over: str | None) -> None:
        look(self, None)
        if over is not None:  # the store counted none of these starts: none to mark
            self._starts = []

    def deaf_cancel(self: Any) -> None:
        return None

    owner._look = blind_look  # type: ignore[method-assign]
    owner.cancel = deaf_cancel  # type: ignore[method-assign]


def spurious_cancel() -> None:
    """cancel_respected: a cancel broadcast cancels every evaluation the worker holds, not
    only the one it names: the others end `cancelled` (their owner writes and announces it)
    although nobody cancelled them."""
    on_cancel = EvaluationController._on_cancel

    def cancel_all(self: EvaluationController, attempt_id: str, delivery: Any) -> Step:
        others = [o for a, o in self.evaluations.items() if a != attempt_id]
        yield from on_cancel(self, attempt_id, delivery)
        for orch in others:
            orch.cancel()

    EvaluationController._on_cancel = cancel_all  # type: ignore[method-assign]


def all_passes_complete() -> None:
    """pass_results_correct: every pass is announced `complete`, whatever it lost
    (`engine.core.dag.pass_outcome`), even when a rule of the pass failed for good or was
    skipped (its rules and their verdicts are unchanged)."""
    dag.pass_outcome = lambda p, state: "complete"


class _Unkept(set[str]):
    """A set that keeps nothing added to it (what was there at the start stays)."""

    def add(self, item: str) -> None:
        pass


def pass_announced_again() -> None:
    """pass_results_correct: the core forgets which passes it announced (`_published`
    keeps only those the snapshot said were): each finished pass is announced again, by
    the same process, whenever another of the evaluation's rules ends."""
    init = Evaluation.__init__

    def forgetting(self: Evaluation, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._published = _Unkept(self._published)

    Evaluation.__init__ = forgetting


#: What `_rewritten`'s change returns for an effect to drop (the step gets None back, as
#: from an effect carried out).
_DROP = object()


def _rewritten(step: Step, change: Callable[[Any], Any]) -> Step:
    """`step`, each effect passed through `change` on its way out: what `change` returns
    goes out in its place (`_DROP`: nothing does)."""
    stepper = Stepper(step)
    while (effect := stepper.next()) is not None:
        effect = change(effect)
        if effect is _DROP:
            stepper.reply(None)
            continue
        try:
            stepper.reply((yield effect))
        except BaseException as exc:
            stepper.fail(exc)
    return stepper.value


def _unannounced(routing_key: str) -> Callable[[Any], Any]:
    """A change for `_rewritten`: the events of `routing_key` are never sent, published
    (dropped) or riding a store operation (an outbox's: the operation goes without it)."""

    def drop(effect: Any) -> Any:
        if isinstance(effect, PublishEvent) and effect.routing_key == routing_key:
            return _DROP
        riding = effect.event if isinstance(effect, Store) else None
        if riding is not None and riding.routing_key == routing_key:
            return Store(effect.op, effect.args)
        return effect

    return drop


def _without_completed(step: Step) -> Step:
    """`step`, its `evaluation.completed` dropped on the way out (as sent)."""
    return (yield from _rewritten(step, _unannounced("evaluation.completed")))


def no_completed_event() -> None:
    """completed_delivered: `evaluation.completed` is never published. Everything around it
    happens as usual (the flag in Redis, the indexes, the lease, `final_published` in the
    history): the engine believes it announced the result, and no consumer ever hears.
    Where the final state's transaction writes it (an outbox), that write goes without it."""
    publish_completed = orchestrator.publish_completed
    confirm_final = orchestrator.PassExecutionOrchestrator._confirm_final

    def publish_nothing(*args: Any, **kwargs: Any) -> Step:
        return (yield from _without_completed(publish_completed(*args, **kwargs)))

    def confirm_unannounced(self: Any, *args: Any, **kwargs: Any) -> Step:
        return (yield from _without_completed(confirm_final(self, *args, **kwargs)))

    orchestrator.publish_completed = publish_nothing
    orchestrator.PassExecutionOrchestrator._confirm_final = confirm_unannounced  # type: ignore[method-assign]


#: What takes an evaluation out of the running index, by script: `leak_running_index`
#: removes each (a terminal evaluation is the only one these lines ever remove).
_RUNNING_UNINDEX = {
    "_DONE": "redis.call('ZREM', KEYS[2], ARGV[2])\n",
    "_BEGIN": "  if published ~= '' then redis.call('ZREM', KEYS[5], ARGV[6]) end\n",
    "_UNINDEX": "redis.call('ZREM', KEYS[1], ARGV[1])\n",
    "_CLAIM_STALE": "  redis.call('ZREM', KEYS[1], ARGV[1])\n",
}


def leak_running_index() -> None:
    """quiet_state: a terminal evaluation is left in the running index. No script takes it
    out any more: not the owner's `done` once it is announced, not `unindex` (another final
    state won), not `begin` nor the sweeper's claim when they meet it announced (the claim
    still declines it, so it is never re-swept: it only stays). The sources are edited
    before `RedisStore.__init__` registers them."""
    for name, line in _RUNNING_UNINDEX.items():
        source = getattr(store, name)
        if source.count(line) != 1:
            raise RuntimeError(f"leak_running_index: the script {name} changed")
        setattr(store, name, source.replace(line, ""))


#: The line of the `done` script that gives the announcer's lease back.
_DONE_RELEASE = "if redis.call('GET', KEYS[3]) == ARGV[3] then redis.call('DEL', KEYS[3]) end\n"


def done_keeps_lease() -> None:
    """quiet_state: `done` flags the evaluation announced and takes it out of the indexes,
    but keeps the announcer's lease: a finished evaluation stays leased to a living worker
    until the lease expires, and a sweeper or a delivery that meets it meanwhile finds it
    held. The source is edited before `RedisStore.__init__` registers it."""
    if store._DONE.count(_DONE_RELEASE) != 1:
        raise RuntimeError("done_keeps_lease: the done script changed")
    store._DONE = store._DONE.replace(_DONE_RELEASE, "")


#: `needless_rerun`: the renewal (counted per evaluation and worker) that gives the lease up.
GIVE_UP_AT_RENEWAL = 2


def needless_rerun() -> None:
    """reruns_explained: the worker gives up a lease it holds. The second renewal of each
    evaluation reports the lease lost although Redis renewed it, so the heartbeat abandons
    the evaluation (its lease released, its deliveries handed back); the sweeper resumes it
    once its stamp is stale and the rules that were in flight run again, with no fault to
    explain it. Once per evaluation and process, so the run still ends."""
    renew = store.RedisStore.renew
    renewals: dict[str, int] = {}

    async def careless_renew(self: store.RedisStore, attempt_ids: Any, me: str) -> dict[str, bool]:
        held = await renew(self, attempt_ids, me)
        for a, ours in held.items():
            renewals[a] = renewals.get(a, 0) + 1
            if ours and renewals[a] == GIVE_UP_AT_RENEWAL:
                held[a] = False
        return held

    store.RedisStore.renew = careless_renew


def ignore_lease() -> None:
    """reruns_explained: `begin` ignores the lease. A delivery for an evaluation another live
    worker owns (a retry, a redelivered copy) no longer finds it held, and is not forwarded:
    the worker takes the lease and runs the evaluation beside its owner, rerunning the rules
    the owner has in flight. The source is edited before `RedisStore.__init__` registers it."""
    check = "if cur and cur ~= ARGV[1] then return {'held', cur} end\n"
    if store._BEGIN.count(check) != 1:
        raise RuntimeError("ignore_lease: the begin script changed")
    store._BEGIN = store._BEGIN.replace(check, "")


def no_fencing() -> None:
    """no_completed_rerun: the owner's writes carry no fence token, and it starts rules on
    whatever its last write allowed however long ago that was, so a worker that lost its
    lease (frozen past it, then awake) still writes results and start markers, and starts
    rules its successor has finished, until its next heartbeat notices. The heartbeat
    itself still judges by the token."""
    fence = store.RedisStore._fence

    def unfenced(self: store.RedisStore, attempt_id: str, token: str | None) -> Any:
        return fence(self, attempt_id, None)

    store.RedisStore._fence = unfenced  # type: ignore[method-assign]
    orchestrator.PassExecutionOrchestrator._lease_short = lambda self, now: False  # type: ignore[method-assign]


def results_only_reannounced() -> None:
    """completed_delivered: an evaluation announced again (its announcer died between the
    final write and the publish) is announced with the verdicts of its stored results
    only, as before issue 25's fix: its permanently failed rules and their skipped
    dependents are missing, so one message id carries another body than the first. On an
    outbox (`pg`) the final state's own transaction announces it: nothing is announced
    again."""
    if not hasattr(Evaluation, "stored_verdicts"):
        raise RuntimeError("results_only_reannounced: Evaluation.stored_verdicts is gone")

    def results_only(self: Evaluation) -> dict[str, str]:
        return {r: v.verdict for r, v in self.snapshot.results.items()}

    Evaluation.stored_verdicts = results_only  # type: ignore[method-assign]


def old_close_order() -> None:
    """reruns_explained: a stopping worker hands its evaluations back while it still
    consumes (the close order before issue 25): it abandons them (their held retries
    requeued, their leases released) and only then closes the broker, so a requeued
    retry comes straight back to it and is begun again (a new lease), its rules started
    and dropped once more. No `worker_stopping` is recorded: its abandons mark the stop."""

    async def close(self: engine.worker.Worker) -> None:
        tasks = [*self._tasks, *self._deliveries]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await drive(self.controller.shutdown(), self.rt)
        await self.rt.broker.close()
        await self.rt.store.close()
        self.rt.history.record("worker_stopped")
        self.rt.history.close()

    engine.worker.Worker.close = close  # type: ignore[method-assign]


# --- engine bugs that the engine absorbs ----------------------------------------------------


def raise_in_shell() -> None:
    """no_engine_error: the controller's set-up of a delivery raises `KeyError` the first
    time each process meets an evaluation (a lookup of something not there yet). The
    shell's own `except` absorbs it: the delivery fails, goes back to the queue, and comes
    round again, so every evaluation still ends as it should; only the error tells."""
    begin = EvaluationController._begin

    def lookup_first(self: EvaluationController, kind: str, attempt_id: str, *args: Any) -> Step:
        met = self.__dict__.setdefault("_mutant_met", set())
        if attempt_id not in met:
            met.add(attempt_id)
            raise KeyError(attempt_id)
        return (yield from begin(self, kind, attempt_id, *args))

    EvaluationController._begin = lookup_first  # type: ignore[method-assign]


def retry_to_undeclared_queue() -> None:
    """no_engine_error: a delayed retry is published to a delay queue nobody declared (its
    jitter bucket 1000 past the policy's): the broker's table of delay queues has no such
    queue, the publish fails, the evaluation is abandoned, and the sweeper re-publishes
    the overdue retry: the run ends as it should, and only the error tells. The patch is
    of `engine.shell.module.schedule_retry`, the step both shells run."""
    from engine.shell import module

    schedule_retry = module.schedule_retry

    def misrouted(config: Any, attempt_id: str, action: Any) -> Step:
        wrong = dataclasses.replace(action, bucket=action.bucket + 1000)
        return (yield from schedule_retry(config, attempt_id, wrong))

    module.schedule_retry = misrouted


# --- evaluation.started ---------------------------------------------------------------------


def _is_started(effect: Any) -> bool:
    return isinstance(effect, PublishEvent) and effect.routing_key == "evaluation.started"


_NO_STARTED = _unannounced("evaluation.started")


def started_after_ack() -> None:
    """started_announced: `evaluation.started` is published after the ACK. The controller's
    set-up of a delivery holds the publish back (answered at once, so `evaluation_started`
    is still recorded where it was) and sends it once the execute message is acknowledged
    (after `after_ack`), or at the end of the set-up for a retry: a crash right after the
    ACK leaves an evaluation that was taken off the queue and never announced. Where the
    event is begin's own row (an outbox: `pg`), it cannot come after the ACK."""
    begin = EvaluationController._begin

    def ack_first(self: EvaluationController, *args: Any) -> Step:
        stepper = Stepper(begin(self, *args))
        held: list[Any] = []
        while (effect := stepper.next()) is not None:
            if _is_started(effect):
                held.append(effect)
                stepper.reply(None)
                continue
            try:
                stepper.reply((yield effect))
            except BaseException as exc:
                stepper.fail(exc)
            if held and isinstance(effect, Failpoint) and effect.name == "after_ack":
                yield held.pop()
        for effect in held:
            yield effect
        return stepper.value

    EvaluationController._begin = ack_first  # type: ignore[method-assign]


def no_started_event() -> None:
    """started_announced: `evaluation.started` is never published; everything else (the
    `evaluation_started` record, the ACK after it) is as usual."""
    begin = EvaluationController._begin

    def unannounced(self: EvaluationController, *args: Any) -> Step:
        return (yield from _rewritten(begin(self, *args), _NO_STARTED))

    EvaluationController._begin = unannounced  # type: ignore[method-assign]


def skips_untold() -> None:
    """prune_only_dependents: a permanent failure prunes exactly its dependents, but the
    engine no longer says so (`rules_skipped` is not recorded): what was pruned, and
    because of which rule, is nowhere but in the missing results."""
    execute = orchestrator.PassExecutionOrchestrator._execute

    def drop(effect: Any) -> Any:
        return _DROP if isinstance(effect, Record) and effect.event == "rules_skipped" else effect

    def untold(self: Any, action: Any) -> Step:
        return (yield from _rewritten(execute(self, action), drop))

    orchestrator.PassExecutionOrchestrator._execute = untold  # type: ignore[method-assign]


def never_passed_on() -> None:
    """retry_delays_respected: a worker whose evaluation slots are all taken no longer
    looks up who holds a delivery's evaluation: a retry for an evaluation another worker
    holds waits there for a slot, then is begun, finds the holder and only then is passed
    on, late by however long the slot took."""
    controller.may_be_held_elsewhere = lambda kind, body, redelivered: False


# --- RabbitMQ flow control and durability ---------------------------------------------------


def unbounded_prefetch() -> None:
    """prefetch_respected: the worker consumes with prefetch 0, RabbitMQ's "no limit":
    `EngineConfig.prefetch` answers 0 (the worker's own config, live and in the
    simulator), so a busy worker is handed the whole queue and holds it unacknowledged
    while its slots are taken."""
    EngineConfig.prefetch = property(lambda self: 0)  # type: ignore[assignment,method-assign]


def non_persistent() -> None:
    """nothing_lost_on_restart: the worker publishes every message transient (delivery mode
    1): retries waiting in their delay queues, re-published evaluations and the
    announcements are held in the broker's memory only, and a broker restart loses them,
    durable queues or not. The encoded properties of `engine.runtime.wire` (and the
    delivery mode aiormq's path reads) are changed before the worker connects."""
    from engine.runtime import wire

    props = wire._FIXED_PROPS
    at = len(b"\x10application/json\x00\x00\x00\x00")
    if wire.DELIVERY_MODE != 2 or props[at] != 2:
        raise RuntimeError("non_persistent: the encoded message properties changed")
    wire.DELIVERY_MODE = 1
    wire._FIXED_PROPS = props[:at] + b"\x01" + props[at + 1 :]


# --- the lease machinery ------------------------------------------------------------------


def heartbeat_stops_when_idle() -> None:
    """leases_renewed: the heartbeat's loop ends the first time it finds nothing to renew
    (written `while evaluations:`, the test before the sleep). A worker starts with
    nothing held, so its heartbeat ends at once and never renews a lease: leases live only
    as long as fenced writes run them on, and lapse during any long call. (Ending at the
    first idle beat *after* the sleep instead is the schedule's to reveal: live, a worker
    may hold something at every beat of a run.)"""
    loop = heartbeat.heartbeat

    def while_held(config: Any, worker_id: str, evaluations: Any, recording: bool = True) -> Step:
        if not evaluations:
            return
        yield from loop(config, worker_id, evaluations, recording)

    heartbeat.heartbeat = while_held  # type: ignore[assignment]


#: `slow_heartbeat`: how many times longer than `heartbeat_ms` the heartbeat sleeps.
SLOW_HEARTBEAT = 10


def slow_heartbeat() -> None:
    """leases_renewed: the heartbeat beats ten times too slowly (it sleeps ten times
    `heartbeat_ms`, longer than the lease at every shipped setting): between two beats a
    lease lapses unless a fenced write happens to run it on."""
    sleep = heartbeat.Sleep

    def slow(seconds: float) -> Any:
        return sleep(seconds * SLOW_HEARTBEAT)

    heartbeat.Sleep = slow  # type: ignore[assignment,misc]


def renew_never_extends() -> None:
    """leases_renewed: the renewal answers that the lease is still held and stamps the
    running index, but never extends the lease (its `PEXPIRE` is gone): the lease runs out
    `stale_ms` after the owner's last fenced write, and a delivery to another worker may
    take the evaluation from its living owner. The source is edited before
    `RedisStore.__init__` registers it."""
    extend = "redis.call('PEXPIRE', KEYS[1], ARGV[2])\n"
    if store._RENEW.count(extend) != 1:
        raise RuntimeError("renew_never_extends: the renew script changed")
    store._RENEW = store._RENEW.replace(extend, "")


#: `sweeper_claims_early`: the fraction of `stale_ms` the sweeper waits for.
EARLY_CLAIM = 10
#: The line of the claim script that leaves a lease still held alone.
_LEASE_HELD = "if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end\n"


def _sweep_early(config: EngineConfig, held: Any) -> Step:
    """`sweep` with a tenth of `stale_ms` as the age a stamp must reach (one generator
    between the loop and the real sweep, each store call's threshold rewritten)."""
    step = _real_sweep(config, held)
    early = max(1, config.stale_ms // EARLY_CLAIM)
    reply: Any = None
    error: BaseException | None = None
    while True:
        try:
            effect = step.throw(error) if error is not None else step.send(reply)
        except StopIteration as done:
            return done.value
        if isinstance(effect, Store) and effect.op in ("stale_evaluations", "claim_stale"):
            effect = Store(effect.op, (*effect.args[:-1], early))
        try:
            reply, error = (yield effect), None
        except BaseException as exc:
            reply, error = None, exc


_real_sweep = shell_sweeper.sweep


def early_sweep() -> None:
    """The shell half of `sweeper_claims_early` (the simulator's too)."""
    global _real_sweep
    _real_sweep = shell_sweeper.sweep
    shell_sweeper.sweep = _sweep_early  # type: ignore[assignment]


def sweeper_claims_early() -> None:
    """leases_respected: the sweeper claims far too early. It takes an evaluation whose
    stamp is a tenth of `stale_ms` old, whether or not its lease is still held (the claim
    script no longer looks at the lease), and re-publishes it while its owner is running
    it. The script's source is edited before `RedisStore.__init__` registers it."""
    if store._CLAIM_STALE.count(_LEASE_HELD) != 1:
        raise RuntimeError("sweeper_claims_early: the claim script changed")
    store._CLAIM_STALE = store._CLAIM_STALE.replace(_LEASE_HELD, "")
    early_sweep()


#: The line of a fenced script that refuses a write whose token is not the current one.
_REFUSED = f"if other then return {{'{store.FENCED}', other}} end"


def _unfence(name: str, mutant: str) -> None:
    source = getattr(store, name)
    if source.count(_REFUSED) != 1:
        raise RuntimeError(f"{mutant}: the script {name} changed")
    setattr(store, name, source.replace(_REFUSED, ""))


def status_unfenced() -> None:
    """writes_fenced: status writes are not fenced. The status script no longer refuses a
    stale token, so an owner that lost its lease (paused past it while a call was failing)
    still writes `failed_attempt_N` over its successor's state. The source is edited before
    `RedisStore.__init__` registers it."""
    _unfence("_WRITE_STATUS", "status_unfenced")


def final_unfenced() -> None:
    """writes_fenced: final-state writes are not fenced. The finish script no longer refuses
    a stale token, so an owner that lost its lease (paused before its final write) still
    writes its terminal state. The source is edited before `RedisStore.__init__` registers
    it."""
    _unfence("_FINISH", "final_unfenced")


def park_unfenced() -> None:
    """writes_fenced: parks are not fenced. The park script no longer refuses a stale token,
    so an owner that lost its lease (paused before it parked) still marks the evaluation
    `parked` and takes it out of the running index while its successor runs it. The source
    is edited before `RedisStore.__init__` registers it."""
    _unfence("_PARK", "park_unfenced")


# --- pg-store and pg: mutants of the database, not of the worker ---------------------------
# Each is a PL/pgSQL function of engine/runtime/migrations replaced, in the run's database,
# by a broken one derived from the shipped definition, or a table of it altered
# (`chaos.systems.pg_store.mutants`, installed by the adapter as the schema's owner and put
# back when the run ends). The worker has nothing to patch: these patches do nothing. They
# only mean something with `--system pg-store` or `pg` (`pg_jobs_unlogged`: `pg` alone, the
# design whose queue is a table): a Redis store never runs the broken functions.


def pg_unfenced() -> None:
    """writes_fenced: `eai.write_status` skips its fence. The function no longer refuses a
    stale token, so an owner that lost its lease (paused past it while a call was failing)
    still writes `failed_attempt_N` over its successor's state, as `status_unfenced` on
    Redis. The breakage is the database's, installed by the pg-store adapter
    (`chaos.systems.pg_store.mutants`); the worker is the engine's, unpatched."""


def pg_overwrite_result() -> None:
    """idempotent_results: `eai.write_result` keeps the last result, not the first, past its
    fence, and reports every write as the winner, as `overwrite_result` on Redis: a late
    write by an execution that lost its lease replaces the result the owner wrote and
    announced first. The breakage is the database's, installed by the pg-store adapter
    (`chaos.systems.pg_store.mutants`); the worker is the engine's, unpatched."""


def pg_double_claim() -> None:
    """leases_respected: `eai.begin` skips its lease check, so a second worker that gets a
    delivery of a run another live worker holds (a retry, a redelivered copy) takes its
    lease and a new token, and both run it, as `ignore_lease` on Redis. The breakage is the
    database's, installed by the pg-store adapter (`chaos.systems.pg_store.mutants`); the
    worker is the engine's, unpatched."""


def pg_resume_forgets() -> None:
    """no_completed_rerun: `eai.resume` deletes every checkpoint of the run, those at or
    before the checkpoint it was asked to keep too, while it names only the later ones as
    deleted: a resume from chk_0001 runs the rule of chk_0001 again. The breakage is the
    database's, installed by the pg-store adapter (`chaos.systems.pg_store.mutants`); the
    worker is the engine's, unpatched."""


def pg_resume_keeps_owner() -> None:
    """writes_fenced: `eai.resume` deletes what follows the checkpoint but takes no lease:
    the run's owner is left holding it with its token, so the resume's own delivery finds
    the run held, and the owner goes on with the results it had in memory, its writes
    landing past a resume that should have fenced it off (the rules after the checkpoint
    never run again). The breakage is the database's, installed by the pg-store adapter
    (`chaos.systems.pg_store.mutants`); the worker is the engine's, unpatched."""


def pg_pass_unfenced() -> None:
    """writes_fenced: `eai.mark_pass_published` skips its fence. The function no longer
    refuses a stale token, so an owner that a resume fenced off (its pass's flag sent just
    after the resume moved the fence) still flags the pass published over the resumed run.
    The breakage is the database's, installed by the pg-store adapter
    (`chaos.systems.pg_store.mutants`); the worker is the engine's, unpatched."""


def pg_jobs_unlogged() -> None:
    """nothing_lost_on_restart: `pg`'s job queue, `eai.jobs`, is an UNLOGGED table (no WAL:
    faster inserts, the trade a queue table is often offered). PostgreSQL truncates an
    unlogged table in the crash recovery after a kill, so every job the queue held is gone
    when it comes back: delayed retries waiting to be due, evaluations waiting for a worker,
    deliveries not yet settled. The breakage is the database's, installed by the pg adapter
    (`chaos.systems.pg_store.mutants`, `ALTER TABLE eai.jobs SET UNLOGGED`); the worker is
    the engine's, unpatched."""


# --- the table -----------------------------------------------------------------------------


def unlabelled_reruns() -> None:
    """history_well_formed: `rule_started` is recorded without its `rerun` and `execution`
    fields (a refactor dropped them). The engine behaves as before; whoever reads the
    history (a post-mortem, a dashboard) can no longer tell a rerun from a first run."""
    make = orchestrator.Record

    def record(event: str, fields: Any = None) -> Any:
        fields = dict(fields or {})
        if event == "rule_started":
            fields.pop("rerun", None)
            fields.pop("execution", None)
        return make(event, fields)

    orchestrator.Record = record  # type: ignore[assignment,misc]


def executions_uncounted() -> None:
    """history_well_formed: the start marker's count is dropped on the floor (`_mark_starts`
    still writes the markers, but keeps none of the counts Redis gives back): every first
    try is told it is execution 1, so a rerun is started, billed and recorded as a first
    run, and the agent is never told it answers again."""

    def forget(self: Any, counts: list[int]) -> None:
        self._starts = []

    orchestrator.PassExecutionOrchestrator._mark_starts = forget  # type: ignore[method-assign]


def marker_write_misread() -> None:
    """history_well_formed: a delayed retry's start marker records its write in microseconds
    as milliseconds (`write_ms` a thousand times the round trip): the worker claims a write
    longer than the time since the retry's delivery, which no clock's disagreement
    explains."""
    execute = orchestrator.PassExecutionOrchestrator._execute

    def misread(effect: Any) -> Any:
        if isinstance(effect, Record) and effect.event == "start_marked":
            fields = dict(effect.fields)
            fields["write_ms"] = round(fields["write_ms"] * 1000, 3)
            return Record(effect.event, fields)
        return effect

    def misreading(self: Any, action: Any) -> Step:
        return (yield from _rewritten(execute(self, action), misread))

    orchestrator.PassExecutionOrchestrator._execute = misreading  # type: ignore[method-assign]


def retry_starts_unmarked() -> None:
    """history_well_formed: a delayed retry's first try starts with no round trip before it
    (a refactor took the retry's delivery for the store's word): no start marker is written
    for it, and nothing asks the store about a cancel or the lease first, unless a write of
    the same batch happens to. The engine records its start as before; a crash during it
    would rerun it told it is execution 1 again."""
    execute = orchestrator.PassExecutionOrchestrator._execute

    def unmarked(self: Any, action: Any) -> Step:
        if isinstance(action, RunRule) and action.attempt > 1 and action.try_no == 1:
            key = (action.rule_id, action.attempt)
            self._starts = [s for s in self._starts if s != key]
            self._looked = True
            self._lease_until = float("inf")
        return (yield from execute(self, action))

    orchestrator.PassExecutionOrchestrator._execute = unmarked  # type: ignore[method-assign]


def cancel_read_unheard() -> None:
    """quiet_state: a cancel the owner reads in the store right before a call stops that
    call, but its core never hears it (the fix of 2026-12-04 undone): with the broadcast
    lost, the evaluation stays in memory, its lease renewed, until the worker stops."""
    feed = orchestrator.PassExecutionOrchestrator._feed
    nothing = orchestrator._no_input

    def deaf(self: Any, fn: Any, *args: Any, **kw: Any) -> Step:
        if fn is nothing:
            return
        yield from feed(self, fn, *args, **kw)

    orchestrator.PassExecutionOrchestrator._feed = deaf  # type: ignore[method-assign]


def call_after_close() -> None:
    """cancel_respected: a started rule's task that waited for its first step calls the
    agent though its evaluation closed meanwhile (the fix of 2026-12-06 undone): only the
    store's word that it is over stops a call, so a cancel's broadcast ends the evaluation
    and the tasks still waiting call for it all the same, and are paid for."""

    def only_over(self: Any) -> bool:
        return self._over is not None

    orchestrator.PassExecutionOrchestrator._gone = only_over  # type: ignore[method-assign]


def final_retry_disowned() -> None:
    """completed_delivered: the owner takes the end its retried final write finds for
    another copy's (the fix of 2026-12-06 undone): a final write whose reply a stalled
    Redis held past the read timeout is sent again, finds the owner's own `completed`, and
    the owner announces nothing, so nobody does."""

    def as_found(self: Any, kept: str | None, action: Any) -> str | None:
        return kept

    orchestrator.PassExecutionOrchestrator._other_end = as_found  # type: ignore[method-assign]


def cancel_unknown() -> None:
    """poison_rejected: the controller no longer knows a cancel broadcast (its `type`
    compared with another spelling) and rejects it as a message of an unknown type, ACKed:
    an owner hears of a cancel only when it next reads the state in Redis."""

    def unknown(self: EvaluationController, attempt_id: str, delivery: Any) -> Step:
        yield Record("message_rejected", {"attempt_id": attempt_id, "reason": "cancel"})
        yield Settle(delivery)

    EvaluationController._on_cancel = unknown  # type: ignore[method-assign]


def failed_calls_free() -> None:
    """matches_reference: the tokens of a failed call are read from an attribute the
    agent's error does not have (`getattr(err, "token", 0)`): every failed call is billed,
    counted and recorded as free, consistently, so the history and the metrics agree with
    each other and only what the agent drew for the call tells."""
    real = getattr

    def misread(obj: Any, name: str, *default: Any) -> Any:
        return real(obj, "token" if name == "tokens" else name, *default)

    orchestrator.getattr = misread  # type: ignore[attr-defined]


def failed_calls_uncounted() -> None:
    """metrics_match_history: `engine_agent_calls_total` moves for the calls that gave a
    result only: a dashboard shows no failed call, whatever the history says."""
    make = orchestrator.Count

    def count(metric: str, amount: float = 1, labels: Any = ()) -> Any:
        if metric == "calls" and labels != (("outcome", "ok"),):
            amount = 0
        return make(metric, amount, labels)

    orchestrator.Count = count  # type: ignore[assignment,misc]


def failpoints_blind() -> None:
    """faults_fired: the orchestrator's failpoint sites no longer say which rule they are
    at (`Failpoint(name, None, attempt_id)`): a failpoint aimed at a rule never matches, so
    every scenario built on one silently tests nothing; the engine is otherwise unchanged."""
    make = orchestrator.Failpoint

    def blind(name: str, rule: Any = None, attempt_id: Any = None) -> Any:
        return make(name, None, attempt_id)

    orchestrator.Failpoint = blind  # type: ignore[assignment,misc]


def pass_result_misrouted() -> None:
    """pass_results_correct: `evaluation.pass_result` goes out under another routing key
    (`evaluation.pass_results`): the engine records every announcement as before, and no
    consumer bound to the documented key ever hears of a pass."""
    make = orchestrator.PublishEvent

    def publish(routing_key: str, body: Any, message_id: str) -> Any:
        if routing_key == "evaluation.pass_result":
            routing_key = "evaluation.pass_results"
        return make(routing_key, body, message_id)

    orchestrator.PublishEvent = publish  # type: ignore[assignment,misc]


def retry_held_to_the_end() -> None:
    """retries_acked: a delayed retry is not ACKed when the outcome of its attempt is
    durable; it stays held until the evaluation ends (then ACKed as stale) or parks (then
    NACKed back, to come round again). Every outcome and every verdict is as before."""

    def keep_holding(self: Evaluation, rule_id: str) -> list[Any]:
        self._retry_tokens.pop(rule_id, None)
        return []

    Evaluation._ack_token = keep_holding  # type: ignore[method-assign]


def poison_requeued() -> None:
    """poison_rejected: a malformed message is NACKed back to its queue when it is dropped,
    not ACKed (the handling of a failed delivery, applied to a poison): it comes round
    again and again, each time rejected anew."""
    on_message = EvaluationController.on_message

    def requeue(self: EvaluationController, delivery: Any, body: Any, redelivered: bool) -> Step:
        malformed = False

        def nack(effect: Any) -> Any:
            nonlocal malformed
            if isinstance(effect, Record) and effect.event == "message_rejected":
                malformed = effect.fields.get("reason") == "malformed"
            return (
                Settle(effect.delivery, ack=False)
                if malformed and isinstance(effect, Settle)
                else effect
            )

        return (yield from _rewritten(on_message(self, delivery, body, redelivered), nack))

    EvaluationController.on_message = requeue  # type: ignore[method-assign]


def _mutant(
    patch: Callable[[], None], breaks: str, description: str, system: str | None = None
) -> Mutant:
    assert breaks in INVARIANT_NAMES, breaks
    if system is None and patch.__name__ in _REDIS_STORE:
        system = "redis-rabbitmq"
    return Mutant(patch.__name__, description, breaks, patch, system)


#: The mutants of the Redis store (a Lua script's source, a `RedisStore` method): they break
#: `redis-rabbitmq` only (pg-store runs PL/pgSQL functions; its own are `pg_*`).
_REDIS_STORE = frozenset(
    {
        "result_without_ttl",
        "overwrite_result",
        "done_keeps_lease",
        "needless_rerun",
        "ignore_lease",
        "no_fencing",
        "renew_never_extends",
        "sweeper_claims_early",
        "status_unfenced",
        "final_unfenced",
        "park_unfenced",
        "leak_running_index",
    }
)


#: The workflow engines' own mutants (their workers run none of the engine's), by design:
#: the module of each, whose `MUTANTS` maps a name to (the invariant it breaks, its patch).
DESIGN_MUTANTS = {
    "temporal": "chaos.systems.temporal.mutants",
    "dbos": "chaos.systems.dbos.mutants",
}


def design_mutants() -> dict[str, tuple[str, str, str]]:
    """Name -> (its design, the invariant it breaks, its docstring's first line)."""
    import importlib

    out = {}
    for system, module in DESIGN_MUTANTS.items():
        for name, (breaks, patch) in importlib.import_module(module).MUTANTS.items():
            out[name] = (system, breaks, (patch.__doc__ or "").split(":", 1)[-1].strip())
    return out


def refusal(name: str | None, system: str) -> str | None:
    """Why mutant `name` cannot run on `system` (it breaks another design's part), in one
    line (None: it can)."""
    from chaos.systems import SYSTEMS
    from engine.config import SYSTEMS as MEMORIES

    design = design_mutants().get(name) if name is not None else None
    if design is not None:
        if design[0] == system:
            return None
        return f"--mutant: {name} breaks {design[0]} only; the scenario runs on {system}"
    mutant = MUTANTS.get(name) if name is not None else None
    sut = SYSTEMS.get(system)
    if mutant is not None and sut is not None and not sut.engine_worker:
        # the patch would not reach its workers: the run would judge an unbroken design
        return f"--mutant: {name} breaks the engine's worker; {system} runs none of it"
    store_of = sut.store_of if sut is not None else None
    broker = MEMORIES[system][1] if system in MEMORIES else None
    if mutant is None or mutant.system in (None, system, store_of, broker):
        return None
    return f"--mutant: {name} breaks {mutant.system} only; the scenario runs on {system}"


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
            sweep_wrong_attempt,
            "all_terminal",
            "the sweeper re-publishes a lost retry for the failed attempt, not the next one",
        ),
        _mutant(
            prune_everything,
            "prune_only_dependents",
            "a permanent failure skips every pending rule, not only its dependents",
        ),
        _mutant(
            never_passed_on,
            "retry_delays_respected",
            "a busy worker holds another owner's retry for a slot instead of passing it on",
        ),
        _mutant(
            skips_untold,
            "prune_only_dependents",
            "what a permanent failure prunes is pruned, but never recorded as skipped",
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
            "rabbitmq",
        ),
        _mutant(
            result_without_ttl,
            "state_keys_expire",
            "rule results are written without their TTL and never expire",
        ),
        _mutant(
            overwrite_result,
            "idempotent_results",
            "rule results are written last-write-wins: a late write replaces the first",
        ),
        _mutant(
            double_final_publish,
            "single_final_result",
            "evaluation.completed is published twice, with the same body",
        ),
        _mutant(
            ignore_dag,
            "dag_order",
            "rules start at once, before their dependencies have a result",
        ),
        _mutant(
            no_immediate_retries,
            "retry_budget",
            "immediate_retries is 0: the first transient failure of an attempt ends it",
        ),
        _mutant(
            give_up_early,
            "retry_budget",
            "a rule is permanently_failed one attempt before max_attempts",
        ),
        _mutant(
            try_made_twice,
            "retry_budget",
            "the shell makes an attempt's failed try 2 again, under the same try number",
        ),
        _mutant(
            slow_tier,
            "retry_delays_respected",
            "a delayed retry goes to the tier after the one the policy gives",
        ),
        _mutant(
            drop_history_events,
            "history_complete",
            "the worker's history loses every 7th event, its seq still counted",
        ),
        _mutant(
            start_after_cancel,
            "cancel_respected",
            "the owner ignores a cancel and keeps starting rules to the end",
        ),
        _mutant(
            spurious_cancel,
            "cancel_respected",
            "a cancel broadcast cancels every evaluation the worker holds",
        ),
        _mutant(
            all_passes_complete,
            "pass_results_correct",
            "every pass is announced complete, whatever it lost",
        ),
        _mutant(
            pass_announced_again,
            "pass_results_correct",
            "each finished pass is announced again whenever another rule ends",
        ),
        _mutant(
            no_completed_event,
            "completed_delivered",
            "evaluation.completed is never published, though flagged as published",
        ),
        _mutant(
            leak_running_index,
            "quiet_state",
            "a terminal evaluation is left in the running index",
        ),
        _mutant(
            done_keeps_lease,
            "quiet_state",
            "the announcer keeps its lease on the evaluation it announced",
        ),
        _mutant(
            needless_rerun,
            "reruns_explained",
            "the heartbeat gives up a lease it holds: the resume reruns the rules in flight",
        ),
        _mutant(
            ignore_lease,
            "reruns_explained",
            "begin ignores the lease: a second worker runs the evaluation beside its owner",
        ),
        _mutant(
            no_wait,
            "no_completed_rerun",
            "behind Sentinel, writes count before the replica holds them (no WAIT)",
        ),
        _mutant(
            no_restore,
            "matches_reference",
            "the final state is announced without making sure Redis still holds its results",
        ),
        _mutant(
            unmitigated,
            "no_completed_rerun",
            "behind Sentinel, neither WAIT nor the results restored before the announcement",
        ),
        _mutant(
            no_fencing,
            "no_completed_rerun",
            "the owner's writes are not fenced: a worker that lost its lease writes on",
        ),
        _mutant(
            results_only_reannounced,
            "completed_delivered",
            "an evaluation announced again names its stored results only, not what failed",
            system="rabbitmq",  # on an outbox the final state's transaction announces it
        ),
        _mutant(
            old_close_order,
            "reruns_explained",
            "a stopping worker hands work back while it consumes: it begins it again",
        ),
        _mutant(
            raise_in_shell,
            "no_engine_error",
            "a delivery's set-up raises KeyError the first time a process meets an evaluation",
        ),
        _mutant(
            retry_to_undeclared_queue,
            "no_engine_error",
            "a delayed retry is published to a delay queue nobody declared",
        ),
        _mutant(
            started_after_ack,
            "started_announced",
            "evaluation.started is published after the ACK of the execute message",
            system="rabbitmq",  # on an outbox, the event is begin's own row
        ),
        _mutant(
            no_started_event,
            "started_announced",
            "evaluation.started is never published",
        ),
        _mutant(
            unbounded_prefetch,
            "prefetch_respected",
            "the worker consumes with prefetch 0 (no limit): a busy worker takes the whole queue",
        ),
        _mutant(
            non_persistent,
            "nothing_lost_on_restart",
            "the worker publishes transient messages: a broker restart loses them",
            "rabbitmq",
        ),
        _mutant(
            ignore_rule_max_attempts,
            "matches_reference",
            "a plan's per-rule max_attempts is ignored: every rule gets the policy's",
        ),
        _mutant(
            hold_due_retry,
            "retry_delays_respected",
            "a due retry is held back for nothing before its first call",
        ),
        _mutant(
            forget_permanent_failure,
            "attempts_monotonic",
            "recovery forgets a permanent failure: a resumed evaluation runs the rule again",
        ),
        _mutant(
            heartbeat_stops_when_idle,
            "leases_renewed",
            "the heartbeat ends when it finds nothing to renew: leases live on fenced writes alone",
        ),
        _mutant(
            slow_heartbeat,
            "leases_renewed",
            "the heartbeat beats ten times too slowly: leases lapse between beats",
        ),
        _mutant(
            renew_never_extends,
            "leases_renewed",
            "the renewal says the lease is held but never extends it",
        ),
        _mutant(
            sweeper_claims_early,
            "leases_respected",
            "the sweeper claims evaluations whose lease is still held, at a tenth of stale_ms",
        ),
        _mutant(
            status_unfenced,
            "writes_fenced",
            "status writes are not fenced: an owner that lost its lease writes statuses",
        ),
        _mutant(
            final_unfenced,
            "writes_fenced",
            "final-state writes are not fenced: an owner that lost its lease writes its end",
        ),
        _mutant(
            park_unfenced,
            "writes_fenced",
            "parks are not fenced: an owner that lost its lease parks its successor's run",
        ),
        _mutant(
            pg_unfenced,
            "writes_fenced",
            "pg-store only: eai.write_status skips its fence: a stale owner's status lands",
            "pg-store",
        ),
        _mutant(
            pg_overwrite_result,
            "idempotent_results",
            "pg-store only: eai.write_result keeps the last result, past its fence",
            "pg-store",
        ),
        _mutant(
            pg_double_claim,
            "leases_respected",
            "pg-store only: eai.begin skips its lease check: two workers run one evaluation",
            "pg-store",
        ),
        _mutant(
            pg_resume_forgets,
            "no_completed_rerun",
            "pg-store only: eai.resume deletes the checkpoints it was asked to keep",
            "pg-store",
        ),
        _mutant(
            pg_resume_keeps_owner,
            "writes_fenced",
            "pg-store only: eai.resume takes no lease: the owner goes on past the resume",
            "pg-store",
        ),
        _mutant(
            pg_pass_unfenced,
            "writes_fenced",
            "pg-store only: eai.mark_pass_published skips its fence: a stale owner's pass flag "
            "lands",
            "pg-store",
        ),
        _mutant(
            pg_jobs_unlogged,
            "nothing_lost_on_restart",
            "pg only: eai.jobs is UNLOGGED: a crash of PostgreSQL empties the job queue",
            "pg",
        ),
        _mutant(
            unlabelled_reruns,
            "history_well_formed",
            "rule_started is recorded without rerun and execution: reruns are unlabelled",
        ),
        _mutant(
            executions_uncounted,
            "history_well_formed",
            "the start marker's count is dropped: every rerun is told it is a first run",
        ),
        _mutant(
            marker_write_misread,
            "history_well_formed",
            "a start marker's write is recorded in microseconds as milliseconds",
        ),
        _mutant(
            retry_starts_unmarked,
            "history_well_formed",
            "a delayed retry starts with no round trip before it: no start marker written",
        ),
        _mutant(
            cancel_read_unheard,
            "quiet_state",
            "a cancel read before a call stops the call, but the core never hears it",
        ),
        _mutant(
            call_after_close,
            "cancel_respected",
            "a started rule's task calls though its evaluation closed while it waited",
        ),
        _mutant(
            final_retry_disowned,
            "completed_delivered",
            "the owner takes its own retried final write for another's and announces nothing",
        ),
        _mutant(
            cancel_unknown,
            "poison_rejected",
            "a cancel broadcast is rejected as a message of an unknown type",
        ),
        _mutant(
            failed_calls_free,
            "matches_reference",
            "a failed call's tokens are misread: every failed call is recorded as free",
        ),
        _mutant(
            failed_calls_uncounted,
            "metrics_match_history",
            "the agent-calls counter moves for successful calls only",
        ),
        _mutant(
            failpoints_blind,
            "faults_fired",
            "the orchestrator's failpoint sites do not name their rule: an aimed one never fires",
        ),
        _mutant(
            pass_result_misrouted,
            "pass_results_correct",
            "evaluation.pass_result is published under another routing key",
        ),
        _mutant(
            retry_held_to_the_end,
            "retries_acked",
            "a delayed retry stays unacknowledged until its evaluation ends",
        ),
        _mutant(
            poison_requeued,
            "poison_rejected",
            "a malformed message is NACKed back to its queue when dropped, not ACKed",
        ),
    )
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    mutant = MUTANTS.get(args[0]) if args else None
    if mutant is None:
        from engine.validation import did_you_mean

        problem = (
            f"unknown mutant {args[0]!r}{did_you_mean(args[0], MUTANTS)}"
            if args
            else "no mutant given"
        )
        names = ", ".join(MUTANTS)
        print(f"chaos.mutants: {problem}; valid: {names}", file=sys.stderr)
        return 2
    mutant.apply()
    return engine.worker.main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
