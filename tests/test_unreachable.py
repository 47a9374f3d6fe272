"""Unreachable or misconfigured services: every command says so in one line and exits 3.

A closed port, a wrong Redis password (a private `redis-server` that requires one), wrong
RabbitMQ credentials (the machine's broker on 5672) and a peer that accepts connections but
never answers: `chaos run --mode live|auto`, `engine.worker` and `engine.submit` must name the
service and its address, mask the password, print no traceback and leave `--out` empty.
Durations are never asserted: the subprocess timeout only guards against a hang.

Also here: `--mode sim` ignores the URLs, and runs on shared services scope their attemptIds
while the agent and the checker still see the seed's.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import AuthenticationError, ResponseError

from chaos.checker import EvaluationFinal, FinalState
from chaos.runner import ScenarioRun
from chaos.scenario import load_scenario
from chaos.stack import free_port
from chaos.systems.redis_rabbitmq.live import run_prefix
from chaos.systems.redis_rabbitmq.services import Services
from chaos.systems.redis_rabbitmq.stack import RedisServer
from engine.agent import AgentProfile, AgentService, FakeAgent
from engine.config import DEFAULT_AMQP_URL, ServiceUnavailable, redacted
from engine.plan import load_plan
from engine.runtime.store import redis_unavailable
from engine.worker import UnscopedAgent

pytestmark = pytest.mark.slow  # a private redis-server and the machine's RabbitMQ

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = "scenarios/crash_after_ack.yaml"
#: Only a guard against a hang: the commands answer within their connect timeout.
GUARD_S = 120.0
#: Unusual enough to be found only where it leaked; fixed, so that each lane of `pytest -n`
#: collects the same test ids (some carry it).
SECRET = "s3cret-5f1d9c2e"
#: For the silent peers: generous for a loopback PING on a busy machine, short for a test.
CONNECT_TIMEOUT_S = "3"


@pytest.fixture(scope="module")
def open_redis() -> Iterator[RedisServer]:
    """A reachable private Redis, for the cases where RabbitMQ is the broken one."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def locked_redis() -> Iterator[RedisServer]:
    """A private Redis that requires a password (not SECRET)."""
    with RedisServer() as server:
        redis.Redis(host=server.host, port=server.port).config_set("requirepass", "right-one")
        yield server


@pytest.fixture(scope="module")
def silent_port() -> Iterator[int]:
    """A port whose connections complete (the kernel's backlog) but never get an answer."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


# case -> (environment, service named, address shown, variable to fix)
Case = tuple[dict[str, str], str, str, str]


@pytest.fixture(scope="module")
def cases(open_redis: RedisServer, locked_redis: RedisServer, silent_port: int) -> dict[str, Case]:
    closed = free_port()
    reachable = {"REDIS_URL": open_redis.url}
    quick = {"ENGINE_CONNECT_TIMEOUT_S": CONNECT_TIMEOUT_S}

    def redis_case(port: int, extra: dict[str, str] | None = None) -> Case:
        env = {"REDIS_URL": f"redis://:{SECRET}@127.0.0.1:{port}/0", "AMQP_URL": DEFAULT_AMQP_URL}
        return ({**env, **(extra or {})}, "Redis", f"127.0.0.1:{port}", "REDIS_URL")

    def amqp_case(port: int, extra: dict[str, str] | None = None) -> Case:
        env = {**reachable, "AMQP_URL": f"amqp://guest:{SECRET}@127.0.0.1:{port}/"}
        return ({**env, **(extra or {})}, "RabbitMQ", f"127.0.0.1:{port}", "AMQP_URL")

    return {
        "redis_closed_port": redis_case(closed),
        "redis_wrong_password": redis_case(locked_redis.port),
        "redis_silent": redis_case(silent_port, quick),
        "amqp_closed_port": amqp_case(closed),
        "amqp_wrong_credentials": amqp_case(5672),
        "amqp_silent": amqp_case(silent_port, quick),
    }


def _env(extra: dict[str, str]) -> dict[str, str]:
    keep = {
        k: v
        for k, v in os.environ.items()
        if k not in ("REDIS_URL", "AMQP_URL") and not k.startswith("ENGINE_")
    }
    return {**keep, **extra}


def _command(name: str, out: Path) -> list[str]:
    ns = f"unreach{uuid.uuid4().hex[:6]}."
    return {
        "chaos_live": ["-m", "chaos", "run", SCENARIO, "--mode", "live", "--out", str(out)],
        "chaos_auto": ["-m", "chaos", "run", SCENARIO, "--mode", "auto", "--out", str(out)],
        "worker": ["-m", "engine.worker", "--namespace", ns],
        "submit": ["-m", "engine.submit", "plans/code_review.yaml", "--namespace", ns],
    }[name]


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=_env(env),
        capture_output=True,
        text=True,
        timeout=GUARD_S,
        check=False,
    )


@pytest.mark.parametrize("command", ["chaos_live", "chaos_auto", "worker", "submit"])
@pytest.mark.parametrize(
    "case",
    [
        "redis_closed_port",
        "redis_wrong_password",
        "redis_silent",
        "amqp_closed_port",
        "amqp_wrong_credentials",
        "amqp_silent",
    ],
)
def test_a_broken_service_is_one_line_and_exit_3(
    case: str, command: str, cases: dict[str, Case], tmp_path: Path
) -> None:
    env, service, address, variable = cases[case]
    out_dir = tmp_path / "out"
    out = _run(_command(command, out_dir), env)
    shown = out.stdout + out.stderr
    assert out.returncode == 3, shown
    assert out.stderr.count("\n") == 1, out.stderr
    assert "Traceback" not in shown
    line = out.stderr
    assert service in line and address in line and variable in line, line
    assert SECRET not in shown and "***" in line  # the password is masked, not dropped
    if case.endswith("wrong_password") or case.endswith("wrong_credentials"):
        assert "cannot log in" in line
    elif case.endswith("silent"):
        assert f"no answer within {CONNECT_TIMEOUT_S} s" in line
    else:
        assert "connection refused" in line
    assert not out_dir.exists() or not any(out_dir.iterdir())


def test_redis_alone_given_fails_before_starting_a_broker(tmp_path: Path) -> None:
    """Only REDIS_URL set (closed): the run stops before starting its own RabbitMQ."""
    port = free_port()
    out_dir = tmp_path / "out"
    out = _run(
        ["-m", "chaos", "run", SCENARIO, "--mode", "live", "--out", str(out_dir)],
        {"REDIS_URL": f"redis://127.0.0.1:{port}/0"},
    )
    assert out.returncode == 3, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and f"127.0.0.1:{port}" in out.stderr
    assert not out_dir.exists() or not any(out_dir.iterdir())


def test_sim_mode_ignores_the_service_urls(tmp_path: Path) -> None:
    closed = free_port()
    env = {
        "REDIS_URL": f"redis://:{SECRET}@127.0.0.1:{closed}/0",
        "AMQP_URL": f"amqp://guest:{SECRET}@127.0.0.1:{closed}/",
    }
    out_dir = tmp_path / "out"
    out = _run(["-m", "chaos", "run", SCENARIO, "--mode", "sim", "--out", str(out_dir)], env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (out_dir / "crash_after_ack" / "journal.json").is_file()
    assert SECRET not in out.stdout + out.stderr


@pytest.mark.parametrize(
    "url", ["notaurl", f"http://u:{SECRET}@127.0.0.1/", f"user:{SECRET}@127.0.0.1:6379"]
)
@pytest.mark.parametrize("command", ["worker", "submit"])
def test_a_malformed_url_is_bad_input(url: str, command: str, tmp_path: Path) -> None:
    out = _run(_command(command, tmp_path / "out"), {"REDIS_URL": url})
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and "REDIS_URL" in out.stderr
    assert SECRET not in out.stdout + out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--event-loop", "tokio"], {}, "--event-loop"),
        ([], {"ENGINE_EVENT_LOOP": "tokio"}, "ENGINE_EVENT_LOOP"),
    ],
)
def test_an_unknown_event_loop_is_bad_input(
    args: list[str], env: dict[str, str], named: str, tmp_path: Path
) -> None:
    out = _run([*_command("worker", tmp_path / "out"), *args], env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and named in out.stderr and "uvloop" in out.stderr


# --- the line itself -------------------------------------------------------------------------


def test_the_line_masks_every_password() -> None:
    url = f"redis://user:{SECRET}@h:1/0?password={SECRET}"
    line = str(redis_unavailable(ResponseError(f"said {SECRET}"), url, 5.0))
    assert SECRET not in line
    assert line.startswith("cannot reach Redis at redis://user:***@h:1/0?password=***")
    assert line.endswith("(ResponseError: said ***); check REDIS_URL")
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_a_password_never_garbles_the_reason() -> None:
    """Only a client's error text is scrubbed: the engine's own words stay readable."""
    line = str(redis_unavailable(AuthenticationError(), "redis://:wrong@h:1/0", 5.0))
    assert "(wrong user name or password); check the credentials in REDIS_URL" in line
    line = str(ServiceUnavailable("RabbitMQ", "amqp://u:refused@h/", "connection refused", "X"))
    assert (
        line == "cannot reach RabbitMQ at amqp://u:***@h/ (connection refused); start it or set X"
    )


# --- attemptIds on shared services -------------------------------------------------------------


def _shared() -> Services:
    return Services(redis_url="redis://127.0.0.1:6379/0", amqp_url=DEFAULT_AMQP_URL)


def test_two_shared_runs_of_one_seed_use_different_keys(tmp_path: Path) -> None:
    loaded = load_scenario(ROOT / SCENARIO)
    a = ScenarioRun(loaded, _shared(), tmp_path / "a")
    b = ScenarioRun(loaded, _shared(), tmp_path / "b")
    try:
        assert a.seed == b.seed and a.ns != b.ns
        assert set(a.attempt_ids).isdisjoint(b.attempt_ids)
        # what each run scans, clears and reads (`attempt:{id_prefix}*`) is its own only
        assert not any(x.startswith(a.id_prefix) for x in b.attempt_ids)
        assert not any(x.startswith(b.id_prefix) for x in a.attempt_ids)
        seed_ids = list(loaded.evaluations(a.seed))
        for run in (a, b):
            assert [x.removeprefix(run.ns) for x in run.attempt_ids] == seed_ids
            args = run.worker_args([])
            assert args[args.index("--agent-id-prefix") + 1] == run.ns
    finally:
        a.history.close()
        b.history.close()


def test_a_run_on_its_own_redis_keeps_the_seed_ids(tmp_path: Path) -> None:
    loaded = load_scenario(ROOT / SCENARIO)
    own = Services(redis_url="redis://127.0.0.1:1/0", amqp_url=DEFAULT_AMQP_URL)
    own.redis = RedisServer()  # never started: the run only asks whether it owns Redis
    run = ScenarioRun(loaded, own, tmp_path / "a")
    try:
        assert run.attempt_ids == list(loaded.evaluations(run.seed))
        assert "--agent-id-prefix" not in run.worker_args([])
    finally:
        run.history.close()
    assert run_prefix("chaos1.", shared_redis=False) == ""
    assert run_prefix("chaos1.", shared_redis=True) == "chaos1."


def test_the_agent_draws_from_the_seed_id() -> None:
    plan = load_plan(ROOT / "plans/code_review.yaml")
    profile = AgentProfile(seed=2)

    async def verdicts(agent: AgentService, attempt_id: str) -> list[tuple[str, float]]:
        out = []
        for rule in plan.rules.values():
            r = await agent.evaluate(attempt_id, rule, 1, 1)
            out.append((r.verdict, r.score))
        return out

    seed_id = "s2-code_review-0"
    plain = asyncio.run(verdicts(FakeAgent(profile), seed_id))
    scoped = asyncio.run(
        verdicts(UnscopedAgent(FakeAgent(profile), "chaos1234."), f"chaos1234.{seed_id}")
    )
    assert scoped == plain
    assert asyncio.run(verdicts(FakeAgent(profile), f"chaos1234.{seed_id}")) != plain


def test_the_checker_sees_the_seed_ids(tmp_path: Path) -> None:
    loaded = load_scenario(ROOT / SCENARIO)
    run = ScenarioRun(loaded, _shared(), tmp_path / "a")
    run.history.close()
    scoped = run.attempt_ids[0]
    seed_id = scoped.removeprefix(run.ns)
    history = [{"ev": "submitted", "attempt_id": scoped}, {"ev": "worker_started"}]
    final = FinalState(
        evaluations={scoped: EvaluationFinal(attempt_id=scoped, state="completed")},
        key_ttls={f"attempt:{scoped}:state": 60},
    )
    events, seen = run._as_seed_run(history, final)
    assert events == [{"ev": "submitted", "attempt_id": seed_id}, {"ev": "worker_started"}]
    assert list(seen.evaluations) == [seed_id] and seen.evaluations[seed_id].attempt_id == seed_id
    assert seen.key_ttls == {f"attempt:{seed_id}:state": 60}
    run.cancelled.add(scoped)
    spec = run.check_spec()
    assert set(spec.plans) == set(loaded.evaluations(run.seed)) and spec.cancelled == {seed_id}
