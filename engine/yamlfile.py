"""Reading a YAML document from a file, where every way it can fail is one line.

Plans and scenarios are both read this way (`yaml.safe_load` only): the caller gives the
error class its users expect, and gets the decoded document or that error, never a
traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def read_yaml(path: str | Path, what: str, error: type[ValueError]) -> Any:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except ValueError as exc:  # an embedded NUL in the path
        raise error(f"{path}: cannot read {what}: {exc}") from None
    try:
        return yaml.safe_load(text)
    except RecursionError:
        raise error(f"{path}: not valid YAML: nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise error(f"{path}: not valid YAML{where}: {problem}") from None
    except (ValueError, TypeError, OverflowError) as exc:
        # PyYAML's constructors: a timestamp like 2024-13-45, an int of 5000 digits
        raise error(f"{path}: not valid YAML: {exc}") from None
