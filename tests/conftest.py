"""Fixtures shared by the test modules that run scenarios live."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

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
