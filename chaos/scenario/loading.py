"""Reading a scenario file: YAML, validated whole, its plans found and loaded."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import (
    ValidationError,
)

from chaos.scenario.loaded import LoadedScenario
from chaos.scenario.messages import _describe
from chaos.scenario.schema import (
    MAX_DOCUMENT_VALUES,
    FailpointFault,
    RunnerFault,
    Scenario,
    ScenarioError,
    _got,
)
from engine.plan import Plan, PlanError, load_plan
from engine.yamlfile import read_yaml

#: The first line of a scenario that must be refused (`scenarios/refused/`): the line it is
#: refused with follows, after the file's name.
REFUSED_MARK = "# refused: "

# --- loading ---------------------------------------------------------------------------------


def expected_refusal(path: str | Path) -> str | None:
    """The line a refused scenario must be refused with (its first line says so), or None
    for a scenario that must load. A suite of them holds the loader, and the engine checks
    it calls, to every bound: a check that lets a bad value through fails the suite."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
    except (OSError, UnicodeDecodeError):
        return None
    return first[len(REFUSED_MARK) :].rstrip("\n") if first.startswith(REFUSED_MARK) else None


def refusal_problem(path: str | Path) -> str | None:
    """What is wrong with how a refused scenario fared: loaded, or refused otherwise."""
    want = expected_refusal(path)
    assert want is not None
    try:
        load_scenario(path)
    except ScenarioError as exc:
        got = str(exc).removeprefix(f"{path}: ")
        return None if got == want else f"refused with {got!r}, expected {want!r}"
    return f"loaded, but must be refused with {want!r}"


def load_scenario(path: str | Path) -> LoadedScenario:
    """Read, validate and load a scenario file and its plans."""
    path = Path(path)
    data = read_yaml(path, "scenario", ScenarioError)
    return scenario_from_dict(data, source=str(path), base_dir=path.parent)


def scenario_from_dict(
    data: Any, source: str = "<scenario>", base_dir: str | Path | None = None
) -> LoadedScenario:
    """Validate a decoded scenario document and load its plans.

    Relative plan paths are tried in `base_dir` (default: the directory of `source` when
    it names a file), then in the current directory.
    """
    if isinstance(data, Mapping) and not isinstance(data, dict):
        data = dict(data)
    if not isinstance(data, dict):
        raise ScenarioError(
            f"{source}: expected a mapping with 'name' and 'plans' (or 'plan') at the top; "
            f"got {_got(data)}"
        )
    _check_size(data, source)
    try:
        spec = Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(f"{source}: {_describe(exc, data)}") from None
    except RecursionError:
        raise ScenarioError(f"{source}: nested too deeply") from None
    if base_dir is None:
        base_dir = None if source.startswith("<") else Path(source).parent
    shorthand = "plan" in data
    plans: list[tuple[Plan, int]] = []
    paths: list[Path] = []
    files: dict[Any, int] = {}  # file identity -> index in plans
    for i, ref in enumerate(spec.plans):
        field = "plan" if shorthand else f"plans[{i}].path"
        found = _find_plan(ref.path, base_dir)
        if found is None:
            where = f"{base_dir} and the current directory" if base_dir else "the current directory"
            raise ScenarioError(
                f"{source}: {field}: no plan file {_got(ref.path)} (looked in {where})"
            )
        same = files.setdefault(_identity(found), i)
        if same != i:
            raise ScenarioError(
                f"{source}: {field}: the same plan file as plans[{same}]; expected each plan "
                f"once (set plans[{same}].evaluations for more evaluations of it)"
            )
        try:
            plan = load_plan(found)
        except PlanError as exc:
            raise ScenarioError(f"{source}: {field}: {exc}") from None
        for j, (other, _) in enumerate(plans):
            if other.id == plan.id:
                # the attemptIds of a run are made of plan ids: two plans would share them
                raise ScenarioError(
                    f"{source}: {field}: plan id {plan.id!r} is also the id of plans[{j}] "
                    f"({_got(str(paths[j]))}); expected distinct plan ids"
                )
        plans.append((plan, ref.evaluations))
        paths.append(found)
    loaded = LoadedScenario(
        spec=spec,
        source=source,
        plans=tuple(plans),
        plan_paths=tuple(paths),
        agent=spec.agent_profile(),
        retry_policy=spec.retry_policy(),
    )
    _check_rules(loaded, source)
    return loaded


def _find_plan(raw: str, base_dir: str | Path | None) -> Path | None:
    """The first candidate that is a file; else one that exists but is not a directory
    (a FIFO, a device), for `load_plan` to refuse in its own words; else None."""
    candidates = [Path(raw)] if Path(raw).is_absolute() else []
    if not candidates:
        if base_dir is not None:
            candidates.append(Path(base_dir) / raw)
        candidates.append(Path(raw))
    odd: Path | None = None
    for candidate in candidates:
        try:  # stat only: opening a FIFO would wait for a writer
            if candidate.is_file():
                return candidate
            if odd is None and candidate.exists() and not candidate.is_dir():
                odd = candidate
        except (OSError, ValueError):  # a name too long, an embedded NUL
            continue
    return odd


def _identity(path: Path) -> Any:
    """What makes two paths the same file (a link, `a/../b`): its device and inode."""
    try:
        info = path.stat()
    except OSError:
        return path.resolve()
    return (info.st_dev, info.st_ino)


def _check_size(data: Any, source: str) -> None:
    """Refuse a document that is huge once its aliases are expanded (or cyclic)."""
    seen = 0
    stack = [data]
    while stack:
        node = stack.pop()
        seen += 1
        if seen > MAX_DOCUMENT_VALUES:
            raise ScenarioError(
                f"{source}: too large: more than {MAX_DOCUMENT_VALUES} values once YAML "
                "aliases are expanded"
            )
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list | tuple | set | frozenset):
            stack.extend(node)


def _check_rules(loaded: LoadedScenario, source: str) -> None:
    """Rule ids a scenario names must exist: a filter on a missing rule never fires."""
    every: set[str] = {rid for plan, _ in loaded.plans for rid in plan.rules}

    def known(rule: str, path: str, plan: Plan | None = None) -> None:
        rules = plan.rules if plan is not None else every
        if rule not in rules:
            where = f"plan {plan.id}" if plan is not None else "any plan of the scenario"
            hint = difflib.get_close_matches(rule, sorted(rules), n=1)
            tip = f"; did you mean {hint[0]!r}?" if hint else ""
            raise ScenarioError(f"{source}: {path}: no rule {_got(rule)} in {where}{tip}")

    for i, fault in enumerate(loaded.spec.faults):
        if isinstance(fault, FailpointFault) and fault.rule is not None:
            plan = None if fault.evaluation is None else loaded.submissions[fault.evaluation].plan
            known(fault.rule, f"faults[{i}].rule", plan)
        elif isinstance(fault, RunnerFault) and fault.after and fault.after.rule is not None:
            known(fault.after.rule, f"faults[{i}].after.rule")
    for key in ("fail_rules", "always_fail_rules"):
        value = loaded.spec.agent.get(key) or ()
        for rule in value:
            short = key == "fail_rules" and len(rule) <= 64
            known(rule, f"agent.{key}.{rule}" if short else f"agent.{key}")
