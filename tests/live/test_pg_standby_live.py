"""The `pg` design's primary and streaming standby (chaos/systems/pg/standby.py) on real
PostgreSQL: base backup, streaming, SIGKILL of the primary, `pg_ctl promote`, no mocks.

Why: "failover to a standby" is only a mitigation if what it loses is measured. With
asynchronous replication a failover may lose commits the primary acknowledged (counted and
reported here, whatever the count); with `remote_apply` it must lose none. Every test waits
for events (a condition polled against a deadline), never for a fixed time, and checks at
teardown that both nodes left nothing behind: no process, no temp dir, no port, no segment.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from chaos.stack import MARKER_ENV, OWNER_ENV, StackError, marked_pids, stop_owned
from chaos.systems.pg.standby import REPLICATION_ROLE, PostgresPair
from chaos.systems.pg_store.postgres import (
    PostgresServer,
    _remove_segment,
    find_postgres_bin,
)
from tests.live.test_postgres_live import _alive, _family, _port_free

_BIN = find_postgres_bin()
_TOOLS = ("postgres", "initdb", "pg_basebackup", "pg_ctl")

pytestmark = [
    pytest.mark.live,
    pytest.mark.slow,
    pytest.mark.skipif(
        _BIN is None or not all(os.access(_BIN / t, os.X_OK) for t in _TOOLS),
        reason="postgres, initdb, pg_basebackup or pg_ctl not installed "
        "(Debian: apt-get install postgresql)",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
#: How long a test waits for an event that must come; only a broken pair uses it up.
PATIENCE_S = 60.0
#: Acknowledged commits before the primary is killed, mid-stream.
BEFORE_KILL = 300
#: What a connection to a SIGKILLed server raises.
_CUT = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError)


# --- processes, ports, segments -----------------------------------------------------------


def _segment(server: PostgresServer) -> tuple[int, int]:
    """(key, shmid) of the SysV segment a running postmaster holds (line 7 of its pid file)."""
    data = server.data_dir
    assert data is not None
    key, shmid = (int(f) for f in (data / "postmaster.pid").read_text().split("\n")[6].split())
    return key, shmid


def _segments() -> set[tuple[int, int]]:
    """Every SysV shared memory segment of the machine, as (key, shmid)."""
    lines = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return {(int(f[0]), int(f[1])) for f in (line.split() for line in lines)}


def _wait_for(ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {PATIENCE_S:.0f} s")
        time.sleep(0.01)


async def _until(ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {PATIENCE_S:.0f} s")
        await asyncio.sleep(0.005)


# --- the pairs a test starts, and what must be gone after --------------------------------


class Pairs:
    """The pairs a test started, every process of theirs it saw, and their segments."""

    def __init__(self) -> None:
        self.pairs: list[PostgresPair] = []
        self.seen: dict[int, str] = {}
        self.dirs: list[Path] = []
        self.segments: set[tuple[int, int]] = set()

    def start(self, **kwargs: Any) -> PostgresPair:
        pair = PostgresPair(start_timeout=PATIENCE_S, **kwargs)
        self.pairs.append(pair)
        pair.start()
        self.note(pair)
        return pair

    def note(self, pair: PostgresPair) -> None:
        """Remember the running nodes' processes, temp dirs and segments now."""
        for node in (pair.primary, pair.standby):
            if node.pid is not None:
                self.seen.update(_family(node.pid))
                self.segments.add(_segment(node))
            if node.dir is not None and node.dir not in self.dirs:
                self.dirs.append(node.dir)

    def close(self) -> None:
        for pair in self.pairs:
            pair.stop()
        for pair in self.pairs:
            for node in (pair.primary, pair.standby):
                assert node.dir is None and not node.alive
                assert marked_pids(node.marker) == []
                assert _port_free(node.port), node.port
        assert [d for d in self.dirs if d.exists()] == []
        assert [pid for pid, token in self.seen.items() if _alive(pid, token)] == []
        assert self.segments & _segments() == set()


@pytest.fixture
def pairs() -> Iterator[Pairs]:
    made = Pairs()
    try:
        yield made
    finally:
        made.close()


# --- a writer cut by the kill -------------------------------------------------------------


async def _create_table(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("CREATE TABLE acked (id bigint PRIMARY KEY)")
    finally:
        await conn.close()


async def _write_until_cut(url: str, acked: list[int]) -> BaseException:
    """Single-row commits, one after the other, each id noted once the primary acknowledged
    it, until the connection breaks; what broke it."""
    conn = await asyncpg.connect(url)
    try:
        for row_id in range(1, 10**9):
            await conn.execute("INSERT INTO acked (id) VALUES ($1)", row_id)
            acked.append(row_id)
    except _CUT as exc:
        return exc
    finally:
        conn.terminate()
    raise AssertionError("the writer was never cut")


async def _fail_over(pairs: Pairs, pair: PostgresPair, acked: list[int]) -> float:
    """Write, SIGKILL the primary mid-stream (from a thread: the writer goes on meanwhile),
    promote the standby; the seconds the promotion took."""
    await _create_table(pair.primary_url)
    writer = asyncio.create_task(_write_until_cut(pair.primary_url, acked))
    await _until(lambda: len(acked) >= BEFORE_KILL or writer.done(), "acknowledged commits")
    assert not writer.done(), writer.result()
    pairs.note(pair)  # the writer's backend and the walsender too
    await asyncio.to_thread(pair.kill_primary)
    assert not pair.primary.alive
    cut = await asyncio.wait_for(writer, PATIENCE_S)
    assert isinstance(cut, _CUT)
    seconds = await asyncio.to_thread(pair.promote)
    assert pair.promoted and pair.writable is pair.standby
    return seconds


async def _accepts_writes(pair: PostgresPair) -> tuple[bool, int]:
    """(in recovery, the id read back) on the node a client reconnects to after failover."""
    conn = await asyncpg.connect(pair.url)
    try:
        await conn.execute("INSERT INTO acked (id) VALUES (-1)")
        return (
            await conn.fetchval("SELECT pg_is_in_recovery()"),
            await conn.fetchval("SELECT id FROM acked WHERE id = -1"),
        )
    finally:
        await conn.close()


async def _settings(url: str) -> tuple[str, str]:
    """(synchronous_commit, synchronous_standby_names) as a plain client sees them."""
    conn = await asyncpg.connect(url)
    try:
        return (
            await conn.fetchval("SHOW synchronous_commit"),
            await conn.fetchval("SHOW synchronous_standby_names"),
        )
    finally:
        await conn.close()


def _report(
    capsys: pytest.CaptureFixture[str],
    record_property: Callable[[str, object], None],
    mode: str,
    acked: int,
    lost: int,
    seconds: float,
) -> None:
    """Say what the failover cost (the number matters, not only the verdict)."""
    record_property(f"{mode}_acknowledged", acked)
    record_property(f"{mode}_lost", lost)
    record_property(f"{mode}_promote_s", round(seconds, 4))
    with capsys.disabled():
        print(
            f"\n[{mode} failover] {acked} commits acknowledged before the kill, {lost} lost;"
            f" promote took {seconds:.3f} s"
        )


# --- the tests ----------------------------------------------------------------------------


def test_the_standby_streams_from_127_0_0_1_only(pairs: Pairs) -> None:
    pair = pairs.start()
    state = pair.replication()
    assert state is not None and state["state"] == "streaming"
    assert pair.standby.fetch("SELECT pg_is_in_recovery() AS r")[0]["r"] is True
    rules = pair.primary.fetch(
        "SELECT user_name, address FROM pg_hba_file_rules WHERE 'replication' = ANY(database)"
    )
    assert [(r["user_name"], r["address"]) for r in rules] == [([REPLICATION_ROLE], "127.0.0.1")]
    [role] = pair.primary.fetch(
        "SELECT rolreplication, rolsuper FROM pg_roles WHERE rolname = $1", REPLICATION_ROLE
    )
    assert (role["rolreplication"], role["rolsuper"]) == (True, False)
    for node in (pair.primary, pair.standby):
        [row] = node.fetch("SELECT current_setting('dynamic_shared_memory_type') AS dsm")
        assert row["dsm"] == "mmap"  # in the data dir: goes with the temp dir, even after a kill
    assert pair.primary_port != pair.standby_port
    assert pair.primary.password() not in repr(pair)


def test_asynchronous_failover_counts_what_it_lost(
    pairs: Pairs,
    capsys: pytest.CaptureFixture[str],
    record_property: Callable[[str, object], None],
) -> None:
    pair = pairs.start(synchronous=False)
    state = pair.replication()
    assert state is not None and state["sync_state"] == "async"
    acked: list[int] = []
    seconds = asyncio.run(_fail_over(pairs, pair, acked))
    assert asyncio.run(_accepts_writes(pair)) == (False, -1)
    missing = pair.missing_commits("acked", "id", acked)
    lost = pair.lost_commits("acked", "id", acked)
    assert lost == len(missing) >= 0
    assert pair.lost_commits("acked", "id", [*acked, 0]) == lost + 1  # 0: never written
    # Asynchronous replication loses a suffix, never a commit from the middle.
    assert missing == acked[len(acked) - lost :]
    _report(capsys, record_property, "async", len(acked), lost, seconds)


def test_remote_apply_loses_no_acknowledged_commit(
    pairs: Pairs,
    capsys: pytest.CaptureFixture[str],
    record_property: Callable[[str, object], None],
) -> None:
    pair = pairs.start(synchronous=True)
    state = pair.replication()
    assert state is not None and state["sync_state"] == "sync"
    # What a plain client (the writer) gets; `fetch` connects with synchronous_commit=on.
    assert asyncio.run(_settings(pair.primary_url)) == (
        "remote_apply",
        f'"{pair.application_name}"',
    )
    acked: list[int] = []
    seconds = asyncio.run(_fail_over(pairs, pair, acked))
    assert len(acked) >= BEFORE_KILL
    assert pair.missing_commits("acked", "id", acked) == []
    # The promoted node names no synchronous standby: its commits do not wait for a ghost.
    assert asyncio.run(_accepts_writes(pair)) == (False, -1)
    _report(capsys, record_property, "sync", len(acked), 0, seconds)


@pytest.mark.parametrize(
    ("synchronous", "failed_over"),
    [(False, False), (True, False), (False, True)],
    ids=["both-running", "both-running-sync", "after-failover"],
)
def test_stop_leaves_no_process_and_no_temp_dir(synchronous: bool, failed_over: bool) -> None:
    pair = PostgresPair(synchronous=synchronous, start_timeout=PATIENCE_S).start()
    assert pair.start() is pair  # a second start leaves the running pair alone
    try:
        nodes = (pair.primary, pair.standby)
        seen: dict[int, str] = {}
        for node in nodes:
            assert node.pid is not None
            seen.update(_family(node.pid))
        segments = {_segment(node) for node in nodes}
        dirs = [node.dir for node in nodes]
        assert all(d is not None and d.is_dir() for d in dirs)
        if failed_over:
            pair.kill_primary()
            pair.promote()
            assert pair.standby.pid is not None
            seen.update(_family(pair.standby.pid))
    finally:
        pair.stop()
    assert [d for d in dirs if d is not None and d.exists()] == []
    assert all(node.dir is None and not node.alive for node in nodes)
    assert [pid for pid, token in seen.items() if _alive(pid, token)] == []
    assert all(marked_pids(node.marker) == [] for node in nodes)
    assert segments & _segments() == set()
    assert all(_port_free(node.port) for node in nodes)


def test_a_failed_start_stops_the_primary_too() -> None:
    pair = PostgresPair(start_timeout=PATIENCE_S)
    with socket.socket() as blocker:  # the standby's port taken: it cannot start
        blocker.bind(("127.0.0.1", pair.standby_port))
        blocker.listen()
        with pytest.raises(StackError) as info:
            pair.start()
    assert "\n" not in str(info.value) and "Address already in use" in str(info.value)
    for node in (pair.primary, pair.standby):
        assert node.dir is None and not node.alive
        assert marked_pids(node.marker) == []


_OWNER_SCRIPT = """
import json, os
from chaos.stack import owner_token
from chaos.systems.pg.standby import PostgresPair

pair = PostgresPair().start()
nodes = {"primary": pair.primary, "standby": pair.standby}
print(json.dumps({"owner": owner_token(), **{name: {"marker": n.marker, "dir": str(n.dir),
      "pid": n.pid, "port": n.port} for name, n in nodes.items()}}), flush=True)
os.kill(os.getpid(), 9)
"""


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (MARKER_ENV, OWNER_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def test_the_reaper_takes_both_nodes_when_their_owner_died() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _OWNER_SCRIPT],
        cwd=ROOT,
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=PATIENCE_S * 2,
        check=False,
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    info = json.loads(out.stdout)
    nodes = [info["primary"], info["standby"]]
    family: dict[int, str] = {}
    segments: list[tuple[int, int]] = []
    for node in nodes:
        family.update(_family(node["pid"]))
        pid_file = Path(node["dir"]) / "data" / "postmaster.pid"
        key, shmid = (int(f) for f in pid_file.read_text().split("\n")[6].split())
        segments.append((key, shmid))
    try:
        reaped = stop_owned(info["owner"])
        assert set(family) <= set(reaped.pids) and not reaped.survivors
        for node in nodes:
            assert Path(node["dir"]) in reaped.dirs and not Path(node["dir"]).exists()
        _wait_for(lambda: not any(_alive(p, t) for p, t in family.items()), "end of both nodes")
        for node in nodes:
            assert marked_pids(node["marker"]) == []
            _wait_for(lambda node=node: _port_free(node["port"]), "free port")
    finally:
        for pid, token in family.items():
            if _alive(pid, token):
                os.kill(pid, signal.SIGKILL)
        for node in nodes:
            shutil.rmtree(node["dir"], ignore_errors=True)
        # A reaper cannot tell a PostgreSQL segment from another: the test drops its own.
        _wait_for(lambda: not any(_alive(p, t) for p, t in family.items()), "end of both nodes")
        for key, shmid in segments:
            _remove_segment(key, shmid)
