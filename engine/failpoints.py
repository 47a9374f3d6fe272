"""Named crash points at the protocol boundaries, armed from a scenario or the environment.

The names are the table below and nowhere else: the runtime, the simulator, the scenario
validator and `chaos list` all read `FAILPOINTS`. Unarmed, a hit is one empty-dict lookup.

Spec syntax (env `ENGINE_FAILPOINTS`, flag `--failpoint`), entries separated by `;`:
    NAME=ACTION[,hit=N][,times=K][,rule=RULE_ID][,attempt_id=ID][,until=EVENT]
ACTION is `crash` (the process SIGKILLs itself), `raise` (an `InjectedFault` surfaces where
the boundary is), `stall:MS` (this task sleeps MS milliseconds of real time; the rest of
the worker, its heartbeat included, goes on) or `freeze:MS` (the whole process stops for MS
milliseconds, as in a long GC pause or a SIGSTOP: its heartbeat stops too, so its leases
lapse and another worker may take its evaluations over while it still holds an answer).
It fires on the Nth matching hit (default 1) and then K times in all (default 1; 0 means
every later hit). `until=EVENT` ends a stall as soon as the run's history records that
event after the firing (MS is then its longest): a scenario that needs the runner to act
inside the stall waits for the act, not for a time the runner may miss on a loaded host.
Its end is recorded (`failpoint_released`, `came`: whether the event did), so that a
checker's window of the stall is the stall's own.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.validation import did_you_mean

FAILPOINTS: dict[str, str] = {
    "on_delivery": "a work message was received; nothing done yet",
    "before_ack": "config loaded, job initialised, evaluation.started published; no ACK yet",
    "after_ack": "the execute message is ACKed; no rule has started",
    "rule_before_call": "a rule is about to call the agent",
    "rule_after_call_before_write": "the agent answered; the result is not in Redis (write window)",
    "rule_after_write": "the result is in Redis; dependents have not started",
    "after_status_write_before_retry_publish": "failed_attempt_N is in Redis; no retry published",
    "after_retry_publish_before_ack": "the next retry is published; the retry message that ran "
    "this attempt is not ACKed",
    "before_pass_publish": "a pass is terminal; its result is not published",
    "before_final_publish": "the final state is in Redis; evaluation.completed is not published",
    "after_final_publish": "evaluation.completed is published; the evaluation is still indexed",
    "rule_after_call_failed": "the agent failed; the rule's status is not in Redis",
    "before_final_write": "the evaluation is decided; its final state is not in Redis",
    "after_final_write": "the final write has its reply (this copy's state, or another's that "
    "came first); nothing announced, the evaluation still indexed and leased",
}

#: Failpoints hit with no rule: a `rule` filter on one of them would never match.
RULELESS_FAILPOINTS: frozenset[str] = frozenset(
    {
        "before_ack",
        "after_ack",
        "before_pass_publish",
        "before_final_publish",
        "after_final_publish",
        "before_final_write",
        "after_final_write",
    }
)

ACTIONS = ("crash", "raise", "stall", "freeze")
#: Actions that take a duration in milliseconds (`stall_ms`).
TIMED_ACTIONS = ("stall", "freeze")
#: How often a stall with `until` looks at the history for its event.
UNTIL_POLL_S = 0.005


class FailpointError(ValueError):
    """A failpoint spec that cannot be armed; one line for a human."""


class InjectedFault(RuntimeError):
    """Raised where an armed `raise` failpoint fires."""


@dataclass
class Failpoint:
    name: str
    action: str
    stall_ms: int = 0
    hit: int = 1
    times: int = 1
    rule: str | None = None
    attempt_id: str | None = None
    until: str | None = None  # a stall's end: this history event, once recorded after it fired
    seen: int = field(default=0, compare=False)
    fired: int = field(default=0, compare=False)

    def matches(self, rule: str | None, attempt_id: str | None) -> bool:
        if self.rule is not None and rule != self.rule:
            return False
        return self.attempt_id is None or attempt_id == self.attempt_id

    def should_fire(self) -> bool:
        self.seen += 1
        if self.seen < self.hit:
            return False
        if self.times and self.fired >= self.times:
            return False
        self.fired += 1
        return True

    def spec(self) -> str:
        action = f"{self.action}:{self.stall_ms}" if self.action in TIMED_ACTIONS else self.action
        out = f"{self.name}={action},hit={self.hit},times={self.times}"
        if self.rule:
            out += f",rule={self.rule}"
        if self.attempt_id:
            out += f",attempt_id={self.attempt_id}"
        if self.until:
            out += f",until={self.until}"
        return out


def fired_fields(fp: Failpoint, rule: str | None, attempt_id: str | None) -> dict[str, Any]:
    """The fields of the history's `failpoint_fired`, live and simulated alike."""
    fields: dict[str, Any] = {
        "failpoint": fp.name,
        "action": fp.action,
        "stall_ms": fp.stall_ms,
        "rule": rule,
        "attempt_id": attempt_id,
    }
    if fp.until is not None:
        fields["until"] = fp.until
    return fields


def released_fields(
    fp: Failpoint, rule: str | None, attempt_id: str | None, came: bool
) -> dict[str, Any]:
    """The fields of the history's `failpoint_released`: a stall with `until` is over (the
    event came, or its longest elapsed), live and simulated alike."""
    return {"failpoint": fp.name, "rule": rule, "attempt_id": attempt_id, "came": came}


def parse_specs(text: str) -> list[Failpoint]:
    """Parse `NAME=ACTION[,k=v...]` entries separated by `;`."""
    out: list[Failpoint] = []
    for raw in text.split(";"):
        entry = raw.strip()
        if not entry:
            continue
        name, sep, rest = entry.partition("=")
        name = name.strip()
        if not sep:
            raise FailpointError(f"failpoint {entry!r}: expected NAME=ACTION")
        if name not in FAILPOINTS:
            raise FailpointError(
                f"failpoint {name!r}: unknown name{did_you_mean(name, FAILPOINTS)}; "
                f"expected one of {', '.join(FAILPOINTS)}"
            )
        action, *opts = [p.strip() for p in rest.split(",")]
        fp = _action(name, action)
        for opt in opts:
            key, _, value = opt.partition("=")
            if key in ("hit", "times"):
                if not value.isdigit() or (key == "hit" and int(value) < 1):
                    raise FailpointError(f"failpoint {name}: {key} must be a whole number >= 1")
                setattr(fp, key, int(value))
            elif key in ("rule", "attempt_id") and value:
                setattr(fp, key, value)
            elif key == "until" and value:
                if fp.action != "stall":
                    raise FailpointError(
                        f"failpoint {name}: until only with stall (a stall ends on the event); "
                        f"action is {fp.action}"
                    )
                fp.until = value
            else:
                raise FailpointError(
                    f"failpoint {name}: unknown option {opt!r}; expected hit, times, rule, "
                    "attempt_id, until"
                )
        out.append(fp)
    return out


def _action(name: str, action: str) -> Failpoint:
    kind, _, arg = action.partition(":")
    if kind in TIMED_ACTIONS:
        if not arg.isdigit():
            raise FailpointError(f"failpoint {name}: {kind} needs milliseconds, e.g. {kind}:500")
        return Failpoint(name, kind, stall_ms=int(arg))
    if kind in ("crash", "raise") and not arg:
        return Failpoint(name, kind)
    raise FailpointError(f"failpoint {name}: unknown action {action!r}; expected {ACTIONS}")


def site(name: str) -> None:
    """A failpoint site's name, checked against `FAILPOINTS` at each hit (armed or not): a
    site the registry does not name can never be armed, and a scenario arming the name it
    should have would wait for nothing. A `KeyError`, the engine's own bug."""
    if name not in FAILPOINTS:
        raise KeyError(f"failpoint site {name!r} is not in FAILPOINTS")


class Failpoints:
    """The armed failpoints of one process. `on_crash` runs just before the SIGKILL;
    `on_fire(fp, rule, attempt_id)` before any other action takes effect (the history's
    `failpoint_fired`: a checker must see a stall, a freeze or a raise to excuse what it
    causes)."""

    def __init__(
        self,
        armed: list[Failpoint] | None = None,
        on_crash: Callable[[str, str | None, str | None], None] | None = None,
    ) -> None:
        self._armed: dict[str, list[Failpoint]] = {}
        self.on_crash = on_crash
        self.on_fire: Callable[[Failpoint, str | None, str | None], None] | None = None
        # a stall with `until`: the history it watches, and what records its end
        self.history_path: str | None = None
        self.on_release: Callable[[Failpoint, str | None, str | None, bool], None] | None = None
        self._watching = False  # a stall with `until` is armed
        for fp in armed or []:
            self.arm(fp)

    @classmethod
    def from_env(cls, env: str = "ENGINE_FAILPOINTS") -> Failpoints:
        return cls(parse_specs(os.environ.get(env, "")))

    def arm(self, fp: Failpoint) -> None:
        self._armed.setdefault(fp.name, []).append(fp)
        self._watching = self._watching or fp.until is not None

    @property
    def armed(self) -> bool:
        return bool(self._armed)

    def fired(
        self, name: str, rule: str | None = None, attempt_id: str | None = None
    ) -> Failpoint | None:
        """Decide synchronously; crash or raise here; return the failpoint that fired."""
        fps = self._armed.get(name)
        if not fps:
            return None
        for fp in fps:
            if fp.matches(rule, attempt_id) and fp.should_fire():
                if fp.action == "crash":
                    if self.on_crash is not None:
                        self.on_crash(name, rule, attempt_id)
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.on_fire is not None:
                    self.on_fire(fp, rule, attempt_id)
                if fp.action == "raise":
                    raise InjectedFault(f"failpoint {name} fired")
                return fp
        return None

    def fire(self, name: str, rule: str | None = None, attempt_id: str | None = None) -> int:
        """Decide synchronously; crash or raise here; return a stall in ms (0: go on)."""
        fp = self.fired(name, rule, attempt_id)
        return fp.stall_ms if fp is not None else 0

    async def hit(self, name: str, rule: str | None = None, attempt_id: str | None = None) -> None:
        if not self._armed:
            return
        # where the history stood before the firing: the event must come after it
        start = self._end_of_history() if self._watching else 0
        fp = self.fired(name, rule, attempt_id)
        if fp is None or not fp.stall_ms:
            return
        if fp.action == "freeze":
            time.sleep(fp.stall_ms / 1000)  # blocks the event loop: the whole worker stops
        elif fp.until is not None:
            came = await self._until(fp.until, start, fp.stall_ms / 1000)
            if self.on_release is not None:
                self.on_release(fp, rule, attempt_id, came)
        else:
            await asyncio.sleep(fp.stall_ms / 1000)

    def _end_of_history(self) -> int:
        if self.history_path is None:
            return 0
        try:
            return os.path.getsize(self.history_path)
        except OSError:
            return 0

    async def _until(self, event: str, start: int, longest_s: float) -> bool:
        """Whether the history records `event` past byte `start`, within `longest_s`: its
        lines read as they are appended (every process writes one whole line at a time)."""
        deadline = time.monotonic() + longest_s
        if self.history_path is None:  # nothing to watch: the longest stall
            await asyncio.sleep(longest_s)
            return False
        line = re.compile(rb'"ev":\s*"' + re.escape(event.encode()) + rb'"')
        with open(self.history_path, "rb") as fh:
            fh.seek(start)
            partial = b""
            while True:
                lines = (partial + fh.read()).split(b"\n")
                partial = lines.pop()  # a line not yet whole
                if any(line.search(text) for text in lines):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                await asyncio.sleep(min(UNTIL_POLL_S, left))
