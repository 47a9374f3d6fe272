"""`python -m chaos docs`: the reference tables of `docs/reference/`, written from the code.

Scenarios (their files' `name` and `description`), their fields (`scenarios/schema.json`,
itself written from the loader's models), invariants (`chaos.checker.INVARIANTS`),
failpoints (`engine.failpoints.FAILPOINTS`), mutants (`chaos.mutants.MUTANTS`) and toxics
(`chaos.proxy.model.ATTRIBUTES`) are listed where they are defined, so a page written by
hand would go stale as soon as one is added. These pages are regenerated instead, and
`tests/test_docs.py` fails when one differs from what this module writes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = Path("docs") / "reference"
COMMAND = "python -m chaos docs"
#: A scenario's description is a paragraph; its table row takes the first sentence, cut here.
MAX_SUMMARY = 200
#: A longer list of allowed names is cut in the fields' table (the schema has them all).
MAX_CHOICES = 12


def _header(title: str, source: str) -> list[str]:
    return [
        f"# {title}",
        "",
        f"<!-- generated from {source} by `{COMMAND}`: edit the code, not this page -->",
        "",
    ]


def _cell(text: str) -> str:
    """One table cell: one line, no column separator."""
    return " ".join(text.split()).replace("|", "\\|")


def _table(columns: tuple[str, ...], rows: Iterable[tuple[str, ...]]) -> list[str]:
    lines = [f"| {' | '.join(columns)} |", f"|{'---|' * len(columns)}"]
    lines += [f"| {' | '.join(_cell(c) for c in row)} |" for row in rows]
    return lines


def summary(description: str) -> str:
    """The first sentence of a description, at most MAX_SUMMARY characters."""
    text = " ".join(description.split())
    first = re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", text, maxsplit=1)[0]
    if len(first) > MAX_SUMMARY:
        first = first[: MAX_SUMMARY - 1].rsplit(" ", 1)[0].rstrip(",;:") + "…"
    return first


def scenarios_page(root: Path = ROOT) -> str:
    from chaos.scenario import ScenarioError, expected_refusal, load_scenario

    groups = (
        ("Shipped scenarios", "scenarios/*.yaml", "the resilience gate runs each live"),
        (
            "pg-store",
            "scenarios/pg_store/*.yaml",
            "the `pg-store` design's own (`system: pg-store`): PostgreSQL's faults, and the "
            "scenarios its mutants are caught on",
        ),
        (
            "pg",
            "scenarios/pg/*.yaml",
            "the `pg` design's own (`system: pg`, PostgreSQL alone): the second document's "
            "acceptance tests and its resume from a checkpoint",
        ),
        (
            "temporal",
            "scenarios/temporal/*.yaml",
            "the `temporal` design's own (`system: temporal`): its server's kill and its "
            "workers' cut link",
        ),
        (
            "dbos",
            "scenarios/dbos/*.yaml",
            "the `dbos` design's own (`system: dbos`): a worker gone for good, whose workflows "
            "wait for the operator's recovery",
        ),
        (
            "Containers mode",
            "scenarios/containers/*.yaml",
            "clean stops and pauses of the services (`--mode containers`, or live processes)",
        ),
        (
            "Regressions",
            "scenarios/regressions/*.yaml",
            "shrunk seeds that failed before a fix and pass since; the gate replays them",
        ),
        (
            "Refused",
            "scenarios/refused/*.yaml",
            "settings past a bound of the engine: each must be refused with the line its "
            "first line names (`chaos mutate` runs them with the suite)",
        ),
        ("Examples", "scenarios/examples/*.yaml", "the loader's tests"),
    )
    lines = _header("Scenarios", "the scenario files' `name` and `description`")
    lines += [
        "Every scenario file the repository ships, with the first sentence of its",
        "`description` (the file says the rest).",
        "",
    ]
    for title, pattern, what in groups:
        paths = sorted(root.glob(pattern))
        if not paths:
            continue
        rows = []
        for path in paths:
            rel = path.relative_to(root).as_posix()
            refusal = expected_refusal(path)
            if refusal is not None:
                rows.append((f"[`{path.stem}`](../../{rel})", f"refused: `{refusal}`"))
                continue
            try:
                spec = load_scenario(path).spec
                name, text = spec.name, summary(spec.description)
            except ScenarioError as exc:
                name, text = "(invalid)", str(exc)
            link = f"[`{path.stem}`](../../{rel})"
            rows.append((link if name == path.stem else f"{link} (`name: {name}`)", text))
        lines += [f"## {title}", "", f"`{pattern}`: {what}.", ""]
        lines += _table(("scenario", "what happens"), rows)
        lines.append("")
    return "\n".join(lines)


def _type(spec: dict[str, Any]) -> str:
    """A JSON Schema type as a reader says it: `integer (1 to 1000)`, `EngineSpec`, ..."""
    if "$ref" in spec:
        name = spec["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    for key in ("anyOf", "oneOf"):
        if key in spec:
            kinds = [_type(s) for s in spec[key] if s.get("type") != "null"]
            nullable = any(s.get("type") == "null" for s in spec[key])
            return " or ".join(kinds) + (" or null" if nullable else "")
    if "enum" in spec:
        names = [f"`{v}`" for v in spec["enum"]]
        if len(names) > MAX_CHOICES:
            return f"one of {len(names)} names: {', '.join(names[:3])}, ..."
        return "one of " + ", ".join(names)
    if "const" in spec:
        return f"`{spec['const']}`"
    kind = str(spec.get("type", "any"))
    if kind == "array":
        if "prefixItems" in spec:
            return f"[{', '.join(_type(s) for s in spec['prefixItems'])}]"
        return f"list of {_type(spec.get('items', {}))}"
    if kind == "object" and isinstance(spec.get("additionalProperties"), dict):
        return f"mapping to {_type(spec['additionalProperties'])}"
    low, high = spec.get("minimum", spec.get("exclusiveMinimum")), spec.get("maximum")
    if low is not None and high is not None:
        return f"{kind} ({low} to {high})"
    if low is not None:
        return f"{kind} (from {low})"
    return kind


def _field_rows(props: dict[str, Any], required: Iterable[str]) -> Iterable[tuple[str, ...]]:
    needed = set(required)
    for name, spec in props.items():
        if name in needed:
            default = "required"
        elif isinstance(spec.get("default"), dict):
            default = "its own defaults"
        elif "default" in spec:
            default = f"`{json.dumps(spec['default'])}`"
        else:
            default = ""
        yield f"`{name}`", _type(spec), default, spec.get("description", "")


def fields_page(root: Path = ROOT) -> str:
    schema = json.loads((root / "scenarios" / "schema.json").read_text(encoding="utf-8"))
    lines = _header("Scenario fields", "`scenarios/schema.json` (`python -m chaos.scenario`)")
    lines += [
        "Every field of a scenario file, with its type, its default and what it sets",
        "([the harness](../harness.md#scenario-files) explains them with an example).",
        "",
        "## Scenario file",
        "",
        " ".join(schema.get("description", "").split()),
        "",
    ]
    rows = _field_rows(schema["properties"], schema.get("required", []))
    lines += _table(("field", "type", "default", "meaning"), rows)
    for name, spec in sorted(schema.get("$defs", {}).items()):
        lines += ["", f"## {name}", ""]
        if spec.get("description"):
            lines += [" ".join(spec["description"].split()), ""]
        rows = _field_rows(spec.get("properties", {}), spec.get("required", []))
        lines += _table(("field", "type", "default", "meaning"), rows)
    return "\n".join(lines) + "\n"


def invariants_page() -> str:
    from chaos.checker import INVARIANTS

    lines = _header("Invariants", "`chaos.checker.INVARIANTS`")
    lines += [
        "What the checker proves on every run's history and final Redis state. Each verdict",
        "counts the cases it judged; zero cases is `unknown`, never `pass`",
        "([the harness](../harness.md#invariants) says more of each).",
        "",
    ]
    lines += _table(("invariant", "what it proves"), ((f"`{n}`", m) for n, m in INVARIANTS.items()))
    return "\n".join(lines) + "\n"


def failpoints_page() -> str:
    from engine.failpoints import FAILPOINTS

    lines = _header("Failpoints", "`engine.failpoints.FAILPOINTS`")
    lines += [
        "Where a fault can be armed inside a worker (`--failpoint`, `ENGINE_FAILPOINTS`, or a",
        "scenario's `failpoint:` fault), as",
        "`NAME=crash|raise|stall:MS|freeze:MS[,hit=N][,times=K][,rule=R][,attempt_id=A]"
        "[,until=EVENT]`.",
        "A stall with `until` ends once the run's history records EVENT after the firing (MS is",
        "then its longest), and records its end (`failpoint_released`, `came`): a scenario that",
        "needs the runner to act inside the stall waits for the act, not for a time.",
        "",
    ]
    rows = ((f"`{n}`", m) for n, m in FAILPOINTS.items())
    lines += _table(("failpoint", "the process is..."), rows)
    return "\n".join(lines) + "\n"


def mutants_page() -> str:
    from chaos.insim import mutants as insim
    from chaos.mutants import MUTANTS

    core = set(getattr(insim, "CORE", ()))
    patched = set(getattr(insim, "PATCHED", ()))

    def in_sim(name: str) -> str:
        if name in core:
            return "the same patch"
        if name in patched:
            return "its model's counterpart"
        return "not modelled"

    lines = _header("Mutants", "`chaos.mutants.MUTANTS` and `chaos.insim.mutants`")
    lines += [
        "Each mutant breaks one behaviour on purpose (`--mutant NAME`) so that the invariant it",
        "targets is seen to fail, live and in the simulator",
        "([the harness](../harness.md#mutants) says how they are applied).",
        "",
    ]
    rows = (
        (f"`{m.name}`", f"`{m.breaks}`", in_sim(m.name), m.description) for m in MUTANTS.values()
    )
    lines += _table(("mutant", "breaks", "in the simulator", "what it does"), rows)
    return "\n".join(lines) + "\n"


def toxics_page() -> str:
    from chaos.proxy.model import ATTRIBUTES

    lines = _header("Toxics", "`chaos.proxy.model.ATTRIBUTES`")
    lines += [
        "The network faults' toxics (`add_toxic`, `update_toxic`, `remove_toxic` on",
        "`link: redis` or `link: broker`), as Toxiproxy 2.x names them.",
        "",
    ]
    rows = (
        (f"`{name}`", ", ".join(f"`{f}`" for f in model.model_fields), model.__doc__ or "")
        for name, model in ATTRIBUTES.items()
    )
    lines += _table(("toxic", "attributes", "what it does"), rows)
    return "\n".join(lines) + "\n"


def history_page() -> str:
    from chaos.checker.vocabulary import COMMON, EVENTS, describe

    lines = _header("History events", "`chaos.checker.vocabulary.EVENTS`")
    lines += [
        "Every event a worker or sweeper records in its history, with its fields: what",
        "`history_well_formed` holds each recorded event to. Every event also carries",
        ", ".join(f"`{c}`" for c in COMMON) + "; a field marked optional may be absent.",
        "",
    ]
    rows = (
        (
            f"`{ev}`",
            "; ".join(
                f"`{name.rstrip('?')}`{' (optional)' if name.endswith('?') else ''}: "
                f"{describe(spec)}"
                for name, spec in fields.items()
            )
            or "none",
        )
        for ev, fields in EVENTS.items()
    )
    lines += _table(("event", "fields"), rows)
    return "\n".join(lines) + "\n"


PAGES: dict[str, Callable[[], str]] = {
    "scenarios.md": scenarios_page,
    "fields.md": fields_page,
    "invariants.md": invariants_page,
    "failpoints.md": failpoints_page,
    "mutants.md": mutants_page,
    "toxics.md": toxics_page,
    "history.md": history_page,
}


def render() -> dict[Path, str]:
    """Every generated page, by its path inside the repository."""
    return {REFERENCE / name: page() for name, page in PAGES.items()}


def stale(root: Path = ROOT) -> list[Path]:
    """The generated pages that differ from what is on disk (or are missing)."""
    out = []
    for rel, text in render().items():
        path = root / rel
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            out.append(rel)
    return out


def write(root: Path = ROOT) -> list[Path]:
    """Write every page that changed; return those written."""
    changed = stale(root)
    pages = render()
    for rel in changed:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(pages[rel], encoding="utf-8")
    return changed
