"""What a message on the work and control queues must carry, checked before anything acts.

A message that does not fit (not JSON, a field missing or of the wrong type, an unknown
`reason`) is a poison message: whatever the engine did with it would fail the same way at
every delivery, and a delivery that fails goes back to its queue (the store may be what
failed). So it is dropped on arrival, ACKed with one `message_rejected` record, and never
reaches a lease, a slot or a failed delivery.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

#: Why an `execute` was published: `engine.submit`, the sweeper's resume of an evaluation
#: whose owner stopped beating, the sweeper's re-publish of a retry it found lost.
SUBMIT_REASON = "submit"
STALE_HEARTBEAT_REASON = "stale_heartbeat"
LOST_RETRY_REASON = "lost_retry"
#: A run resumed from a checkpoint on request (`engine.submit --resume`).
RESUME_REASON = "resume"
REASONS = frozenset({SUBMIT_REASON, STALE_HEARTBEAT_REASON, LOST_RETRY_REASON, RESUME_REASON})


def decode(raw: bytes) -> Any:
    """A message's body as the controller takes it: None when it is not JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def problem(body: Any) -> str | None:
    """What makes `body` (the decoded message; None: it did not decode) a poison message,
    in a few words; None when it fits. Only the shape is judged here: a type nobody
    handles, or a plan that does not validate, is refused later with its own reason."""
    if not isinstance(body, Mapping):
        return "not a JSON object"
    kind, attempt_id = body.get("type"), body.get("attempt_id")
    if not isinstance(kind, str):
        return "type: expected a string"
    if not isinstance(attempt_id, str) or not attempt_id:
        return "attempt_id: expected a non-empty string"
    if kind not in ("execute", "retry"):
        return None
    if not _is_int(body.get("published_ms")):
        return "published_ms: expected an integer"
    reason = body.get("reason")
    if reason is not None and reason not in REASONS:
        return f"reason: expected one of {', '.join(sorted(REASONS))}"
    delay = body.get("delay_ms")
    if delay is not None and not _is_int(delay):
        return "delay_ms: expected an integer"
    rule_id, attempt = body.get("rule_id"), body.get("attempt")
    if kind == "retry":
        if not isinstance(rule_id, str):
            return "rule_id: a retry names its rule"
        if not (_is_int(attempt) and attempt >= 2):
            return "attempt: a retry is of attempt 2 or later"
    elif rule_id is not None or attempt is not None:
        return "an execute names no rule and no attempt"
    return None
