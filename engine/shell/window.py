"""The deliveries a worker holds unsettled: what its prefetch allows, as the history sees it.

RabbitMQ sends a consumer at most `prefetch` deliveries it has not settled (0: no limit).
Each driver tells `DeliveryWindow` of every delivery as it arrives (per consumer: one
channel and queue) and of every settle the shell asks for; the window records
`prefetch_window` each time the worker's largest count grows, with the prefetch it set,
so that the checker (`prefetch_respected`) can hold what the worker took against what its
flow control allows. A settle may reach a channel already gone: the delivery still leaves
the count of the consumer it came through (a new channel is a new consumer).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any


class DeliveryWindow:
    def __init__(
        self,
        record: Callable[[str, Mapping[str, Any]], None],
        prefetch: int,
        max_evaluations: int,
    ) -> None:
        self._record = record
        self.prefetch = prefetch
        self.max_evaluations = max_evaluations
        self._held: dict[Hashable, int] = {}  # consumer -> deliveries not settled
        self._of: dict[int, tuple[Any, Hashable, str]] = {}  # id(delivery) -> it, its consumer
        self.peak = 0

    def delivered(self, delivery: Any, consumer: Hashable, queue: str) -> None:
        n = self._held.get(consumer, 0) + 1
        self._held[consumer] = n
        self._of[id(delivery)] = (delivery, consumer, queue)  # kept: its id stays its own
        if n > self.peak:
            self.peak = n
            self._record(
                "prefetch_window",
                {
                    "in_flight": n,
                    "queue": queue,
                    "prefetch": self.prefetch,
                    "max_evaluations": self.max_evaluations,
                },
            )

    def settled(self, delivery: Any) -> None:
        entry = self._of.pop(id(delivery), None)
        if entry is not None:
            self._held[entry[1]] -= 1
