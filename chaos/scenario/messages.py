"""A pydantic error as one line: `field.path[i].sub: what was expected; got what`."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import (
    BaseModel,
    ValidationError,
)

from chaos.scenario.schema import (
    _FAULT_TAGS,
    EVENT_PATTERN,
    AfterEvent,
    BrokerSpec,
    BudgetsSpec,
    EngineSpec,
    FailpointFault,
    PlanRef,
    RedisSpec,
    RetrySpec,
    RunnerFault,
    Scenario,
)
from engine.plan import _PATTERNS as _PLAN_PATTERNS
from engine.validation import child as _child
from engine.validation import expected
from engine.validation import join as _join
from engine.validation import render as _render

# --- pydantic errors as one line -------------------------------------------------------------

_PATTERNS = {
    **_PLAN_PATTERNS,
    EVENT_PATTERN: "an event name (lower case letters, digits, '_')",
}


def _describe(exc: ValidationError, data: Any) -> str:
    """`field.path[i].sub: what was expected; got what` for the first error."""
    err = exc.errors(include_url=False)[0]
    loc = tuple(
        part
        for k, part in enumerate(err["loc"])
        if not (k == 2 and err["loc"][0] == "faults" and part in _FAULT_TAGS)
    )
    path = _render(loc, data)
    ctx = err.get("ctx") or {}
    if err["type"] == "scenario_rule":
        return f"{_join(path, str(ctx['path']))}: {ctx['detail']}"
    if err["type"] == "agent_profile":
        detail = str(ctx["detail"])
        return (
            f"agent: {detail[len('(top): ') :]}"
            if detail.startswith("(top)")
            else f"agent.{detail}"
        )
    if err["type"] == "extra_forbidden":
        return f"{path}: {_unknown_field(loc, data)}"
    if err["type"] == "missing" and loc == ("plans",):
        return "plans: required field is missing (or the plan shorthand)"
    return f"{path or '(top)'}: {_message(err)}"


def _message(err: Mapping[str, Any]) -> str:
    ctx = err.get("ctx") or {}
    if err["type"] == "scenario_value":
        return str(ctx["detail"])
    if err["type"] == "scenario_rule":
        return _join(str(ctx["path"]), str(ctx["detail"]))
    return expected(err, _PATTERNS)


def _unknown_field(loc: Sequence[Any], data: Any) -> str:
    """'unknown field', with the nearest known name and the known names of that mapping."""
    parent = loc[:-1]
    model: type[BaseModel] | None = {
        (): Scenario,
        ("retry",): RetrySpec,
        ("engine",): EngineSpec,
        ("budgets",): BudgetsSpec,
        ("broker",): BrokerSpec,
        ("redis",): RedisSpec,
    }.get(tuple(parent))
    if len(parent) == 2 and parent[0] == "plans":
        model = PlanRef
    elif len(parent) >= 2 and parent[0] == "faults":
        node = _child(_child(data, "faults"), parent[1])
        is_fp = isinstance(node, dict) and "failpoint" in node
        model = AfterEvent if parent[2:] == ("after",) else FailpointFault if is_fp else RunnerFault
    if model is None:
        return "unknown field"
    known = list(model.model_fields)
    if model is Scenario:
        known += ["plan", "evaluations"]
    hint = difflib.get_close_matches(str(loc[-1]), known, n=1)
    tip = f" (did you mean {hint[0]}?)" if hint else ""
    return f"unknown field{tip}; expected one of {', '.join(known)}"
