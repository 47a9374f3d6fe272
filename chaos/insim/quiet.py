"""A simulated task that the end of a run may interrupt."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import simpy


def quiet(gen: Generator) -> Generator[Any, Any, None]:
    """A runner task cancelled at the end of the run stops where it waits."""
    with contextlib.suppress(simpy.Interrupt):
        yield from gen
