"""Losing Redis's last acknowledged writes, for real: cut back a stopped server's AOF.

A failover to a replica that lacked the last writes loses writes the primary had already
acknowledged. A live run models it on the run's own `redis-server` (append-only file,
`appendfsync always`): once the server is SIGKILLed, and before it restarts, the tail of
its append-only file is cut by N writes, so the restarted server comes back without them,
exactly as the simulator's `SimRedis(failover_loss=N)` rolls back its last N writes.

A write, as the file records it, is one command or one `MULTI` ... `EXEC` block (a Lua
script's effects are wrapped that way when it wrote more than one key); a `SELECT` goes
with the write that follows it. Redis 7 keeps a multi-part AOF: a manifest names a base
file and incremental files, and only the last incremental file is cut, so at most the
writes since the last rewrite can be lost.
"""

from __future__ import annotations

import os
from pathlib import Path

AOF_DIR = "appendonlydir"


class AofError(RuntimeError):
    """The append-only file is not what this module expects (one line)."""


def last_incremental(directory: Path) -> Path:
    """The incremental file the manifest lists last (the one being appended to)."""
    manifests = sorted(directory.glob("*.manifest"))
    if not manifests:
        raise AofError(f"no AOF manifest in {directory}")
    incr: list[tuple[int, str]] = []
    for line in manifests[-1].read_text().splitlines():
        fields = line.split()
        info = dict(zip(fields[::2], fields[1::2], strict=False))
        if info.get("type") == "i" and "file" in info:
            incr.append((int(info.get("seq", 0)), info["file"]))
    if not incr:
        raise AofError(f"{manifests[-1]}: no incremental file listed")
    return directory / max(incr)[1]


def write_offsets(data: bytes) -> list[int]:
    """Where each write of an AOF fragment starts (see the module docstring); a trailing
    partial command is ignored, as Redis ignores it with `aof-load-truncated`."""
    starts: list[int] = []
    pending: int | None = None  # a SELECT, or an open MULTI, waiting for its write
    in_multi = False
    pos = 0
    while pos < len(data):
        begin = pos
        parsed = _command(data, pos)
        if parsed is None:
            break
        name, pos = parsed
        if name == b"SELECT":
            pending = begin if pending is None else pending
        elif name == b"MULTI":
            pending = begin if pending is None else pending
            in_multi = True
        elif in_multi:
            if name == b"EXEC":
                starts.append(pending if pending is not None else begin)
                pending, in_multi = None, False
        else:
            starts.append(pending if pending is not None else begin)
            pending = None
    return starts


def _command(data: bytes, pos: int) -> tuple[bytes, int] | None:
    """The name of the RESP array at `pos` and where the next one starts."""
    line_end = data.find(b"\r\n", pos)
    if line_end < 0 or data[pos : pos + 1] != b"*":
        return None
    count = int(data[pos + 1 : line_end])
    pos = line_end + 2
    name = b""
    for i in range(count):
        line_end = data.find(b"\r\n", pos)
        if line_end < 0 or data[pos : pos + 1] != b"$":
            return None
        size = int(data[pos + 1 : line_end])
        start = line_end + 2
        if start + size + 2 > len(data):
            return None
        if i == 0:
            name = data[start : start + size].upper()
        pos = start + size + 2
    return name, pos


def drop_last_writes(directory: str | os.PathLike[str], count: int) -> int:
    """Cut the last `count` writes off a stopped server's AOF (`directory` is its data
    dir or its `appendonlydir`); return how many were cut."""
    if count <= 0:
        return 0
    root = Path(directory)
    if (root / AOF_DIR).is_dir():
        root = root / AOF_DIR
    path = last_incremental(root)
    data = path.read_bytes()
    starts = write_offsets(data)
    lost = min(count, len(starts))
    if lost:
        with open(path, "r+b") as fh:
            fh.truncate(starts[-lost])
            os.fsync(fh.fileno())
    return lost
