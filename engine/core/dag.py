"""The graph's rules: when a rule may start, what a permanent failure prunes, what a pass
announces. Pure functions of a plan and its rules' states, looked up here by the core at
each decision, so that each rule of the seed's DAG is stated once, and in one place.

The mutants that break a rule of the graph (`chaos.mutants`: `ignore_dag`, `prune_nothing`,
`prune_everything`, `all_passes_complete`) replace one of these functions, live in a
worker process and in the simulator alike.
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.core.states import RuleState
from engine.plan import Pass, Plan

States = Mapping[str, RuleState]


_SUCCEEDED = RuleState.SUCCEEDED  # a plain name: read for every pending rule, every input


def ready(plan: Plan, state: States, rule_id: str) -> bool:
    """A pending rule may start once every rule it depends on has succeeded."""
    # `all(...)` without its generator: asked for every pending rule at every input
    for d in plan.rules[rule_id].depends_on:  # noqa: SIM110
        if state[d] is not _SUCCEEDED:
            return False
    return True


def pruned(plan: Plan, state: States, failed: str) -> tuple[str, ...]:
    """What the permanent failure of `failed` skips: its transitive dependents still
    pending, in plan order; every other rule goes on."""
    doomed = plan.transitive_dependents([failed])
    return tuple(r for r in plan.order if r in doomed and state[r] is RuleState.PENDING)


def pass_outcome(p: Pass, state: States) -> str:
    """A pass whose rules are all terminal is `complete` if every one succeeded, otherwise
    `partial` (a rule failed for good or was skipped)."""
    return "complete" if all(state[r] is RuleState.SUCCEEDED for r in p.rule_ids) else "partial"
