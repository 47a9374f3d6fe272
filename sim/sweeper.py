"""Heartbeat and sweeper in the simulator, as `engine.runtime.sweeper` runs them.

The heartbeat renews the lease of each evaluation in memory every `heartbeat_ms` (one
pipelined batch) and drops those whose lease another worker took. The sweeper, every
`sweep_ms`, re-publishes evaluations whose running-index stamp is stale and whose lease
expired, then delayed retries overdue by more than the grace, each behind its claim
script. Both swallow what the live loops only log (Redis or the broker unreachable).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from engine.core import parse_status
from engine.runtime.store import split_member
from sim.broker import Unroutable

if TYPE_CHECKING:
    from sim.worker import SimWorker


def heartbeat(w: SimWorker) -> Generator[Any, Any, None]:
    period = w.config.heartbeat_ms / 1000
    while True:
        yield w.env.timeout(period)
        held = {a: orch.fence for a, orch in w.controller.evaluations.items()}
        if not held:
            continue
        try:
            ours = yield from w.store.call(w.redis.renew, held, w.worker_id, w.store.now_ms())
            for attempt_id, still in ours.items():
                orch = w.controller.evaluations.get(attempt_id)
                if orch is None or still == 1:
                    continue
                if still == 2:  # forgotten by a lossy Redis: ours again
                    yield from orch.reinstate()
                else:
                    yield from orch.abandon("lease lost")
        except ConnectionError:
            pass  # Redis away: leases may lapse, the owner keeps going


def sweeper(w: SimWorker) -> Generator[Any, Any, None]:
    period = w.config.sweep_ms / 1000
    while True:
        yield w.env.timeout(period)
        with contextlib.suppress(ConnectionError, Unroutable):  # logged by the live loop
            yield from sweep(w)


def sweep(w: SimWorker) -> Generator[Any, Any, None]:
    store, redis, config = w.store, w.redis, w.config
    stale_ms = config.stale_ms
    held = set(w.controller.evaluations)
    stale = yield from store.call(redis.stale_evaluations, stale_ms, store.now_ms())
    for attempt_id in stale:
        if attempt_id in held:
            continue
        claimed_from_ms = store.now_ms()  # the claim is atomic, somewhere after this
        if not (yield from store.call(redis.claim_stale, attempt_id, stale_ms, store.now_ms())):
            continue
        body = {
            "type": "execute",
            "attempt_id": attempt_id,
            "reason": "stale_heartbeat",
            "published_ms": store.now_ms(),
        }
        yield from w.broker.publish_work(body, f"{attempt_id}:resume:{body['published_ms']}")
        w.record("sweeper_resumed", attempt_id=attempt_id, claimed_from_ms=claimed_from_ms)
    grace = config.grace_ms
    overdue = yield from store.call(redis.overdue_retries, grace, store.now_ms())
    for member in overdue:
        claimed_from_ms = store.now_ms()
        status = yield from store.call(redis.claim_retry, member, grace, store.now_ms())
        attempt_id, rule_id = split_member(member)
        n = parse_status(status) if status else None
        if n is None:
            continue
        body = {
            "type": "retry",
            "attempt_id": attempt_id,
            "rule_id": rule_id,
            "attempt": n + 1,
            "reason": "lost_retry",
            "published_ms": store.now_ms(),
            "delay_ms": 0,
        }
        yield from w.broker.publish_work(body, f"{attempt_id}:{rule_id}:{n + 1}")
        w.record(
            "sweeper_retried",
            attempt_id=attempt_id,
            rule_id=rule_id,
            attempt=n + 1,
            claimed_from_ms=claimed_from_ms,
        )
