"""The checker compiled with mypyc (`chaos.compiled`): named by a hash of the whole source,
loaded by an exploration's processes only when that hash is their source's, and judging
every run exactly as the source does."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chaos import compiled
from chaos.compiled import BUILD_ENV, PACKAGES, SWITCH_ENV, source_key
from chaos.explore import _marked_spawns, map_processes
from tests.cli_helpers import chaos

ROOT = Path(__file__).resolve().parents[1]
#: The scenarios every mutant runs on here: a crash, kills and transient errors.
MUTANT_SCENARIOS = ("crash_after_ack", "worker_kill_storm", "transient_llm_errors")


def test_a_build_is_named_by_every_file_of_the_source(tmp_path: Path) -> None:
    for package in PACKAGES:
        (tmp_path / package / "sub").mkdir(parents=True)
        (tmp_path / package / "sub" / "m.py").write_text("X = 1\n")
    first = source_key.__wrapped__(tmp_path)
    assert source_key.__wrapped__(tmp_path) == first
    for package in PACKAGES:  # any module of any package: the compiled code's imports too
        path = tmp_path / package / "sub" / "m.py"
        path.write_text("X = 2\n")
        assert source_key.__wrapped__(tmp_path) != first, package
        path.write_text("X = 1\n")
    (tmp_path / "engine" / "new.py").write_text("")
    assert source_key.__wrapped__(tmp_path) != first


def test_explorations_load_only_a_complete_build_of_their_own_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAOS_COMPILED_DIR", str(tmp_path))
    monkeypatch.delenv(SWITCH_ENV, raising=False)
    monkeypatch.delenv(BUILD_ENV, raising=False)

    def handed_down() -> str | None:
        with _marked_spawns():
            return os.environ.get(BUILD_ENV)

    assert handed_down() is None  # nothing built
    other = tmp_path / ("0" * 24)  # another source's build
    other.mkdir()
    (other / "COMPLETE").write_text("")
    assert handed_down() is None
    build = tmp_path / source_key()
    build.mkdir()
    assert handed_down() is None  # cut short: no COMPLETE
    (build / "COMPLETE").write_text("")
    assert handed_down() == str(build)
    assert BUILD_ENV not in os.environ  # only for the spawns
    monkeypatch.setenv(SWITCH_ENV, "0")
    assert handed_down() is None
    assert not compiled.activate(build)  # a build without modules is never loaded


def test_the_compiled_modules_type_check_as_the_build_asks(tmp_path: Path) -> None:
    """mypy's half of a build, in seconds: a type error in a compiled module (a variable
    reused for another type) fails here, in the quick subset, not minutes into a build."""
    config = tmp_path / "mypy.ini"
    config.write_text(compiled.MYPY_CONFIG)
    argv = [sys.executable, "-m", "mypy", "--config-file", str(config)]
    argv += ["--cache-dir", str(tmp_path / "cache"), *compiled.modules()]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


def test_chaos_compile_status_says_whether_this_source_is_built(tmp_path: Path) -> None:
    env = {**os.environ, "CHAOS_COMPILED_DIR": str(tmp_path)}
    env.pop(SWITCH_ENV, None)
    done = chaos("compile", "--status", env=env)
    assert (done.returncode, done.stdout) == (0, "chaos compile: no build for this source\n")
    build = tmp_path / source_key()
    build.mkdir()
    (build / "COMPLETE").write_text("")
    done = chaos("compile", "--status", env=env)
    assert done.stdout == f"chaos compile: built for this source: {build}\n"
    done = chaos("compile", "--status", env={**env, SWITCH_ENV: "0"})
    assert "CHAOS_COMPILED=0: explorations run the source" in done.stdout


def _judgement(item: tuple[str, int, str | None]) -> tuple[bool, str]:
    """Whether this process runs the compiled checker, and a digest of everything the
    checker said of one simulated run (verdicts, cases, stats, violations with their
    evidence, budgets; not its timings), with the history's hash."""
    from chaos.insim import run_scenario
    from chaos.scenario import load_scenario

    path, seed, mutant = item
    outcome = run_scenario(load_scenario(path), seed=seed, mutant=mutant)
    said = dataclasses.asdict(outcome.result)
    said.pop("durations_s")
    text = json.dumps([outcome.history_hash, said], sort_keys=True, default=repr)
    return compiled.active(), hashlib.sha256(text.encode()).hexdigest()


def _work() -> list[tuple[str, int, str | None]]:
    """Every shipped scenario the simulator runs (three seeds), and every mutant on three
    scenarios that catch most of them (one seed): broken engines, broken histories."""
    from chaos.insim import mutants
    from chaos.scenario import load_scenario
    from chaos.systems import refusal

    work: list[tuple[str, int, str | None]] = []
    for path in sorted((ROOT / "scenarios").glob("*.yaml")):
        loaded = load_scenario(path)
        if refusal(loaded, loaded.spec.system, "sim") is None:
            work += [(str(path), seed, None) for seed in range(3)]
    for name in MUTANT_SCENARIOS:
        loaded = load_scenario(ROOT / "scenarios" / f"{name}.yaml")
        for mutant in mutants.known():
            if mutants.refusal(mutant, loaded.spec.system) is None:
                work.append((str(loaded.path), 0, mutant))
    return work


@pytest.mark.slow
def test_the_compiled_checker_judges_every_run_as_the_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SWITCH_ENV, raising=False)
    built = compiled.build()  # the cache's, when this source was built already
    assert compiled.fresh_build() == built
    work = _work()
    assert len(work) > 300
    source = [_judgement(item) for item in work]
    assert not any(active for active, _ in source)  # this process runs the source
    pooled = list(map_processes(_judgement, work, jobs=2, chunksize=8))
    assert all(active for active, _ in pooled)  # the pool's processes loaded the build
    differ = [item for item, (_, a), (_, b) in zip(work, source, pooled, strict=True) if a != b]
    assert not differ, f"{len(differ)} runs judged otherwise compiled, e.g. {differ[:3]}"
