"""The protocol written once (`engine.shell`), run without any I/O: a step is a generator
of effects, so a test is a script of replies, and what the worker would do is the list of
effects it yields. The live and simulated drivers run these same steps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator, Mapping
from types import SimpleNamespace
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.keys import retry_member
from engine.shell.effects import Clock, Effect, PublishWork, Record, Sleep, Store
from engine.shell.sweeper import sweep


def play(
    step: Generator[Effect, Any, Any], store: Mapping[str, Callable[..., Any]]
) -> list[Effect]:
    """Carry out a step with scripted store replies and a clock at 1000 ms."""
    done: list[Effect] = []
    reply: Any = None
    while True:
        try:
            effect = step.send(reply)
        except StopIteration:
            return done
        done.append(effect)
        match effect:
            case Store(op=op, args=args):
                reply = store[op](*args)
            case Clock():
                reply = 1000
            case _:
                reply = None


CONFIG = EngineConfig(stale_ms=600, retry_grace_ms=300)


def test_a_sweep_resumes_stale_evaluations_not_held_here_and_claimed() -> None:
    claims: list[str] = []

    def claim_stale(a: str, older_than: int) -> bool:
        claims.append(a)
        return a != "lost-race"

    store = {
        "stale_evaluations": lambda older: ["held", "lost-race", "dead"],
        "claim_stale": claim_stale,
        "overdue_retries": lambda grace: [],
    }
    done = play(sweep(CONFIG, {"held"}), store)
    assert claims == ["lost-race", "dead"]  # never the evaluation in this worker's memory
    published = [e for e in done if isinstance(e, PublishWork)]
    assert [(p.body["attempt_id"], p.body["reason"]) for p in published] == [
        ("dead", "stale_heartbeat")
    ]
    assert published[0].message_id == "dead:resume:1000"
    assert Record("sweeper_resumed", {"attempt_id": "dead", "claimed_from_ms": 1000}) in done


@pytest.mark.parametrize(
    ("status", "attempt"),
    [("failed_attempt_2", 3), ("permanently_failed", None), ("", None)],
)
def test_a_lost_retry_is_published_after_the_attempt_its_claim_read(
    status: str, attempt: int | None
) -> None:
    member = retry_member("a1", "compiles")
    store = {
        "stale_evaluations": lambda older: [],
        "overdue_retries": lambda grace: [member],
        "claim_retry": lambda m, grace: status or None,
    }
    published = [e for e in play(sweep(CONFIG, set()), store) if isinstance(e, PublishWork)]
    if attempt is None:
        assert published == []  # nothing to retry from
    else:
        (p,) = published
        assert (p.body["rule_id"], p.body["attempt"], p.body["delay_ms"]) == ("compiles", 3, 0)
        assert p.message_id == "a1:compiles:3"  # the stable id of that retry


def test_a_store_error_surfaces_from_the_step() -> None:
    """A driver throws the error of an effect into the step; the sweep lets it out (its
    loop logs it and sweeps again later)."""
    step = sweep(CONFIG, set())
    assert step.send(None) == Store("stale_evaluations", (600,))
    with pytest.raises(ConnectionError):
        step.throw(ConnectionError("redis away"))


# --- the asyncio driver: a cancellation that is the connection's, not the task's ----------


class _Channel:
    """What `settle` reads of an aiormq channel: an observer of its end, one per look."""

    def __init__(self) -> None:
        self.end: asyncio.Future[None] | None = None
        self.observers: list[asyncio.Future[None]] = []

    @property
    def closing(self) -> asyncio.Future[None]:
        if self.end is None:
            self.end = asyncio.get_running_loop().create_future()
        observer = asyncio.get_running_loop().create_future()
        self.end.add_done_callback(lambda _: observer.done() or observer.set_result(None))
        self.observers.append(observer)
        return observer


class _Dying:
    """A service call that a dying aiormq connection cancels under its caller."""

    def __init__(self) -> None:
        self.channel = _Channel()

    async def holder(self, attempt_id: str) -> str:
        raise asyncio.CancelledError

    async def ack(self) -> None:
        raise asyncio.CancelledError


class _Stuck:
    """An ACK on a connection whose writer is gone: its frame is never written."""

    def __init__(self) -> None:
        self.channel = _Channel()

    async def ack(self) -> None:
        await asyncio.get_running_loop().create_future()


def _asks_holder() -> Generator[Effect, Any, str]:
    try:
        return (yield Store("holder", ("a1",)))
    except ConnectionError as exc:
        return f"lost: {exc}"


def test_a_call_cancelled_by_its_connection_reaches_the_step_as_a_lost_connection() -> None:
    from engine.runtime.context import settle
    from engine.runtime.drive import drive

    rt = SimpleNamespace(store=_Dying())
    assert asyncio.run(drive(_asks_holder(), rt)) == "lost: Store cancelled"  # type: ignore[arg-type]
    assert asyncio.run(settle(_Dying(), timeout_s=5)) is False  # type: ignore[arg-type]  # closed

    class Closed:  # aio-pika's message refuses to hand out a channel that closed
        @property
        def channel(self) -> _Channel:
            raise RuntimeError("ChannelInvalidStateError")

    assert asyncio.run(settle(Closed(), timeout_s=5)) is False  # type: ignore[arg-type]


def test_an_ack_that_is_never_written_ends_when_its_channel_closes_or_after_the_bound() -> None:
    from engine.runtime.context import settle

    async def channel_closes(message: _Stuck) -> bool:
        ack = asyncio.ensure_future(settle(message, timeout_s=3600))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        assert message.channel.end is not None and not ack.done()
        message.channel.end.set_result(None)
        return await asyncio.wait_for(ack, 10)  # a hang would fail here

    stuck = _Stuck()
    assert asyncio.run(channel_closes(stuck)) is False
    assert all(o.done() for o in stuck.channel.observers)  # no observer left behind
    assert asyncio.run(settle(_Stuck(), timeout_s=0.01)) is False  # type: ignore[arg-type]


def test_the_task_s_own_cancellation_still_propagates() -> None:
    from engine.runtime.context import settle
    from engine.runtime.drive import drive

    class Slow:
        async def holder(self, attempt_id: str) -> str:
            await asyncio.sleep(10)
            return "never"

        channel = _Channel()

        async def ack(self) -> None:
            await asyncio.sleep(10)

    async def cancel_soon(coro: Any) -> str:
        task = asyncio.ensure_future(coro)
        await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "finished"

    rt = SimpleNamespace(store=Slow())
    assert asyncio.run(cancel_soon(drive(_asks_holder(), rt))) == "cancelled"  # type: ignore[arg-type]
    assert asyncio.run(cancel_soon(settle(Slow(), timeout_s=60))) == "cancelled"  # type: ignore[arg-type]


def test_a_delivery_s_step_outlives_the_cancellation_of_aio_pika_s_task() -> None:
    """aio-pika cancels a consumer's callback when its channel closes: the step goes on (an
    evaluation it put in memory still starts), and only the worker's end stops it."""
    from engine.runtime.drive import detached

    seen: list[str] = []
    rt = SimpleNamespace(
        history=SimpleNamespace(record=lambda event, **f: seen.append(event)),
        broker=SimpleNamespace(outbox=False),
    )

    def delivery() -> Generator[Effect, Any, None]:
        yield Record("evaluation_started", {})
        yield Sleep(0.05)  # the ACK, while the channel closes
        yield Record("rule_started", {})

    async def channel_closes() -> set[asyncio.Task[Any]]:
        running: set[asyncio.Task[Any]] = set()
        callback = asyncio.ensure_future(detached(delivery(), rt, running))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        callback.cancel()
        with pytest.raises(asyncio.CancelledError):
            await callback
        assert len(running) == 1
        await asyncio.wait_for(asyncio.gather(*running), 10)
        return running

    assert asyncio.run(channel_closes()) == set()
    assert seen == ["evaluation_started", "rule_started"]


def test_a_failpoint_site_the_registry_does_not_name_is_an_engine_bug() -> None:
    from engine.failpoints import FAILPOINTS, site

    for name in FAILPOINTS:
        site(name)
    with pytest.raises(KeyError, match="on_delivry"):
        site("on_delivry")  # never armed: a scenario arming on_delivery waits for nothing


def test_a_log_level_logging_does_not_know_is_an_engine_bug() -> None:
    import logging

    from engine.shell.effects import Log, log_level

    assert log_level(Log("error", "x")) == logging.ERROR
    assert log_level(Log("warning", "x")) == logging.WARNING
    with pytest.raises(KeyError, match="'fatl'"):
        log_level(Log("fatl", "x"))


def test_the_heartbeat_leaves_alone_a_lease_being_given_back() -> None:
    """A renewal landing after the final `done` (or a park, a release) would take the lease
    again for an evaluation nobody runs (found by `quiet_state` behind Sentinel, where a
    batch waits for its replica): a copy that gives its lease back is not renewed."""
    from types import SimpleNamespace

    from engine.shell.heartbeat import beat

    leaving = SimpleNamespace(fence="1:w", leaving=True)
    staying = SimpleNamespace(fence="2:w", leaving=False)
    assert list(beat("w", {"a": leaving}, 600)) == []  # nothing held: no round trip at all
    step = beat("w", {"a": leaving, "b": staying}, 600)
    next(step)  # the clock
    renew = step.send(0)
    assert renew.op == "renew" and renew.args == ({"b": "2:w"}, "w")


def test_a_delivery_for_an_evaluation_leaving_memory_goes_back_not_dropped() -> None:
    """The evaluation is being abandoned (its lease lost, its release under way) when a
    message that would resume it arrives (a sweeper's, a resume's): dropped as a duplicate,
    the evaluation would wait for the next sweep; it goes back to the queue, to find the
    evaluation gone from memory next time. A copy for one still running is a duplicate."""
    from engine.shell.controller import EvaluationController
    from engine.shell.effects import Settle

    def deliver(closing: bool) -> list[Effect]:
        host = SimpleNamespace(
            recording=True,
            semaphore=lambda n: None,
            lock=lambda: SimpleNamespace(take=lambda: True, release=lambda: None),
        )
        controller = EvaluationController(host, CONFIG, "w1")  # type: ignore[arg-type]
        controller.evaluations["a"] = SimpleNamespace(closing=closing)  # type: ignore[assignment]
        body = {"type": "execute", "attempt_id": "a", "reason": "stale_heartbeat",
                "published_ms": 1}  # fmt: skip
        return play(controller._dispatch("execute", "a", body, "delivery", False), {})

    back = deliver(closing=True)
    assert back == [Settle("delivery", ack=False)]
    dropped = deliver(closing=False)
    assert Settle("delivery", ack=True) in dropped
    assert Record("duplicate_dropped", {"attempt_id": "a", "kind": "execute"}) in dropped
