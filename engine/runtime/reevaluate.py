"""ReEvaluateUseCase: on any (re)delivery, read Redis first and rebuild the DAG from it.

The classification itself (loaded / retrying / failed / fresh) is the core's
(`engine.core.recovery`); this shell only fetches the snapshot in one round trip.
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.core import Evaluation
from engine.plan import Plan
from engine.runtime.context import Runtime


class ReEvaluateUseCase:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def load(self, plan: Plan, attempt_id: str, due: Mapping[str, int]) -> Evaluation:
        snapshot = await self.rt.store.snapshot(attempt_id, plan.order)
        return Evaluation(
            plan,
            attempt_id,
            self.rt.config.policy,
            snapshot=snapshot,
            due=due,
            max_parallel=self.rt.config.max_parallel,
        )
