"""What a step of the protocol asks of the world, as plain values.

A driver carries each one out and sends the result back into the generator (or throws the
error in: a store that is down, a publish that is refused, a cancellation).

Values that nobody changes once yielded, though not frozen: a frozen dataclass builds
itself through `object.__setattr__`, three times the cost of a plain slotted one, and a
worker builds about a dozen effects a rule.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine.plan import Rule


@dataclass(slots=True)
class Store:
    """A store operation: a `RedisStore` method live, its reference in `sim.redis` (the
    table `sim.redis.REFERENCES`); the reply is sent back.

    `event`: where events are rows of the store (an outbox: `Host.outbox`), the event this
    operation's change announces, written by its transaction if the operation takes effect
    (migration 0005's `eai._took_effect`, `sim.redis.took_effect`); never set on a broker's
    design, which publishes its events apart."""

    op: str
    args: tuple[Any, ...] = ()
    event: PublishEvent | None = None


@dataclass(slots=True)
class PublishWork:
    """A message for the work queue (mandatory: an unroutable one raises)."""

    body: Mapping[str, Any]
    message_id: str


@dataclass(slots=True)
class Record:
    """A history event of this worker."""

    event: str
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class PublishEvent:
    """An event for the `evaluation.*` exchange (`evaluation.started`, `.completed`, a pass
    result). Where events are rows of the store, it rides a `Store` instead (`event`)."""

    routing_key: str
    body: Mapping[str, Any]
    message_id: str


@dataclass(slots=True)
class PublishRetry:
    """A retry for delay queue `tier` (its TTL bucket), dead-lettered to the work queue."""

    tier: int
    bucket: int
    body: Mapping[str, Any]
    message_id: str


@dataclass(slots=True)
class Forward:
    """Hand a delivery to the private queue of the worker `holder` (mandatory: `Unroutable`
    when that queue is gone)."""

    holder: str
    delivery: Any


@dataclass(slots=True)
class Settle:
    """ACK a delivery, or NACK it back to its queue (`ack=False`)."""

    delivery: Any
    ack: bool = True


@dataclass(slots=True)
class CallAgent:
    """One agent call: the rule's result is sent back, or its `AgentError` thrown in."""

    attempt_id: str
    rule: Rule
    attempt: int
    try_no: int
    execution: int


@dataclass(slots=True)
class Failpoint:
    """A named point where `engine.failpoints` may crash, raise, stall or freeze."""

    name: str
    rule: str | None
    attempt_id: str | None


@dataclass(slots=True)
class Count:
    """A counter moves (`engine.metrics`, live and in the simulator alike)."""

    metric: str
    amount: float = 1
    labels: tuple[tuple[str, str], ...] = ()


@dataclass(slots=True)
class Gauge:
    """A metric is set (`engine.metrics`; the simulator keeps none)."""

    metric: str
    value: float


@dataclass(slots=True)
class Acquire:
    """Wait for `lock` or a unit of a semaphore (the host's); the step releases it itself,
    synchronously."""

    lock: Any


@dataclass(slots=True)
class Join:
    """Wait for a task the host spawned; its error is thrown in. Cancelling the waiter
    does not cancel the task (asyncio's `shield`)."""

    task: Any


@dataclass(slots=True)
class Log:
    """A log line; with `error`, a task failed with it. Live it is logged; the simulator
    re-raises an error no live failure explains (its own bug, not a fault)."""

    level: str
    message: str
    error: BaseException | None = None


def log_level(e: Log) -> int:
    """The `logging` level of a log line (`KeyError` for a level `logging` does not know:
    the engine's own bug, as live `logging` raises for it)."""
    level = logging.getLevelName(e.level.upper())
    if type(level) is not int:
        raise KeyError(f"unknown log level {e.level!r}")
    return level


@dataclass(slots=True)
class Sleep:
    """Wait `seconds` (of the worker's clock: wall live, simulated in sim)."""

    seconds: float


@dataclass(slots=True)
class Clock:
    """The time in ms: the wall clock live, the simulated one in sim."""


@dataclass(slots=True)
class Monotonic:
    """A monotonic time in seconds (leases are timed on it)."""


NOW = Clock()
MONO = Monotonic()

Effect = (
    Store
    | PublishWork
    | PublishEvent
    | PublishRetry
    | Forward
    | Settle
    | CallAgent
    | Failpoint
    | Count
    | Gauge
    | Acquire
    | Join
    | Log
    | Sleep
    | Record
    | Clock
    | Monotonic
)
Step = Generator[Effect, Any, Any]


def published_before(outbox: bool, event: PublishEvent, store: Store) -> Step:
    """Publish `event` before `store`, the operation that flags it published (the caller's
    next effect): on a broker, two writes (a crash between them announces it again on
    recovery; consumers dedupe on its id); where events are rows of the store, one
    transaction (the event rides `store`)."""
    if outbox:
        store.event = event
    else:
        yield event


class Lock(Protocol):
    def release(self) -> None: ...


class Semaphore(Lock, Protocol):
    def locked(self) -> bool:
        """An `Acquire` now would wait."""
        ...


class Host(Protocol):
    """What a driver gives a step that runs tasks of its own: asyncio tasks live, simpy
    processes in sim. Each call returns at once; waiting is an effect (`Acquire`, `Join`).

    `recording` False: the history discards every event (the live worker's default), so a
    step may leave out its `Record`s rather than build them (about three a rule, a dict
    each); the simulator's host always records. `failpoints` False: none is armed in this
    process, and none can be (they are armed when it starts), so a step may leave out its
    `Failpoint`s on a rule's path; the simulator's host always has them. `outbox`: see
    `Store.event`."""

    recording: bool
    failpoints: bool
    #: Events are rows of the store (the `pg` design): each rides the store operation whose
    #: change it announces (`Store.event`), in one transaction.
    outbox: bool

    def spawn(self, step: Step, on_done: Callable[[Any], None] | None = None) -> Any | None:
        """Run `step` as a task of its own (None: the process is dead, it never runs)."""
        ...

    def cancel(self, task: Any) -> None:
        """Throw a cancellation into `task` where it waits (nothing if it has ended)."""
        ...

    def current(self) -> Any:
        """The task running now."""
        ...

    def lock(self) -> Lock:
        """A new FIFO lock."""
        ...

    def semaphore(self, value: int) -> Semaphore:
        """A new FIFO semaphore of `value` units."""
        ...


class Unroutable(RuntimeError):
    """The broker returned a mandatory message: no queue was bound to its route."""


class Cancelled(BaseException):
    """Thrown into a step whose task is cancelled where the host's own cancellation is an
    `Exception` (simpy's `Interrupt`), so that `except Exception` never catches it."""


#: What a handler of `Stepper.advance` returns for an effect it leaves to be waited for.
WAIT = object()


class Stepper:
    """One step as a driver turns it: `next()` is the next effect, or None once the step
    has ended (`value` is then what it returned); the effect's outcome goes back in with
    `reply` or `fail`. The one loop both drivers turn (`advance`)."""

    def __init__(self, step: Step) -> None:
        self._send = step.send
        self._throw = step.throw
        self._reply: Any = None
        self._error: BaseException | None = None
        self.value: Any = None

    def next(self) -> Effect | None:
        reply, error, self._reply, self._error = self._reply, self._error, None, None
        try:
            return self._throw(error) if error is not None else self._send(reply)
        except StopIteration as done:
            self.value = done.value
            return None

    def advance(self, now: Mapping[type, Callable[[Any, Any], Any]], ctx: Any) -> Effect | None:
        """`next()`, but every effect that `now` has a handler for is carried out in place
        (`handler(effect, ctx)`, unless it returns `WAIT`): the next effect to wait for, or
        None once the step has ended. The hot loop of both drivers."""
        send, throw = self._send, self._throw
        reply, error = self._reply, self._error
        while True:
            try:
                effect = send(reply) if error is None else throw(error)
            except StopIteration as done:
                self.value = done.value
                self._reply = self._error = None
                return None
            reply = error = None
            handler = now.get(type(effect))
            if handler is not None:
                try:
                    reply = handler(effect, ctx)
                except BaseException as exc:  # into the step, which decides
                    error = exc
                    continue
                if reply is not WAIT:
                    continue
            self._reply = self._error = None
            return effect

    def reply(self, value: Any) -> None:
        self._reply = value

    def fail(self, error: BaseException) -> None:
        self._error = error
