"""A pydantic validation error as one line: `path[i].field: what was expected; got what`.

One renderer for every file a person writes (plans, agent profiles, scenarios), so that
each says what is wrong in the same words; a file type adds only what is its own (a
scenario's hints for unknown fields, a plan's rule name).
"""

from __future__ import annotations

import difflib
import math
import re
import reprlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError

_short_repr = reprlib.Repr()
_short_repr.maxlevel = 2
_short_repr.maxstring = 40
_short_repr.maxother = 40
_short_repr.maxlist = _short_repr.maxtuple = _short_repr.maxset = 4
_short_repr.maxdict = 3
_short_repr.maxlong = 40

_BOUNDS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}
_TYPES = {
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "finite_number": "a finite number",
    "string_too_short": "a non-empty string",
}


def is_finite_number(value: Any) -> bool:
    """A number a file may hold: an int or float (not a bool), finite, within a float."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def got(value: Any) -> str:
    """A value as the message shows it: YAML spelling for null and booleans, ~60 chars."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    try:
        text = _short_repr.repr(value)
    except Exception:  # a value whose repr fails (a huge int) still gets a message
        text = f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."


def did_you_mean(value: Any, choices: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for a typed name close to one of `choices`, else ``."""
    if not isinstance(value, str):
        return ""
    hint = difflib.get_close_matches(value, list(choices), n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


#: How long a list of names an error line spells out in full.
NAMES_IN_FULL = 300


def one_of(choices: list[str]) -> str:
    """`one of a, b, c`; a list too long for one readable line is shortened to its count
    and first names (the did-you-mean tip still names the closest one)."""
    names = ", ".join(choices)
    if len(names) <= NAMES_IN_FULL:
        return f"one of {names}"
    return f"one of {len(choices)} names: {', '.join(choices[:3])}, ..."


def expected(err: Mapping[str, Any], patterns: Mapping[str, str] | None = None) -> str:
    """What one pydantic error says was expected, and what was found instead."""
    kind = err["type"]
    ctx = err.get("ctx") or {}
    found = got(err.get("input"))
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return "unknown field"
    if kind in _TYPES:
        return f"expected {_TYPES[kind]}; got {found}"
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        tip = did_you_mean(err.get("input"), choices)
        return f"expected {one_of(choices)}; got {found}{tip}"
    if kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        bound = ctx.get(key)
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)
        return f"expected a value {op} {bound}; got {found}"
    if kind == "too_short":
        return f"expected at least {ctx.get('min_length')} item(s); got {ctx.get('actual_length')}"
    if kind == "too_long":
        return f"expected at most {ctx.get('max_length')} items; got {ctx.get('actual_length')}"
    if kind == "string_pattern_mismatch":
        pattern = str(ctx.get("pattern", ""))
        what = (patterns or {}).get(pattern, f"a string matching {pattern}")
        return f"expected {what}; got {found}"
    msg = str(err.get("msg", kind))
    return f"{msg[:1].lower()}{msg[1:]}; got {found}"


def join(path: str, sub: str) -> str:
    """`path` and a sub-path: `a` + `[2]` is `a[2]`, `a` + `b` is `a.b`."""
    if not sub:
        return path or "(top)"
    if not path:
        return sub
    return f"{path}{sub}" if sub.startswith("[") else f"{path}.{sub}"


def render(loc: Sequence[Any], data: Any) -> str:
    """`faults[2].after.count`: lists get brackets, mappings dots (whatever the key type)."""
    out = ""
    node: Any = data
    for part in loc:
        in_list = isinstance(node, list | tuple) or (node is None and isinstance(part, int))
        if in_list and isinstance(part, int):
            out += f"[{part}]"
        else:  # a key from the file: an unknown field may be long
            key = str(part)
            out = join(out, key if len(key) <= 60 else key[:57] + "...")
        node = child(node, part)
    return out


def child(node: Any, key: Any) -> Any:
    """`node[key]` when the document has it, else None."""
    if isinstance(node, dict):
        return node.get(key)
    if isinstance(node, list | tuple) and isinstance(key, int) and 0 <= key < len(node):
        return node[key]
    return None


def describe(
    exc: ValidationError,
    data: Any = None,
    *,
    prefix: str = "",
    patterns: Mapping[str, str] | None = None,
) -> str:
    """The first error of `exc` as one line, its path under `prefix`."""
    err = exc.errors(include_url=False)[0]
    path = join(prefix, render(err["loc"], data)) if prefix else render(err["loc"], data)
    return f"{path or '(top)'}: {expected(err, patterns)}"
