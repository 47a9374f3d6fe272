"""EvaluationModule: levels 2 and 3 of the seed.

Level 2 writes `failed_attempt_N` (with the retry's due time in the sweeper's index, in the
same script, counted from when the write lands) and only then publishes the retry to its
delay queue: a crash between the two leaves a status without a message, which the
sweeper finds overdue and re-publishes. The other order would leave a message for a rule
whose failure nobody recorded.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from engine.config import EngineConfig
from engine.core import PERMANENTLY_FAILED, PersistStatus, ScheduleRetry
from engine.shell.effects import NOW, Count, Effect, Failpoint, PublishRetry, Record, Store


def persist_status(
    config: EngineConfig,
    attempt_id: str,
    action: PersistStatus,
    fence: str | None = None,
    sent_ms: int = 0,
) -> Generator[Effect, Any, str | None]:
    """Write the status; return the evaluation's state if the store says it is over (a
    cancel): the caller then schedules no retry and starts nothing more. `sent_ms`: when
    the caller sent it (recorded with the token it carried)."""
    delay = None
    if action.retry_due_in_ms is not None:
        delay = round(action.retry_due_in_ms * config.time_scale)
    kept, over, due = yield Store(
        "write_status", (attempt_id, action.rule_id, action.status, delay, fence)
    )
    yield Record(
        "status_written",
        {
            "attempt_id": attempt_id,
            "rule_id": action.rule_id,
            "status": action.status,
            "kept": kept,
            "error": action.error,
            "due_ms": due,
            "fence": fence,
            "landed": True,
            "sent_ms": sent_ms,
        },
    )
    if action.status == PERMANENTLY_FAILED:
        yield Count("retries", labels=(("level", "3"),))
    else:
        yield Count("retries", labels=(("level", "2"),))
        yield Failpoint("after_status_write_before_retry_publish", action.rule_id, attempt_id)
    return over


def schedule_retry(
    config: EngineConfig, attempt_id: str, action: ScheduleRetry
) -> Generator[Effect, Any, None]:
    body = {
        "type": "retry",
        "attempt_id": attempt_id,
        "rule_id": action.rule_id,
        "attempt": action.attempt,
        "published_ms": (yield NOW),
        "delay_ms": round(action.delay_ms * config.time_scale),
    }
    msg_id = f"{attempt_id}:{action.rule_id}:{action.attempt}"
    yield PublishRetry(action.tier, action.bucket, body, msg_id)
    yield Record(
        "retry_published",
        {
            "attempt_id": attempt_id,
            "rule_id": action.rule_id,
            "attempt": action.attempt,
            "tier": action.tier + 1,
            "bucket": action.bucket,
            "delay_ms": body["delay_ms"],
            "sent_ms": body["published_ms"],
        },
    )
    yield Failpoint("after_retry_publish_before_ack", action.rule_id, attempt_id)
