"""Poison messages: what the runner's `publish_poison` fault puts on the work queue.

Each kind breaks the message contract one way (`engine.core.messages`): not JSON, a
field missing or of the wrong type, a type nobody handles, an `execute` with no plan
anywhere or with one that does not validate. The engine must drop each on arrival with one
`message_rejected` and ACK it: a poison message NACKed back comes round for ever, and one
that reaches a lease or a slot takes it from real work. The bytes are the same live and in
the simulator (its worker decodes them as the live worker does).
"""

from __future__ import annotations

from typing import Any

import orjson

#: Every kind, in the order a `publish_poison` fault publishes them, and the message
#: each makes from the attempt id it is given (None: the message names none).
_BODIES: dict[str, Any] = {
    "not_json": b"\xff\xfe{not json",
    "not_an_object": ["execute"],
    "no_type": lambda a: {"attempt_id": a, "published_ms": 0},
    "type_not_a_string": lambda a: {"type": 7, "attempt_id": a},
    "no_attempt_id": {"type": "execute", "published_ms": 0, "reason": "submit"},
    "empty_attempt_id": {
        "type": "execute", "attempt_id": "", "published_ms": 0, "reason": "submit",
    },
    "no_published_ms": lambda a: {"type": "execute", "attempt_id": a, "reason": "submit"},
    "unknown_type": lambda a: {"type": "explode", "attempt_id": a},
    "unknown_reason": lambda a: {
        "type": "execute", "attempt_id": a, "published_ms": 0, "reason": "because",
    },
    "retry_without_rule": lambda a: {
        "type": "retry", "attempt_id": a, "attempt": 2, "published_ms": 0, "delay_ms": 0,
    },
    "retry_delay_not_an_integer": lambda a: {
        "type": "retry", "attempt_id": a, "rule_id": "compiles", "attempt": 2,
        "published_ms": 0, "delay_ms": "soon",
    },
    "retry_of_no_attempt": lambda a: {
        "type": "retry", "attempt_id": a, "rule_id": "compiles", "attempt": "two",
        "published_ms": 0, "delay_ms": 0,
    },
    "execute_naming_a_rule": lambda a: {
        "type": "execute", "attempt_id": a, "rule_id": "compiles", "published_ms": 0,
    },
    "no_plan": lambda a: {
        "type": "execute", "attempt_id": a, "published_ms": 0, "reason": "submit",
    },
    "bad_plan": lambda a: {
        "type": "execute", "attempt_id": a, "published_ms": 0, "reason": "submit",
        "plan": {"plan": "broken", "passes": [{"id": "p", "rules": [{"id": ""}]}]},
    },
}  # fmt: skip
POISON_KINDS: tuple[str, ...] = tuple(_BODIES)
#: The kinds refused for their shape (`message_rejected` reason `malformed`); the others
#: carry a reason of their own: the unknown type, `no plan`, or the plan's error line.
MALFORMED: frozenset[str] = frozenset(POISON_KINDS) - {"unknown_type", "no_plan", "bad_plan"}
#: The kinds whose message names no attempt id (their rejection cannot name one either).
NAMELESS: frozenset[str] = frozenset(
    {"not_json", "not_an_object", "no_attempt_id", "empty_attempt_id"}
)
#: How the rejection of each malformed kind starts its `detail`: the field it is about.
DETAILS: dict[str, str] = {
    "not_json": "not a JSON object",
    "not_an_object": "not a JSON object",
    "no_type": "type: ",
    "type_not_a_string": "type: ",
    "no_attempt_id": "attempt_id: ",
    "empty_attempt_id": "attempt_id: ",
    "no_published_ms": "published_ms: ",
    "unknown_reason": "reason: expected one of lost_retry, resume, stale_heartbeat, submit",
    "retry_without_rule": "rule_id: ",
    "retry_delay_not_an_integer": "delay_ms: ",
    "retry_of_no_attempt": "attempt: ",
    "execute_naming_a_rule": "an execute names no rule and no attempt",
}


def poison(kind: str, attempt_id: str) -> bytes:
    """The message of `kind`, naming `attempt_id` where it names one."""
    body = _BODIES[kind]
    if isinstance(body, bytes):
        return body
    return orjson.dumps(body(attempt_id) if callable(body) else body)


def expected_reason(kind: str, attempt_id: str) -> str:
    """How the rejection of a `kind` poison starts (`message_rejected.reason`)."""
    if kind in MALFORMED:
        return "malformed"
    if kind == "unknown_type":
        return "explode"
    if kind == "no_plan":
        return "no plan"
    return f"plan of {attempt_id}"
