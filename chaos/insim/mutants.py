"""`chaos.mutants` in the simulator: the services' mutants as switches, the others as patches.

A live mutant runs in its own worker process, so its monkeypatch dies with it. The
simulator runs many engines in one process, one after the other, so:
- mutants of the modelled broker and of the run (the broker's delay queues, the worker's
  config, the agent, the history writer) are switched on by name where the simulator
  models them (`SHELL`, see chaos/insim/run.py);
- mutants of the pure core and of the worker's protocol (`engine.shell`: the controller,
  the orchestrator, the sweep) are chaos.mutants' own patch functions, applied by
  `patched` around one run: it saves the namespace of every object such a patch may
  touch and puts it back afterwards, so a clean run that follows is the clean engine;
- mutants of a Lua script whose reference is a method of `SimRedis` are patched there the
  same way (`PATCHED`), the live patch's counterpart, saved and restored alike.
A mutant `chaos.mutants` gains later fails here loudly until the simulator models it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from engine.core import evaluation
from engine.core.evaluation import Evaluation
from engine.policy import RetryPolicy
from engine.runtime.store import eval_key
from engine.shell import controller, orchestrator, reevaluate
from engine.shell import sweeper as shell_sweeper
from sim.broker import SHARED_DELAY_QUEUE, Message, Queue, SimBroker
from sim.redis import SimRedis

#: Switched on where the simulator models them (see chaos/insim/run.py).
SHELL: dict[str, str] = {
    "no_sweeper": "workers run without the sweeper",
    "nondeterministic_agent": "FakeAgent(nondeterministic=True) with a seed-derived salt",
    "drop_history_events": "a worker's history source skips every 7th seq (chaos.mutants)",
}
#: Patches of the pure core and of the shared shell (`engine.shell`), applied with
#: `patched`: chaos.mutants' own patch, exactly as live.
CORE: tuple[str, ...] = (
    "sweep_wrong_attempt",
    "no_redis_results",
    "spurious_cancel",
    "double_final_publish",
    "no_completed_event",
    "start_after_cancel",
    "prune_everything",
    "prune_nothing",
    "reset_attempts_on_recovery",
    "ignore_dag",
    "no_immediate_retries",
    "give_up_early",
    "slow_tier",
    "all_passes_complete",
)
#: Every object a core patch may change: saved and restored whole.
_OWNERS: tuple[Any, ...] = (
    Evaluation,
    evaluation,
    RetryPolicy,
    shell_sweeper,
    orchestrator,
    orchestrator.PassExecutionOrchestrator,
    controller.EvaluationController,
    reevaluate.ReEvaluateUseCase,
)

_active: list[str] = []


def known() -> tuple[str, ...]:
    """Every mutant of `chaos.mutants.MUTANTS`, checked to be modelled here."""
    from chaos.mutants import MUTANTS

    missing = [m for m in MUTANTS if m not in SHELL and m not in CORE and m not in PATCHED]
    if missing:
        raise NotImplementedError(f"the simulator does not model mutant(s) {missing}")
    return tuple(MUTANTS)


def history_drops(name: str | None) -> Callable[[int], bool] | None:
    """For `drop_history_events`, which `seq` a worker's history source numbers and does
    not write: `chaos.mutants.history_drops`, the live patch's own rule; None otherwise."""
    if name != "drop_history_events":
        return None
    from chaos import mutants

    return mutants.history_drops


@contextlib.contextmanager
def patched(name: str | None) -> Iterator[None]:
    """Apply mutant `name` of `CORE` or `PATCHED` (nothing for None or one of `SHELL`) for
    the duration."""
    if name is None or name in SHELL:
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
            self._set(key, result, None)
        return existing

    SimRedis.set_result = set_nx  # type: ignore[method-assign]


def _overwrite_result() -> None:
    """The live patch's blind `SET ... EX` past the fence: the last write wins, and every
    write reports that it won."""
    write_result = SimRedis.write_result

    def blind_write(self: SimRedis, a: str, result: Any, starts: Any, fence: Any = None) -> Any:
        return write_result(self, a, result, starts, None)

    def set_ex(self: SimRedis, key: str, result: Any) -> None:
        self._set(key, result, self.ttl)

    SimRedis.write_result = blind_write  # type: ignore[method-assign]
    SimRedis.set_result = set_ex  # type: ignore[method-assign]


def _per_message_ttl() -> None:
    """The live patch's topology: every retry in one shared delay queue, its tier's TTL
    carried by the message (and, as in RabbitMQ, expiring only at the queue's head)."""

    def publish_shared(self: SimBroker, route: tuple[int, int], body: Any, msg_id: str) -> bool:
        shared = self.queues.get(SHARED_DELAY_QUEUE)
        if shared is None:
            shared = self.queues[SHARED_DELAY_QUEUE] = Queue(SHARED_DELAY_QUEUE, delay=True)
        self.hold(shared, Message(body, msg_id), self.tier_ttl[route])
        return True

    SimBroker.publish_delay = publish_shared  # type: ignore[method-assign]


#: Mutants of a Lua script or of the broker's topology, patched on their model in `SimRedis`
#: or `SimBroker` with `patched`, like the core's.
PATCHED: dict[str, Callable[[], None]] = {
    "per_message_ttl": _per_message_ttl,
    "result_without_ttl": _result_without_ttl,
    "overwrite_result": _overwrite_result,
    "leak_running_index": _leak_running_index,
    "needless_rerun": _needless_rerun,
    "ignore_lease": _ignore_lease,
    "no_fencing": _no_fencing,
}
#: Every object a patch of `PATCHED` may change: saved and restored whole.
_SHELL_OWNERS: tuple[Any, ...] = (SimRedis, SimBroker)
