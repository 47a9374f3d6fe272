"""Systems under test behind one seam (`chaos.systems`): the scenario's `system:` and
`--system`, the generic service faults, the refusals said before anything starts, the `n/a`
verdict of an invariant that does not apply to a design, and a harness that knows no design.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import yaml

from chaos import acts
from chaos.checker import CheckSpec, FinalState, check
from chaos.insim import run_scenario
from chaos.insim.run import SimRun
from chaos.journal import junit_cases, summary_line
from chaos.scenario import load_scenario
from chaos.systems import DEFAULT_SYSTEM, SYSTEMS, System, on_system, refusal
from chaos.systems.redis_rabbitmq.live import RedisRabbitLive
from chaos.systems.redis_rabbitmq.sim import RedisRabbitSim
from tests.helpers import imports_of

ROOT = Path(__file__).resolve().parents[1]


def _scenario(tmp_path: Path, name: str, **changes: Any) -> Path:
    """A shipped scenario with `changes` to its document, written next to its plans' copy."""
    src = ROOT / "scenarios" / f"{name}.yaml"
    data = yaml.safe_load(src.read_text())
    data.update(changes)
    data["plan"] = str((src.parent / data["plan"]).resolve())
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _chaos(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "chaos", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


# --- the registry and the seam ---------------------------------------------------------------


def test_a_scenario_runs_on_the_default_system_unless_it_names_one() -> None:
    loaded = load_scenario(ROOT / "scenarios" / "redis_restart.yaml")
    assert loaded.spec.system == DEFAULT_SYSTEM == "redis-rabbitmq"
    assert set(SYSTEMS) >= {DEFAULT_SYSTEM}


def test_each_adapter_carries_out_every_act_of_a_system() -> None:
    """The interpreters carry out the rest; a missing one would fail at a run's first act."""
    for adapter in (RedisRabbitLive, RedisRabbitSim):
        missing = [a for a in acts.SYSTEM_ACTS if not hasattr(adapter, acts.handler_name(a))]
        assert missing == [], adapter
    assert SYSTEMS[DEFAULT_SYSTEM].adapter("live") is RedisRabbitLive
    assert SYSTEMS[DEFAULT_SYSTEM].adapter("sim") is RedisRabbitSim


def test_the_workflow_engines_adapters_carry_out_every_act_too() -> None:
    for name in ("temporal", "dbos"):
        adapter = SYSTEMS[name].adapter("live")
        missing = [a for a in acts.SYSTEM_ACTS if not hasattr(adapter, acts.handler_name(a))]
        assert missing == [], name


@pytest.mark.parametrize("system", ["temporal", "dbos"])
def test_the_engines_mutants_are_refused_on_a_workflow_engine(system: str) -> None:
    """Their workers run the core inside the workflow, never the engine's worker the
    mutants patch: a run would judge an unbroken design under a mutant's name."""
    from chaos.mutants import MUTANTS, design_mutants
    from chaos.mutants import refusal as mutant_refusal

    for name in MUTANTS:
        said = mutant_refusal(name, system)
        assert said == f"--mutant: {name} breaks the engine's worker; {system} runs none of it"
    assert mutant_refusal("no_sweeper", DEFAULT_SYSTEM) is None
    # its own mutants run on it, and on no other design
    own = {n for n, (design, _, _) in design_mutants().items() if design == system}
    assert own
    for name in own:
        assert mutant_refusal(name, system) is None
        elsewhere = f"breaks {system} only; the scenario runs on {DEFAULT_SYSTEM}"
        assert mutant_refusal(name, DEFAULT_SYSTEM) == f"--mutant: {name} {elsewhere}"


#: The generic harness: what every design shares. None of it may import one design's code,
#: a client library of a service, or the live runtime of the engine.
GENERIC = (
    "chaos/acts.py",
    "chaos/conductor.py",
    "chaos/runner.py",
    "chaos/insim/run.py",
    "chaos/supervision.py",
    "chaos/journal.py",
    "chaos/explore.py",
    "chaos/scenario",
    "chaos/checker",
)
DESIGN_SPECIFIC = (
    "chaos.systems.redis_rabbitmq",
    "chaos.systems.pg_store",
    "chaos.systems.pg",
    "chaos.systems.temporal",
    "chaos.systems.dbos",
    "chaos.systems.core_workflow",
    "chaos.systems.workflow_engine",
    "engine.runtime",
    "sim.redis",
    "sim.broker",
    "sim.sentinel",
    "aio_pika",
    "aiormq",
    "redis",
    "asyncpg",
    "temporalio",
    "dbos",
)


def test_the_generic_harness_imports_no_design() -> None:
    wrong = []
    for place in GENERIC:
        path = ROOT / place
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            for line, name in imports_of(file):
                if any(name == d or name.startswith(d + ".") for d in DESIGN_SPECIFIC):
                    wrong.append(f"{file.relative_to(ROOT)}:{line}: imports {name}")
    assert wrong == []


# --- generic service faults ------------------------------------------------------------------


def _without_fault_records(history: list[dict]) -> list[dict]:
    """The run as the engine lived it: the fault's own record names it by its action."""
    return [
        {k: v for k, v in e.items() if k not in ("action", "service")}
        if e["ev"] == "fault_fired"
        else e
        for e in history
    ]


def test_kill_service_is_kill_redis_by_its_generic_name(tmp_path: Path) -> None:
    alias = load_scenario(ROOT / "scenarios" / "redis_restart.yaml")
    generic_path = _scenario(
        tmp_path,
        "redis_restart",
        faults=[
            {"at_s": 0.3, "action": "kill_service", "service": "redis", "restart_after_s": 0.5}
        ],
    )
    generic = load_scenario(generic_path)
    a, b = run_scenario(alias), run_scenario(generic)
    assert a.result.ok and b.result.ok
    fired = [e for e in b.history if e["ev"] == "fault_fired"]
    assert [(e["action"], e["service"]) for e in fired] == [("kill_service", "redis")]
    assert _without_fault_records(a.history) == _without_fault_records(b.history)


def test_restart_service_stops_cleanly_and_starts_again_at_once(tmp_path: Path) -> None:
    path = _scenario(
        tmp_path,
        "redis_restart",
        faults=[{"at_s": 0.3, "action": "restart_service", "service": "broker"}],
        budgets={},
        exercised={"all_terminal": 4},
    )
    outcome = run_scenario(load_scenario(path))
    assert outcome.result.ok, outcome.result.violations[:2]
    killed = [e for e in outcome.history if e["ev"] == "service_killed"]
    back = [e for e in outcome.history if e["ev"] == "service_restarted"]
    assert [(e["service"], e.get("signal")) for e in killed] == [("broker", "SIGTERM")]
    assert [e["service"] for e in back] == ["broker"]


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        (
            {"at_s": 0.3, "action": "kill_service"},
            "faults[0].service: required field is missing (action is kill_service)",
        ),
        (
            {"at_s": 0.3, "action": "kill_redis", "service": "redis"},
            "faults[0].service: only with kill_service, stop_service, pause_service, "
            "restart_service; action is kill_redis",
        ),
        (
            {"at_s": 0.3, "action": "restart_service", "service": "redis", "restart_after_s": 1},
            "faults[0].restart_after_s: not with restart_service (it starts again at once)",
        ),
    ],
)
def test_a_generic_service_fault_is_checked_when_loaded(
    tmp_path: Path, fault: dict, message: str
) -> None:
    path = _scenario(tmp_path, "redis_restart", faults=[fault])
    run = _chaos("validate", str(path))
    assert run.returncode == 2
    assert run.stderr == f"{path}: {message}\n"


# --- refusals, before anything starts --------------------------------------------------------


@pytest.mark.parametrize("mode", ["sim", "live"])
def test_a_service_the_system_does_not_have_is_refused_in_one_line(
    tmp_path: Path, mode: str
) -> None:
    path = _scenario(
        tmp_path,
        "redis_restart",
        faults=[{"at_s": 0.3, "action": "kill_service", "service": "postgres"}],
    )
    out = tmp_path / "out"
    run = _chaos("run", str(path), "--mode", mode, "--quiet", "--out", str(out))
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr == (
        f"{path}: faults[0].service: redis-rabbitmq has no service 'postgres' "
        "(it has redis, broker)\n"
    )
    assert not out.exists()  # nothing started, nothing written


def test_the_system_is_chosen_by_the_file_or_by_system(tmp_path: Path) -> None:
    unknown = _scenario(tmp_path, "redis_restart", system="mongo")
    run = _chaos("validate", str(unknown))
    assert run.returncode == 2
    assert run.stderr.startswith(f"{unknown}: system: expected one of redis-rabbitmq")
    assert run.stderr.count("\n") == 1
    flag = _chaos("sim", "scenarios/redis_restart.yaml", "--system", "mongo", "--seeds", "1")
    assert flag.returncode == 2 and flag.stderr.count("\n") == 1, flag.stderr
    assert "--system" in flag.stderr and "mongo" in flag.stderr


def test_a_fault_its_simulator_has_no_model_of_is_refused_by_the_system(tmp_path: Path) -> None:
    loaded = load_scenario(ROOT / "scenarios" / "containers" / "broker_pause.yaml")
    assert refusal(loaded, DEFAULT_SYSTEM, "live") is None
    assert "pause_broker is not simulated on redis-rabbitmq" in (
        refusal(loaded, DEFAULT_SYSTEM, "sim") or ""
    )
    with pytest.raises(ValueError, match="not simulated"):
        SimRun(loaded)


def _other_design(monkeypatch: pytest.MonkeyPatch, **fields: Any) -> System:
    """A second design beside today's: its adapters today's, what it can take its own."""
    sut = dataclasses.replace(SYSTEMS[DEFAULT_SYSTEM], name="other", **fields)
    monkeypatch.setitem(SYSTEMS, "other", sut)
    return sut


def test_links_and_settings_of_another_design_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _other_design(monkeypatch, links=("broker",), settings=("broker",))
    cut = load_scenario(ROOT / "scenarios" / "redis_partition.yaml")
    assert refusal(cut, "other", "sim") == (
        f"{cut.path}: faults[0].link: other has no link 'redis' (it has broker)"
    )
    lossy = load_scenario(ROOT / "scenarios" / "redis_data_loss.yaml")
    assert (refusal(lossy, "other", "sim") or "").endswith(
        ": redis: other does not read it (a setting of another design)"
    )


# --- n/a: an invariant that does not apply to the design -------------------------------------


def test_an_invariant_that_does_not_apply_is_n_a_with_its_reason_never_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    why = "retention instead of TTLs"
    _other_design(monkeypatch, not_applicable={"state_keys_expire": why})
    loaded = load_scenario(ROOT / "scenarios" / "redis_restart.yaml")
    outcome = SimRun(loaded, system="other").run()
    result = outcome.result
    assert result.ok
    assert result.verdicts["state_keys_expire"] == "n/a"
    assert result.not_applicable == {"state_keys_expire": why}
    assert "state_keys_expire" not in result.cases  # never counted as judged
    assert result.to_dict()["not_applicable"] == {"state_keys_expire": why}
    case = next(c for c in junit_cases("s", result) if c.get("name") == "state_keys_expire")
    skipped = case.find("skipped")
    assert skipped is not None and skipped.get("message") == f"n/a: {why}"
    line = summary_line("s", "sim", result, 4, "in 1 s").plain
    assert f"n/a: state_keys_expire ({why})" in line
    # today's design judges it, on the same run
    today = run_scenario(loaded)
    assert today.result.verdicts["state_keys_expire"] == "pass"
    assert "not_applicable" not in today.result.to_dict()


def test_a_violation_of_an_invariant_that_does_not_apply_fails_nothing() -> None:
    """n/a is not a pass that hides a failure: the invariant is not judged at all, its
    violations are not reported (the design has no such guarantee to break)."""
    history = [{"ev": "run_started", "t": 0.0, "proc": "runner", "pid": 1}]
    final = FinalState(key_ttls={"attempt:a:state": -1})  # a key without a TTL
    judged = check(history, final, CheckSpec(invariants=("state_keys_expire",)))
    assert judged.verdicts == {"state_keys_expire": "fail"}
    spared = check(
        history,
        final,
        CheckSpec(invariants=("state_keys_expire",), not_applicable={"state_keys_expire": "x"}),
    )
    assert spared.verdicts == {"state_keys_expire": "n/a"} and spared.violations == []
    assert spared.cases == {} and spared.ok


def test_chaos_list_shows_each_system_and_what_it_takes() -> None:
    run = _chaos("list")
    assert run.returncode == 0, run.stderr
    assert "systems (system:, --system)" in run.stdout
    assert "redis-rabbitmq (default)" in run.stdout
    assert "sim: no broker.pause" in run.stdout


def test_a_run_s_journal_names_its_system(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ("run", "scenarios/redis_restart.yaml", "--mode", "sim", "--quiet", "--out", str(out))
    run = _chaos(*args)
    assert run.returncode == 0, run.stdout + run.stderr
    (journal,) = out.glob("*/journal.json")
    assert json.loads(journal.read_text())["extra"]["system"] == DEFAULT_SYSTEM
    assert ET.parse(out / "junit.xml").getroot().tag == "testsuites"


# --- pg-store in the simulator: the same references, PostgreSQL's names and timings --------


def _shipped() -> list[Path]:
    return sorted(ROOT.glob("scenarios/*.yaml")) + sorted(ROOT.glob("scenarios/regressions/*.yaml"))


def test_every_shipped_scenario_whose_faults_apply_passes_on_pg_store_in_sim() -> None:
    ran, refused = [], []
    for path in _shipped():
        loaded = on_system(load_scenario(path), "pg-store")
        problem = refusal(loaded, "pg-store", "sim")
        if problem is not None:  # a Redis fault or setting: said, never run
            assert "redis" in problem or "replication" in problem, problem
            refused.append(path.name)
            continue
        outcome = SimRun(loaded).run()
        assert outcome.result.ok, (path.name, outcome.result.violations[:1])
        assert outcome.result.verdicts["state_keys_expire"] == "n/a"
        ran.append(path.name)
    assert len(ran) > 2 * len(refused)  # most of the suite applies to this design


def test_pg_store_s_own_faults_pass_in_sim_and_lost_commits_are_lost() -> None:
    for path in sorted(ROOT.glob("scenarios/pg_store/*.yaml")):
        outcome = run_scenario(load_scenario(path))
        assert outcome.result.ok, (path.name, outcome.result.violations[:1])
        assert outcome.extra["system"] == "pg-store"
        restarted = [e for e in outcome.history if e["ev"] == "service_restarted"]
        if path.stem == "postgres_lost_commits":  # acknowledged and gone: the analogue of
            assert restarted[0]["lost_writes"] > 0  # redis.lose_last_writes, survived
        else:
            assert all("lost_writes" not in e for e in restarted)


def test_a_redis_fault_is_refused_on_pg_store(tmp_path: Path) -> None:
    loaded = load_scenario(ROOT / "scenarios" / "redis_restart.yaml")
    assert refusal(loaded, "pg-store", "sim") == (
        f"{loaded.path}: faults[0].action: pg-store has no service 'redis' "
        "(it has postgres, broker)"
    )
    pg = load_scenario(ROOT / "scenarios" / "pg_store" / "postgres_restart.yaml")
    assert refusal(pg, DEFAULT_SYSTEM, "sim") == (
        f"{pg.path}: faults[0].service: redis-rabbitmq has no service 'postgres' "
        "(it has redis, broker)"
    )
    lossy = load_scenario(
        _scenario(tmp_path, "redis_restart", faults=[], postgres={"synchronous_commit": False})
    )
    assert refusal(lossy, "pg-store", "sim") is None
    assert refusal(lossy, DEFAULT_SYSTEM, "sim") == (
        f"{lossy.path}: postgres: redis-rabbitmq does not read it (a setting of another design)"
    )


# --- the durable designs compared ------------------------------------------------------------


def test_compare_durable_sets_the_designs_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    names = ("crash_after_ack", "transient_llm_errors")
    paths = [f"scenarios/{n}.yaml" for n in names]
    args = ("compare", *paths, "--designs", "durable", "--mode", "sim", "--seeds", "2")
    run = _chaos(*args, "--out", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads((out / "compare.json").read_text())
    assert [r["variant"] for r in doc["rows"]] == [
        "Redis + RabbitMQ",
        "PostgreSQL store + RabbitMQ",
        "PostgreSQL alone",
    ]
    for row in doc["rows"]:
        assert row["runs"] == 4 and row["unfinished_evaluations"] == 0
        assert set(row["retry_latency_production_estimate_s_by_level"]) >= {"1", "2", "3"}
        assert row["duplicated_usd"]["n"] == 4
    table = (out / "compare.md").read_text()
    assert "p99 retry latency L1 / L2 / L3" in table and "duplicated cost USD" in table
    for design in ("redis-rabbitmq", "pg-store", "pg"):  # each design's runs, on its system
        journals = sorted((out / design).glob("*/journal.json"))
        assert len(journals) == 4
        assert {json.loads(j.read_text())["extra"]["system"] for j in journals} == {design}
    assert (out / "compare.png").stat().st_size > 0 and (out / "compare.html").exists()


def test_compare_durable_refuses_a_scenario_one_design_cannot_take(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    args = ("compare", "scenarios/redis_restart.yaml", "--designs", "durable", "--mode", "sim")
    run = _chaos(*args, "--out", str(out))
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr == (
        "scenarios/redis_restart.yaml: faults[0].action: pg-store has no service 'redis' "
        "(it has postgres, broker) (--designs durable: every design takes it)\n"
    )
    assert not out.exists()


def test_a_mutant_of_another_design_s_store_is_refused(tmp_path: Path) -> None:
    """A Lua script's mutant breaks nothing on PostgreSQL, a PL/pgSQL function's nothing on
    Redis: either would pass for a missed catch. Refused before anything runs."""
    run = _chaos(
        "run", "scenarios/crash_after_ack.yaml", "--mode", "sim", "--mutant", "pg_unfenced"
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr == (
        "scenarios/crash_after_ack.yaml: --mutant: pg_unfenced breaks pg-store only; "
        "the scenario runs on redis-rabbitmq\n"
    )
    loaded = load_scenario(ROOT / "scenarios" / "crash_after_ack.yaml")
    with pytest.raises(ValueError, match="overwrite_result breaks redis-rabbitmq only"):
        SimRun(loaded, mutant="overwrite_result", system="pg-store")
    assert SimRun(loaded, mutant="no_sweeper", system="pg-store").mutant == "no_sweeper"
    # pg's own table (its job queue) is not pg-store's, whose queue is RabbitMQ; pg runs
    # pg-store's functions, so their mutants run there
    with pytest.raises(ValueError, match="pg_jobs_unlogged breaks pg only"):
        SimRun(loaded, mutant="pg_jobs_unlogged", system="pg-store")
    assert SimRun(loaded, mutant="pg_unfenced", system="pg").mutant == "pg_unfenced"


def test_temporal_workflows_read_the_stop_flag_their_worker_sets() -> None:
    """Temporal's sandbox imports a workflow's module afresh for its workflows: a flag of
    that module's own would stay False there whatever the worker set (an eviction at a stop
    said `lease lost`). The flag lives in a module the sandbox passes through."""
    import importlib

    from temporalio.worker.workflow_sandbox import SandboxRestrictions
    from temporalio.worker.workflow_sandbox._importer import Importer
    from temporalio.worker.workflow_sandbox._restrictions import RestrictionContext

    import chaos.systems.temporal.workflow as outside
    from chaos.systems import core_workflow
    from chaos.systems.temporal import worker

    importer = Importer(SandboxRestrictions.default, RestrictionContext())
    with importer.applied():
        inside = importlib.import_module("chaos.systems.temporal.workflow")
    assert inside is not outside  # imported afresh, as Temporal's workflows see it
    assert inside.STOPPING is outside.STOPPING is worker.STOPPING is core_workflow.STOPPING
