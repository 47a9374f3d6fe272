"""ReEvaluateUseCase: on any (re)delivery, read Redis first and rebuild the DAG from it.

The read is one round trip (the store's `begin`: lease, state, plan and every rule's
keys); the classification of what it finds (loaded / retrying / failed / fresh) is the
core's (`engine.core.recovery`).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import Any

from engine.config import EngineConfig
from engine.core import Evaluation, Snapshot
from engine.plan import Plan
from engine.shell.effects import Effect, PublishEvent, Store


class ReEvaluateUseCase:
    def __init__(self, config: EngineConfig, worker_id: str) -> None:
        self.config = config
        self.worker_id = worker_id

    def read(
        self,
        attempt_id: str,
        plan: Plan | None,
        plan_in_message: bool,
        event: PublishEvent | None = None,
    ) -> Generator[Effect, Any, Any]:
        """The store's `Begun`; the plan is stored when it came in the message. `event`:
        `evaluation.started`, written by begin's transaction where events are rows of the
        store."""
        rule_ids = plan.order if plan else ()
        stored = plan if plan is not None and plan_in_message else None
        return (yield Store("begin", (attempt_id, self.worker_id, rule_ids, stored), event))

    def rebuild(
        self, plan: Plan, attempt_id: str, snapshot: Snapshot, due: Mapping[str, int]
    ) -> Evaluation:
        return Evaluation(
            plan,
            attempt_id,
            self.config.policy,
            snapshot=snapshot,
            due=due,
            max_parallel=self.config.max_parallel,
        )
