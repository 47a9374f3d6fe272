"""`chaos.mutants` in the simulator: the same patches, saved and restored around a run.

A live mutant runs in its own worker process, so its monkeypatch dies with it. The
simulator runs many engines in one process, one after the other, so `patched` applies a
mutant around one run: it saves the namespace of every object a patch may touch and puts
it back afterwards, so a clean run that follows is the clean engine.
- Mutants of the pure core, of the worker's protocol (`engine.shell`), of its config and of
  its agent (`CORE`) are chaos.mutants' own patch functions, exactly as live.
- Mutants of a Lua script, of the broker's topology, of the history writer or of a
  PostgreSQL design's database (`PATCHED`) are the live patch's counterpart on the
  simulator's model of it (`SimRedis`, `SimBroker`, `sim.history.Source`,
  `sim.pgqueue.SimJobs`), saved and restored alike.
No mutant is a switch inside the engine, the simulator or the simulated runner. A mutant
`chaos.mutants` gains later fails here loudly until the simulator models it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Generator, Iterator
from typing import Any

from engine.agent import FakeAgent
from engine.config import EngineConfig
from engine.core import dag, evaluation
from engine.core.evaluation import Evaluation
from engine.core.results import RuleResult
from engine.keys import eval_key, result_key, status_key
from engine.policy import RetryPolicy
from engine.shell import controller, heartbeat, orchestrator, reevaluate
from engine.shell import module as shell_module
from engine.shell import sweeper as shell_sweeper
from engine.shell.replies import Renewal
from sim.broker import SHARED_DELAY_QUEUE, BrokerClient, Message, Queue, SimBroker
from sim.drive import drive as sim_drive
from sim.history import Source
from sim.pgqueue import SimJobs
from sim.redis import SimRedis
from sim.worker import EXIT_STOPPED, SimWorker

#: Patches of the pure core, the shared shell (`engine.shell`), the worker's config and its
#: agent, applied with `patched`: chaos.mutants' own patch, exactly as live.
CORE: tuple[str, ...] = (
    "no_sweeper",
    "no_wait",
    "no_restore",
    "unmitigated",
    "nondeterministic_agent",
    "sweep_wrong_attempt",
    "no_redis_results",
    "spurious_cancel",
    "double_final_publish",
    "no_completed_event",
    "start_after_cancel",
    "prune_everything",
    "prune_nothing",
    "skips_untold",
    "never_passed_on",
    "reset_attempts_on_recovery",
    "ignore_dag",
    "no_immediate_retries",
    "give_up_early",
    "try_made_twice",
    "slow_tier",
    "all_passes_complete",
    "pass_announced_again",
    "results_only_reannounced",
    "raise_in_shell",
    "retry_to_undeclared_queue",
    "started_after_ack",
    "no_started_event",
    "unbounded_prefetch",
    "ignore_rule_max_attempts",
    "forget_permanent_failure",
    "hold_due_retry",
    "heartbeat_stops_when_idle",
    "slow_heartbeat",
    "unlabelled_reruns",
    "executions_uncounted",
    "marker_write_misread",
    "retry_starts_unmarked",
    "failed_calls_uncounted",
    "failed_calls_free",
    "cancel_unknown",
    "cancel_read_unheard",
    "call_after_close",
    "final_retry_disowned",
    "poison_requeued",
    "retry_held_to_the_end",
    "pass_result_misrouted",
    "failpoints_blind",
)
#: Every object a core patch may change: saved and restored whole.
_OWNERS: tuple[Any, ...] = (
    EngineConfig,
    FakeAgent,
    Evaluation,
    evaluation,
    dag,
    RetryPolicy,
    shell_sweeper,
    orchestrator,
    orchestrator.PassExecutionOrchestrator,
    controller,
    controller.EvaluationController,
    reevaluate.ReEvaluateUseCase,
    shell_module,
    heartbeat,
)

_active: list[str] = []


def known() -> tuple[str, ...]:
    """Every mutant of `chaos.mutants.MUTANTS`, checked to be modelled here."""
    from chaos.mutants import MUTANTS

    missing = [m for m in MUTANTS if m not in CORE and m not in PATCHED]
    if missing:
        raise NotImplementedError(f"the simulator does not model mutant(s) {missing}")
    return tuple(MUTANTS)


def refusal(name: str | None, system: str) -> str | None:
    """`chaos.mutants.refusal`: a mutant of another design's part does not run here.
    Without a mutant nothing imports `chaos.mutants` (and the live engine's worker, its
    clients with it): a pool's processes start without them."""
    if name is None:
        return None
    from chaos.mutants import refusal as mutant_refusal

    return mutant_refusal(name, system)


@contextlib.contextmanager
def patched(name: str | None) -> Iterator[None]:
    """Apply mutant `name` of `CORE` or `PATCHED` (nothing for None) for the duration."""
    if name is None:
        yield
        return
    if name not in CORE and name not in PATCHED:
        known()
        raise ValueError(f"unknown mutant {name!r}; expected one of {', '.join(known())}")
    if _active:
        raise RuntimeError(f"mutant {_active[0]} is already applied in this process")
    from chaos import mutants

    saved = [(owner, dict(vars(owner))) for owner in (*_OWNERS, *_SHELL_OWNERS)]
    _active.append(name)
    try:
        if name in PATCHED:
            PATCHED[name]()
        else:
            mutants.MUTANTS[name].apply()
        yield
    finally:
        mutants._APPLIED.discard(name)
        for owner, before in saved:
            _restore(owner, before)
        _active.clear()


def _restore(owner: Any, before: dict[str, Any]) -> None:
    now = vars(owner)
    for key in [k for k in now if k not in before]:
        delattr(owner, key)
    for key, value in before.items():
        if now.get(key, before) is not value:
            setattr(owner, key, value)


# --- the shell's patches: each the live patch (chaos.mutants), on the simulator's seam ------


def _leaving_it_indexed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, minus its removal of the evaluation from the running index."""

    def method(self: SimRedis, a: str, *args: Any) -> Any:
        score = (self.get(self.running_index) or {}).get(a)
        out = fn(self, a, *args)
        if score is not None and a not in (self.get(self.running_index) or {}):
            self._container(self.running_index)[a] = score
        return out

    return method


def _leak_running_index() -> None:
    for name in ("done", "begin", "unindex", "claim_stale"):  # the scripts the live one edits
        setattr(SimRedis, name, _leaving_it_indexed(getattr(SimRedis, name)))


def _done_keeps_lease() -> None:
    """The live patch's `done` script without its `DEL` of the owner key: the release it
    makes is asked for a holder no lease ever has."""
    done = SimRedis.done

    def done_keeping(self: SimRedis, a: str, me: str) -> bool:
        return done(self, a, "")

    SimRedis.done = done_keeping  # type: ignore[method-assign]


def _needless_rerun() -> None:
    from chaos.mutants import GIVE_UP_AT_RENEWAL

    renew = SimRedis.renew

    def careless_renew(self: SimRedis, ids: Any, me: str, now_ms: int) -> dict[str, bool]:
        held = renew(self, ids, me, now_ms)
        counts = self.__dict__.setdefault("_renewals", {})  # per worker: the live process's
        for a, ours in held.items():
            counts[me, a] = counts.get((me, a), 0) + 1
            if ours and counts[me, a] == GIVE_UP_AT_RENEWAL:
                held[a] = False
        return held

    SimRedis.renew = careless_renew  # type: ignore[method-assign]


def _ignore_lease() -> None:
    begin = SimRedis.begin

    def lease_blind_begin(self: SimRedis, a: str, me: str, *args: Any) -> Any:
        key = eval_key(a, "owner")
        holder = self.get(key)
        if holder is None or holder == me:
            return begin(self, a, me, *args)
        expires = self.expires.get(key)
        self._del(key)  # the script no longer looks at it
        out = begin(self, a, me, *args)
        if self.get(key) is None:  # not taken (terminal, no plan): the holder keeps it
            self._restore(key, holder, expires)
        return out

    SimRedis.begin = lease_blind_begin  # type: ignore[method-assign]


def _no_fencing() -> None:
    SimRedis._fenced = lambda self, a, token: None  # type: ignore[method-assign]
    orchestrator.PassExecutionOrchestrator._lease_short = lambda self, now: False  # type: ignore[method-assign]


def _result_without_ttl() -> None:
    """The live patch's `SET NX` without `EX`; the rest of the script unchanged."""

    def set_nx(self: SimRedis, key: str, result: Any) -> Any:
        existing = self.get(key)
        if existing is None:
            self._set(key, result.to_json(), None)
            return None
        return RuleResult.from_json(existing)

    SimRedis.set_result = set_nx  # type: ignore[method-assign]


def _overwrite_result() -> None:
    """The live patch's blind `SET ... EX` past the fence: the last write wins, and every
    write reports that it won."""
    write_result = SimRedis.write_result

    def blind_write(self: SimRedis, a: str, result: Any, starts: Any, fence: Any = None) -> Any:
        return write_result(self, a, result, starts, None)

    def set_ex(self: SimRedis, key: str, result: Any) -> None:
        self._set(key, result.to_json(), self.ttl)

    SimRedis.write_result = blind_write  # type: ignore[method-assign]
    SimRedis.set_result = set_ex  # type: ignore[method-assign]


def _per_message_ttl() -> None:
    """The live patch's topology: every retry in one shared delay queue, its tier's TTL
    carried by the message (and, as in RabbitMQ, expiring only at the queue's head)."""

    def publish_shared(
        self: SimBroker, route: tuple[int, int], body: Any, msg_id: str, persistent: bool = True
    ) -> bool:
        shared = self.queues.get(SHARED_DELAY_QUEUE)
        if shared is None:
            shared = self.queues[SHARED_DELAY_QUEUE] = Queue(SHARED_DELAY_QUEUE, delay=True)
        self.hold(shared, Message(body, msg_id, persistent=persistent), self.tier_ttl[route])
        return True

    SimBroker.publish_delay = publish_shared  # type: ignore[method-assign]


def _drop_history_events() -> None:
    """The live patch's rule (`chaos.mutants.history_drops`) on the simulator's history
    writer: a worker's source numbers every event and loses every 7th. The runner's is
    another process live, which the patch never reaches."""
    from chaos.mutants import history_drops

    record_fields = Source.record_fields  # every event goes through it (`record` too)

    def lossy_record_fields(self: Source, ev: str, fields: Any) -> None:
        if self.src != "runner" and history_drops(self._seq + 1):
            self._seq += 1
            return
        record_fields(self, ev, fields)

    Source.record_fields = lossy_record_fields  # type: ignore[method-assign]


def _non_persistent() -> None:
    """The live patch's delivery mode, on the simulated client of every worker (the
    runner's own clients say theirs: live they are another process)."""
    BrokerClient.DELIVERY_MODE = 1


def _renew_never_extends() -> None:
    """The live patch's renew script without its `PEXPIRE`: a lease still held keeps the
    expiry it had (a lapsed one is still written again, as the script's `SET` does)."""
    renew = SimRedis.renew

    def renew_in_place(self: SimRedis, ids: Any, me: str, now_ms: int) -> dict[str, Any]:
        keys = [eval_key(a, "owner") for a in ids]
        before = {k: self.expires.get(k) for k in keys if self.get(k) is not None}
        out = renew(self, ids, me, now_ms)
        for key, expires in before.items():
            if expires is not None and self.get(key) is not None:
                self.expires[key] = expires
        # the PEXPIRETIME the script returns is read after the (missing) PEXPIRE
        owner = self._pexpiretime
        return {a: Renewal(int(v), owner(eval_key(a, "owner"))) if v else v for a, v in out.items()}

    SimRedis.renew = renew_in_place  # type: ignore[method-assign]


def _sweeper_claims_early() -> None:
    """The live patch: the shell's sweep at a tenth of `stale_ms` (chaos.mutants' own) and
    the claim script blind to the lease."""
    from chaos.mutants import early_sweep

    early_sweep()
    claim_stale = SimRedis.claim_stale

    def lease_blind_claim(self: SimRedis, a: str, *args: Any) -> bool:
        key = eval_key(a, "owner")
        holder, expires = self.get(key), self.expires.get(key)
        if holder is None:
            return claim_stale(self, a, *args)
        self._del(key)  # the script no longer looks at it
        try:
            return claim_stale(self, a, *args)
        finally:
            self._restore(key, holder, expires)

    SimRedis.claim_stale = lease_blind_claim  # type: ignore[method-assign]


def _unfence(script: str) -> Callable[[], None]:
    """The patch of a live mutant whose fenced script (`SimRedis.<script>`, its reference)
    no longer refuses a stale token: the lease still runs on for a token the fence lets
    through (`_fenced` as before), a refusal is ignored."""

    def patch() -> None:
        original = getattr(SimRedis, script)
        signature = inspect.signature(original)

        def unfenced(self: SimRedis, a: str, *args: Any) -> Any:
            bound = signature.bind(self, a, *args)
            self._fenced(a, bound.arguments.get("fence"))
            bound.arguments["fence"] = None
            return original(*bound.args, **bound.kwargs)

        setattr(SimRedis, script, unfenced)

    return patch


# --- pg-store: each the SQL mutant's counterpart (chaos/systems/pg_store/mutants.py) ------
# pg-store's simulator runs the same references as Redis (`sim.redis.REFERENCES`), so the
# counterpart of a broken PL/pgSQL function is the same patch of its `SimRedis` reference.
# Only meaningful on `--system pg-store`: live, these mutants are in the database alone.


def _pg_overwrite_result() -> None:
    """`eai.write_result` without its refusal and with `result = p_result` (not the first
    kept): the last write wins, and every write reports that it won."""
    write_result = SimRedis.write_result

    def blind_write(self: SimRedis, a: str, result: Any, starts: Any, fence: Any = None) -> Any:
        self._fenced(a, fence)  # a lease still ours runs on; a refusal is ignored
        return write_result(self, a, result, starts, None)

    def overwrite(self: SimRedis, key: str, result: Any) -> None:
        self._set(key, result.to_json(), self.ttl)

    SimRedis.write_result = blind_write  # type: ignore[method-assign]
    SimRedis.set_result = overwrite  # type: ignore[method-assign]


def _pg_double_claim() -> None:
    """`eai.begin` without its lease check: a worker begins a run another holds, taking the
    lease and a new token from its live owner (`ignore_lease`'s model, the same misstep)."""
    _ignore_lease()


def _pg_resume_forgets() -> None:
    """`eai.resume` deleting every checkpoint, the kept ones too, and naming only the later
    ones: what the run had finished before the checkpoint runs again."""
    resume_from = SimRedis.resume_from

    def forgets(self: SimRedis, a: str, number: int | None, reason: str) -> list[str]:
        reply = resume_from(self, a, number, reason)
        if reply[0] == "ok":
            key = eval_key(a, "checkpoints")
            for r in self.get(key) or ():
                self._del(result_key(a, r))
                self._del(status_key(a, r))
            self._set(key, [], self.ttl)
        return reply

    SimRedis.resume_from = forgets  # type: ignore[method-assign]


def _pg_resume_keeps_owner() -> None:
    """`eai.resume` without taking the lease: the owner keeps it, and its token."""
    resume_from = SimRedis.resume_from

    def keeps_owner(self: SimRedis, a: str, number: int | None, reason: str) -> list[str]:
        keys = (eval_key(a, "owner"), eval_key(a, "fence"))
        kept = {k: (self.get(k), self.expires.get(k)) for k in keys}
        reply = resume_from(self, a, number, reason)
        if reply[0] == "ok":  # put back as they were, expiry and all
            for key, (value, expires) in kept.items():
                self._del(key)
                if value is not None:
                    self.data[key] = value
                    if expires is not None:
                        self.expires[key] = expires
        return reply

    SimRedis.resume_from = keeps_owner  # type: ignore[method-assign]


# --- pg: the job queue's table (chaos/systems/pg_store/mutants.py, live) ------------------


def _pg_jobs_unlogged() -> None:
    """`eai.jobs` UNLOGGED: the crash recovery of a killed PostgreSQL resets the table to
    its empty init fork, so the restart finds no job (a clean shutdown keeps them)."""
    restart = SimJobs.restart

    def truncating(self: SimJobs) -> None:
        if self.crashed:
            self.jobs.clear()
        restart(self)

    SimJobs.restart = truncating  # type: ignore[method-assign]


#: Mutants of a Lua script, of the broker's topology, of the history writer or of the job
#: queue's table, patched on their model in `SimRedis`, `SimBroker`, `Source` or `SimJobs`
#: with `patched`, like the core's.
def _old_close_order() -> None:
    """The live patch's close on the simulated worker: the evaluations handed back while
    its consumers stand, its deliveries in flight left running, no `worker_stopping`."""

    def close(self: SimWorker) -> Generator[Any, Any, None]:
        for loop in self._loops:
            if loop.is_alive:
                loop.interrupt()
        yield from sim_drive(self.controller.shutdown(), self)
        yield from self.broker.close()
        self.record("worker_stopped")
        self.die(EXIT_STOPPED)

    SimWorker._close = close  # type: ignore[method-assign]


PATCHED: dict[str, Callable[[], None]] = {
    "drop_history_events": _drop_history_events,
    "per_message_ttl": _per_message_ttl,
    "result_without_ttl": _result_without_ttl,
    "overwrite_result": _overwrite_result,
    "leak_running_index": _leak_running_index,
    "done_keeps_lease": _done_keeps_lease,
    "needless_rerun": _needless_rerun,
    "ignore_lease": _ignore_lease,
    "no_fencing": _no_fencing,
    "old_close_order": _old_close_order,
    "non_persistent": _non_persistent,
    "renew_never_extends": _renew_never_extends,
    "sweeper_claims_early": _sweeper_claims_early,
    "status_unfenced": _unfence("write_status"),
    "final_unfenced": _unfence("finish"),
    "park_unfenced": _unfence("park"),
    # `eai.write_status` without its refusal: the Redis script's counterpart, the same patch
    "pg_unfenced": _unfence("write_status"),
    "pg_overwrite_result": _pg_overwrite_result,
    "pg_double_claim": _pg_double_claim,
    "pg_resume_forgets": _pg_resume_forgets,
    "pg_resume_keeps_owner": _pg_resume_keeps_owner,
    "pg_pass_unfenced": _unfence("mark_pass_published"),
    "pg_jobs_unlogged": _pg_jobs_unlogged,
}
#: Every object a patch of `PATCHED` may change: saved and restored whole.
_SHELL_OWNERS: tuple[Any, ...] = (
    SimRedis,
    SimBroker,
    Source,
    SimWorker,
    BrokerClient,
    SimJobs,
)
