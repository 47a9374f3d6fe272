"""`redis-rabbitmq`'s private services: a throwaway `redis-server` and RabbitMQ node that
tests and the scenario runner may SIGKILL, on the harness's private-process machinery
(`chaos.stack`: free ports, owner marks, reaping).

`start()` blocks until the service answers (a Redis PING, a full AMQP 0-9-1 handshake), with
plain sockets and no event loop, so it works from sync tests and, through
`asyncio.to_thread`, from the async runner.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from chaos.stack import (
    MARKER_ENV,
    OWNER_ENV,
    StackError,
    _is_zombie,
    _owner_token,
    _Service,
    _tail,
    free_ports,
)

RABBITMQ_SBIN_DIRS = ("/usr/lib/rabbitmq/bin", "/usr/lib/rabbitmq/sbin")


# --- binaries ---------------------------------------------------------------------------------


def _executable(path: str | os.PathLike[str]) -> str | None:
    p = Path(path)
    return str(p) if p.is_file() and os.access(p, os.X_OK) else None


def find_redis_server() -> str | None:
    """Path of `redis-server` on PATH, or None: tests skip rather than fail without it."""
    return shutil.which("redis-server")


def _is_su_wrapper(path: str) -> bool:
    """Debian's /usr/sbin/rabbitmq-* are a wrapper that `su`s to the `rabbitmq` user and, for
    the server, writes /var/log/rabbitmq/startup_log: run as root it would boot our node as
    another user (EACCES on our temp dir) and touch the shared node's files."""
    if Path(path).resolve().name == "rabbitmq-script-wrapper":
        return True
    try:
        with open(path, "rb") as fh:
            return b"su rabbitmq" in fh.read(8192)
    except OSError:
        return False


def _find_rabbitmq_script(name: str) -> str | None:
    """`name` from PATH unless it is the su wrapper, then from the RabbitMQ bin dirs."""
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    for directory in [*dirs, *RABBITMQ_SBIN_DIRS]:
        found = _executable(Path(directory) / name)
        if found and not _is_su_wrapper(found):
            return found
    return None


def find_rabbitmq_server() -> str | None:
    """Path of the real `rabbitmq-server` script (PATH, then /usr/lib/rabbitmq/bin), or None."""
    return _find_rabbitmq_script("rabbitmq-server")


def find_epmd() -> str | None:
    """Path of Erlang's `epmd`: we run a private one per node, so a kill takes it too."""
    found = shutil.which("epmd")
    if found:
        return found
    for candidate in sorted(Path("/usr/lib/erlang").glob("erts-*/bin/epmd"), reverse=True):
        found = _executable(candidate)
        if found:
            return found
    return None


def _rabbitmqctl_for(server: str) -> str | None:
    """`rabbitmqctl` next to the server script, so both come from the same installation."""
    found = _executable(Path(server).parent / "rabbitmqctl")
    if found and not _is_su_wrapper(found):
        return found
    return _find_rabbitmq_script("rabbitmqctl")


# --- probes -----------------------------------------------------------------------------------


def redis_ping(host: str, port: int, timeout: float = 1.0) -> bool:
    """True when Redis answers PING with PONG (not LOADING): it serves data then."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
    except OSError:
        return False
    return reply.startswith(b"+PONG")


_FRAME_METHOD = 1
_FRAME_END = 0xCE


def _shortstr(value: bytes) -> bytes:
    return struct.pack(">B", len(value)) + value


def _longstr(value: bytes) -> bytes:
    return struct.pack(">I", len(value)) + value


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("server closed the connection during the AMQP handshake")
        data.extend(chunk)
    return bytes(data)


def _recv_method(sock: socket.socket) -> tuple[int, int, bytes]:
    """Next method frame on channel 0 as (class_id, method_id, arguments); skips heartbeats."""
    while True:
        header = _recv_exact(sock, 7)
        if header.startswith(b"AMQP"):
            raise ConnectionError(f"server rejected protocol header: {header!r}")
        frame_type, _channel, size = struct.unpack(">BHI", header)
        payload = _recv_exact(sock, size)
        if _recv_exact(sock, 1)[0] != _FRAME_END:
            raise ConnectionError("malformed AMQP frame")
        if frame_type != _FRAME_METHOD:
            continue
        class_id, method_id = struct.unpack(">HH", payload[:4])
        args = payload[4:]
        if (class_id, method_id) == (10, 50):  # connection.close from the server
            code = struct.unpack(">H", args[:2])[0]
            text = args[3 : 3 + args[2]].decode(errors="replace")
            raise ConnectionError(f"server closed the connection: {code} {text}")
        return class_id, method_id, args


def _send_method(sock: socket.socket, class_id: int, method_id: int, args: bytes) -> None:
    payload = struct.pack(">HH", class_id, method_id) + args
    sock.sendall(
        struct.pack(">BHI", _FRAME_METHOD, 0, len(payload)) + payload + bytes([_FRAME_END])
    )


def _expect(sock: socket.socket, class_id: int, method_id: int) -> bytes:
    got_class, got_method, args = _recv_method(sock)
    if (got_class, got_method) != (class_id, method_id):
        raise ConnectionError(
            f"expected AMQP method {class_id}.{method_id}, got {got_class}.{got_method}"
        )
    return args


def amqp_handshake(
    host: str,
    port: int,
    user: str = "guest",
    password: str = "guest",
    vhost: str = "/",
    timeout: float = 2.0,
) -> None:
    """Open and close one AMQP 0-9-1 connection (PLAIN auth, vhost open); raise on failure.

    Why not aio-pika: this runs from sync code and from inside a running event loop alike, and
    an open TCP port is not enough (the listener may accept before auth and vhosts are ready).
    """
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(b"AMQP\x00\x00\x09\x01")
        _expect(sock, 10, 10)  # connection.start
        response = b"\x00" + user.encode() + b"\x00" + password.encode()
        start_ok = (
            struct.pack(">I", 0)  # empty client-properties table
            + _shortstr(b"PLAIN")
            + _longstr(response)
            + _shortstr(b"en_US")
        )
        _send_method(sock, 10, 11, start_ok)
        tune = _expect(sock, 10, 30)
        channel_max, frame_max, _heartbeat = struct.unpack(">HIH", tune[:8])
        _send_method(sock, 10, 31, struct.pack(">HIH", channel_max, frame_max, 0))
        _send_method(sock, 10, 40, _shortstr(vhost.encode()) + _shortstr(b"") + b"\x00")
        _expect(sock, 10, 41)  # connection.open-ok
        _send_method(sock, 10, 50, struct.pack(">H", 200) + _shortstr(b"probe") + b"\0" * 4)
        with contextlib.suppress(OSError):
            _expect(sock, 10, 51)  # connection.close-ok


class RedisServer(_Service):
    """A private `redis-server` on a free loopback port, its data in a temp dir.

    With `persistence=True` it writes an AOF with `appendfsync always`, so a SIGKILLed and
    restarted server still holds every acknowledged write (the engine's Redis state must
    survive a store crash in those scenarios); without it a restart comes back empty.
    """

    kind = "redis"

    def __init__(
        self,
        *,
        persistence: bool = False,
        port: int | None = None,
        start_timeout: float = 10.0,
        extra_args: Sequence[str] = (),
        binary: str | None = None,
        tmp_root: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(port=port, start_timeout=start_timeout, tmp_root=tmp_root)
        found = binary or find_redis_server()
        if found is None:
            raise StackError("redis-server not found on PATH")
        self.binary: str = found
        self.persistence = persistence
        self.extra_args: tuple[str, ...] = tuple(extra_args)

    @property
    def url(self) -> str:
        """redis://127.0.0.1:PORT/0, for redis-py and the engine's REDIS_URL."""
        return f"redis://{self.host}:{self.port}/0"

    def argv(self) -> list[str]:
        """The command line; `--save ""` keeps RDB snapshots out of the persistence story.

        `extra_args` come last and may override anything, but not `--set-proc-title yes`:
        that would hide the process from the leftover checks.
        """
        assert self._dir is not None
        argv = [
            self.binary,
            "--bind",
            self.host,
            "--port",
            str(self.port),
            "--dir",
            str(self._dir),
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            "",
            # Redis's proc-title code reuses the memory behind /proc/PID/environ, which would
            # erase the marker that `marked_pids` and `reap_orphans` look for.
            "--set-proc-title",
            "no",
        ]
        if self.persistence:
            argv += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            argv += ["--appendonly", "no"]
        return argv + list(self.extra_args)

    def _launch(self) -> None:
        self._spawn(self.argv(), "redis.log", self._env())

    def _ready(self) -> bool:
        return redis_ping(self.host, self.port, timeout=0.5)

    def _log_paths(self) -> list[Path]:
        return [self._dir / "redis.log"] if self._dir is not None else []


_RABBIT_CONFIG = """\
listeners.tcp.default = {host}:{port}
loopback_users = none
default_user = guest
default_pass = guest
log.file.level = info
"""


def _tick_ms(timeout_ms: int) -> int:
    """A channel checks its deliveries' age on its tick, every `channel_tick_interval` (a
    minute by default): for a short `consumer_timeout` to mean anything, the tick must be a
    fraction of it."""
    return max(50, min(60_000, timeout_ms // 4))


def _consumer_tick(timeout_ms: int) -> str:
    """advanced.config setting the tick for `consumer_timeout = timeout_ms`."""
    return f"[{{rabbit, [{{channel_tick_interval, {_tick_ms(timeout_ms)}}}]}}].\n"


class RabbitNode(_Service):
    """A private RabbitMQ node (AMQP, Erlang distribution and epmd all on private ports).

    Everything that would otherwise come from /etc/rabbitmq or /var/lib/rabbitmq (env conf,
    config, plugins, mnesia, logs, Erlang cookie via HOME) points into the temp dir, so the
    node cannot disturb the shared one. `kill()` SIGKILLs the node tree and its epmd;
    `restart()` reuses the node name, ports and mnesia dir, so durable queues and persistent
    messages survive. Startup takes several seconds: call `start()` via `asyncio.to_thread`
    from async code.
    """

    kind = "rabbit"

    def __init__(
        self,
        *,
        port: int | None = None,
        dist_port: int | None = None,
        epmd_port: int | None = None,
        node_name: str | None = None,
        start_timeout: float = 60.0,
        extra_config: str = "",
        consumer_timeout_ms: int | None = None,
        binary: str | None = None,
        epmd: str | None = None,
        tmp_root: str | os.PathLike[str] | None = None,
    ) -> None:
        wanted = [p for p in (port, dist_port, epmd_port) if p is None]
        spare = iter(free_ports(len(wanted))) if wanted else iter(())
        super().__init__(
            port=port if port is not None else next(spare),
            start_timeout=start_timeout,
            tmp_root=tmp_root,
        )
        self.dist_port: int = dist_port if dist_port is not None else next(spare)
        self.epmd_port: int = epmd_port if epmd_port is not None else next(spare)
        found = binary or find_rabbitmq_server()
        if found is None:
            raise StackError("rabbitmq-server not found (PATH, /usr/lib/rabbitmq/bin)")
        self.binary: str = found
        epmd = epmd or find_epmd()
        if epmd is None:
            raise StackError("epmd not found (PATH, /usr/lib/erlang/erts-*/bin)")
        self.epmd_binary: str = epmd
        self.node_name: str = node_name or f"chaos_{self.marker[:12]}@localhost"
        self.extra_config = extra_config
        self.consumer_timeout_ms = consumer_timeout_ms
        self._epmd: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """amqp://guest:guest@127.0.0.1:PORT/, for aio-pika and the engine's AMQP_URL."""
        return f"amqp://guest:guest@{self.host}:{self.port}/"

    @property
    def beam_pid(self) -> int | None:
        """OS pid of the Erlang VM (from the node's pid file), None when not running."""
        if self._dir is None or not self.alive:
            return None
        try:
            pid = int((self._dir / "rabbit.pid").read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if not _is_zombie(pid) else None

    def node_env(self) -> dict[str, str]:
        """The environment that pins every RabbitMQ/Erlang path and port to this node.

        Inherited RABBITMQ_* / ERL_* variables are dropped first, and RABBITMQ_CONF_ENV_FILE
        points at an empty file: /etc/rabbitmq/rabbitmq-env.conf would otherwise set
        NODENAME=rabbit@localhost, the shared node's name.
        """
        assert self._dir is not None
        d = self._dir
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("RABBITMQ_", "ERL_")) and k not in ("NODENAME", "CONFIG_FILE")
        }
        env.update(
            {
                MARKER_ENV: self.marker,
                OWNER_ENV: _owner_token(),
                "HOME": str(d),  # private .erlang.cookie
                "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
                "RABBITMQ_NODENAME": self.node_name,
                "RABBITMQ_NODE_IP_ADDRESS": self.host,
                "RABBITMQ_NODE_PORT": str(self.port),
                "RABBITMQ_DIST_PORT": str(self.dist_port),
                "ERL_EPMD_PORT": str(self.epmd_port),
                "ERL_EPMD_ADDRESS": self.host,
                "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
                "RABBITMQ_CONFIG_FILES": str(d / "conf.d"),
                "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
                "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
                "RABBITMQ_LOG_BASE": str(d / "log"),
                "RABBITMQ_PID_FILE": str(d / "rabbit.pid"),
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": (
                    "-kernel inet_dist_use_interface {127,0,0,1}"
                ),
                "ERL_CRASH_DUMP_SECONDS": "0",
            }
        )
        return env

    def _write_files(self) -> None:
        assert self._dir is not None
        d = self._dir
        (d / "conf.d").mkdir(exist_ok=True)
        (d / "log").mkdir(exist_ok=True)
        (d / "rabbitmq-env.conf").write_text("")
        (d / "enabled_plugins").write_text("[].\n")
        config = _RABBIT_CONFIG.format(host=self.host, port=self.port)
        timeout = self.consumer_timeout_ms
        if timeout is not None:
            config += f"consumer_timeout = {timeout}\n"
            (d / "advanced.config").write_text(_consumer_tick(timeout))
        else:
            (d / "advanced.config").unlink(missing_ok=True)
        (d / "rabbitmq.conf").write_text(config + self.extra_config)

    def _main(self) -> subprocess.Popen[bytes] | None:
        for proc in self._procs:
            if proc is not self._epmd:
                return proc
        return None

    def _launch(self) -> None:
        self._write_files()
        env = self.node_env()
        epmd_argv = [self.epmd_binary, "-port", str(self.epmd_port), "-address", self.host]
        self._spawn(epmd_argv, "epmd.log", env)
        self._epmd = self._procs[-1]
        self._wait_epmd()
        self._spawn([self.binary], "console.log", env)

    def _wait_epmd(self, timeout: float = 5.0) -> None:
        """Our epmd must listen before the node boots, or the VM would spawn a daemon one."""
        deadline = time.monotonic() + timeout
        while True:
            assert self._epmd is not None
            if self._epmd.poll() is not None:
                raise StackError(
                    f"epmd on {self.host}:{self.epmd_port} exited (code "
                    f"{self._epmd.returncode}); log: {_tail(self._log_paths()[-1:])}"
                )
            try:
                with socket.create_connection((self.host, self.epmd_port), timeout=0.5):
                    return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise StackError(
                        f"epmd on {self.host}:{self.epmd_port} not listening: {exc}"
                    ) from exc
            time.sleep(0.02)

    def _ready(self) -> bool:
        try:
            amqp_handshake(self.host, self.port, timeout=2.0)
        except (OSError, ValueError, struct.error):
            return False
        return True

    def _log_paths(self) -> list[Path]:
        if self._dir is None:
            return []
        d = self._dir
        return [d / "console.log", d / "log" / f"{self.node_name}.log", d / "epmd.log"]

    def _kill_all(self) -> None:
        self._epmd = None
        super()._kill_all()

    def set_consumer_timeout(self, timeout_ms: int | None) -> None:
        """Change `consumer_timeout` (None: RabbitMQ's default) for channels opened from now
        on, without a restart (about a second: one `rabbitmqctl eval`); a restart keeps it."""
        if timeout_ms == self.consumer_timeout_ms:
            return
        self.consumer_timeout_ms = timeout_ms
        if self.alive:
            value = 1_800_000 if timeout_ms is None else timeout_ms
            tick = 60_000 if timeout_ms is None else _tick_ms(timeout_ms)
            self.ctl(
                "eval",
                f"application:set_env(rabbit, consumer_timeout, {value}), "
                f"application:set_env(rabbit, channel_tick_interval, {tick}).",
            )

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """Run `rabbitmqctl -n NODE args...` against this node and return its stdout.

        Slow (an Erlang VM boots per call, about 1-2 s); meant for inspection in scenarios.
        """
        if self._dir is None:
            raise StackError(f"rabbit node {self.node_name} is not started")
        ctl = _rabbitmqctl_for(self.binary)
        if ctl is None:
            raise StackError("rabbitmqctl not found next to rabbitmq-server")
        result = subprocess.run(
            [ctl, "-n", self.node_name, *args],
            env=self.node_env(),
            cwd=self._dir,
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,
            check=False,
        )
        if result.returncode != 0:
            raise StackError(
                f"rabbitmqctl {' '.join(args)} failed ({result.returncode}): "
                f"{result.stderr or result.stdout}"
            )
        return result.stdout
