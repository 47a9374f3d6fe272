"""A private PostgreSQL server per live chaos run, that scenarios may SIGKILL, pause and restart.

Why private: the machine's PostgreSQL on 5432 authenticates with `trust` (a wrong password is
never refused there) and belongs to everybody; a scenario kills and restarts its store. Each
instance here runs on its own loopback port, from a data dir in its own temp dir, with
`scram-sha-256` authentication and a superuser password drawn per instance.

It is a `chaos.stack._Service`, like the private Redis and RabbitMQ: the postmaster carries
the stack's marker and owner variables and leads its own session, so `chaos clean`,
`reap_dead_owners` and `stop_owned` find it after its owner died. Its children (backends,
checkpointer, ...) overwrite their environment with a process title and each call setsid,
so neither the marker nor a killpg reaches them: the reapers find them as children of the
marked postmaster, and `kill()` / `pause()` signal them one by one, found by parent pid.

`initdb` runs once per machine, user and PostgreSQL major version, into a template data
dir under the temp root (built aside, then renamed into place, so a concurrent run never
sees half of one; `chaos clean` leaves it, being a cache); each instance copies it, which
is several times faster. initdb and the server refuse root: as root both run as the
`postgres` OS user.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import ctypes
import hashlib
import hmac
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import asyncpg

from chaos.stack import (
    StackError,
    _owner_token,
    _read_proc,
    _Service,
    _signal_pid,
    _tail,
)

__all__ = ["PostgresServer", "find_postgres_bin", "pg_accepting", "scram_verifier"]

#: Where Debian and Ubuntu install the server binaries (one dir per major version).
PG_BIN_GLOB = "/usr/lib/postgresql/*/bin"
INSTALL_HINT = "install PostgreSQL (Debian: apt-get install postgresql)"
#: The OS user initdb and the server run as when we are root (both refuse root).
PG_OS_USER = "postgres"
SUPERUSER = "postgres"
#: Bumped whenever the template's initdb options change, so an old template is not reused.
TEMPLATE_RECIPE = "r1"

_T = TypeVar("_T")
_template_lock = threading.Lock()
_versions: dict[str, str] = {}
#: A unix socket path longer than this fails to bind (sun_path is 108 bytes with its NUL).
_SOCKET_PATH_MAX = 107


# --- binaries ---------------------------------------------------------------------------------


def _has_server(directory: Path) -> bool:
    return all(os.access(directory / name, os.X_OK) for name in ("postgres", "initdb"))


def find_postgres_bin() -> Path | None:
    """The dir holding `postgres` and `initdb` (PATH first, through its symlinks, then the
    newest /usr/lib/postgresql/*/bin), or None. Both must come from one installation:
    initdb boots the `postgres` next to it."""
    found = shutil.which("postgres")
    if found:
        directory = Path(found).resolve().parent
        if _has_server(directory):
            return directory

    def major(path: Path) -> tuple[int, str]:
        name = path.parent.name
        return (int(name) if name.isdigit() else -1, name)

    for directory in sorted(Path("/").glob(PG_BIN_GLOB.lstrip("/")), key=major, reverse=True):
        if _has_server(directory):
            return directory
    return None


def _major_version(postgres: Path) -> str:
    """`15` from `postgres (PostgreSQL) 15.13 (Debian ...)`: the template's compatibility key."""
    key = str(postgres)
    if key not in _versions:
        try:
            out = subprocess.run(
                [key, "-V"], capture_output=True, text=True, timeout=30, check=True
            ).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise StackError(f"{postgres} -V failed: {exc}") from exc
        match = re.search(r"\(PostgreSQL\)\s+(\d+)", out)
        if match is None:
            raise StackError(f"{postgres} -V: unexpected answer {out.strip()!r}")
        _versions[key] = match[1]
    return _versions[key]


# --- protocol helpers -------------------------------------------------------------------------


def pg_accepting(
    host: str, port: int, user: str = SUPERUSER, database: str = "postgres", timeout: float = 1.0
) -> bool:
    """True when the server would authenticate a connection now: its first answer to a
    startup packet is an authentication request ('R'), not an error such as 57P03 "the
    database system is starting up" (recovery after a kill). What `pg_isready` checks,
    without a process per poll; closing before the password is silent on the server side."""
    params = f"user\0{user}\0database\0{database}\0\0".encode()
    packet = struct.pack("!ii", 8 + len(params), 196608) + params  # protocol 3.0
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(packet)
            reply = sock.recv(1)
    except OSError:
        return False
    return reply == b"R"


def scram_verifier(password: str, iterations: int = 4096) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for `password` (RFC 5802/7677): sent in
    `PASSWORD '...'` instead of the password, which thus never reaches a server log."""
    salt = secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()
    b64 = base64.b64encode
    return (
        f"SCRAM-SHA-256${iterations}:{b64(salt).decode()}"
        f"${b64(stored_key).decode()}:{b64(server_key).decode()}"
    )


def _ident(name: str) -> str:
    """A quoted SQL identifier (roles and databases cannot be bind parameters)."""
    return '"' + name.replace('"', '""') + '"'


def _blocking(make: Callable[[], Awaitable[_T]]) -> _T:
    """Run a coroutine to its end from sync code, also from a thread that runs an event loop
    (asyncio.run refuses there: the coroutine gets a thread and a loop of its own)."""

    async def main() -> _T:
        return await make()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, main()).result()


# --- process helpers --------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of a process, None when it is gone."""
    stat = _read_proc(pid, "stat")
    if stat is None:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1])


def _descendants(root: int) -> list[int]:
    """Live descendants of `root`, found by parent pid: the postmaster's children each lead
    a session of their own (InitPostmasterChild calls setsid), so no killpg reaches them."""
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            state = _stat(int(entry.name))
            if state is not None and state[0] not in ("Z", "X"):
                parents[int(entry.name)] = state[1]
    found: list[int] = []
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier}
        found.extend(sorted(frontier))
    return found


def _wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Until `pid` is stopped (or gone): SIGSTOP takes effect after kill() returns, and a
    postmaster caught mid-fork has one more child once it stops."""
    deadline = time.monotonic() + timeout
    while (state := _stat(pid)) is not None and state[0] not in ("T", "t", "Z", "X"):
        if time.monotonic() > deadline:
            raise StackError(f"postgres: process {pid} did not stop on SIGSTOP")
        time.sleep(0.002)


def _gone(pid: int, token: str) -> bool:
    """True when the process `token` names has exited (a zombie has: its memory is freed)."""
    state = _stat(pid)
    return state is None or state[0] in ("Z", "X") or _owner_token(pid) != token


_IPC_RMID, _IPC_STAT = 0, 2


def _remove_segment(key: int, shmid: int) -> None:
    """shmctl(IPC_RMID) on `shmid` if it still carries `key` (the id of a removed segment
    may have been handed to another since): the first field of `struct shmid_ds` is the key
    on Linux. Best effort: no libc, no segment, no permission leave things as they are."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)
        if libc.shmctl(shmid, _IPC_STAT, buf) != 0:
            return
        if struct.unpack_from("=i", buf.raw)[0] == key:
            libc.shmctl(shmid, _IPC_RMID, None)
    except (OSError, AttributeError):
        return


class PostgresServer(_Service):
    """A private PostgreSQL on a free loopback port, its data dir copied from the template.

    `fsync=on` always; `synchronous_commit` is a parameter ("off" lets a kill lose
    acknowledged commits, a fault of its own). Life cycle as `chaos.stack`'s services:
    `start`, `stop` (fast shutdown: SIGINT, then the temp dir goes), `kill` (SIGKILL of the
    postmaster and of every process it forked, waiting until all are gone), `restart` (same
    port and data: crash recovery from the WAL), `pause` / `resume` (SIGSTOP / SIGCONT of
    them all: stopping the postmaster alone leaves every open connection answering).

    Credentials are drawn per instance with `secrets` and never printed; `repr` shows none.
    Setup statements (`admin`, `execute`, `create_role`, ...) commit synchronously whatever
    `synchronous_commit` says, so they survive a kill.
    """

    kind = "postgres"

    def __init__(
        self,
        *,
        port: int | None = None,
        synchronous_commit: str = "on",
        shared_buffers: str = "16MB",
        max_connections: int = 100,
        settings: Mapping[str, str] | None = None,
        start_timeout: float = 30.0,
        bin_dir: str | os.PathLike[str] | None = None,
        tmp_root: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(port=port, start_timeout=start_timeout, tmp_root=tmp_root)
        found = Path(bin_dir) if bin_dir is not None else find_postgres_bin()
        if found is None or not _has_server(found):
            where = found if found is not None else f"PATH or {PG_BIN_GLOB}"
            raise StackError(f"postgres and initdb not found in {where}; {INSTALL_HINT}")
        self.bin_dir: Path = found
        self.synchronous_commit = synchronous_commit
        self.shared_buffers = shared_buffers
        self.max_connections = max_connections
        self.settings: dict[str, str] = dict(settings or {})
        self.superuser: str = SUPERUSER
        self._run_as: tuple[int, int] | None = None
        if os.geteuid() == 0:
            try:
                entry = pwd.getpwnam(PG_OS_USER)
            except KeyError:
                raise StackError(
                    f"initdb and postgres refuse root and there is no {PG_OS_USER!r} OS user; "
                    f"{INSTALL_HINT}, or run as another user"
                ) from None
            self._run_as = (entry.pw_uid, entry.pw_gid)
        self._passwords: dict[str, str] = {self.superuser: secrets.token_urlsafe(24)}
        self._password_set = False
        self._template_password: str | None = None  # until this instance's replaces it

    # -- paths and credentials

    @property
    def data_dir(self) -> Path | None:
        """The cluster's data dir (also its unix socket dir); None when not started."""
        return self._dir / "data" if self._dir is not None else None

    def password(self, user: str | None = None) -> str:
        """The password of the superuser (default) or of a role `create_role` made."""
        name = user or self.superuser
        if name not in self._passwords:
            raise KeyError(f"no password known for role {name!r}")
        return self._passwords[name]

    def url(
        self, user: str | None = None, password: str | None = None, database: str = "postgres"
    ) -> str:
        """postgresql://USER:PASSWORD@127.0.0.1:PORT/DATABASE (default: the superuser, with
        its password); a DSN for asyncpg and libpq. Holds a secret: do not print it."""
        name = user or self.superuser
        secret = password if password is not None else self.password(name)
        return (
            f"postgresql://{quote(name, safe='')}:{quote(secret, safe='')}"
            f"@{self.host}:{self.port}/{quote(database, safe='')}"
        )

    def connect_args(
        self, user: str | None = None, password: str | None = None, database: str = "postgres"
    ) -> dict[str, Any]:
        """Keywords for `asyncpg.connect(**...)`: TCP on 127.0.0.1, no TLS, no PG* variables
        or ~/.pgpass consulted."""
        name = user or self.superuser
        return {
            "host": self.host,
            "port": self.port,
            "user": name,
            "password": password if password is not None else self.password(name),
            "database": database,
            "ssl": False,
        }

    # -- setup as the superuser

    async def admin(self, database: str = "postgres", timeout: float = 10.0) -> asyncpg.Connection:
        """A superuser connection (the caller closes it); its commits are synchronous even
        when the server runs with `synchronous_commit=off`."""
        return await asyncpg.connect(
            **self.connect_args(database=database),
            timeout=timeout,
            server_settings={"synchronous_commit": "on"},
        )

    def execute(self, sql: str, *args: Any, database: str = "postgres") -> str:
        """Run one statement as the superuser (sync); its status, e.g. `CREATE TABLE`."""

        async def go() -> str:
            conn = await self.admin(database)
            try:
                return await conn.execute(sql, *args)
            finally:
                await conn.close()

        return _blocking(go)

    def fetch(self, sql: str, *args: Any, database: str = "postgres") -> list[asyncpg.Record]:
        """Run one query as the superuser (sync) and return its rows."""

        async def go() -> list[asyncpg.Record]:
            conn = await self.admin(database)
            try:
                return await conn.fetch(sql, *args)
            finally:
                await conn.close()

        return _blocking(go)

    def create_role(self, name: str, password: str | None = None, *, createdb: bool = False) -> str:
        """Create a login role that is neither superuser nor BYPASSRLS (row-level security
        applies to it) and return its password, drawn with `secrets` unless given."""
        secret = password if password is not None else secrets.token_urlsafe(24)
        options = "LOGIN NOSUPERUSER NOBYPASSRLS NOCREATEROLE NOREPLICATION"
        options += " CREATEDB" if createdb else " NOCREATEDB"
        self.execute(f"CREATE ROLE {_ident(name)} {options} PASSWORD '{scram_verifier(secret)}'")
        self._passwords[name] = secret
        return secret

    def create_database(self, name: str, owner: str | None = None) -> None:
        """Create a database (owned by `owner`, default the superuser)."""
        sql = f"CREATE DATABASE {_ident(name)}"
        if owner is not None:
            sql += f" OWNER {_ident(owner)}"
        self.execute(sql)

    # -- the command line

    def argv(self) -> list[str]:
        """`postgres -D data -p PORT -c ...`: the postmaster itself, not pg_ctl, so that its
        pid (and its children, by parent pid) are ours. `settings` come last, overriding."""
        data = self.data_dir
        assert data is not None
        params = {
            "listen_addresses": self.host,
            "unix_socket_directories": str(data),
            "unix_socket_permissions": "0700",
            "fsync": "on",
            "synchronous_commit": self.synchronous_commit,
            "shared_buffers": self.shared_buffers,
            "max_connections": str(self.max_connections),
            "logging_collector": "off",
            "log_destination": "stderr",
            **self.settings,
        }
        argv = [str(self.bin_dir / "postgres"), "-D", str(data), "-p", str(self.port)]
        for key, value in params.items():
            argv += ["-c", f"{key}={value}"]
        return argv

    # -- what _Service asks for

    def _popen_user(self) -> dict[str, Any]:
        if self._run_as is None:
            return {}
        uid, gid = self._run_as
        return {"user": uid, "group": gid, "extra_groups": []}

    def _server_env(self) -> dict[str, str]:
        """Marked like every stack process; PG* variables dropped, they would steer the tools."""
        return {k: v for k, v in self._env().items() if not k.startswith("PG")}

    def _chown(self, path: Path) -> None:
        if self._run_as is not None:
            os.chown(path, *self._run_as)

    def _launch(self) -> None:
        data = self.data_dir
        assert self._dir is not None and data is not None
        socket_path = data / f".s.PGSQL.{self.port}"
        if len(str(socket_path)) > _SOCKET_PATH_MAX:
            raise StackError(f"unix socket path too long ({socket_path}): use a shorter tmp_root")
        if not data.exists():
            try:
                template = self._template()
                self._chown(self._dir)
                self._run(["cp", "-a", "--reflink=auto", f"{template}/data", str(data)], "copy")
                self._template_password = (template / "superuser").read_text().strip()
            except OSError as exc:
                raise StackError(f"postgres: preparing {data} failed: {exc}") from exc
        self._spawn(self.argv(), "postgres.log", self._server_env(), **self._popen_user())

    def _ready(self) -> bool:
        return pg_accepting(self.host, self.port, self.superuser, timeout=0.5)

    def _wait_ready(self, began: float) -> None:
        super()._wait_ready(began)
        if not self._password_set:
            self._set_superuser_password(began)

    def _log_paths(self) -> list[Path]:
        return [self._dir / "postgres.log"] if self._dir is not None else []

    def pause(self) -> None:
        """SIGSTOP the postmaster, then every process it forked: open connections stop
        answering, and new ones wait in the listen backlog (a frozen VM)."""
        with self._lock:
            postmaster = self.pid
            if postmaster is None:
                return
            _signal_pid(postmaster, signal.SIGSTOP)
            _wait_stopped(postmaster)
            children = _descendants(postmaster)
            for pid in children:
                _signal_pid(pid, signal.SIGSTOP)
            for pid in children:
                _wait_stopped(pid)

    def resume(self) -> None:
        """SIGCONT every process of the server, the postmaster last."""
        with self._lock:
            postmaster = self.pid
            if postmaster is None:
                return
            for pid in _descendants(postmaster):
                _signal_pid(pid, signal.SIGCONT)
            _signal_pid(postmaster, signal.SIGCONT)

    def _terminate(self, timeout: float) -> None:
        """Fast shutdown (SIGINT): SIGTERM is PostgreSQL's smart shutdown, which waits for
        every client to disconnect. A paused server is resumed first, or it could not."""
        main = self._main()
        if main is None or main.poll() is not None:
            return
        self.resume()
        _signal_pid(main.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            main.wait(timeout)

    def _kill_all(self) -> None:
        """SIGKILL the postmaster and every process it forked, then wait until they are all
        gone: a restart before then fails on the old shared memory, still attached."""
        main = self._main()
        doomed: list[tuple[int, str]] = []
        if main is not None and main.poll() is None:
            _signal_pid(main.pid, signal.SIGSTOP)  # forks no more: its child list is final
            _wait_stopped(main.pid)
            doomed = [(pid, _owner_token(pid)) for pid in _descendants(main.pid)]
            for pid, _token in doomed:
                _signal_pid(pid, signal.SIGKILL)
        super()._kill_all()
        deadline = time.monotonic() + 10.0
        while left := [pid for pid, token in doomed if not _gone(pid, token)]:
            if time.monotonic() > deadline:
                raise StackError(f"postgres: processes {left} survived SIGKILL")
            time.sleep(0.005)

    def _cleanup(self) -> None:
        self._drop_shared_memory()
        super()._cleanup()
        self._password_set = False
        self._passwords = {self.superuser: self._passwords[self.superuser]}

    # -- helpers

    def _drop_shared_memory(self) -> None:
        """Remove the SysV segment a killed postmaster left (a restart would have reused and
        then removed it; a clean shutdown removes it and its `postmaster.pid`): without this,
        every instance killed and never restarted would leak one for good."""
        data = self.data_dir
        if data is None or self.alive:
            return
        try:
            lines = (data / "postmaster.pid").read_text().splitlines()
            key, shmid = (int(field) for field in lines[6].split())
        except (OSError, IndexError, ValueError):
            return
        _remove_segment(key, shmid)

    def _run(self, argv: list[str], what: str, cwd: Path | None = None) -> None:
        """A setup command (initdb, the copy) as the server's OS user, marked like the server
        so that a reaper finds it should this process die meanwhile."""
        try:
            result = subprocess.run(
                argv,
                cwd=cwd or self._dir,
                env=self._server_env(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=max(5.0, self.start_timeout),
                start_new_session=True,
                check=False,
                **self._popen_user(),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise StackError(f"postgres {what} failed: {exc}") from exc
        if result.returncode != 0:
            lines = [line for line in (result.stderr + result.stdout).splitlines() if line]
            raise StackError(
                f"postgres {what} failed (code {result.returncode}): {' | '.join(lines[-6:])}"
            )

    def _template(self) -> Path:
        """The template data dir for this PostgreSQL major version and user, made once."""
        root = Path(self._tmp_root) if self._tmp_root is not None else Path(tempfile.gettempdir())
        major = _major_version(self.bin_dir / "postgres")
        # Never of the form chaos-<kind>-<pid>_<start>-...: the reapers must leave it alone.
        name = f"chaos-pgtemplate-v{major}-{TEMPLATE_RECIPE}-u{os.getuid()}"
        template = root / name
        with _template_lock:
            if self._valid_template(template):
                return template
            tag = _owner_token().replace(":", "_")
            if template.exists() and not self._valid_template(template):
                # damaged (a complete one is renamed into place whole, so it is not one being
                # made): moved aside under a reapable name, then removed
                aside = Path(tempfile.mkdtemp(prefix=f"chaos-pgbuild-{tag}-", dir=root))
                with contextlib.suppress(OSError):
                    template.rename(aside / "old")
                shutil.rmtree(aside, ignore_errors=True)
            # Named like the services' temp dirs: a build whose owner dies is reaped.
            build = Path(tempfile.mkdtemp(prefix=f"chaos-pgbuild-{tag}-", dir=root))
            try:
                self._initdb(build)
                try:
                    build.rename(template)
                except OSError:
                    if not self._valid_template(template):  # not another run's, finished
                        raise
            finally:
                shutil.rmtree(build, ignore_errors=True)
        return template

    @staticmethod
    def _valid_template(template: Path) -> bool:
        return (template / "data" / "PG_VERSION").is_file() and (template / "superuser").is_file()

    def _initdb(self, build: Path) -> None:
        """initdb into build/data with scram-sha-256; the superuser's password goes through a
        private file (the template's own: each instance then sets one of its own)."""
        self._chown(build)
        pwfile = build / "superuser"
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(24) + "\n")
        self._chown(pwfile)
        argv = [
            str(self.bin_dir / "initdb"),
            "-D",
            str(build / "data"),
            "-U",
            self.superuser,
            "-A",
            "scram-sha-256",
            f"--pwfile={pwfile}",
            "--encoding=UTF8",
            "--locale=C",
            "--no-instructions",
        ]
        self._run(argv, "initdb", cwd=build)

    def _set_superuser_password(self, began: float) -> None:
        """Replace the template's superuser password by this instance's, committed
        synchronously (a kill right after must not bring the template's back)."""
        template_password = self._template_password
        if template_password is None:
            raise StackError("postgres: the template's superuser password is unknown")
        verifier = scram_verifier(self.password())
        timeout = max(2.0, began + self.start_timeout - time.monotonic())

        async def go() -> None:
            conn = await asyncpg.connect(
                **self.connect_args(password=template_password),
                timeout=timeout,
                server_settings={"synchronous_commit": "on"},
            )
            try:
                await conn.execute(f"ALTER ROLE {_ident(self.superuser)} PASSWORD '{verifier}'")
            finally:
                await conn.close()

        try:
            _blocking(go)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            raise StackError(
                f"postgres on {self.host}:{self.port}: setting the superuser password failed "
                f"({type(exc).__name__}); log: {_tail(self._log_paths())}"
            ) from exc
        self._password_set = True
        self._template_password = None
