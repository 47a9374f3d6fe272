"""The names of the engine's Redis keys and index members: plain strings, no I/O.

Every key of an evaluation starts with `attempt:{attemptId}:`, so one evaluation's keys
are found (and purged) by that prefix.
"""

from __future__ import annotations

import re


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


CHECKPOINT_ID = re.compile(r"^chk_(\d{4,})$")


def checkpoint_id(number: int) -> str:
    """A run's checkpoint as the durable design names it: `chk_0001` is its first."""
    return f"chk_{number:04d}"


def checkpoint_number(name: str) -> int:
    """`chk_0042` -> 42; ValueError for anything else."""
    m = CHECKPOINT_ID.match(name)
    if m is None or int(m.group(1)) < 1:
        raise ValueError(f"expected a checkpoint id chk_0001, chk_0002, ...; got {name!r}")
    return int(m.group(1))
