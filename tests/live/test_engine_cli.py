"""The engine's command lines on the machine's Redis and RabbitMQ: the worker's ready line,
`engine.submit --status/--cancel` of an unknown attemptId, `--purge` (the README's "Try it"
clean-up), and two chaos runs of one seed side by side on the shared services.

Every test works in its own namespace and attemptId prefix (the `live` fixture), which its
teardown removes whatever the test asserted.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aio_pika
import pytest
import redis
from aio_pika.exceptions import ChannelNotFoundEntity

from engine.config import DEFAULT_AMQP_URL, DEFAULT_REDIS_URL
from engine.plan import load_plan
from tests.live.conftest import PATIENCE_S, ROOT, Live

pytestmark = [pytest.mark.live, pytest.mark.slow]

CHAOS_RUN = [sys.executable, "-m", "chaos", "run", "scenarios/crash_after_ack.yaml"]


def _env(**extra: str) -> dict[str, str]:
    keep = {
        k: v
        for k, v in os.environ.items()
        if k not in ("REDIS_URL", "AMQP_URL") and not k.startswith("ENGINE_")
    }
    return {**keep, **extra}


def _cli(*args: str, namespace: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=_env(ENGINE_NAMESPACE=namespace, **env),
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
        check=False,
    )


def _wait_for(path: Path, needle: str, proc: subprocess.Popen[bytes]) -> None:
    """Until `needle` is in the file (or the process died): an event, not a duration."""
    deadline = time.monotonic() + PATIENCE_S
    while needle not in path.read_text():
        assert proc.poll() is None, path.read_text()
        assert time.monotonic() < deadline, f"no {needle!r} in {PATIENCE_S} s"
        time.sleep(0.05)


def _existing_queues(names: list[str]) -> list[str]:
    async def check() -> list[str]:
        conn = await aio_pika.connect(DEFAULT_AMQP_URL, timeout=PATIENCE_S)
        found = []
        try:
            for name in names:
                ch = await conn.channel()
                try:
                    await ch.declare_queue(name, passive=True)
                    found.append(name)
                    await ch.close()
                except ChannelNotFoundEntity:
                    pass
        finally:
            await conn.close()
        return found

    return asyncio.run(check())


def _keys(pattern: str) -> list[str]:
    client = redis.Redis.from_url(DEFAULT_REDIS_URL, decode_responses=True)
    try:
        return list(client.scan_iter(match=pattern, count=1000))
    finally:
        client.close()


def test_worker_says_ready_in_one_line_and_purge_waits_for_it(live: Live, tmp_path: Path) -> None:
    worker_id = f"cli{uuid.uuid4().hex[:6]}"
    log = tmp_path / "worker.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine.worker", "--worker-id", worker_id],
            cwd=ROOT,
            env=_env(ENGINE_NAMESPACE=live.ns, ENGINE_TIME_SCALE="0.001"),
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for(log, "ready", proc)
        busy = _cli("-m", "engine.submit", "--purge", namespace=live.ns)
        assert busy.returncode == 1, busy.stdout + busy.stderr
        assert busy.stderr.count("\n") == 1 and "consumer" in busy.stderr
        assert _existing_queues([f"{live.ns}evaluation.execute"])  # nothing was deleted
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(PATIENCE_S)
    lines = log.read_text().splitlines()
    assert len(lines) == 1, lines  # the ready line, nothing else at the default log level
    line = lines[0]
    assert f"engine.worker {worker_id} ready" in line
    for part in (
        "redis://127.0.0.1:6379/0",
        "amqp://guest:***@127.0.0.1:5672/",
        repr(live.ns),
        f"{live.ns}evaluation.execute",
        f"{live.ns}worker.{worker_id}",
        f"{live.ns}evaluation.retry.*",
    ):
        assert part in line, (part, line)
    assert "guest:guest" not in line

    queues = [f"{live.ns}evaluation.execute", f"{live.ns}evaluation.retry.t1.b0.30ms"]
    assert _existing_queues(queues) == queues
    done = _cli("-m", "engine.submit", "--purge", namespace=live.ns)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"queue:{live.ns}evaluation.execute" in json.loads(done.stdout)["deleted"]
    assert _existing_queues(queues) == []
    assert _keys(f"{live.ns}*") == []


def test_status_and_cancel_of_an_unknown_attempt_id(live: Live) -> None:
    unknown = f"{live.prefix}never-{uuid.uuid4().hex[:6]}"
    for flag in ("--status", "--cancel"):
        out = _cli("-m", "engine.submit", flag, unknown, namespace=live.ns)
        assert out.returncode == 1, out.stdout + out.stderr
        assert out.stderr.count("\n") == 1 and repr(unknown) in out.stderr
        assert "Traceback" not in out.stderr and out.stdout == ""
    assert _keys(f"attempt:{unknown}*") == []  # a refused cancel wrote nothing


def test_try_it_leaves_nothing_after_purge(live: Live) -> None:
    """The README's example in a namespace of its own, then its clean-up command."""
    live.worker()
    cand, load = f"{live.prefix}cand-", f"{live.prefix}load-"
    plan = "plans/code_review.yaml"
    one = _cli(
        "-m", "engine.submit", plan, "--attempt-id", f"{cand}42", "--wait", namespace=live.ns
    )
    assert one.returncode == 0 and json.loads(one.stdout) == {f"{cand}42": "completed"}, one.stderr
    many = _cli(
        "-m", "engine.submit", plan, "--count", "3", "--prefix", load, "--wait", namespace=live.ns
    )
    assert many.returncode == 0, many.stdout + many.stderr
    status = _cli("-m", "engine.submit", "--status", f"{cand}42", namespace=live.ns)
    shown = json.loads(status.stdout)
    assert (shown["attempt_id"], shown["state"]) == (f"{cand}42", "completed")
    order = load_plan(plan).order
    assert list(shown["rules"]) == list(order)  # every rule, in the plan's order
    assert all(r["verdict"] in ("pass", "fail", "needs_review") for r in shown["rules"].values())
    cancel = _cli("-m", "engine.submit", "--cancel", f"{cand}42", namespace=live.ns)
    assert json.loads(cancel.stdout)["state"] == "completed"  # the final state stays
    for w in live.workers:
        w.terminate()
    assert _keys(f"attempt:{cand}*") and _keys(f"attempt:{load}*")
    out = _cli("-m", "engine.submit", "--purge", cand, load, namespace=live.ns)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["keys_deleted"] > 0
    assert _keys(f"attempt:{live.prefix}*") == [] and _keys(f"{live.ns}*") == []
    assert _existing_queues([f"{live.ns}evaluation.execute"]) == []


def test_two_runs_of_one_seed_share_the_services_without_touching_each_other(
    tmp_path: Path,
) -> None:
    env = _env(REDIS_URL=DEFAULT_REDIS_URL, AMQP_URL=DEFAULT_AMQP_URL)
    runs = [
        subprocess.Popen(
            [*CHAOS_RUN, "--mode", "live", "--quiet", "--out", str(tmp_path / name)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in ("a", "b")
    ]
    outputs = [run.communicate(timeout=PATIENCE_S)[0] for run in runs]
    journals = [
        json.loads((tmp_path / name / "crash_after_ack" / "journal.json").read_text())
        for name in ("a", "b")
    ]
    namespaces = []
    for run, output, journal in zip(runs, outputs, journals, strict=True):
        extra = journal["extra"]
        namespaces.append(extra["namespace"])
        clean = _cli(
            "-m",
            "engine.submit",
            "--purge",
            extra["attempt_id_prefix"],
            namespace=extra["namespace"],
        )
        assert clean.returncode == 0, clean.stdout + clean.stderr
        assert run.returncode == 0, output
        assert extra["attempt_id_prefix"] == extra["namespace"]
    assert namespaces[0] != namespaces[1]
    for ns in namespaces:
        assert _keys(f"attempt:{ns}*") == [] and _keys(f"{ns}*") == []
