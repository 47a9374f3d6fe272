"""Bugs planted in the shared shell (`engine.shell`) are found by the simulator's explorer.

The simulator runs the shell that ships, so a protocol bug planted there is a bug of the
simulated worker too: `chaos sim` must find it within 1,000 swarm seeds of a shipped
scenario. Each bug below is a patch of one step (none is in `chaos.mutants`' table); the
search runs seed after seed, stops at the first failing one and names the invariant that
caught it. The seed it stops at is printed, so a change that makes a bug harder to find
shows here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chaos.explore import document, simulate, swarm
from chaos.scenario import load_scenario
from engine.shell import module
from engine.shell.effects import PublishWork, Step, Stepper
from engine.shell.orchestrator import PassExecutionOrchestrator

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"
SEEDS = 1000


def _blind_before_the_call(mp: pytest.MonkeyPatch) -> None:
    """The lease is not asked again right before the agent call: a worker paused after
    its start was allowed calls the agent for a rule its successor has finished."""

    def still_ours(self: PassExecutionOrchestrator) -> Step:
        return self._over is None
        yield  # a step that yields nothing

    mp.setattr(PassExecutionOrchestrator, "_still_ours", still_ours)


def _retry_a_tier_late(mp: pytest.MonkeyPatch) -> None:
    """Level 2 publishes a retry to the delay tier after the one its attempt asks for."""
    schedule_retry = module.schedule_retry

    def late(config: Any, attempt_id: str, action: Any) -> Step:
        later = dataclasses.replace(action, tier=min(action.tier + 1, 2), bucket=0)
        return (yield from schedule_retry(config, attempt_id, later))

    mp.setattr(module, "schedule_retry", late)


def _announce_without_final_state(mp: pytest.MonkeyPatch) -> None:
    """The final state is announced without being made durable first."""

    def confirm_final(self: PassExecutionOrchestrator, action: Any, again: bool = False) -> Step:
        return None
        yield  # a step that yields nothing

    mp.setattr(PassExecutionOrchestrator, "_confirm_final", confirm_final)


def _sweep_resumes_nothing_lost(mp: pytest.MonkeyPatch) -> None:
    """The sweeper claims an overdue retry but republishes the attempt that failed, not the
    next one: the copy is stale, and the retry it stands for never runs."""
    from engine.shell import sweeper

    sweep = sweeper.sweep

    def stale_attempt(config: Any, held: Any) -> Step:
        stepper = Stepper(sweep(config, held))
        while (effect := stepper.next()) is not None:
            if isinstance(effect, PublishWork) and effect.body.get("reason") == "lost_retry":
                body = dict(effect.body, attempt=effect.body["attempt"] - 1)
                effect = PublishWork(body, effect.message_id)
            try:
                stepper.reply((yield effect))
            except BaseException as exc:
                stepper.fail(exc)
        return stepper.value

    mp.setattr(sweeper, "sweep", stale_attempt)


#: bug -> (shipped scenario, an invariant that must catch it)
PLANTED: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str, str]] = {
    "lease_not_rechecked_before_the_call": (
        _blind_before_the_call,
        "regressions/paused-before-call-no-completed-rerun-s4.yaml",
        "no_completed_rerun",
    ),
    "retry_published_a_tier_late": (
        _retry_a_tier_late,
        "transient_llm_errors.yaml",
        "retry_delays_respected",
    ),
    "announced_before_durable": (
        _announce_without_final_state,
        "crash_after_ack.yaml",
        "all_terminal",
    ),
    "sweeper_republishes_the_failed_attempt": (
        _sweep_resumes_nothing_lost,
        "lost_dead_letter.yaml",
        "all_terminal",
    ),
}


def first_failure(data: dict[str, Any]) -> tuple[int, tuple[str, ...], str] | None:
    for seed in range(SEEDS):
        result = simulate(swarm(data, seed))
        if not result.ok:
            return seed, result.failed, result.message
    return None


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_a_bug_planted_in_the_shared_shell_is_found_in_sim(
    bug: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plant, scenario, invariant = PLANTED[bug]
    data = document(load_scenario(SCENARIOS / scenario))
    plant(monkeypatch)
    found = first_failure(data)
    assert found is not None, f"{bug}: not found in {SEEDS} seeds of {scenario}"
    seed, failed, message = found
    print(f"{bug}: seed {seed} of {scenario}: {failed}: {message}")
    assert invariant in failed, (seed, failed, message)
    monkeypatch.undo()  # the same seed, with the shell that ships: the bug made it fail
    assert simulate(swarm(data, seed)).ok
