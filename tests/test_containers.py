"""Containers mode: Redis and RabbitMQ in containers (`chaos.systems.redis_rabbitmq.containers`,
`chaos.systems.redis_rabbitmq.images`).

Most of these need a Docker engine and skip without one, saying so; `.ci/run` starts one
when none answers and sets CHAOS_REQUIRE_DOCKER=1, so in CI they run (or fail). Without
an engine, `--mode containers` must say so in one line and exit 3, and the simulator must
refuse a broker pause: those two always run. The images are built once per module
(`python -m chaos images build`: seconds, from the host's own Redis and RabbitMQ), the
scenarios run through the command line as a user would, and the tests check that no
container of their own is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from chaos.mutants import MUTANTS
from chaos.stack import StackError
from chaos.systems.redis_rabbitmq.containers import (
    OFFICIAL_IMAGES,
    OWNER_LABEL,
    RabbitContainer,
    RedisContainer,
    engine_problem,
    image_for,
)
from chaos.systems.redis_rabbitmq.images import IMAGE_LABEL, LOCAL_IMAGES
from tests.rabbit import dump_queue_records, wait_for_queue
from tests.test_chaos_runs import chaos

pytestmark = pytest.mark.slow  # a Docker engine, images built, scenarios in containers

ROOT = Path(__file__).resolve().parents[1]
ENGINE = engine_problem()
#: Set by .ci/run, which starts an engine: there a missing one fails these tests.
REQUIRED = os.environ.get("CHAOS_REQUIRE_DOCKER") == "1"
needs_engine = pytest.mark.skipif(
    ENGINE is not None and not REQUIRED, reason=f"{ENGINE} (.ci/run starts one for CI)"
)
#: The scenarios the issue names (crash, broker restart, Redis restart, a network fault),
#: and the ones of the container actions (a clean stop, a pause).
SCENARIOS = [
    "scenarios/crash_after_ack.yaml",
    "scenarios/broker_restart.yaml",
    "scenarios/redis_restart.yaml",
    "scenarios/redis_partition.yaml",
    "scenarios/containers/broker_stop.yaml",
    "scenarios/containers/broker_pause.yaml",
    "scenarios/containers/redis_pause.yaml",
]


def containers_of(pid: int) -> list[str]:
    """The harness's containers the process `pid` started, still there."""
    import docker

    client = docker.from_env()
    try:
        found = client.containers.list(all=True, filters={"label": OWNER_LABEL})
        return [c.name for c in found if c.labels[OWNER_LABEL].startswith(f"{pid}:")]
    finally:
        client.close()


# --- without an engine ----------------------------------------------------------------------


def test_without_an_engine_containers_mode_exits_3_in_one_line(tmp_path: Path) -> None:
    nowhere = {"DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock"}
    run = chaos(
        "run", "scenarios/crash_after_ack.yaml", "--mode", "containers", "--quiet", env=nowhere
    )
    assert run.returncode == 3, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and "Docker engine" in run.stderr, run.stderr
    build = chaos("images", "build", env=nowhere)
    assert build.returncode == 3 and build.stderr.count("\n") == 1, build.stderr


def test_the_simulator_refuses_a_broker_pause_in_one_line(tmp_path: Path) -> None:
    run = chaos("run", "scenarios/containers/broker_pause.yaml", "--mode", "sim")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr == (
        "scenarios/containers/broker_pause.yaml: faults[0].action: pause_broker is not "
        "simulated on redis-rabbitmq (a frozen RabbitMQ node (connections held, nothing "
        "delivered or confirmed) has no model in the simulator); run it with --mode live or "
        "--mode containers\n"
    )
    stopped = chaos("run", "scenarios/containers/broker_stop.yaml", "--mode", "sim")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr  # a stop: a kill there


# --- with an engine -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def images() -> Iterator[None]:
    if ENGINE is not None:
        (pytest.fail if REQUIRED else pytest.skip)(f"{ENGINE} (.ci/run starts one for CI)")
    build = chaos("images", "build")
    assert build.returncode == 0, build.stdout + build.stderr
    yield


@needs_engine
def test_the_images_are_built_from_the_hosts_services(images: None) -> None:
    import docker

    client = docker.from_env()
    try:
        for service, tag in LOCAL_IMAGES.items():
            assert client.images.get(tag).labels[IMAGE_LABEL] == service
        version = client.containers.run(
            LOCAL_IMAGES["redis"], ["redis-server", "--version"], network="host", remove=True
        )
        host = subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True, check=True
        )
        assert version.decode().split()[:3] == host.stdout.split()[:3]  # the host's build
    finally:
        client.close()


@needs_engine
def test_without_an_image_the_line_says_how_to_build_one(
    images: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither the official image (here: a name no registry holds) nor the local build."""
    monkeypatch.delenv("CHAOS_REDIS_IMAGE", raising=False)
    monkeypatch.setitem(OFFICIAL_IMAGES, "redis", "chaos-absent-official:none")
    monkeypatch.setitem(LOCAL_IMAGES, "redis", "chaos-absent-local:none")
    with pytest.raises(StackError) as info:
        image_for("redis")
    assert "python -m chaos images build" in str(info.value)
    assert "\n" not in str(info.value)
    monkeypatch.undo()
    assert image_for("redis") in (OFFICIAL_IMAGES["redis"], LOCAL_IMAGES["redis"])


@needs_engine
def test_redis_keeps_or_loses_its_data_as_its_persistence_says(images: None) -> None:
    import redis

    for persistence, kept in ((True, b"v"), (False, None)):
        server = RedisContainer(persistence=persistence).start()
        try:
            client = redis.Redis.from_url(server.url)
            client.set("k", "v")
            server.kill()
            assert not server.alive
            server.restart()
            assert client.get("k") == kept, persistence
            client.close()
        finally:
            server.stop()


@needs_engine
def test_a_paused_redis_answers_nothing_until_resumed(images: None) -> None:
    import redis

    server = RedisContainer(persistence=True).start()
    try:
        redis.Redis.from_url(server.url).set("k", "v")
        server.pause()
        assert server.alive and server.paused
        frozen = redis.Redis.from_url(server.url, socket_timeout=0.5)
        with pytest.raises(redis.TimeoutError):
            frozen.ping()
        server.resume()
        assert redis.Redis.from_url(server.url).get("k") == b"v"
        server.terminate(10)  # a clean stop keeps the data too
        assert not server.alive
        server.restart()
        assert redis.Redis.from_url(server.url).get("k") == b"v"
    finally:
        server.stop()
    assert containers_of(os.getpid()) == []


async def _fill(url: str) -> None:
    import aio_pika

    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        durable = await channel.declare_queue("kept", durable=True)
        transient = await channel.declare_queue("gone", durable=False)
        for queue, body in ((durable, b"persistent"), (transient, b"transient")):
            message = aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
            await channel.default_exchange.publish(message, routing_key=queue.name)


async def _after_restart(url: str) -> tuple[bytes | None, bool]:
    """The durable queue's message, and whether the transient queue is still there."""
    import aio_pika
    from aiormq.exceptions import ChannelNotFoundEntity

    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue("kept", durable=True, passive=True)
        message = await queue.get(fail=False)
        body = message.body if message is not None else None
        try:
            await (await connection.channel()).declare_queue("gone", passive=True)
        except ChannelNotFoundEntity:
            return body, False
        return body, True


@needs_engine
def test_durable_queues_survive_a_container_restart(images: None) -> None:
    broker = RabbitContainer().start()
    try:
        asyncio.run(_fill(broker.url))
        dump_queue_records(broker)
        broker.kill()
        assert not broker.alive
        broker.restart()
        wait_for_queue(broker, "kept", 1)
        body, transient_left = asyncio.run(_after_restart(broker.url))
        assert body == b"persistent"
        assert not transient_left  # the restart was real: what was not durable went
    finally:
        broker.stop()
    assert containers_of(os.getpid()) == []


def _journal(out: Path, name: str) -> dict:
    return json.loads((out / name / "journal.json").read_text())


@needs_engine
def test_the_scenarios_pass_in_containers(images: None, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = chaos(
        "run", *SCENARIOS, "--mode", "containers", "--quiet", "--out", str(out), timeout=900
    )
    assert run.returncode == 0, run.stdout + run.stderr
    for path in SCENARIOS:
        journal = _journal(out, Path(path).stem)
        assert journal["ok"] and journal["mode"] == "containers", journal["verdicts"]
    assert run.stdout.count("(containers)") == len(SCENARIOS)
    assert "faults stop_broker" in run.stdout and "faults pause_redis" in run.stdout


@needs_engine
def test_a_mutant_fails_in_containers(images: None, tmp_path: Path) -> None:
    mutant = "no_redis_results"
    out = tmp_path / "out"
    run = chaos(
        "run", "scenarios/crash_after_ack.yaml", "--mode", "containers", "--quiet",
        "--mutant", mutant, "--out", str(out), timeout=600,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    journal = _journal(out, "crash_after_ack")
    assert journal["verdicts"][MUTANTS[mutant].breaks] == "fail", journal["verdicts"]


@needs_engine
def test_ctrl_c_removes_the_containers(images: None, tmp_path: Path) -> None:
    from tests.test_signals import started_run

    out = tmp_path / "out"
    proc = started_run(
        ["run", "scenarios/broker_restart.yaml", "--mode", "containers", "--quiet",
         "--out", str(out)],
        out / "broker_restart" / "history.raw.jsonl",
        patience_s=300,  # generous: only a hang fails it
    )  # fmt: skip
    assert len(containers_of(proc.pid)) == 2  # Redis and RabbitMQ, running
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert containers_of(proc.pid) == []
