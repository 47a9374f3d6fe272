"""The simulated history: the live `FileHistory` line format, on simulated time.

Every source (the runner, each worker incarnation) appends to one shared list, in the
order events happen in simulated time. A line is `{t, src, pid, seq, ev, **fields}` as
`engine.history.FileHistory` writes it, with `t` in simulated seconds. A dead worker that
tries to record is a simulator bug, and fails loudly.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from typing import Any

import orjson
import simpy


class Source:
    __slots__ = ("_env", "_events", "_seq", "alive", "pid", "src")

    def __init__(self, env: simpy.Environment, events: list[dict], src: str, pid: int) -> None:
        self._env = env
        self._events = events
        self.src = src
        self.pid = pid
        self._seq = 0
        self.alive = True

    def record(self, ev: str, **fields: Any) -> None:
        self.record_fields(ev, fields)

    def record_fields(self, ev: str, fields: Mapping[str, Any]) -> None:
        """`record(ev, **fields)`, the fields as they come (a `Record` effect's): no
        keyword dict built for each event of a run. Every event is written here (the
        history mutant patches this one)."""
        if not self.alive:
            raise RuntimeError(f"{self.src} recorded {ev!r} after it died")
        self._seq += 1
        line = {"t": self._env.now, "src": self.src, "pid": self.pid, "seq": self._seq, "ev": ev}
        line.update(fields)
        self._events.append(line)


def canonical_lines(history: list[dict]) -> bytes:
    """One JSON object per line, keys sorted, in history order (orjson's spelling)."""
    return b"".join(map(_dump_line, history))


_dump_line = functools.partial(
    orjson.dumps, option=orjson.OPT_SORT_KEYS | orjson.OPT_APPEND_NEWLINE
)


def history_hash(history: list[dict]) -> str:
    """sha256 of `canonical_lines`: equal hashes mean byte-identical histories. Hashed a
    slice of lines at a time: a long history's lines are never held whole (a 600,000-event
    run's are 150 MB, and building them took twice as long as hashing them)."""
    digest = hashlib.sha256()
    for i in range(0, len(history), _HASHED_AT_ONCE):
        digest.update(canonical_lines(history[i : i + _HASHED_AT_ONCE]))
    return digest.hexdigest()


#: Events whose lines are hashed at once by `history_hash`.
_HASHED_AT_ONCE = 4096
