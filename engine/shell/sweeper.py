"""The sweeper's pass: how the hole after the ACK is closed.

Once `evaluation.execute` is acknowledged, RabbitMQ forgets it; if the worker dies then,
nobody would ever resume the evaluation (the seed's design as written). Every worker's
sweeper re-publishes an evaluation whose running-index stamp went stale and whose lease
expired, then a delayed retry overdue by more than the grace (dead-lettering is not
publisher-confirmed: a retry can be lost, or never published if its worker died after
writing `failed_attempt_N`). Claims are compare-and-set scripts, so two sweepers never
both act, and a retry claim reads the rule's status in the same step, so the retry
published is the one after the attempt judged overdue.
"""

from __future__ import annotations

from collections.abc import Collection, Generator
from typing import Any

from engine.config import EngineConfig
from engine.core import parse_status
from engine.core.messages import LOST_RETRY_REASON, STALE_HEARTBEAT_REASON
from engine.keys import split_member
from engine.shell.effects import NOW, Effect, Log, PublishWork, Record, Sleep, Step, Store


def sweeper(config: EngineConfig, held: Collection[str]) -> Step:
    """The loop, for as long as the worker runs; `held` is the live set of evaluations in
    memory (the controller's)."""
    while True:
        yield Sleep(config.sweep_ms / 1000)
        try:
            yield from sweep(config, set(held))
        except Exception as exc:  # Redis or the broker away: the next pass tries again
            yield Log("warning", f"sweep failed: {exc}", exc)


def sweep(config: EngineConfig, held: Collection[str]) -> Generator[Effect, Any, None]:
    """One pass; `held` are the evaluations in this worker's memory (never re-published)."""
    stale_ms = config.stale_ms
    for attempt_id in (yield Store("stale_evaluations", (stale_ms,))):
        if attempt_id in held:
            continue
        claimed_from_ms = yield NOW  # the claim is atomic, somewhere after this
        if not (yield Store("claim_stale", (attempt_id, stale_ms))):
            continue
        published_ms = yield NOW
        body = {
            "type": "execute",
            "attempt_id": attempt_id,
            "reason": STALE_HEARTBEAT_REASON,
            "published_ms": published_ms,
        }
        yield PublishWork(body, f"{attempt_id}:resume:{published_ms}")
        yield Record(
            "sweeper_resumed", {"attempt_id": attempt_id, "claimed_from_ms": claimed_from_ms}
        )
    grace = config.grace_ms
    for member in (yield Store("overdue_retries", (grace,))):
        claimed_from_ms = yield NOW
        status = yield Store("claim_retry", (member, grace))
        attempt_id, rule_id = split_member(member)
        n = parse_status(status) if status else None
        if n is None:
            continue
        body = {
            "type": "retry",
            "attempt_id": attempt_id,
            "rule_id": rule_id,
            "attempt": n + 1,
            "reason": LOST_RETRY_REASON,
            "published_ms": (yield NOW),
            "delay_ms": 0,
        }
        yield PublishWork(body, f"{attempt_id}:{rule_id}:{n + 1}")
        yield Record(
            "sweeper_retried",
            {
                "attempt_id": attempt_id,
                "rule_id": rule_id,
                "attempt": n + 1,
                "claimed_from_ms": claimed_from_ms,
            },
        )
