"""`engine.failpoints` in a simulated worker: the same specs, the same firing rule.

The specs are parsed by `engine.failpoints.parse_specs` and each `Failpoint` decides with
its own `matches` / `should_fire`, in the order `Failpoints.fire` walks them. Only the
actions differ: `crash` kills the simulated worker (a `crash` event first, as the live
`on_crash` hook records it), `raise` raises `InjectedFault` where the boundary is,
`stall:MS` sleeps MS milliseconds of simulated time (with `until`, until the run's history
records the event, looked at as often as the live worker looks at its file), and
`freeze:MS` also stops the whole worker for as long (`SimWorker.freeze`: every process of
it waits for the thaw, as the live worker's blocked event loop does).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, NoReturn

import simpy

from engine.failpoints import UNTIL_POLL_S, Failpoint, InjectedFault, parse_specs


class SimFailpoints:
    def __init__(
        self,
        env: simpy.Environment,
        specs: str,
        crash: Callable[[str, str | None, str | None], NoReturn],
        freeze: Callable[[float], None] | None = None,
        on_fire: Callable[[Failpoint, str | None, str | None], None] | None = None,
        history: list[dict] | None = None,
        on_release: Callable[[Failpoint, str | None, str | None, bool], None] | None = None,
    ) -> None:
        self.env = env
        self.crash = crash
        self.freeze = freeze
        self.on_fire = on_fire  # the live `Failpoints.on_fire`: `failpoint_fired`
        self.history = history  # the run's, which a stall with `until` watches
        self.on_release = on_release  # the live `Failpoints.on_release`: `failpoint_released`
        self._armed: dict[str, list[Failpoint]] = {}
        for fp in parse_specs(specs):
            self._armed.setdefault(fp.name, []).append(fp)

    @property
    def freezes(self) -> bool:
        """Whether a `freeze` is armed (the worker then watches for it at every step)."""
        return any(fp.action == "freeze" for fps in self._armed.values() for fp in fps)

    def __bool__(self) -> bool:
        return bool(self._armed)

    def hit(
        self, name: str, rule: str | None = None, attempt_id: str | None = None
    ) -> Generator[simpy.Event, Any, None]:
        fps = self._armed.get(name)
        if not fps:
            return
        for fp in fps:
            if fp.matches(rule, attempt_id) and fp.should_fire():
                if fp.action == "crash":
                    self.crash(name, rule, attempt_id)
                start = 0 if self.history is None else len(self.history)
                if self.on_fire is not None:
                    self.on_fire(fp, rule, attempt_id)
                if fp.action == "raise":
                    raise InjectedFault(f"failpoint {name} fired")
                if fp.action == "freeze" and self.freeze is not None:
                    self.freeze(fp.stall_ms / 1000)
                if fp.until is not None and fp.stall_ms:
                    came = yield from self._until(fp.until, start, fp.stall_ms / 1000)
                    if self.on_release is not None:
                        self.on_release(fp, rule, attempt_id, came)
                elif fp.stall_ms:
                    yield self.env.timeout(fp.stall_ms / 1000)
                return

    def _until(self, event: str, start: int, longest_s: float) -> Generator[simpy.Event, Any, bool]:
        """Whether the history records `event` past `start` within `longest_s` (the live
        `Failpoints._until`, on the simulated clock)."""
        deadline = self.env.now + longest_s
        history = self.history if self.history is not None else []
        while True:
            if any(e.get("ev") == event for e in history[start:]):
                return True
            start = len(history)
            left = deadline - self.env.now
            if left <= 1e-12:
                return False
            yield self.env.timeout(min(UNTIL_POLL_S, left))
