"""Fixtures shared by the test modules that run scenarios live."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from chaos.systems import DEFAULT_SYSTEM, system
from chaos.systems.redis_rabbitmq.services import Services


@pytest.fixture(scope="module")
def services() -> Iterator[Services]:
    """A private Redis and RabbitMQ for one module's live scenario runs (their kills touch
    nothing else); `REDIS_URL` / `AMQP_URL` are set aside meanwhile, so the runner starts
    its own rather than using the machine's."""
    env = {k: os.environ.pop(k) for k in ("REDIS_URL", "AMQP_URL") if k in os.environ}
    stack = Services.start()
    try:
        yield stack
    finally:
        stack.stop()
        os.environ.update(env)


@pytest.fixture(scope="module")
def stacks(services: Services) -> Iterator[Callable[[str], Any]]:
    """The services of each system under test (`chaos.systems`), by name: today's design's
    the module's `services`, another's started when first asked for, stopped at the end."""
    started: dict[str, Any] = {DEFAULT_SYSTEM: services}

    def of(name: str) -> Any:
        if name not in started:
            started[name] = system(name).stack_class().start()
        return started[name]

    try:
        yield of
    finally:
        for name, stack in started.items():
            if name != DEFAULT_SYSTEM:
                stack.stop()
