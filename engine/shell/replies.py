"""What the store's operations answer, apart from the store (`engine.runtime.store`) so
that the simulator's Redis (`sim.redis`) answers the same without importing redis-py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from engine.core import Snapshot


class LeaseLost(Exception):
    """An owner's write was refused: another worker acquired the lease since (the fence)."""


class Renewal(int):
    """`renew`'s answer for one evaluation: 0 lost, 1 still ours, 2 forgotten by Redis and
    ours again (an int, as it always was), and `expires_ms`: when the lease runs out once
    renewed, as the store computed it (its `PEXPIRETIME`, Unix ms by its clock; None: lost,
    or not told)."""

    expires_ms: int | None

    def __new__(cls, code: int, expires_ms: int | None = None) -> Renewal:
        out = super().__new__(cls, code)
        out.expires_ms = expires_ms
        return out

    def __repr__(self) -> str:
        return f"Renewal({int(self)}, expires_ms={self.expires_ms})"


class StatusWritten(NamedTuple):
    """What `RedisStore.write_status` did."""

    kept: str | None  # the status kept instead (the write would have moved the count back)
    over: str | None  # the evaluation's terminal state: its retry is not indexed
    due_ms: int | None  # when the retry is due, by the store's clock (None: not indexed)


@dataclass(frozen=True)
class Begun:
    """What `RedisStore.begin` found: exactly one of the outcomes is set."""

    holder: str | None = None  # another worker holds the lease
    fence: str = ""  # the token of this acquisition, carried by every write of the owner
    terminal: str | None = None  # the evaluation is over (and `published` says if announced)
    published: bool = False
    no_plan: bool = False
    plan_json: str | None = None
    snapshot: Snapshot | None = None
