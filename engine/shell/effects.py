"""What a step of the protocol asks of the world, as plain values.

A driver carries each one out and sends the result back into the generator (or throws the
error in: a store that is down, a publish that is refused, a cancellation).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Store:
    """A store operation: a `RedisStore` method live, its reference in `sim.redis` (the
    table `sim.redis.REFERENCES`); the reply is sent back."""

    op: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class PublishWork:
    """A message for the work queue (mandatory: an unroutable one raises)."""

    body: Mapping[str, Any]
    message_id: str


@dataclass(frozen=True, slots=True)
class Record:
    """A history event of this worker."""

    event: str
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Clock:
    """The time in ms: the wall clock live, the simulated one in sim."""


NOW = Clock()

Effect = Store | PublishWork | Record | Clock


class Stepper:
    """One step as a driver turns it: `next()` is the next effect, or None once the step
    has ended (`value` is then what it returned); the effect's outcome goes back in with
    `reply` or `fail`. The one loop both drivers turn."""

    def __init__(self, step: Generator[Effect, Any, Any]) -> None:
        self._step = step
        self._reply: Any = None
        self._error: BaseException | None = None
        self.value: Any = None

    def next(self) -> Effect | None:
        reply, error, self._reply, self._error = self._reply, self._error, None, None
        try:
            return self._step.throw(error) if error is not None else self._step.send(reply)
        except StopIteration as done:
            self.value = done.value
            return None

    def reply(self, value: Any) -> None:
        self._reply = value

    def fail(self, error: BaseException) -> None:
        self._error = error
