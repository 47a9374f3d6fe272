"""Targets and mutants: which functions of which files, and each one-change copy of a file.

The mutations are mutmut's (libcst node rewrites, `# pragma: no mutate` honoured); a mutant
here is the whole file with that one node replaced, so the worker compiles it in place of
the original module and nothing else of the file changes. Only mutations inside a function
or a method are kept (as mutmut does): the module's top level runs at import, where a
change breaks every scenario at once and measures nothing.

A mutant's id is `path:function:hash`, the hash taken over the function's name and the
changed lines' text (not their line numbers), so it stays the same when code elsewhere in
the file moves: `equivalent.toml` can name it across runs.
"""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: What `chaos mutate` targets by default: the engine's pure core, its one shell, its retry
#: policy and the store's Python references (the methods of `sim.redis.SimRedis` named in
#: `sim.redis.REFERENCES`, each proven equal to its Lua script on a real Redis).
DEFAULT_PATHS = ("engine/core", "engine/policy.py", "engine/shell")
REFERENCE_FILE = "sim/redis.py"


class TargetError(Exception):
    """A target the command cannot mutate: one line, exit 2."""


@dataclass(frozen=True)
class Target:
    """A file to mutate (relative to the checkout), its module name, and the functions
    (qualified names, e.g. `SimRedis.begin`) it is restricted to, or None for all."""

    path: str
    module: str
    functions: frozenset[str] | None = None


@dataclass(frozen=True)
class Mutant:
    id: str
    path: str
    module: str
    function: str
    line: int
    node: str  # the kind of node changed (libcst's class name): the survivors' class
    diff: str
    source: str  # the whole mutated file
    #: The lines whose execution would run the change: the node's own and the first line of
    #: the statement holding it (what coverage.py records of a statement spanning lines).
    lines: tuple[int, ...] = ()

    @property
    def change(self) -> str:
        """The changed lines, `-old / +new`, on one line each: for the console."""
        lines = [
            ln
            for ln in self.diff.splitlines()
            if ln[:1] in "-+" and not ln.startswith(("---", "+++"))
        ]
        return " | ".join(" ".join(ln.split()) for ln in lines)


def module_name(path: Path, root: Path) -> str:
    """`engine/core/dag.py` -> `engine.core.dag` (a package's `__init__.py` -> the package)."""
    rel = path.resolve().relative_to(root.resolve())
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if not parts or not all(p.isidentifier() for p in parts):
        raise TargetError(f"{rel}: expected a file importable as a module from {root}")
    return ".".join(parts)


def targets(paths: Iterable[str] | None, root: Path) -> list[Target]:
    """The files under `paths` (files or folders, relative to `root`), or the defaults."""
    chosen: list[Target] = []
    explicit = paths is not None
    for raw in paths if explicit else DEFAULT_PATHS:
        path = (root / raw) if not Path(raw).is_absolute() else Path(raw)
        if not path.exists():
            raise TargetError(f"--paths: {raw}: no such file or folder")
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        if path.is_file() and path.suffix != ".py":
            raise TargetError(f"--paths: {raw}: expected a Python file or a folder")
        try:
            for f in files:
                if "__pycache__" in f.parts:
                    continue
                rel = f.resolve().relative_to(root.resolve()).as_posix()
                chosen.append(Target(rel, module_name(f, root)))
        except ValueError:
            raise TargetError(f"--paths: {raw}: expected a path inside {root}") from None
    if not explicit and (root / REFERENCE_FILE).is_file():
        chosen.append(_references(root))
    if not chosen:
        raise TargetError(f"--paths: no Python file under {' '.join(paths or DEFAULT_PATHS)}")
    return chosen


def _references(root: Path) -> Target:
    """`sim/redis.py`, restricted to the store's Python references."""
    from sim.redis import REFERENCES

    methods = frozenset(f"SimRedis.{name}" for name in REFERENCES.values())
    return Target(REFERENCE_FILE, module_name(root / REFERENCE_FILE, root), methods)


def mutants(target: Target, root: Path, function: str | None = None) -> list[Mutant]:
    """Every mutant of `target`'s functions (of `function` only, when given: a qualified
    name `Class.method`, or a bare name matching any function or method so named)."""
    import libcst as cst
    from libcst.metadata import (
        MetadataWrapper,
        ParentNodeProvider,
        PositionProvider,
        WhitespaceInclusivePositionProvider,
    )
    from mutmut.mutation.file_mutation import MutationVisitor, deep_replace
    from mutmut.mutation.mutators import mutation_operators
    from mutmut.mutation.pragma_handling import IgnoredCode, PragmaVisitor

    code = (root / target.path).read_text(encoding="utf-8")
    wrapper = MetadataWrapper(cst.parse_module(code))
    pragmas = PragmaVisitor(target.path)
    wrapper.visit(pragmas)
    # mutmut's own pattern list comes from its config file; pragmas are all we honour
    ignored = IgnoredCode(pragmas.no_mutate_lines, pragmas.ignore_node_lines, set())
    visitor = MutationVisitor(mutation_operators, ignored)
    wrapper.visit(visitor)
    module = wrapper.module
    names = _qualified_names(module)
    positions = wrapper.resolve(PositionProvider)
    parents = wrapper.resolve(ParentNodeProvider)
    spans = wrapper.resolve(WhitespaceInclusivePositionProvider)
    starts = [0]
    for text in code.split("\n"):
        starts.append(starts[-1] + len(text) + 1)
    original = code.splitlines(keepends=True)
    found: list[Mutant] = []
    seen: dict[str, int] = {}
    for mutation in visitor.mutations:
        owner = mutation.contained_by_top_level_function
        name = names.get(id(owner)) if owner is not None else None
        if name is None:
            continue  # the module's top level
        if target.functions is not None and name not in target.functions:
            continue
        if function is not None and function not in (name, name.rpartition(".")[2]):
            continue
        source = _spliced(code, module, spans, starts, mutation)
        if source is None:  # the node's text is not where its position says: rebuild
            mutated = deep_replace(module, mutation.original_node, mutation.mutated_node)
            assert isinstance(mutated, cst.Module)
            source = mutated.code
        if source == code:
            continue
        diff = "".join(
            difflib.unified_diff(
                original,
                source.splitlines(keepends=True),
                f"a/{target.path}",
                f"b/{target.path}",
                n=1,
            )
        )
        changed = [
            " ".join(ln[1:].split())
            for ln in diff.splitlines()
            if ln[:1] in "-+" and not ln.startswith(("---", "+++"))
        ]
        digest = hashlib.sha256("\0".join([name, *changed]).encode()).hexdigest()[:10]
        key = f"{target.path}:{name}:{digest}"
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:  # the same change to a repeated expression of the function
            key += f"#{seen[key]}"
        position = positions.get(mutation.original_node)
        line = position.start.line if position is not None else 0
        node = type(mutation.original_node).__name__
        lines = _lines(mutation.original_node, positions, parents)
        found.append(Mutant(key, target.path, target.module, name, line, node, diff, source, lines))
    return found


def _spliced(
    code: str, module: Any, spans: Mapping[Any, Any], starts: list[int], mutation: Any
) -> str | None:
    """The file with the mutated node's text in place of the original's, or None when the
    original's text, rendered alone, is not exactly at its position (a node whose text
    depends on its indentation, a compound statement): the caller then rebuilds the whole
    tree. The same file as rebuilding, in a fraction of the time (libcst renders a node
    from its own fields, whitespace included, except for a block's indentation)."""
    span = spans.get(mutation.original_node)
    if span is None:
        return None
    begin = starts[span.start.line - 1] + span.start.column
    end = starts[span.end.line - 1] + span.end.column
    if code[begin:end] != module.code_for_node(mutation.original_node):
        return None
    return code[:begin] + module.code_for_node(mutation.mutated_node) + code[end:]


def _lines(node: Any, positions: Mapping[Any, Any], parents: Mapping[Any, Any]) -> tuple[int, ...]:
    """The node's lines and the first line of its innermost statement (a small one, or a
    compound one's header): coverage.py records a statement by its first line, so a
    change on a continuation line is reached when that line is."""
    import libcst as cst

    position = positions.get(node)
    lines = set(range(position.start.line, position.end.line + 1)) if position else set()
    current = node
    while current is not None:
        if isinstance(current, cst.BaseSmallStatement | cst.BaseCompoundStatement):
            where = positions.get(current)
            if where is not None:
                lines.add(where.start.line)
            break
        current = parents.get(current)
    return tuple(sorted(lines))


def _qualified_names(module: object) -> dict[int, str]:
    """id(function node) -> `name` or `Class.name`: the top-level functions and methods,
    the owners mutmut tags each mutation with."""
    import libcst as cst

    assert isinstance(module, cst.Module)
    names: dict[int, str] = {}
    for stmt in module.body:
        if isinstance(stmt, cst.FunctionDef):
            names[id(stmt)] = stmt.name.value
        elif isinstance(stmt, cst.ClassDef) and isinstance(stmt.body, cst.IndentedBlock):
            for child in stmt.body.body:
                if isinstance(child, cst.FunctionDef):
                    names[id(child)] = f"{stmt.name.value}.{child.name.value}"
    return names
