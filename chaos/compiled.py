"""The checker compiled with mypyc, for the processes that explore seeds.

A seed of the bench scenario spends a third of its time in the checker: thirty invariants,
each a pass of plain Python over the history's dicts, a flat profile. mypyc compiles that
same source to C (no other code, no other semantics: the annotations it checks are the
source's own, checked at run time) and a seed costs about 12 % fewer instructions
(bench/sim_speed.py).

Opt-in, and never stale: `python -m chaos compile` builds it once into a cache directory
named by a hash of the project's source (every module of `chaos`, `engine`, `reports` and
`sim`, since the compiled code relies on the types of what it imports), mypy's version and
the interpreter's. An exploration's processes (`chaos.explore.map_processes`, a local
cluster's workers) load a build only when one exists under the hash of the source they
run; after any edit, they run the source as it is until the next build. `CHAOS_COMPILED=0`
turns it off; `CHAOS_COMPILED=1` turns it on in every process of the harness (a remote
Dask worker's, a single simulated run's). The engine, the simulator and the harness's
other modules are never compiled: what is simulated is the code that ships, interpreted
as it runs live, and the mutants patch the simulator's classes, which compiled classes
would not allow. Compiling them too was tried (bench/README.md, 2026-12-07): no faster,
and its run-time type checks made it another program.

Only the modules of `modules()` are compiled: the checker's package, its parallel runner
(forks and pipes) and the `Events` list subclass aside, with the figures of `reports` it
reads. A process loads them by a finder placed before every other (`activate`), at the
import of `chaos` (its `__init__`), before any checker module is imported.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.abc
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The packages whose source names a build (`source_key`): the compiled modules and all
#: they may import.
PACKAGES = ("chaos", "engine", "reports", "sim")
#: Left out of the checker's package: its `__init__` (not hot), `shared` (forks and pipes)
#: and `events` (a `list` subclass, which mypyc compiles only as an interpreter's class).
_LEFT_OUT = {"__init__.py", "shared.py", "events.py"}
#: "0": never; unset (or anything else): in the processes an exploration spawns, where a
#: build of the source exists; "1": in every process of the harness too (a remote Dask
#: worker, `chaos run --mode sim`).
SWITCH_ENV = "CHAOS_COMPILED"
#: The build a parent found for its spawned processes (`chaos.explore._marked_spawns`),
#: read by `chaos`'s `__init__` in each of them.
BUILD_ENV = "CHAOS_COMPILED_BUILD"
#: Builds kept in the cache: other checkouts' and branches' too, the newest first.
KEPT = 4


#: mypy's settings for a build: the compiled modules' errors stop it, those of what they
#: import do not.
MYPY_CONFIG = "[mypy]\nfollow_imports = silent\n"


def modules(root: Path = ROOT) -> list[str]:
    """The compiled modules' files, relative to `root`."""
    checker = sorted(
        f"chaos/checker/{p.name}"
        for p in (root / "chaos" / "checker").glob("*.py")
        if p.name not in _LEFT_OUT
    )
    return [*checker, "reports/history.py", "reports/cost.py"]


def cache_dir() -> Path:
    """Where builds are kept: `$CHAOS_COMPILED_DIR`, else the user's cache."""
    where = os.environ.get("CHAOS_COMPILED_DIR")
    if where:
        return Path(where)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "durable-chaos" / "compiled"


def _mypy_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mypy")
    except PackageNotFoundError:
        return None


@functools.cache
def source_key(root: Path = ROOT) -> str:
    """The hash a build of this source is kept under (its directory's name)."""
    h = hashlib.sha256()
    for part in (sys.version, sysconfig.get_config_var("EXT_SUFFIX"), _mypy_version()):
        h.update(f"{part}\0".encode())
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(f"{path.relative_to(root).as_posix()}\0".encode())
            h.update(path.read_bytes())
            h.update(b"\0")
    return h.hexdigest()[:24]


def fresh_build(root: Path = ROOT) -> Path | None:
    """The build of this source in the cache, complete, or None."""
    build = cache_dir() / source_key(root)
    return build if (build / "COMPLETE").is_file() else None


def wanted() -> Path | None:
    """The build this process's explorations should load: fresh, and not switched off."""
    if os.environ.get(SWITCH_ENV) == "0":
        return None
    return fresh_build()


class _Finder(importlib.abc.MetaPathFinder):
    """The build's extension modules, by module name, found before any other finder."""

    def __init__(self, found: dict[str, Path]) -> None:
        self.found = found

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: object = None
    ) -> ModuleSpec | None:
        where = self.found.get(fullname)
        if where is None:
            return None
        return importlib.util.spec_from_file_location(fullname, where)


def built_modules(build: Path) -> dict[str, Path]:
    """Module name -> extension file, for each file of a build."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    out: dict[str, Path] = {}
    for path in build.rglob(f"*{suffix}"):
        rel = path.relative_to(build).as_posix().removesuffix(suffix)
        if rel.startswith("build/"):  # mypyc's own intermediate files
            continue
        out[rel.replace("/", ".")] = path
    return out


def activate(build: str | Path) -> bool:
    """Load the compiled modules of `build` from now on in this process; False (and the
    source is run as it is) when one of them is imported already or the build is gone."""
    build = Path(build)
    found = built_modules(build)
    if not (build / "COMPLETE").is_file() or not found or any(m in sys.modules for m in found):
        return False
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(found))
    return True


def at_import() -> None:
    """At the import of `chaos`: the build a parent handed down, or with `CHAOS_COMPILED=1`
    the fresh build of this source, if any."""
    handed = os.environ.get(BUILD_ENV)
    if handed:
        activate(handed)
    elif os.environ.get(SWITCH_ENV) == "1" and (build := fresh_build()) is not None:
        activate(build)


def active() -> bool:
    """Whether this process runs the compiled checker."""
    module = sys.modules.get("chaos.checker.context")
    return module is not None and not str(getattr(module, "__file__", "")).endswith(".py")


def build(root: Path = ROOT, out: Path | None = None) -> Path:
    """Compile `modules()` with mypyc into the cache (`out`: there instead) under the
    source's hash; the build directory appears whole or not at all. Raises
    `CompileError` with mypyc's own words when it cannot."""
    if _mypy_version() is None:
        raise CompileError("mypyc is not installed: pip install -e '.[compiled]'")
    key = source_key(root)
    dest = (out or cache_dir()) / key
    if (dest / "COMPLETE").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    _sweep(dest.parent)
    prefix = f"{_BUILDING}{os.getpid()}-"
    with tempfile.TemporaryDirectory(prefix=prefix, dir=dest.parent) as tmp:
        work = Path(tmp) / "src"
        for package in PACKAGES:
            shutil.copytree(
                root / package, work / package, ignore=shutil.ignore_patterns("__pycache__")
            )
        (work / "mypy.ini").write_text(MYPY_CONFIG)
        done = subprocess.run(
            [sys.executable, "-m", "mypyc", "--config-file", "mypy.ini", *modules(root)],
            cwd=work,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            said = [ln for ln in (done.stdout + done.stderr).splitlines() if "error" in ln]
            raise CompileError("mypyc failed: " + ("; ".join(said[:5]) or "see its output"))
        staged = Path(tmp) / key
        for path in built_modules(work).values():
            target = staged / path.relative_to(work)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
        (staged / "COMPLETE").write_text(f"{' '.join(modules(root))}\n")
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(dest)  # an incomplete build's leftovers
        staged.rename(dest)
    _prune(dest.parent, keep=dest)
    return dest


#: A build under way: `<prefix><pid>-...` in the cache, gone at its end (even on Ctrl-C).
_BUILDING = "building-"


def _sweep(cache: Path) -> None:
    """Remove what builds whose process died (SIGKILL) left in the cache."""
    for path in cache.glob(f"{_BUILDING}*"):
        pid = path.name.removeprefix(_BUILDING).split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


def _prune(cache: Path, keep: Path) -> None:
    """Keep the `KEPT` newest builds (`keep` among them)."""
    builds = sorted(
        (p for p in cache.iterdir() if p.is_dir() and (p / "COMPLETE").is_file() and p != keep),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in builds[KEPT - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


class CompileError(RuntimeError):
    """The checker could not be compiled (mypyc missing, or its error)."""
