"""EvaluationModule: levels 2 and 3 of the seed, carried out on Redis and RabbitMQ.

Level 2 writes `failed_attempt_N` (with the retry's due time in the sweeper's index, in the
same script, counted from when the write lands) and only then publishes the retry to its
delay queue: a crash between the two leaves a status without a message, which the
sweeper finds overdue and re-publishes. The other order would leave a message for a rule
whose failure nobody recorded.
"""

from __future__ import annotations

from engine.core import PERMANENTLY_FAILED, PersistStatus, ScheduleRetry
from engine.runtime.context import Runtime
from engine.runtime.store import now_ms


class EvaluationModule:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    async def persist_status(
        self, attempt_id: str, action: PersistStatus, fence: str | None = None
    ) -> str | None:
        """Write the status; return the evaluation's state if the store says it is over (a
        cancel): the caller then schedules no retry and starts nothing more."""
        rt = self.rt
        delay = None
        if action.retry_due_in_ms is not None:
            delay = round(action.retry_due_in_ms * rt.config.time_scale)
        kept, over, due = await rt.store.write_status(
            attempt_id, action.rule_id, action.status, delay, fence
        )
        rt.history.record(
            "status_written",
            attempt_id=attempt_id,
            rule_id=action.rule_id,
            status=action.status,
            kept=kept,
            error=action.error,
            due_ms=due,
        )
        if action.status == PERMANENTLY_FAILED:
            rt.metrics.retries.labels(level="3").inc()
        else:
            rt.metrics.retries.labels(level="2").inc()
            await rt.failpoints.hit(
                "after_status_write_before_retry_publish", action.rule_id, attempt_id
            )
        return over

    async def schedule_retry(self, attempt_id: str, action: ScheduleRetry) -> None:
        rt = self.rt
        body = {
            "type": "retry",
            "attempt_id": attempt_id,
            "rule_id": action.rule_id,
            "attempt": action.attempt,
            "published_ms": now_ms(),
            "delay_ms": round(action.delay_ms * rt.config.time_scale),
        }
        msg_id = f"{attempt_id}:{action.rule_id}:{action.attempt}"
        await rt.broker.publish_retry(action.tier, action.bucket, body, msg_id)
        rt.history.record(
            "retry_published",
            attempt_id=attempt_id,
            rule_id=action.rule_id,
            attempt=action.attempt,
            tier=action.tier + 1,
            bucket=action.bucket,
            delay_ms=body["delay_ms"],
        )
        await rt.failpoints.hit("after_retry_publish_before_ack", action.rule_id, attempt_id)
