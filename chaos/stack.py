"""Private services that tests and the scenario runner may SIGKILL: the machinery every
system under test's services share (`chaos.systems`: a private Redis and RabbitMQ, a
private PostgreSQL), and the reapers of what a killed run left.

Why private instances: a chaos scenario kills and restarts the broker and the store, and the
shared services on 6379/5672/5432 belong to everybody on this machine. Each instance runs
on its own loopback ports, in its own temp dir, in its own session (process group), and
every process it spawns carries a unique marker in its environment, so a kill reaches the
whole tree (RabbitMQ's `erl_child_setup` and `inet_gethost` call setsid and escape the
process group; PostgreSQL's children do too, and overwrite their environment: they are
found by parent pid) and no orphan outlives the test run.

The marker comes with an owner mark (OWNER_ENV: `pid:starttime` of the Python process that
started it), also carried by the harness's workers and simulator pools and written into the
name and `.owner` of each temp dir. When the owner is SIGKILLed, no atexit hook runs: the
next run, or `python -m chaos clean`, reaps what belongs to dead owners (`reap_dead_owners`),
an interrupted run sweeps what is its own (`stop_owned`), and a live owner's things are
never touched.

A service's `start()` blocks until it answers, with plain sockets and no event loop, so it
works from sync tests and, through `asyncio.to_thread`, from the async runner.
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
    "Reaped",
    "StackError",
    "free_port",
    "free_ports",
    "kill_owned",
    "marked_pids",
    "owner_token",
    "reap_dead_owners",
    "reap_orphans",
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
