"""The `pg` design's primary and streaming standby (chaos/systems/pg/standby.py) on real
PostgreSQL: base backup, streaming, SIGKILL of the primary, `pg_ctl promote`, no mocks.

Why: "failover to a standby" is only a mitigation if what it loses, and what it costs, is
measured. On loopback a standby keeps up, so the standby is cut off first (as Sentinel's
scenarios cut the replica's link): an asynchronous primary goes on acknowledging commits
that the failover then loses, every one of them, counted and reported; with `remote_apply`
the commits wait for the standby instead (none acknowledged, none lost), and each commit
pays a wait for the standby's replay, measured beside the asynchronous one. Every test waits
for events (a condition polled against a deadline), never for a fixed time, and checks at
teardown that both nodes left nothing behind: no process, no temp dir, no port, no segment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
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
#: Acknowledged commits before the standby is cut off, mid-stream.
BEFORE_CUT = 200
#: Acknowledged commits the asynchronous primary goes on to make while its standby is cut off.
WHILE_CUT = 100
#: The commit cost's measure: rounds, each of so many commits on each pair in turn.
ROUNDS = 6
PER_ROUND = 100
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


# --- a writer cut off, then cut by the kill ---------------------------------------------


#: The writer's backend waiting for its synchronous standby (`pg_stat_activity`).
_SYNC_WAITERS = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE backend_type = 'client backend' AND wait_event = 'SyncRep'"
)


@dataclass
class Failover:
    """What one failover after a cut showed: the numbers the tests print and judge."""

    acked: list[int]  # every commit the primary acknowledged, in order
    before_cut: int  # how many of them before `pause_replication` returned
    stalled_at: int | None  # acknowledged when the writer was seen waiting in SyncRep
    latencies: list[float]  # seconds each commit took while the standby streamed
    lag_bytes: int | None  # WAL the standby lacked just before the kill
    promote_s: float

    @property
    def while_cut(self) -> int:
        """Commits acknowledged after the standby was cut off."""
        return len(self.acked) - self.before_cut


async def _create_table(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("CREATE TABLE acked (id bigint PRIMARY KEY)")
    finally:
        await conn.close()


async def _write_until_cut(
    url: str, acked: list[int], latencies: list[float] | None = None
) -> BaseException:
    """Single-row commits, one after the other, each id noted once the primary acknowledged
    it (and, given `latencies`, how long it took), until the connection breaks; what broke
    it."""
    conn = await asyncpg.connect(url)
    try:
        for row_id in range(1, 10**9):
            began = time.perf_counter()
            await conn.execute("INSERT INTO acked (id) VALUES ($1)", row_id)
            if latencies is not None:
                latencies.append(time.perf_counter() - began)
            acked.append(row_id)
    except _CUT as exc:
        return exc
    finally:
        conn.terminate()
    raise AssertionError("the writer was never cut")


@dataclass
class _Writing:
    """A writer of single-row commits to the primary (`_write_until_cut`), what it had
    acknowledged and how long each took, and a connection beside it to watch the server."""

    task: asyncio.Task[BaseException]
    acked: list[int]
    latencies: list[float]
    monitor: Any


@contextlib.asynccontextmanager
async def _writing(pair: PostgresPair) -> AsyncIterator[_Writing]:
    await _create_table(pair.primary_url)
    acked: list[int] = []
    latencies: list[float] = []
    task = asyncio.create_task(_write_until_cut(pair.primary_url, acked, latencies))
    monitor = await asyncpg.connect(pair.primary_url)
    try:
        yield _Writing(task, acked, latencies, monitor)
    finally:
        await monitor.close()


async def _fail_over_cut_off(pairs: Pairs, pair: PostgresPair) -> Failover:
    """Write; cut the standby off (`pause_replication`, from a thread: the writer goes on);
    then, once the primary acknowledged `WHILE_CUT` more commits or the writer waits in
    SyncRep for the standby, SIGKILL the primary and promote the standby."""
    async with _writing(pair) as w:
        writer, acked, latencies, monitor = w.task, w.acked, w.latencies, w.monitor
        await _until(lambda: len(acked) >= BEFORE_CUT or writer.done(), "acknowledged commits")
        assert not writer.done(), writer.result()
        streamed = latencies[:BEFORE_CUT]
        await asyncio.to_thread(pair.pause_replication)
        before_cut = len(acked)
        stalled_at: int | None = None
        deadline = time.monotonic() + PATIENCE_S
        while len(acked) < before_cut + WHILE_CUT:
            if await monitor.fetchval(_SYNC_WAITERS):
                stalled_at = len(acked)
                break
            assert not writer.done(), writer.result()
            if time.monotonic() > deadline:
                pytest.fail(f"neither commits nor a wait for the standby in {PATIENCE_S:.0f} s")
            await asyncio.sleep(0.005)
        lag = await asyncio.to_thread(pair.lag_bytes)
    pairs.note(pair)  # the writer's backend too
    await asyncio.to_thread(pair.kill_primary)
    assert not pair.primary.alive
    cut = await asyncio.wait_for(writer, PATIENCE_S)
    assert isinstance(cut, _CUT)
    seconds = await asyncio.to_thread(pair.promote)
    assert pair.promoted and pair.writable is pair.standby
    return Failover(acked, before_cut, stalled_at, streamed, lag, seconds)


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


def _ms(latencies: list[float]) -> float:
    """The median commit latency, in milliseconds."""
    return 1000 * statistics.median(latencies)


def _report(
    capsys: pytest.CaptureFixture[str],
    record_property: Callable[[str, object], None],
    mode: str,
    f: Failover,
    lost: int,
) -> None:
    """Say what the failover cost (the numbers matter, not only the verdict)."""
    record_property(f"{mode}_acknowledged", len(f.acked))
    record_property(f"{mode}_acknowledged_while_cut_off", f.while_cut)
    record_property(f"{mode}_lost", lost)
    record_property(f"{mode}_commit_ms", round(_ms(f.latencies), 4))
    record_property(f"{mode}_promote_s", round(f.promote_s, 4))
    waited = "" if f.stalled_at is None else ", then the next commit waited in SyncRep"
    with capsys.disabled():
        print(
            f"\n[{mode} failover, standby cut off] {len(f.acked)} commits acknowledged"
            f" ({f.before_cut} before the cut, median {_ms(f.latencies):.2f} ms each;"
            f" {f.while_cut} while cut off{waited}), {lost} lost;"
            f" {f.lag_bytes} bytes of WAL behind at the kill; promote took {f.promote_s:.3f} s"
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


def test_a_cut_off_asynchronous_standby_loses_what_the_primary_acknowledged(
    pairs: Pairs,
    capsys: pytest.CaptureFixture[str],
    record_property: Callable[[str, object], None],
) -> None:
    pair = pairs.start(synchronous=False)
    state = pair.replication()
    assert state is not None and state["sync_state"] == "async"
    f = asyncio.run(_fail_over_cut_off(pairs, pair))
    assert f.stalled_at is None  # an asynchronous primary never waits for its standby
    assert f.lag_bytes is not None and f.lag_bytes > 0
    assert asyncio.run(_accepts_writes(pair)) == (False, -1)
    missing = pair.missing_commits("acked", "id", f.acked)
    lost = pair.lost_commits("acked", "id", f.acked)
    assert lost == len(missing)
    assert pair.lost_commits("acked", "id", [*f.acked, 0]) == lost + 1  # 0: never written
    # Every commit acknowledged once the standby was cut off is lost, and maybe a few just
    # before (not yet sent); a suffix, never a commit from the middle.
    assert lost >= f.while_cut >= WHILE_CUT
    assert missing == f.acked[len(f.acked) - lost :]
    _report(capsys, record_property, "async", f, lost)


def test_remote_apply_acknowledges_nothing_while_the_standby_is_cut_off(
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
    f = asyncio.run(_fail_over_cut_off(pairs, pair))
    # The writer waited for the standby from the cut until the kill: nothing acknowledged
    # meanwhile but the one commit whose answer may have been on its way at the cut.
    assert f.stalled_at is not None and len(f.acked) == f.stalled_at
    assert f.while_cut <= 1
    assert len(f.acked) >= BEFORE_CUT
    assert pair.missing_commits("acked", "id", f.acked) == []
    # The promoted node names no synchronous standby: its commits do not wait for a ghost.
    assert asyncio.run(_accepts_writes(pair)) == (False, -1)
    _report(capsys, record_property, "sync", f, 0)


#: How long the writer's commit waits in SyncRep, as PostgreSQL sees it, before the
#: standby is brought back.
HOLD_S = 0.3
#: The longest wait in SyncRep of a client's statement now (seconds; 0 when none waits).
_SYNC_WAITED = (
    "SELECT coalesce(extract(epoch FROM max(clock_timestamp() - query_start)), 0)::float8"
    " FROM pg_stat_activity WHERE backend_type = 'client backend' AND wait_event = 'SyncRep'"
)


async def _wait_out_a_cut(pair: PostgresPair) -> tuple[int, float]:
    """Write to a synchronous pair, cut the standby off until PostgreSQL shows the writer's
    commit waiting `HOLD_S` in SyncRep, then bring the standby back: (commits acknowledged
    while it was away, the slowest commit's seconds)."""
    async with _writing(pair) as w:
        writer, acked, latencies, monitor = w.task, w.acked, w.latencies, w.monitor
        try:
            await _until(lambda: len(acked) >= WHILE_CUT or writer.done(), "acknowledged commits")
            await asyncio.to_thread(pair.pause_replication)
            away = len(acked)
            deadline = time.monotonic() + PATIENCE_S
            while await monitor.fetchval(_SYNC_WAITED) < HOLD_S:
                assert not writer.done() and time.monotonic() < deadline, "no wait in SyncRep"
                await asyncio.sleep(0.005)
            while_away = len(acked) - away
            await asyncio.to_thread(pair.resume_replication)
            await _until(lambda: len(acked) >= away + WHILE_CUT, "commits once it is back")
            assert not writer.done()
        finally:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
    assert await asyncio.to_thread(pair.missing_commits, "acked", "id", acked) == []
    return while_away, max(latencies)


def test_remote_apply_commits_wait_out_a_cut_and_land_once_the_standby_is_back(
    pairs: Pairs, capsys: pytest.CaptureFixture[str]
) -> None:
    pair = pairs.start(synchronous=True)
    while_away, slowest = asyncio.run(_wait_out_a_cut(pair))
    # Nothing acknowledged while the standby was away but the one commit whose answer may
    # have been on its way at the cut; the commit the cut caught waited it out, then landed.
    assert while_away <= 1
    assert slowest >= HOLD_S
    with capsys.disabled():
        print(
            f"\n[sync, standby cut off, then back] {while_away} commits acknowledged while it"
            f" was away; the commit it caught waited {slowest:.3f} s, then landed"
        )


async def _rounds(modes: dict[str, PostgresPair]) -> tuple[dict[str, list[float]], Counter[str]]:
    """`ROUNDS` rounds of `PER_ROUND` single-row commits on each pair, the pairs taking
    turns (a load on the machine falls on both alike): every commit's latency, and how many
    commits were not yet on the standby when the round's last was acknowledged."""
    latencies: dict[str, list[float]] = {mode: [] for mode in modes}
    unapplied: Counter[str] = Counter()
    conns = {}
    for mode, pair in modes.items():
        await _create_table(pair.primary_url)
        conns[mode] = await asyncpg.connect(pair.primary_url)
    try:
        for r in range(ROUNDS):
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            for mode in order:
                ids = range(r * PER_ROUND + 1, (r + 1) * PER_ROUND + 1)
                for row_id in ids:
                    began = time.perf_counter()
                    await conns[mode].execute("INSERT INTO acked (id) VALUES ($1)", row_id)
                    latencies[mode].append(time.perf_counter() - began)
                missing = await asyncio.to_thread(
                    modes[mode].missing_commits, "acked", "id", list(ids)
                )
                unapplied[mode] += len(missing)
    finally:
        for conn in conns.values():
            await conn.close()
    return latencies, unapplied


def test_remote_apply_costs_each_commit_a_wait_for_the_standby(
    pairs: Pairs,
    capsys: pytest.CaptureFixture[str],
    record_property: Callable[[str, object], None],
) -> None:
    """The mitigation's price, measured beside what it buys: with remote_apply a commit is
    acknowledged only once the standby applied it (so it is there the moment it is read),
    which costs every commit a round trip to the standby and its replay."""
    modes = {"async": pairs.start(synchronous=False), "sync": pairs.start(synchronous=True)}
    latencies, unapplied = asyncio.run(_rounds(modes))
    assert unapplied["sync"] == 0  # each acknowledged commit was on the standby already
    ms = {mode: _ms(lat) for mode, lat in latencies.items()}
    rate = {mode: len(lat) / sum(lat) for mode, lat in latencies.items()}
    for mode in modes:
        record_property(f"{mode}_commit_ms", round(ms[mode], 4))
        record_property(f"{mode}_commits_per_s", round(rate[mode], 1))
        record_property(f"{mode}_unapplied_when_acknowledged", unapplied[mode])
    n = ROUNDS * PER_ROUND
    with capsys.disabled():
        print(
            f"\n[commit cost, {n} commits each, interleaved] async: median"
            f" {ms['async']:.2f} ms, {rate['async']:.0f} commits/s, {unapplied['async']} not yet"
            f" on the standby when acknowledged; sync (remote_apply): median {ms['sync']:.2f} ms,"
            f" {rate['sync']:.0f} commits/s, 0 not on the standby;"
            f" {ms['sync'] / ms['async']:.2f}x the latency"
        )


async def _through_a_proxy(pair: PostgresPair) -> None:
    """The standby streams through a proxy of the harness's own (`chaos.proxy`) and gets
    the primary's commits through it; disabling it ends the stream, enabling it brings it
    back (all while the proxy lives: it goes with this function)."""
    from chaos.proxy.client import ToxiproxyClient
    from chaos.proxy.server import ProxyServer

    server = ProxyServer(seed=0, port=0)
    await server.start()
    try:
        async with ToxiproxyClient(server.url) as client:
            upstream = f"127.0.0.1:{pair.primary_port}"
            made = await client.create_proxy("replication", upstream=upstream)
            host, _, port = made["listen"].rpartition(":")
            await asyncio.to_thread(pair.replicate_through, host, int(port))
            receiver = await asyncio.to_thread(pair.standby.receiver)
            assert receiver is not None and receiver["status"] == "streaming"
            assert receiver["sender_port"] == int(port) != pair.primary_port
            await client.update_proxy("replication", enabled=False)
            await asyncio.to_thread(_wait_for, lambda: pair.replication() is None, "a cut")
            await asyncio.to_thread(pair.primary.execute, "CREATE TABLE acked (id bigint)")
            await client.update_proxy("replication", enabled=True)
            await asyncio.to_thread(pair.wait_streaming, PATIENCE_S)
            await asyncio.to_thread(pair.primary.execute, "INSERT INTO acked (id) VALUES (1)")
            await asyncio.to_thread(
                _wait_for,
                lambda: pair.missing_commits("acked", "id", [1]) == [],
                "the row on the standby",
            )
    finally:
        await server.close()


def test_the_standby_streams_through_a_proxy_whose_cut_stops_it(pairs: Pairs) -> None:
    pair = pairs.start()
    asyncio.run(_through_a_proxy(pair))


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
