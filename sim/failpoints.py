"""`engine.failpoints` in a simulated worker: the same specs, the same firing rule.

The specs are parsed by `engine.failpoints.parse_specs` and each `Failpoint` decides with
its own `matches` / `should_fire`, in the order `Failpoints.fire` walks them. Only the
actions differ: `crash` kills the simulated worker (a `crash` event first, as the live
`on_crash` hook records it), `raise` raises `InjectedFault` where the boundary is, and
`stall:MS` sleeps MS milliseconds of simulated time.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, NoReturn

import simpy

from engine.failpoints import Failpoint, InjectedFault, parse_specs


class SimFailpoints:
    def __init__(
        self, env: simpy.Environment, specs: str, crash: Callable[[str], NoReturn]
    ) -> None:
        self.env = env
        self.crash = crash
        self._armed: dict[str, list[Failpoint]] = {}
        for fp in parse_specs(specs):
            self._armed.setdefault(fp.name, []).append(fp)

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
                    self.crash(name)
                if fp.action == "raise":
                    raise InjectedFault(f"failpoint {name} fired")
                if fp.stall_ms:
                    yield self.env.timeout(fp.stall_ms / 1000)
                return
