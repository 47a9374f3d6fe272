"""EvaluationModule in the simulator: levels 2 and 3, as `engine.runtime.module` does them.

`failed_attempt_N` (with the retry's due time in the sweeper's index) is written first, the
retry published to its delay queue second; the history events and failpoints sit where
the live module has them.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from engine.core import PERMANENTLY_FAILED, PersistStatus, ScheduleRetry

if TYPE_CHECKING:
    from sim.worker import SimWorker


def persist_status(
    w: SimWorker, a: str, action: PersistStatus, fence: str | None = None
) -> Generator[Any, Any, str | None]:
    """The status write; returns the evaluation's state if the store says it is over."""
    delay = None
    if action.retry_due_in_ms is not None:
        delay = round(action.retry_due_in_ms * w.config.time_scale)
    kept, over, due = yield from w.store.call(
        w.redis.write_status, a, action.rule_id, action.status, delay, fence
    )
    w.record(
        "status_written",
        attempt_id=a,
        rule_id=action.rule_id,
        status=action.status,
        kept=kept,
        error=action.error,
        due_ms=due,
    )
    if action.status != PERMANENTLY_FAILED and w.fp:
        yield from w.fp.hit("after_status_write_before_retry_publish", action.rule_id, a)
    return over


def schedule_retry(w: SimWorker, a: str, action: ScheduleRetry) -> Generator[Any, Any, None]:
    body = {
        "type": "retry",
        "attempt_id": a,
        "rule_id": action.rule_id,
        "attempt": action.attempt,
        "published_ms": w.store.now_ms(),
        "delay_ms": round(action.delay_ms * w.config.time_scale),
    }
    msg_id = f"{a}:{action.rule_id}:{action.attempt}"
    yield from w.broker.publish_retry(action.tier, action.bucket, body, msg_id)
    w.record(
        "retry_published",
        attempt_id=a,
        rule_id=action.rule_id,
        attempt=action.attempt,
        tier=action.tier + 1,
        bucket=action.bucket,
        delay_ms=body["delay_ms"],
    )
    if w.fp:
        yield from w.fp.hit("after_retry_publish_before_ack", action.rule_id, a)
