"""asyncio's Lock and Semaphore for simpy processes: FIFO, and safe to interrupt.

`acquire()` is a generator (`yield from lock.acquire()`); it does not yield at all when
the lock is free. A waiter that is interrupted (a cancelled task, a crashed worker) leaves
the queue, or hands on the ownership it was just given, exactly as an asyncio task
cancelled inside `async with lock` does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator
from typing import Any

import simpy


class Semaphore:
    __slots__ = ("_env", "_free", "_waiters")

    def __init__(self, env: simpy.Environment, value: int = 1) -> None:
        self._env = env
        self._free = value
        self._waiters: deque[simpy.Event] = deque()

    def acquire(self) -> Generator[simpy.Event, Any, None]:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        ev = self._env.event()
        self._waiters.append(ev)
        try:
            yield ev
        except BaseException:
            if ev.triggered:  # the unit was handed to us just before the interrupt
                self.release()
            else:
                self._waiters.remove(ev)
            raise

    def locked(self) -> bool:
        """asyncio's `Semaphore.locked`: an `acquire` now would wait."""
        return self._free == 0 or bool(self._waiters)

    def release(self) -> None:
        if self._waiters:
            self._waiters.popleft().succeed()  # the unit passes straight to the next waiter
        else:
            self._free += 1


class Lock(Semaphore):
    __slots__ = ()

    def __init__(self, env: simpy.Environment) -> None:
        super().__init__(env, 1)
