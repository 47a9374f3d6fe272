"""ReEvaluateUseCase: on any (re)delivery, read Redis first and rebuild the DAG from it.

The read is one round trip (`RedisStore.begin`: lease, state, plan and every rule's keys);
the classification of what it finds (loaded / retrying / failed / fresh) is the core's
(`engine.core.recovery`), so the simulator recovers exactly the same way.
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.core import Evaluation, Snapshot
from engine.plan import Plan
from engine.runtime.context import Runtime
from engine.runtime.store import Begun


class ReEvaluateUseCase:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def read(self, attempt_id: str, plan: Plan | None, plan_in_message: bool) -> Begun:
        rule_ids = plan.order if plan else ()
        plan_json = plan.to_json() if plan and plan_in_message else None
        return await self.rt.store.begin(attempt_id, self.rt.worker_id, rule_ids, plan_json)

    def rebuild(
        self, plan: Plan, attempt_id: str, snapshot: Snapshot, due: Mapping[str, int]
    ) -> Evaluation:
        return Evaluation(
            plan,
            attempt_id,
            self.rt.config.policy,
            snapshot=snapshot,
            due=due,
            max_parallel=self.rt.config.max_parallel,
        )
