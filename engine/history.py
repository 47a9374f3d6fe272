"""The recorded history: one JSON line per event, appended by every worker and the runner.

Written with `os.write` on an `O_APPEND` descriptor, so each line is in the kernel before
the event's effect can be observed, and a SIGKILL loses nothing already recorded. Lines of
several processes interleave whole (each write is one line, well under a page), and every
line carries its source, pid and a per-source sequence number so a checker can order the
events of one process exactly and those of an evaluation by wall time.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import orjson


class History:
    """Discards events: the default when nobody records."""

    source = "-"

    def record(self, ev: str, **fields: Any) -> None:
        return None

    def close(self) -> None:
        return None


class FileHistory(History):
    def __init__(self, path: str | Path, source: str) -> None:
        self.path = Path(path)
        self.source = source
        self._pid = os.getpid()
        self._seq = 0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(self, ev: str, **fields: Any) -> None:
        self._seq += 1
        line = {"t": time.time(), "src": self.source, "pid": self._pid, "seq": self._seq, "ev": ev}
        line.update(fields)
        os.write(self._fd, orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


#: The checkout's root: tracebacks name files relative to it (one seed, one history, on any
#: checkout).
CHECKOUT = str(Path(__file__).resolve().parents[1]) + os.sep


def error_fields(exc: BaseException, during: str) -> dict[str, Any]:
    """An `engine_error` event's fields: what escaped the engine's code, where, and its
    traceback (files named from the checkout's root)."""
    trace = "".join(traceback.format_exception(exc)).replace(CHECKOUT, "").rstrip()
    return {"error": f"{type(exc).__name__}: {exc}", "during": during, "traceback": trace}


def open_history(path: str | Path | None, source: str) -> History:
    return FileHistory(path, source) if path else History()


#: What `read_history(..., keep_unreadable=True)` records for a line that does not parse.
UNREADABLE = "history_unreadable"


def read_history(path: str | Path, *, keep_unreadable: bool = False) -> list[dict[str, Any]]:
    """Every event of a history file. A line that does not parse (a write torn by a crash,
    or worse) is skipped, or with `keep_unreadable` kept as a `history_unreadable` event
    (its 1-based line number, whether it is the file's last line, its first bytes) so the
    checker can tell a torn last line from a hole in the middle."""
    out: list[dict[str, Any]] = []
    with open(path, "rb") as fh:
        lines = fh.read().splitlines()
    last_t: Any = None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
            event = None
        if isinstance(event, dict):
            out.append(event)
            last_t = event.get("t", last_t)
        elif keep_unreadable:
            text = line[:80].decode("utf-8", "replace")
            torn = {"t": last_t, "src": "history", "ev": UNREADABLE, "line": n}
            out.append({**torn, "last": n == len(lines), "text": text})
    return out
