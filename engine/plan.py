"""Evaluation plans: passes of rules whose `depends_on` edges form a rule-level DAG.

A plan is read once, validated whole, and then frozen: the core only ever sees a `Plan`
whose dependencies are known to exist, point backwards (to the same or an earlier pass)
and contain no cycle. Every way a file can be wrong ends in one `PlanError` line naming
the file, the field path and what was expected, so the CLI never shows a traceback.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.policy import MAX_ATTEMPTS
from engine.validation import expected, render
from engine.yamlfile import clip, parse_yaml, read_bytes

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_PATTERNS = {
    ID_PATTERN: "an id (letters, digits, '_', '.', '-'; up to 64, not starting with a symbol)"
}


class PlanError(ValueError):
    """A plan that cannot be used; the message is one line meant for a human."""

    def __init__(self, message: str) -> None:
        # ids, keys and paths come from the file: escape line breaks and control characters
        # so that the message stays one line
        super().__init__(
            "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in message)
        )


# --- the schema, as the file spells it ------------------------------------------------


class _RuleSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    id: str = Field(pattern=ID_PATTERN)
    description: str = ""
    depends_on: list[str] = Field(default_factory=list)
    max_attempts: int | None = Field(default=None, ge=1, le=MAX_ATTEMPTS)


class _PassSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    id: str = Field(pattern=ID_PATTERN)
    description: str = ""
    rules: list[_RuleSpec] = Field(min_length=1)


class _PlanSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    plan: str = Field(pattern=ID_PATTERN)
    description: str = ""
    passes: list[_PassSpec] = Field(min_length=1)


# --- the frozen plan the core reads ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    pass_id: str
    depends_on: tuple[str, ...] = ()
    max_attempts: int | None = None
    description: str = ""


@dataclass(frozen=True)
class Pass:
    id: str
    rule_ids: tuple[str, ...]
    description: str = ""


@dataclass(frozen=True)
class Plan:
    id: str
    passes: tuple[Pass, ...]
    rules: Mapping[str, Rule]
    description: str = ""
    _dependents: Mapping[str, tuple[str, ...]] = field(default_factory=dict, repr=False)

    @cached_property
    def order(self) -> tuple[str, ...]:
        """Rule ids in a topological order (stable: pass order, then file order)."""
        return tuple(rid for p in self.passes for rid in _toposort(p.rule_ids, self.rules))

    @cached_property
    def position(self) -> Mapping[str, int]:
        """Each rule's place in `order`."""
        return {rid: i for i, rid in enumerate(self.order)}

    def dependents(self, rule_id: str) -> tuple[str, ...]:
        """Direct dependents of a rule."""
        return self._dependents.get(rule_id, ())

    def transitive_dependents(self, rule_ids: Iterable[str]) -> frozenset[str]:
        """Every rule that (directly or not) depends on one of `rule_ids`."""
        seen: set[str] = set()
        stack = list(rule_ids)
        while stack:
            for dep in self.dependents(stack.pop()):
                if dep not in seen:
                    seen.add(dep)
                    stack.append(dep)
        return frozenset(seen)

    def to_dict(self) -> dict[str, Any]:
        """The plan as its file would spell it; `plan_from_dict` reads it back."""
        return {
            "plan": self.id,
            "description": self.description,
            "passes": [
                {
                    "id": p.id,
                    "description": p.description,
                    "rules": [_rule_dict(self.rules[rid]) for rid in p.rule_ids],
                }
                for p in self.passes
            ],
        }

    def to_json(self) -> str:
        return self._json

    @cached_property
    def _json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)


def _rule_dict(rule: Rule) -> dict[str, Any]:
    out: dict[str, Any] = {"id": rule.id, "depends_on": list(rule.depends_on)}
    if rule.max_attempts is not None:
        out["max_attempts"] = rule.max_attempts
    if rule.description:
        out["description"] = rule.description
    return out


def _toposort(rule_ids: Iterable[str], rules: Mapping[str, Rule]) -> list[str]:
    """Order the rules of one pass so that a rule follows its in-pass dependencies.

    The order is that of sweeping the pass in file order again and again, placing each
    rule whose in-pass dependencies are placed (the core starts ready rules in this order,
    so it must not change), computed in linear time (Kahn's algorithm) instead of one
    sweep per chain link: a rule's sweep is the latest of its dependencies' sweeps, plus
    one for a dependency that comes after it in the file, which its sweep has passed by.
    """
    ids = list(rule_ids)
    index = {rid: i for i, rid in enumerate(ids)}
    waiting = {rid: 0 for rid in ids}
    local_dependents: dict[str, list[str]] = {rid: [] for rid in ids}
    for rid in ids:
        for dep in rules[rid].depends_on:
            if dep in index:
                waiting[rid] += 1
                local_dependents[dep].append(rid)
    sweep = dict.fromkeys(ids, 1)
    ready = deque(rid for rid in ids if waiting[rid] == 0)
    seen = 0
    while ready:
        rid = ready.popleft()
        seen += 1
        for nxt in local_dependents[rid]:
            later = 1 if index[rid] > index[nxt] else 0
            sweep[nxt] = max(sweep[nxt], sweep[rid] + later)
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                ready.append(nxt)
    if seen < len(ids):  # pragma: no cover - plans are checked for cycles first
        raise PlanError("cycle")
    return sorted(ids, key=lambda rid: (sweep[rid], index[rid]))


# --- loading ------------------------------------------------------------------------------


#: Plans already validated, by path and content: the explorer loads the same file for
#: every seed, and parsing YAML costs more than a simulated run. A `Plan` is frozen.
_LOADED: dict[tuple[str, bytes], Plan] = {}


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file (YAML or JSON)."""
    data = read_bytes(Path(path), "plan", PlanError)
    key = (str(path), data)
    plan = _LOADED.get(key)
    if plan is None:
        plan = plan_from_dict(parse_yaml(data, path, PlanError), source=str(path))
        if len(_LOADED) >= 64:
            _LOADED.clear()
        _LOADED[key] = plan
    return plan


def plan_from_dict(data: Any, source: str = "<plan>") -> Plan:
    """Validate a decoded plan document and freeze it."""
    if not isinstance(data, dict):
        raise PlanError(f"{source}: expected a mapping with 'plan' and 'passes' at the top")
    try:
        spec = _PlanSpec.model_validate(data)
    except ValidationError as exc:
        raise PlanError(f"{source}: {_describe(exc, data)}") from None
    return _freeze(spec, source)


def _describe(exc: ValidationError, data: Any) -> str:
    """`engine.validation`'s line, with the rule it is about named (its id, if it has one)."""
    err = exc.errors(include_url=False)[0]
    loc = err["loc"]
    path = render(loc, data) or "(top)"
    rule_hint = ""
    if "rules" in loc:
        idx = loc.index("rules")
        rules = _walk(data, loc[: idx + 2])
        if isinstance(rules, dict) and isinstance(rules.get("id"), str):
            rule_hint = f" (rule {clip(repr(rules['id']))})"
    return f"{path}{rule_hint}: {expected(err, _PATTERNS)}"


def _has(node: Any, key: Any) -> bool:
    if isinstance(node, dict):
        return key in node
    return isinstance(key, int) and 0 <= key < len(node)


def _walk(data: Any, loc: tuple[Any, ...]) -> Any:
    node = data
    for key in loc:
        if isinstance(node, dict | list) and _has(node, key):
            node = node[key]
        else:
            return None
    return node


def _freeze(spec: _PlanSpec, source: str) -> Plan:
    rules: dict[str, Rule] = {}
    pass_of: dict[str, int] = {}
    passes: list[Pass] = []
    pass_ids: set[str] = set()
    for pi, p in enumerate(spec.passes):
        if p.id in pass_ids:
            raise PlanError(f"{source}: passes[{pi}].id: duplicate pass id '{p.id}'")
        pass_ids.add(p.id)
        for ri, r in enumerate(p.rules):
            where = f"passes[{pi}].rules[{ri}]"
            if r.id in rules:
                raise PlanError(f"{source}: {where}.id: duplicate rule id '{r.id}'")
            if len(set(r.depends_on)) != len(r.depends_on):
                raise PlanError(f"{source}: {where}.depends_on (rule '{r.id}'): listed twice")
            rules[r.id] = Rule(
                id=r.id,
                pass_id=p.id,
                depends_on=tuple(r.depends_on),
                max_attempts=r.max_attempts,
                description=r.description,
            )
            pass_of[r.id] = pi
        passes.append(
            Pass(id=p.id, rule_ids=tuple(r.id for r in p.rules), description=p.description)
        )

    for pi, p in enumerate(spec.passes):
        for ri, r in enumerate(p.rules):
            where = f"passes[{pi}].rules[{ri}].depends_on (rule '{r.id}')"
            for dep in r.depends_on:
                if dep == r.id:
                    raise PlanError(f"{source}: {where}: a rule cannot depend on itself")
                if dep not in rules:
                    raise PlanError(f"{source}: {where}: unknown rule {clip(repr(dep))}")
                if pass_of[dep] > pi:
                    raise PlanError(
                        f"{source}: {where}: '{dep}' is in a later pass "
                        f"('{rules[dep].pass_id}'); a rule may depend only on rules of its "
                        "own or an earlier pass"
                    )
    cycle = _find_cycle(rules)
    if cycle:
        rid = cycle[0]
        pi = pass_of[rid]
        ri = passes[pi].rule_ids.index(rid)
        shown = [*cycle, cycle[0]] if len(cycle) <= 6 else [*cycle[:5], "...", cycle[0]]
        size = "" if len(cycle) <= 6 else f" ({len(cycle)} rules)"
        raise PlanError(
            f"{source}: passes[{pi}].rules[{ri}].depends_on (rule '{rid}'): "
            f"dependency cycle {' -> '.join(shown)}{size}"
        )
    dependents: dict[str, list[str]] = {}
    for rid in (rid for p in passes for rid in p.rule_ids):
        for dep in rules[rid].depends_on:
            dependents.setdefault(dep, []).append(rid)
    return Plan(
        id=spec.plan,
        passes=tuple(passes),
        rules=rules,
        description=spec.description,
        _dependents={k: tuple(v) for k, v in dependents.items()},
    )


def _find_cycle(rules: Mapping[str, Rule]) -> list[str] | None:
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(rules, white)
    for start in rules:
        if colour[start] != white:
            continue
        path: list[str] = []
        stack: list[tuple[str, int]] = [(start, 0)]
        while stack:
            rid, i = stack.pop()
            if i == 0:
                colour[rid] = grey
                path.append(rid)
            deps = rules[rid].depends_on
            if i < len(deps):
                stack.append((rid, i + 1))
                nxt = deps[i]
                if colour[nxt] == grey:
                    return path[path.index(nxt) :]
                if colour[nxt] == white:
                    stack.append((nxt, 0))
            else:
                colour[rid] = black
                path.pop()
    return None
