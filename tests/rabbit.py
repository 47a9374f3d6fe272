"""Killing a RabbitMQ node and reading its durable queues back, as the tests that do it
(a private node in tests/test_stack.py, a container in tests/test_containers.py) need it.

Both kinds of node have `ctl(*args) -> str` (rabbitmqctl against that node).
"""

from __future__ import annotations

import time
from typing import Protocol


class Node(Protocol):
    def ctl(self, *args: str) -> str: ...


def dump_queue_records(node: Node) -> None:
    """A publisher confirm covers the message, not the durable queue's own record, which
    is in Mnesia's log: a busy machine may not have written it yet when the node is
    SIGKILLed. Write it now."""
    out = node.ctl("eval", "mnesia:dump_log().")
    assert "dumped" in out, f"mnesia:dump_log() answered {out!r}"


def wait_for_queue(node: Node, name: str, messages: int, timeout_s: float = 60) -> None:
    """A restarted node answers AMQP while its queues may still be recovering (a busy
    machine widens that window): wait until `name` is listed with `messages` messages,
    never for a fixed time."""
    want = f"{name}\t{messages}"
    deadline = time.monotonic() + timeout_s
    while (
        want not in (listed := node.ctl("list_queues", "name", "messages", "--quiet")).splitlines()
    ):
        assert time.monotonic() < deadline, f"queue {name!r} not recovered: {listed!r}"
        time.sleep(0.2)
