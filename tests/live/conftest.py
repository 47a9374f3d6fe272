"""Live tests: the machine's real Redis and RabbitMQ, real worker processes, real SIGKILLs.

Each test gets its own namespace (queues, exchanges, index keys) and attemptId prefix, so
tests never see each other's messages; at teardown every worker is killed and every queue,
exchange and key the test made is deleted, so the shared services are left as found.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest
import redis

from chaos.workers import WorkerProcess
from engine.config import DEFAULT_AMQP_URL, DEFAULT_REDIS_URL, EngineConfig
from engine.core import RuleResult
from engine.history import read_history
from engine.plan import Plan, load_plan
from engine.policy import RetryPolicy
from engine.submit import EngineClient

ROOT = Path(__file__).resolve().parents[2]
PLANS = ROOT / "plans"
#: How long a test waits for an event that must come. Only a broken engine uses it up, so it
#: is generous: CI runs on a busy 2-core machine, and a fast one never waits this long.
PATIENCE_S = 120.0

#: What to do when the services are not there, after the line that says which one.
START_THEM = (
    "install and start redis-server, rabbitmq-server and PostgreSQL on 127.0.0.1 (.ci/run does "
    "all three), "
    'or leave the live tests out: python3 -m pytest -q -m "not slow"'
)


def _services_up() -> str | None:
    try:
        redis.Redis.from_url(DEFAULT_REDIS_URL, socket_connect_timeout=1).ping()
    except Exception as exc:
        return f"Redis on 127.0.0.1:6379 is not reachable: {exc}"

    async def amqp() -> None:
        conn = await aio_pika.connect(DEFAULT_AMQP_URL, timeout=2)
        await conn.close()

    try:
        asyncio.run(amqp())
    except Exception as exc:
        return f"RabbitMQ on 127.0.0.1:5672 is not reachable: {type(exc).__name__}"
    try:  # the PostgreSQL store's tests make their own database there
        socket.create_connection(("127.0.0.1", 5432), timeout=2).close()
    except OSError as exc:
        return f"PostgreSQL on 127.0.0.1:5432 is not reachable: {exc}"
    return None


def _missing() -> str | None:
    """One line naming the service that does not answer and what to do, or None."""
    problem = _services_up()
    return None if problem is None else f"{problem.rstrip('.')}; {START_THEM}"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Without the machine's Redis or RabbitMQ the run stops before its first test, in one
    line saying what to start, rather than failing every live test one by one."""
    if any(item.get_closest_marker("live") for item in session.items):
        line = _missing()
        if line:
            pytest.exit(line, returncode=pytest.ExitCode.TESTS_FAILED)


@pytest.fixture(scope="session", autouse=True)
def _require_services() -> None:
    """The same check when the collection's was not made (a live test not marked `live`)."""
    line = _missing()
    if line:
        pytest.fail(line, pytrace=False)


class Live:
    """One test's slice of the live stack."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ns = f"t{uuid.uuid4().hex[:8]}."
        self.prefix = f"{self.ns}att-"
        self.history_path = tmp / "history.jsonl"
        self.workers: list[WorkerProcess] = []
        self.time_scale = 0.001
        self.redis = redis.Redis.from_url(DEFAULT_REDIS_URL, decode_responses=True)
        self.base_args = {
            "namespace": self.ns,
            "time-scale": str(self.time_scale),
            "heartbeat-ms": "100",
            "stale-ms": "600",
            "sweep-ms": "100",
            "retry-grace-ms": "600",
        }

    def config(self) -> EngineConfig:
        return EngineConfig(namespace=self.ns, time_scale=self.time_scale, policy=RetryPolicy())

    # --- workers ------------------------------------------------------------------------

    def worker(
        self,
        *flags: str,
        agent: dict[str, Any] | None = None,
        failpoints: list[str] | None = None,
        ready: bool = True,
        **opts: str,
    ) -> WorkerProcess:
        args: list[str] = []
        for key, value in {**self.base_args, **opts}.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        args += ["--history", str(self.history_path), "--log-level", "INFO", *flags]
        if agent is not None:
            args += ["--agent", json.dumps(agent)]
        for fp in failpoints or []:
            args += ["--failpoint", fp]
        n = len(self.workers)
        w = WorkerProcess(args, log_path=self.tmp / f"worker{n}.log", name=f"worker{n}").start()
        self.workers.append(w)
        if ready and not w.wait_for_log("ready", PATIENCE_S):
            raise AssertionError(f"worker did not start:\n{w.log_path.read_text()}")
        return w

    # --- the client ---------------------------------------------------------------------

    def ids(self, n: int, tag: str = "") -> list[str]:
        return [f"{self.prefix}{tag}{i}" for i in range(n)]

    def submit(self, plan: Plan, ids: list[str]) -> None:
        async def go() -> None:
            async with EngineClient(self.config()) as client:
                for a in ids:
                    await client.submit(plan, a)

        asyncio.run(go())

    def cancel(self, attempt_id: str) -> str:
        async def go() -> str:
            async with EngineClient(self.config()) as client:
                return await client.cancel(attempt_id)

        return asyncio.run(go())

    def wait(self, ids: list[str], timeout: float = PATIENCE_S) -> dict[str, str | None]:
        async def go() -> dict[str, str | None]:
            async with EngineClient(self.config()) as client:
                return await client.wait(ids, timeout)

        return asyncio.run(go())

    def wait_for(self, predicate: Any, timeout: float = PATIENCE_S, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what or predicate}")

    # --- what happened ------------------------------------------------------------------

    def history(self, attempt_id: str | None = None) -> list[dict[str, Any]]:
        if not self.history_path.exists():
            return []
        events = read_history(self.history_path)
        if attempt_id is not None:
            events = [e for e in events if e.get("attempt_id") == attempt_id]
        return sorted(events, key=lambda e: e["t"])

    def events(self, ev: str, attempt_id: str, **match: Any) -> list[dict[str, Any]]:
        return [
            e
            for e in self.history(attempt_id)
            if e["ev"] == ev and all(e.get(k) == v for k, v in match.items())
        ]

    def starts(self, attempt_id: str) -> Counter[str]:
        """How many times each rule attempt round was started (immediate retries excluded)."""
        return Counter(
            e["rule_id"]
            for e in self.history(attempt_id)
            if e["ev"] == "rule_started" and e["try_no"] == 1
        )

    def calls(self, attempt_id: str) -> Counter[str]:
        return Counter(e["rule_id"] for e in self.history(attempt_id) if e["ev"] == "rule_started")

    def result(self, attempt_id: str, rule_id: str) -> RuleResult | None:
        raw = self.redis.get(f"attempt:{attempt_id}:rule:{rule_id}:result")
        return None if raw is None else RuleResult.from_json(raw)

    def status(self, attempt_id: str, rule_id: str) -> str | None:
        return self.redis.get(f"attempt:{attempt_id}:rule:{rule_id}:status")

    # --- teardown -----------------------------------------------------------------------

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        for key in self.redis.scan_iter(match=f"attempt:{self.prefix}*", count=1000):
            self.redis.delete(key)
        for key in self.redis.scan_iter(match=f"{self.ns}*", count=1000):
            self.redis.delete(key)
        self.redis.close()
        asyncio.run(_delete_broker_objects(self.ns))


def _broker_objects(kind: str, prefix: str) -> list[str]:
    out = subprocess.run(
        ["rabbitmqctl", f"list_{kind}", "-q", "name", "--no-table-headers"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return [n.strip() for n in out.stdout.splitlines() if n.strip().startswith(prefix)]


async def _delete_broker_objects(ns: str) -> None:
    """Delete every queue and exchange of the namespace (the delay tiers vary by test)."""
    conn = await aio_pika.connect(DEFAULT_AMQP_URL)
    try:
        for kind, delete in (("queues", "queue_delete"), ("exchanges", "exchange_delete")):
            for name in _broker_objects(kind, ns):
                ch = await conn.channel()
                with contextlib.suppress(Exception):
                    await getattr(ch, delete)(name)
    finally:
        await conn.close()


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    stack = Live(tmp_path)
    try:
        yield stack
    finally:
        stack.close()


@pytest.fixture(scope="session")
def code_review() -> Plan:
    return load_plan(PLANS / "code_review.yaml")


@pytest.fixture(scope="session")
def tiny() -> Plan:
    return load_plan(PLANS / "tiny.yaml")


@pytest.fixture
def workers() -> Iterator[list[Any]]:
    """Worker processes a test starts (`chaos.systems.core_workflow.ReadyProcess`): each
    SIGKILLed at teardown if still running."""
    started: list[Any] = []
    yield started
    for w in started:
        w.kill()
