"""Throwaway Redis servers and RabbitMQ nodes that tests and the scenario runner may SIGKILL.

Why private instances: a chaos scenario kills and restarts the broker and the store, and the
shared services on 6379/5672 belong to everybody on this machine. Each instance here runs on
its own loopback ports, in its own temp dir, in its own session (process group), and every
process it spawns carries a unique marker in its environment, so a kill reaches the whole tree
(RabbitMQ's `erl_child_setup` and `inet_gethost` call setsid and escape the process group)
and no orphan outlives the test run.

The marker comes with an owner mark (OWNER_ENV: `pid:starttime` of the Python process that
started it), also carried by the harness's workers and simulator pools and written into the
name and `.owner` of each temp dir. When the owner is SIGKILLed, no atexit hook runs: the
next run, or `python -m chaos clean`, reaps what belongs to dead owners (`reap_dead_owners`),
an interrupted run sweeps what is its own (`stop_owned`), and a live owner's things are
never touched.

`start()` blocks until the service answers (a Redis PING, a full AMQP 0-9-1 handshake), with
plain sockets and no event loop, so it works from sync tests and, through
`asyncio.to_thread`, from the async runner.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

__all__ = [
    "MARKER_ENV",
    "OWNER_ENV",
    "RabbitNode",
    "Reaped",
    "RedisServer",
    "StackError",
    "amqp_handshake",
    "find_epmd",
    "find_rabbitmq_server",
    "find_redis_server",
    "free_port",
    "free_ports",
    "kill_owned",
    "marked_pids",
    "owner_token",
    "reap_dead_owners",
    "reap_orphans",
    "redis_ping",
    "stop_all",
    "stop_owned",
]

HOST = "127.0.0.1"

#: Environment variable set on every process this module starts; its value is per instance.
#: Children inherit it even when they leave the process group, which makes it the reliable
#: way to find (and kill) a whole service tree.
MARKER_ENV = "CHAOS_STACK_MARKER"
#: `pid:starttime` of the Python process that started the instance (see `reap_orphans`).
OWNER_ENV = "CHAOS_STACK_OWNER"

RABBITMQ_SBIN_DIRS = ("/usr/lib/rabbitmq/bin", "/usr/lib/rabbitmq/sbin")

_LOG_TAIL_LINES = 6
_LOG_TAIL_CHARS = 1200


class StackError(RuntimeError):
    """A service could not be started or stopped; the message is a single line."""

    def __init__(self, message: str) -> None:
        super().__init__(_one_line(message))


# --- ports ------------------------------------------------------------------------------------

_port_lock = threading.Lock()
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing source ports, which we avoid (see `free_ports`)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    """True when nothing listens on (or is bound to) 127.0.0.1:port right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """Reserve `count` distinct free loopback ports, never handed out twice by this process.

    Ports come from below the kernel's ephemeral range when possible: a port picked there
    can be taken as the source port of any outgoing connection (a client reconnecting
    during a chaos run) between a kill and the restart that must bind it again.
    """
    if count < 1:
        raise ValueError("count must be >= 1")
    low, _high = _ephemeral_range()
    lo, hi = 20000, low - 1
    picked: list[int] = []
    with _port_lock:
        if hi - lo > 1000:
            rng = random.Random()
            for _ in range(count * 200):
                if len(picked) == count:
                    break
                port = rng.randint(lo, hi)
                if port in _handed_out or port in picked or not _bindable(port):
                    continue
                picked.append(port)
        while len(picked) < count:  # fallback: let the kernel choose
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((HOST, 0))
                port = sock.getsockname()[1]
            if port not in _handed_out and port not in picked:
                picked.append(port)
        _handed_out.update(picked)
    return picked


def free_port() -> int:
    """One free loopback port (see `free_ports` for why it is not simply an ephemeral one)."""
    return free_ports(1)[0]


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


# --- process bookkeeping ------------------------------------------------------------------


def _read_proc(pid: int, name: str) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return None


def _proc_state(pid: int) -> tuple[str, str] | None:
    """(state letter, start time in clock ticks) of a process, or None when it is gone."""
    stat = _read_proc(pid, "stat")
    if stat is None:
        return None
    # Fields follow the parenthesised command name, which may itself contain ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    return fields[0].decode(), fields[19].decode()


def _is_zombie(pid: int) -> bool:
    state = _proc_state(pid)
    return state is None or state[0] in ("Z", "X")


def _owner_token(pid: int | None = None) -> str:
    """`pid:starttime` of a process: unlike a bare pid, never matches a recycled pid."""
    pid = os.getpid() if pid is None else pid
    state = _proc_state(pid)
    return f"{pid}:{state[1] if state else '?'}"


def owner_token(pid: int | None = None) -> str:
    """The OWNER_ENV value for processes started by `pid` (default: this process)."""
    return _owner_token(pid)


def _owner_alive(token: str) -> bool:
    """Whether the owner runs: a zombie owner (SIGKILLed, not yet waited for) is dead."""
    pid, _, _start = token.partition(":")
    return pid.isdigit() and _owner_token(int(pid)) == token and not _is_zombie(int(pid))


def _parent_of(pid: int) -> int | None:
    """Parent pid of a live (non-zombie) process, None when it is gone or a zombie."""
    stat = _read_proc(pid, "stat")
    if stat is None:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return None if fields[0] in (b"Z", b"X") else int(fields[1])


def _marked_processes() -> list[tuple[int, dict[str, str]]]:
    """(pid, our env vars) of every live process carrying MARKER_ENV, or descending from one.

    A /proc scan instead of psutil: no extra dependency, and it sees daemons that left the
    process group. Processes of other users are unreadable and therefore never matched.
    Descent covers children that erase their environment (PostgreSQL's backends overwrite
    theirs with a process title, and each leads a session of its own): the scan lists them
    while their marked parent lives, so one pass of SIGKILLs takes parent and children.
    """
    found: list[tuple[int, dict[str, str]]] = []
    unmarked: list[int] = []
    own = os.getpid()
    prefix = MARKER_ENV.encode() + b"="
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        environ = _read_proc(int(entry.name), "environ")
        if environ is None:
            continue
        if prefix not in environ:
            unmarked.append(int(entry.name))
            continue
        ours = {}
        for item in environ.split(b"\0"):
            key, sep, value = item.partition(b"=")
            if sep and key in (MARKER_ENV.encode(), OWNER_ENV.encode()):
                ours[key.decode()] = value.decode(errors="replace")
        if MARKER_ENV in ours and not _is_zombie(int(entry.name)):
            found.append((int(entry.name), ours))
    marks = dict(found)
    if marks:
        parents = {pid: _parent_of(pid) for pid in unmarked}
        while True:
            heirs = [p for p, parent in parents.items() if parent in marks and p not in marks]
            if not heirs:
                break
            for pid in heirs:
                marks[pid] = dict(marks[parents[pid]])
                found.append((pid, marks[pid]))
    return found


def marked_pids(marker: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries `MARKER_ENV=marker`."""
    return [pid for pid, env in _marked_processes() if env[MARKER_ENV] == marker]


@dataclass
class Reaped:
    """What a clean-up removed: killed pids, deleted temp dirs, and pids that would not die."""

    pids: list[int] = field(default_factory=list)
    dirs: list[Path] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)

    def summary(self) -> str:
        """One line for a human: `stopped 7 processes (pids ...), deleted 2 temp dirs`."""
        shown = " ".join(str(p) for p in self.pids[:12]) + (" ..." if len(self.pids) > 12 else "")
        text = (
            f"stopped {len(self.pids)} process{'es' if len(self.pids) != 1 else ''}"
            + (f" (pids {shown})" if self.pids else "")
            + f", deleted {len(self.dirs)} temp dir{'s' if len(self.dirs) != 1 else ''}"
        )
        if self.survivors:
            text += f"; still running: {' '.join(str(p) for p in self.survivors)}"
        return text


#: `chaos-<kind>-<pid>_<starttime>-<random>`: the owner is in the name from the first
#: instant, so a dir whose `.owner` was never written (a kill right after mkdtemp) is found too.
_DIR_NAME = re.compile(r"^chaos-[a-z]+-(\d+)_(\d+)-")


def _dir_owner(path: Path) -> str | None:
    """The owner token of a harness temp dir (its `.owner`, else its name), or None. An
    empty `.owner` is one being written: the name still says whose it is."""
    with contextlib.suppress(OSError):
        written = (path / ".owner").read_text().strip()
        if written:
            return written
    match = _DIR_NAME.match(path.name)
    return f"{match[1]}:{match[2]}" if match else None


def _dirs_where(keep: Callable[[str], bool]) -> list[Path]:
    """The harness temp dirs under the default temp root whose owner token `keep` selects."""
    found = []
    for path in Path(tempfile.gettempdir()).glob("chaos-*-*"):
        owner = _dir_owner(path) if path.is_dir() else None
        if owner is not None and keep(owner):
            found.append(path)
    return found


def _kill_where(keep: Callable[[str], bool], timeout: float) -> tuple[list[int], list[int]]:
    """SIGKILL marked processes whose owner token `keep` selects, until none is left or
    `timeout` passes; (every pid killed, the survivors)."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for p, env in _marked_processes() if keep(env.get(OWNER_ENV, ""))]
        if not pids or time.monotonic() > deadline:
            return killed, pids
        for pid in pids:
            _signal_pid(pid, signal.SIGKILL)
            if pid not in killed:
                killed.append(pid)
        time.sleep(0.02)


def _remove_dirs(dirs: list[Path]) -> list[Path]:
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)
    return [p for p in dirs if not p.exists()]


def kill_owned(token: str | None = None) -> list[int]:
    """SIGKILL, once and without waiting, every process `token` (default: this process)
    started; fast and lock-free, so a signal handler may call it before unwinding."""
    token = token or _owner_token()
    pids = [p for p, env in _marked_processes() if env.get(OWNER_ENV) == token]
    for pid in pids:
        _signal_pid(pid, signal.SIGKILL)
    return pids


def stop_owned(token: str | None = None, timeout: float = 10.0) -> Reaped:
    """Kill every process `token` (default: this process) started, whatever registry lost
    track of it, and delete its temp dirs: the last word of an interrupted run."""
    token = token or _owner_token()
    killed, survivors = _kill_where(lambda owner: owner == token, timeout)
    dirs = _remove_dirs(_dirs_where(lambda owner: owner == token))
    return Reaped(killed, dirs, survivors)


def reap_dead_owners(timeout: float = 10.0) -> Reaped:
    """Kill the processes and delete the temp dirs whose owning Python process died without
    cleaning up (SIGKILL: an OOM kill, a CI timeout), and say what went.

    Everything the harness starts (services, workers, simulator pools) carries MARKER_ENV
    and OWNER_ENV, so a /proc scan finds it even after it left its process group. Whatever
    belongs to a live owner (a parallel test run) is never touched.
    """
    killed, survivors = _kill_where(lambda owner: not _owner_alive(owner), timeout)
    dirs = _remove_dirs(_dirs_where(lambda owner: not _owner_alive(owner)))
    return Reaped(killed, dirs, survivors)


def reap_orphans() -> list[int]:
    """Kill instances whose owning Python process died without cleanup; return their pids.

    atexit does not run when the owner is SIGKILLed (a CI timeout, a chaos run killing its
    own runner by mistake): `chaos run` calls this at its start, `chaos clean` on demand.
    Instances of live owners (a parallel test run) are never touched. Temp dirs under the
    default temp root whose owner is dead are deleted too (see `reap_dead_owners`).
    """
    return reap_dead_owners().pids


def _signal_pid(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _kill_marked(marker: str, timeout: float = 5.0) -> list[int]:
    """SIGKILL every process carrying the marker until none is left; return the survivors."""
    deadline = time.monotonic() + timeout
    while True:
        pids = marked_pids(marker)
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            _signal_pid(pid, signal.SIGKILL)
        time.sleep(0.02)


def _tail(paths: Sequence[Path], lines: int = _LOG_TAIL_LINES) -> str:
    """The last non-blank lines of the first non-empty log, joined into one line.

    RabbitMQ's last lines are a long Erlang term; its "Error during startup" line, when there
    is one, names the cause in a few words, so it goes first.
    """
    for path in paths:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        text = _ANSI.sub("", text)
        kept = [_clip(line.strip()) for line in text.splitlines() if line.strip()]
        if not kept:
            continue
        picked = kept[-lines:]
        cause = next((line for line in kept if "Error during startup" in line), None)
        if cause is not None and cause not in picked:
            picked = [cause, "...", *picked[-(lines - 1) :]]
        joined = " | ".join(picked)
        return joined if len(joined) <= _LOG_TAIL_CHARS else "..." + joined[-_LOG_TAIL_CHARS:]
    return "(log empty)"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _clip(line: str, width: int = 240) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def _one_line(text: str) -> str:
    return " ".join(text.split())


_registry_lock = threading.Lock()
_registry: dict[int, _Service] = {}


def stop_all() -> None:
    """Kill every service this process started and delete their temp dirs (also at exit).

    A forked child inherits the registry and the atexit hook but not the services: it must
    leave its parent's instances alone.
    """
    with _registry_lock:
        services = [s for s in _registry.values() if s._owner_pid == os.getpid()]
    for service in services:
        with contextlib.suppress(Exception):
            service.stop(graceful=False)


atexit.register(stop_all)


# --- services -----------------------------------------------------------------------------


class _Service:
    """Shared life cycle: temp dir, marked processes in own sessions, registry, waits."""

    kind = "service"

    def __init__(
        self,
        *,
        port: int | None,
        start_timeout: float,
        tmp_root: str | os.PathLike[str] | None,
    ) -> None:
        self.port: int = port if port is not None else free_port()
        self.host: str = HOST
        self.start_timeout = start_timeout
        self.marker: str = uuid.uuid4().hex
        self.startup_seconds: float | None = None
        self._tmp_root = tmp_root
        self._dir: Path | None = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []
        self._lock = threading.RLock()
        self._owner_pid = os.getpid()

    # -- what subclasses provide

    def _launch(self) -> None:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def _log_paths(self) -> list[Path]:
        raise NotImplementedError

    def _main(self) -> subprocess.Popen[bytes] | None:
        """The process whose exit means the service died."""
        return self._procs[-1] if self._procs else None

    # -- public surface

    @property
    def dir(self) -> Path | None:
        """The instance's temp dir (data and logs); None before start and after stop."""
        return self._dir

    @property
    def pid(self) -> int | None:
        """Pid of the main process (leader of its own process group), None when not running."""
        main = self._main()
        return main.pid if main is not None and main.poll() is None else None

    @property
    def alive(self) -> bool:
        """True while the main process runs (it may still be booting)."""
        return self.pid is not None

    def start(self) -> Self:
        """Start and block until the service answers, or raise StackError (one line)."""
        with self._lock:
            if self.alive:
                return self
            fresh = self._dir is None
            if fresh:
                root = self._tmp_root
                tag = _owner_token().replace(":", "_")  # see _DIR_NAME
                prefix = f"chaos-{self.kind}-{tag}-"
                self._dir = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
                (self._dir / ".owner").write_text(_owner_token())
                with _registry_lock:
                    _registry[id(self)] = self
            began = time.monotonic()
            try:
                self._kill_all()  # remnants of a previous incarnation would hold the ports
                self._owner_pid = os.getpid()
                self._launch()
                self._wait_ready(began)
            except BaseException:
                with contextlib.suppress(StackError):
                    self._kill_all()
                if fresh:
                    self._cleanup()
                raise
            self.startup_seconds = time.monotonic() - began
            return self

    def kill(self) -> None:
        """SIGKILL the whole tree (a crash: no shutdown hook runs); keep data and ports."""
        with self._lock:
            self._kill_all()

    def terminate(self, timeout: float = 30.0) -> None:
        """Stop cleanly (SIGTERM, SIGKILL after `timeout`), keeping data and ports, as an
        operator's stop would: `restart` brings it back."""
        with self._lock:
            self.resume()
            self._terminate(timeout)
            self._kill_all()

    def pause(self) -> None:
        """SIGSTOP the whole tree: it stops answering with its sockets open (a frozen VM)."""
        with self._lock:
            if self.pid is not None:
                _signal_group(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        with self._lock:
            if self.pid is not None:
                _signal_group(self.pid, signal.SIGCONT)

    def restart(self, graceful: bool = False) -> Self:
        """Kill (or stop cleanly) if running, then start again on the same ports and data."""
        with self._lock:
            if self.alive:
                if graceful:
                    self._terminate(self.start_timeout)
                self._kill_all()
            return self.start()

    def stop(self, graceful: bool = True, timeout: float = 30.0) -> None:
        """Stop (SIGTERM, then SIGKILL after `timeout`), kill leftovers, delete the temp dir."""
        with self._lock:
            try:
                if graceful and self.alive:
                    self._terminate(timeout)
                self._kill_all()
            finally:
                self._cleanup()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.alive else "stopped"
        return f"<{type(self).__name__} {self.host}:{self.port} {state}>"

    # -- helpers

    def _env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env[MARKER_ENV] = self.marker
        env[OWNER_ENV] = _owner_token()
        if extra:
            env.update(extra)
        return env

    def _spawn(
        self, argv: Sequence[str], log_name: str, env: Mapping[str, str], **popen: Any
    ) -> None:
        """Run argv in its own session (so killpg reaches it), output into a log in the dir;
        `popen` adds Popen keywords (`user=`: a server that refuses to run as root)."""
        assert self._dir is not None
        log = (self._dir / log_name).open("ab")
        self._logs.append(log)
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self._dir,
            env=dict(env),
            start_new_session=True,
            **popen,
        )
        self._procs.append(proc)

    def _wait_ready(self, began: float) -> None:
        deadline = began + self.start_timeout
        while True:
            main = self._main()
            if main is None or main.poll() is not None:
                code = None if main is None else main.returncode
                raise StackError(
                    f"{self.kind} on {self.host}:{self.port} exited during startup "
                    f"(code {code}); log: {_tail(self._log_paths())}"
                )
            if self._ready():
                return
            if time.monotonic() > deadline:
                raise StackError(
                    f"{self.kind} on {self.host}:{self.port} not ready after "
                    f"{self.start_timeout:.0f}s; log: {_tail(self._log_paths())}"
                )
            time.sleep(0.05)

    def _terminate(self, timeout: float) -> None:
        main = self._main()
        if main is None or main.poll() is not None:
            return
        _signal_pid(main.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            main.wait(timeout)

    def _kill_all(self) -> None:
        for proc in self._procs:
            _signal_group(proc.pid, signal.SIGKILL)
        survivors = _kill_marked(self.marker)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5.0)  # reap our direct children: no zombies of ours
        for log in self._logs:
            with contextlib.suppress(OSError):
                log.close()
        self._procs.clear()
        self._logs.clear()
        if survivors:
            raise StackError(f"{self.kind}: processes {survivors} survived SIGKILL")

    def _cleanup(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        with _registry_lock:
            _registry.pop(id(self), None)


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
