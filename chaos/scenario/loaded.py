"""A validated scenario with its plans loaded, and what runs are made of it: the attemptIds,
the submissions, the failpoint specs of each worker and the checker's spec."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from chaos.checker import CheckSpec, RetrySettings
from chaos.checker.records import COST_BUDGETS
from chaos.scenario.faults import PlannedFault, fault_schedule
from chaos.scenario.schema import Scenario
from chaos.systems import SYSTEMS
from engine.agent import AgentProfile
from engine.plan import Plan
from engine.policy import (
    RetryPolicy,
)

if TYPE_CHECKING:
    from chaos.reference import Draws

# --- the loaded scenario ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Submission:
    """One evaluation the run submits; `index` is what `evaluation` and cancel `target`
    refer to (plan order, then number)."""

    index: int
    plan_index: int
    number: int  # 0-based, within its plan's evaluations
    plan: Plan


@dataclass(frozen=True)
class LoadedScenario:
    """A validated scenario with its plans loaded and its profiles built."""

    spec: Scenario
    source: str
    plans: tuple[tuple[Plan, int], ...]  # (plan, evaluations), in file order
    plan_paths: tuple[Path, ...]  # where each plan was found
    agent: AgentProfile
    retry_policy: RetryPolicy

    @property
    def path(self) -> Path:
        return Path(self.source)

    @staticmethod
    def id_prefix(seed: int) -> str:
        return f"s{seed}-"

    def evaluations(self, seed: int) -> dict[str, Plan]:
        """The attemptIds of a run under `seed`, in submission order, with their plans.

        They come from the seed and the plans, not from the run: the fake agent draws from
        them, so the same seed replays the same calls, live and simulated alike.
        """
        prefix = self.id_prefix(seed)
        return {f"{prefix}{plan.id}-{k}": plan for plan, count in self.plans for k in range(count)}

    def check_spec(
        self,
        seed: int,
        plans: dict[str, Plan],
        cancelled: set[str],
        agent: AgentProfile,
        *,
        reference: bool = True,
        draws: Draws | None = None,
    ) -> CheckSpec:
        """What the checker needs of this scenario, for a run under `seed` (live or sim),
        with the fault-free reference of the same evaluations (`chaos.reference`: the core
        alone, well under a millisecond an evaluation) unless `reference` is False; `draws`:
        the calls the run drew, which the reference reads rather than draws again."""
        from chaos.reference import reference_for

        budgets = self.spec.budgets
        latency = budgets.max_retry_latency_s
        return CheckSpec(
            reference=reference_for(self, seed, plans, draws) if reference else None,
            plans=plans,
            agent=agent,
            # the scenario's settings as plain data: the checker computes the tiers itself
            policy=RetrySettings.of(self.spec.retry),
            time_scale=self.spec.time_scale,
            max_parallel=self.spec.engine.max_parallel,
            max_evaluations=self.spec.engine.max_evaluations,
            invariants=tuple(self.spec.invariants),
            exercised=dict(self.spec.exercised),
            cancelled=set(cancelled),
            budgets={
                "max_duplicated_tokens": budgets.max_duplicated_tokens,
                "max_reruns": budgets.max_reruns,
                # the scenario states it in engine time; the checker measures run time
                "max_retry_latency_s": None if latency is None else latency * self.spec.time_scale,
                **{name: getattr(budgets, name) for name in COST_BUDGETS},
            },
            price_per_1k_tokens=budgets.price_per_1k_tokens,
            not_applicable=dict(SYSTEMS[self.spec.system].not_applicable),
            brokers=SYSTEMS[self.spec.system].brokers,
            start_markers=SYSTEMS[self.spec.system].start_markers,
            retries_in_due_order=SYSTEMS[self.spec.system].retries_in_due_order,
            faults_planned=tuple(f.label for f in self.schedule(random.Random(seed))),
            failpoints=tuple(
                (f.failpoint, f.rule, None if f.evaluation is None else list(plans)[f.evaluation])
                for _, f in self.spec.failpoint_faults
            ),
        )

    @cached_property
    def submissions(self) -> tuple[Submission, ...]:
        out: list[Submission] = []
        for pi, (plan, count) in enumerate(self.plans):
            out += [Submission(len(out) + n, pi, n, plan) for n in range(count)]
        return tuple(out)

    def failpoint_specs(self, worker: int, attempt_ids: Sequence[str]) -> str:
        """`ENGINE_FAILPOINTS` for worker `worker`; `attempt_ids[i]` is submission i's id."""
        if len(attempt_ids) != self.spec.total_evaluations:
            raise ValueError(
                f"expected {self.spec.total_evaluations} attempt ids; got {len(attempt_ids)}"
            )
        return ";".join(
            f.to_spec(None if f.evaluation is None else attempt_ids[f.evaluation])
            for _, f in self.spec.failpoint_faults
            if f.arms(worker)
        )

    def schedule(self, rng: random.Random | None = None) -> list[PlannedFault]:
        return fault_schedule(self, rng)
