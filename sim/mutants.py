"""`chaos.mutants` in the simulator: the shell's mutants as switches, the core's as patches.

A live mutant runs in its own worker process, so its monkeypatch dies with it. The
simulator runs many engines in one process, one after the other, so:
- mutants of the shell (a Redis script, the broker's delay queues, the worker's config, the
  agent, the final publish, ReEvaluateUseCase's read) are modelled by the sim's own
  shell, switched on by name (`SHELL`);
- mutants of the pure core are chaos.mutants' own patch functions, applied by `patched`
  around one run: it saves the namespace of every object such a patch may touch and puts
  it back afterwards, so a clean run that follows is the clean engine again.
A mutant `chaos.mutants` gains later fails here loudly until the simulator models it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from engine.core import evaluation
from engine.core.evaluation import Evaluation

#: Modelled by the simulator's shell (see sim/run.py for where each is switched).
SHELL: dict[str, str] = {
    "no_redis_results": "the controller rebuilds the core from a snapshot without results",
    "no_sweeper": "workers run without the sweeper",
    "nondeterministic_agent": "FakeAgent(nondeterministic=True) with a seed-derived salt",
    "per_message_ttl": "one shared delay queue, per-message TTLs, expiring at its head",
    "result_without_ttl": "rule results are written without EX",
    "double_final_publish": "evaluation.completed is published twice",
}
#: Patches of the pure core, applied with `patched`.
CORE: tuple[str, ...] = ("prune_everything", "prune_nothing", "reset_attempts_on_recovery")
#: Every object a core patch may change: saved and restored whole.
_OWNERS: tuple[Any, ...] = (Evaluation, evaluation)

_active: list[str] = []


def known() -> tuple[str, ...]:
    """Every mutant of `chaos.mutants.MUTANTS`, checked to be modelled here."""
    from chaos.mutants import MUTANTS

    missing = [m for m in MUTANTS if m not in SHELL and m not in CORE]
    if missing:
        raise NotImplementedError(f"the simulator does not model mutant(s) {missing}")
    return tuple(MUTANTS)


@contextlib.contextmanager
def patched(name: str | None) -> Iterator[None]:
    """Apply core mutant `name` (nothing for None or a shell mutant) for the duration."""
    if name is None or name in SHELL:
        yield
        return
    if name not in CORE:
        known()
        raise ValueError(f"unknown mutant {name!r}; expected one of {', '.join(known())}")
    if _active:
        raise RuntimeError(f"mutant {_active[0]} is already applied in this process")
    from chaos import mutants

    saved = [(owner, dict(vars(owner))) for owner in _OWNERS]
    _active.append(name)
    try:
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
