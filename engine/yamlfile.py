"""Reading a YAML document from a file, where every way it can fail is one line.

Plans and scenarios are both read this way (PyYAML's safe loader only, made strict): the
caller gives the error class its users expect, and gets the decoded document or that
error, never a traceback, a hang or a memory blow-up:

- only a regular file is read (`/dev/zero` would be read until memory runs out, a FIFO
  blocks until someone writes to it), and at most `MAX_BYTES` of it;
- a key given twice in one mapping is an error (plain PyYAML keeps the last one silently);
- a document of more than `MAX_NODES` nodes is refused while it is parsed, so a large
  file costs seconds, not minutes.

The pure-Python parser is used on purpose: libyaml's recurses without limit on nested
flow collections (`[[[[...` of 100 KB takes half a minute; deeper crashes the process).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

#: Largest file read. The pure-Python parser reads about 1 MB a second at worst (blank
#: lines), and the largest plan worth running (3,000 rules) is under 200 KB.
MAX_BYTES = 2 * 1024 * 1024
#: Most YAML nodes in one document (aliases count each time they are used).
MAX_NODES = 100_000
#: Longest key or value quoted in an error line.
MAX_SHOWN = 80


def clip(text: str, limit: int = MAX_SHOWN) -> str:
    """`text` cut to `limit` characters with '...', for an error line."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


class YamlProblem(ValueError):
    """What is wrong with a document, without the file name; `read_yaml` adds it."""


class StrictSafeLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader that refuses duplicate mapping keys and oversized documents."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise YamlProblem(f"too large: more than {MAX_NODES} YAML nodes")
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        # before `flatten_mapping`: keys merged in with `<<` may be overridden on purpose
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # unhashable: SafeConstructor says so below
                    continue
                if first is not key_node:
                    mark = key_node.start_mark
                    raise YamlProblem(
                        f"duplicate key {clip(repr(key))} (line {mark.line + 1}, column "
                        f"{mark.column + 1}; first at line {first.start_mark.line + 1}); "
                        "expected each key once per mapping"
                    )
        return super().construct_mapping(node, deep=deep)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a plain file"


def read_bytes(path: Path, what: str, error: type[ValueError], limit: int = MAX_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, or one `error` line.

    Opened without blocking and checked on the open descriptor, so a FIFO or a device
    swapped in after a check is still refused, and nothing waits for a writer.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    except ValueError as exc:  # an embedded NUL in the path
        raise error(f"{path}: cannot read {what}: {exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(
                f"{path}: cannot read {what}: {_kind(info.st_mode)}; expected a regular file"
            )
        if info.st_size > limit:
            raise error(
                f"{path}: cannot read {what}: too large ({info.st_size} bytes); "
                f"expected at most {limit} bytes"
            )
        chunks: list[bytes] = []
        size = 0
        while size <= limit:  # the file may grow while it is read
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise error(f"{path}: cannot read {what}: too large; expected at most {limit} bytes")
        return b"".join(chunks)
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def read_yaml(path: str | Path, what: str, error: type[ValueError]) -> Any:
    """The decoded YAML document of `path`, or one `error` line naming the file."""
    path = Path(path)
    return parse_yaml(read_bytes(path, what, error), path, error)


def parse_yaml(data: bytes, path: str | Path, error: type[ValueError]) -> Any:
    """The decoded YAML document `data` (the bytes of `path`), or one `error` line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte {exc.start})") from None
    try:
        return yaml.load(text, Loader=StrictSafeLoader)  # a SafeLoader subclass
    except YamlProblem as exc:
        raise error(f"{path}: not valid YAML: {exc}") from None
    except RecursionError:
        raise error(f"{path}: not valid YAML: nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise error(f"{path}: not valid YAML{where}: {clip(problem, 200)}") from None
    except (ValueError, TypeError, OverflowError) as exc:
        # PyYAML's constructors: a timestamp like 2024-13-45, an int of 5000 digits
        raise error(f"{path}: not valid YAML: {clip(str(exc), 200)}") from None
