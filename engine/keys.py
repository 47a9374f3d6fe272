"""The names of the engine's Redis keys and index members: plain strings, no I/O.

Every key of an evaluation starts with `attempt:{attemptId}:`, so one evaluation's keys
are found (and purged) by that prefix.
"""

from __future__ import annotations


def result_key(attempt_id: str, rule_id: str) -> str:
    return f"attempt:{attempt_id}:rule:{rule_id}:result"


def status_key(attempt_id: str, rule_id: str) -> str:
    return f"attempt:{attempt_id}:rule:{rule_id}:status"


def runs_key(attempt_id: str, rule_id: str) -> str:
    return f"attempt:{attempt_id}:rule:{rule_id}:runs"


def eval_key(attempt_id: str, what: str) -> str:
    """plan | state | passes | owner | final_published"""
    return f"attempt:{attempt_id}:{what}"


def retry_member(attempt_id: str, rule_id: str) -> str:
    return f"{attempt_id}\x1f{rule_id}"


def split_member(member: str) -> tuple[str, str]:
    attempt_id, _, rule_id = member.partition("\x1f")
    return attempt_id, rule_id
