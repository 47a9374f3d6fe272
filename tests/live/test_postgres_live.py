"""The private PostgreSQL of a live run (chaos/systems/pg_store/postgres.py): a real server,
real SIGKILLs and SIGSTOPs, no mocks. Each test starts its own instance (about 0.3 s from
the template) and checks at teardown that nothing of it is left: no process, no data dir,
no port held."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from chaos.stack import MARKER_ENV, OWNER_ENV, StackError, marked_pids, owner_token, stop_owned
from chaos.systems.pg_store.postgres import (
    PostgresServer,
    _descendants,
    _remove_segment,
    find_postgres_bin,
)

pytestmark = [
    pytest.mark.live,
    pytest.mark.slow,
    pytest.mark.skipif(
        find_postgres_bin() is None,
        reason="postgres/initdb not installed (Debian: apt-get install postgresql)",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
#: How long a test waits for an event that must come; only a broken server uses it up.
PATIENCE_S = 30.0


def _state(pid: int) -> str | None:
    """The state letter of a process, None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()[0].decode()


def _alive(pid: int, token: str) -> bool:
    """Whether the process `token` names still runs (a zombie has exited)."""
    return owner_token(pid) == token and _state(pid) not in (None, "Z", "X")


def _family(postmaster: int) -> dict[int, str]:
    """The postmaster and everything it forked, as pid -> `pid:starttime`."""
    return {pid: owner_token(pid) for pid in [postmaster, *_descendants(postmaster)]}


def _port_free(port: int) -> bool:
    """Nothing listens there (SO_REUSEADDR, as a server binding it: closed connections in
    TIME_WAIT do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait_for(ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {PATIENCE_S:.0f} s")
        time.sleep(0.01)


class Stack:
    """The instances a test started and every process of theirs it saw."""

    def __init__(self) -> None:
        self.servers: list[PostgresServer] = []
        self.seen: dict[int, str] = {}

    def start(self, **kwargs: Any) -> PostgresServer:
        server = PostgresServer(**kwargs)
        self.servers.append(server)
        server.start()
        self.note(server)
        return server

    def note(self, server: PostgresServer) -> dict[int, str]:
        """Remember the server's processes now (a backend appears per connection)."""
        assert server.pid is not None
        family = _family(server.pid)
        self.seen.update(family)
        return family

    def close(self) -> None:
        for server in self.servers:
            server.stop()
        for server in self.servers:
            assert server.dir is None and not server.alive
            assert marked_pids(server.marker) == []
            assert _port_free(server.port), server.port
        left = [pid for pid, token in self.seen.items() if _alive(pid, token)]
        assert not left, left


@pytest.fixture
def stack() -> Iterator[Stack]:
    made = Stack()
    try:
        yield made
    finally:
        made.close()


def test_starts_and_answers_with_the_settings_asked(stack: Stack) -> None:
    pg = stack.start()
    data = pg.data_dir
    assert data is not None and pg.pid is not None
    mode = data.stat()
    assert mode.st_mode & 0o777 == 0o700
    if os.geteuid() == 0:  # initdb and the server refuse root
        assert mode.st_uid == pwd.getpwnam("postgres").pw_uid
    assert pg.password() not in repr(pg)

    async def go() -> dict[str, Any]:
        conn = await asyncpg.connect(pg.url())
        try:
            row = await conn.fetchrow(
                "SELECT current_user AS user, current_setting('fsync') AS fsync,"
                " current_setting('synchronous_commit') AS sync,"
                " current_setting('listen_addresses') AS listen,"
                " current_setting('unix_socket_directories') AS sockets,"
                " current_setting('port')::int AS port,"
                " current_setting('max_connections')::int AS max_connections,"
                " current_setting('password_encryption') AS encryption"
            )
            return dict(row)
        finally:
            await conn.close()

    got = asyncio.run(go())
    assert got == {
        "user": "postgres",
        "fsync": "on",
        "sync": "on",
        "listen": "127.0.0.1",
        "sockets": str(data),
        "port": pg.port,
        "max_connections": 100,
        "encryption": "scram-sha-256",
    }
    assert (data / f".s.PGSQL.{pg.port}").exists()


def test_synchronous_commit_off_is_the_servers_default(stack: Stack) -> None:
    pg = stack.start(synchronous_commit="off")

    async def go() -> tuple[str, str]:
        plain = await asyncpg.connect(pg.url())
        admin = await pg.admin()
        try:
            return (
                await plain.fetchval("SHOW synchronous_commit"),
                await admin.fetchval("SHOW synchronous_commit"),
            )
        finally:
            await plain.close()
            await admin.close()

    # Setup through `admin` stays durable: only the engine's own commits may be lost.
    assert asyncio.run(go()) == ("off", "on")


def test_a_commit_survives_kill_and_restart(stack: Stack) -> None:
    pg = stack.start()
    port, first_pid = pg.port, pg.pid

    async def go() -> list[int]:
        conn = await asyncpg.connect(pg.url())
        await conn.execute("CREATE TABLE t (x int)")
        await conn.execute("INSERT INTO t VALUES (42)")  # committed: fsync'd WAL
        # Paused, no process can notice the postmaster's death and leave by itself: the
        # kill must take every one, and return only when they are all gone.
        pg.pause()
        family = stack.note(pg)
        assert len(family) >= 3  # postmaster, background processes, our backend
        pg.kill()
        assert not pg.alive
        assert [pid for pid, token in family.items() if _alive(pid, token)] == []
        conn.terminate()
        pg.restart()  # crash recovery from the WAL, same port, same data dir
        stack.note(pg)
        again = await asyncpg.connect(pg.url())
        try:
            return [r["x"] for r in await again.fetch("SELECT x FROM t")]
        finally:
            await again.close()

    assert asyncio.run(go()) == [42]
    assert pg.port == port and pg.pid != first_pid


def test_pause_silences_an_open_connection_and_resume_revives_it(stack: Stack) -> None:
    pg = stack.start()

    async def go() -> None:
        conn = await asyncpg.connect(pg.url(), command_timeout=0.5)
        assert await conn.fetchval("SELECT 1") == 1
        pg.pause()
        family = stack.note(pg)
        assert {_state(pid) for pid in family} == {"T"}
        with pytest.raises(TimeoutError):
            await conn.fetchval("SELECT 2")
        with pytest.raises(TimeoutError):
            await asyncpg.connect(pg.url(), timeout=0.5)
        pg.resume()
        assert await conn.fetchval("SELECT 3", timeout=PATIENCE_S) == 3
        await conn.close()
        pg.pause()  # left paused: the teardown's clean stop must resume it to shut it down

    asyncio.run(go())


def test_a_wrong_password_is_refused(stack: Stack) -> None:
    pg = stack.start()

    async def go() -> None:
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(**pg.connect_args(password="not-" + pg.password()))
        conn = await asyncpg.connect(**pg.connect_args())
        await conn.close()

    asyncio.run(go())


def test_a_created_role_is_neither_superuser_nor_bypassrls(stack: Stack) -> None:
    pg = stack.start()
    secret = pg.create_role("app")
    pg.create_database("appdb", owner="app")
    assert secret == pg.password("app")
    [row] = pg.fetch(
        "SELECT rolsuper, rolbypassrls, rolcanlogin, rolpassword LIKE 'SCRAM-SHA-256$%' AS scram"
        " FROM pg_authid WHERE rolname = 'app'"
    )
    assert dict(row) == {
        "rolsuper": False,
        "rolbypassrls": False,
        "rolcanlogin": True,
        "scram": True,
    }

    async def go() -> str:
        conn = await asyncpg.connect(pg.url("app", database="appdb"))
        try:
            await conn.execute("CREATE TABLE mine (x int)")
            return await conn.fetchval("SELECT current_user")
        finally:
            await conn.close()

    assert asyncio.run(go()) == "app"


def test_a_failed_start_is_one_line_and_leaves_nothing() -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        pg = PostgresServer(port=blocker.getsockname()[1], start_timeout=PATIENCE_S)
        with pytest.raises(StackError) as info:
            pg.start()
    message = str(info.value)
    assert "\n" not in message and "log:" in message and "Address already in use" in message
    assert pg.dir is None and not pg.alive and marked_pids(pg.marker) == []


def test_missing_binaries_say_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(StackError, match="apt-get install postgresql"):
        PostgresServer(bin_dir=tmp_path)


_OWNER_SCRIPT = """
import asyncio, json, os
import asyncpg
from chaos.stack import owner_token
from chaos.systems.pg_store.postgres import PostgresServer

pg = PostgresServer().start()
loop = asyncio.new_event_loop()
conn = loop.run_until_complete(asyncpg.connect(pg.url()))  # a backend of ours
pg.pause()  # nothing of it can notice our death and leave by itself
print(json.dumps({"marker": pg.marker, "owner": owner_token(), "dir": str(pg.dir),
                  "pid": pg.pid, "port": pg.port}), flush=True)
os.kill(os.getpid(), 9)
"""


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (MARKER_ENV, OWNER_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def test_the_reaper_takes_a_server_whose_owner_died() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _OWNER_SCRIPT],
        cwd=ROOT,
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
        check=False,
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    info = json.loads(out.stdout)
    family = _family(info["pid"])
    data = Path(info["dir"])
    key, shmid = (
        int(f) for f in (data / "data" / "postmaster.pid").read_text().split("\n")[6].split()
    )
    try:
        assert len(family) >= 3 and {_state(pid) for pid in family} == {"T"}
        # The children's environment no longer holds the marker: found as the postmaster's.
        assert set(family) <= set(marked_pids(info["marker"]))
        reaped = stop_owned(info["owner"])
        assert set(family) <= set(reaped.pids) and not reaped.survivors
        assert data in reaped.dirs and not data.exists()
        _wait_for(lambda: not any(_alive(p, t) for p, t in family.items()), "end of the server")
        assert marked_pids(info["marker"]) == []
        _wait_for(lambda: _port_free(info["port"]), "free port")
    finally:
        for pid, token in family.items():
            if _alive(pid, token):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(data, ignore_errors=True)
        # A reaper cannot tell a PostgreSQL segment from another: the test drops its own.
        _wait_for(lambda: not any(_alive(p, t) for p, t in family.items()), "end of the server")
        _remove_segment(key, shmid)


_TEMPLATE_SCRIPT = """
import sys
from chaos.systems.pg_store.postgres import PostgresServer

with PostgresServer(tmp_root=sys.argv[1]) as pg:
    assert pg.fetch("SELECT 1 AS one")[0]["one"] == 1
"""


def test_concurrent_first_runs_build_one_template() -> None:
    # Short (a unix socket path has 107 bytes) and reachable by the `postgres` OS user.
    root = Path(tempfile.mkdtemp(prefix="pgt-"))
    root.chmod(0o755)
    try:
        runs = [
            subprocess.Popen(
                [sys.executable, "-c", _TEMPLATE_SCRIPT, str(root)],
                cwd=ROOT,
                env=_child_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        for run in runs:
            _out, err = run.communicate(timeout=PATIENCE_S * 2)
            assert run.returncode == 0, err
        left = sorted(p.name for p in root.iterdir())
        assert len(left) == 1 and left[0].startswith("chaos-pgtemplate-v"), left
        assert (root / left[0] / "data" / "PG_VERSION").is_file()
    finally:
        shutil.rmtree(root, ignore_errors=True)
