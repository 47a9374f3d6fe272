"""Interrupts and leftovers: SIGINT or SIGTERM at any moment of a run stops all it started.

Every case starts a real `python -m chaos` process with the signal dispositions of a
terminal (a background job of a non-interactive shell would inherit SIGINT ignored), waits
for an event of the run (its handlers installed, its own redis-server up, a worker up, the
history started, the check under way, the outputs being written, a pool process up), or a
delay drawn from a seeded RNG after one, and signals it. Then: the exit code is 130 or 143,
stderr is one line and no traceback, and no process carrying the run's owner mark, no temp
dir of its own and no port it listened on is left. A runner that is SIGKILLed instead leaves
its stack behind, and `python -m chaos clean` or the next `chaos run` reaps it.

No assertion is on wall-clock time and no signal races the end of a run: every moment is
one where the run still has seconds of work ahead (three scenarios, a long simulation, 2000
seeds). "Right after spawn" is the moment the process catches SIGTERM (`SigCgt`), i.e. the
first lines of `chaos/__main__.py` have run: before that only the interpreter's own
start-up has, and a signal there gets Python's default behaviour, whatever the program.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from chaos.stack import MARKER_ENV, OWNER_ENV, _marked_processes, owner_token, stop_owned
from chaos.systems.redis_rabbitmq.stack import find_epmd, find_rabbitmq_server, find_redis_server

pytestmark = pytest.mark.slow  # live runs interrupted: their own redis-server and RabbitMQ

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = "scenarios/crash_after_ack.yaml"
#: How long a test waits for an event that must come: only a broken harness uses it up.
PATIENCE_S = 120.0

needs_live = pytest.mark.skipif(
    find_redis_server() is None or find_rabbitmq_server() is None or find_epmd() is None,
    reason="redis-server or RabbitMQ/Erlang not installed",
)


def terminal_signals() -> None:
    """preexec_fn: SIGINT and SIGTERM at their defaults and unblocked, as under a terminal;
    a child of a background job would otherwise start with SIGINT ignored and never stop."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def started_run(
    args: list[str], history: Path, patience_s: float, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """`python -m chaos ARGS` started as under a terminal (`terminal_signals`, a session of
    its own), returned once its history has started: the run then has seconds to go, so a
    signal sent now lands mid-run. Event-driven; `patience_s` only stops a hang."""
    base = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "AMQP_URL")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "chaos", *args],
        cwd=Path(__file__).resolve().parents[1],
        env={**base, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=terminal_signals,
    )
    deadline = time.monotonic() + patience_s
    while not (history.exists() and b"run_started" in history.read_bytes()):
        if proc.poll() is not None:
            pytest.fail(f"the run ended before its history started: {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the run never started")
        time.sleep(0.02)
    return proc


# --- what a run owns ---------------------------------------------------------------------


def owned(token: str) -> list[tuple[int, dict[str, str]]]:
    """Live processes carrying the owner mark `token`, with their mark variables."""
    return [(pid, env) for pid, env in _marked_processes() if env.get(OWNER_ENV) == token]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def owned_dirs(token: str) -> list[Path]:
    """The temp dirs of the owner: named after it, or holding its `.owner`."""
    found = []
    for path in Path(tempfile.gettempdir()).glob("chaos-*-*"):
        try:
            mark = (path / ".owner").read_text().strip()
        except OSError:
            mark = ""
        if mark == token or f"-{token.replace(':', '_')}-" in path.name:
            found.append(path)
    return found


def listening_ports(pids: list[int]) -> set[int]:
    """TCP ports on which these processes listen (/proc/net/tcp inodes, matched to fds)."""
    inodes: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                inodes[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    ports = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                ports.add(inodes[target[8:-1]])
    return ports


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def handlers_installed(pid: int) -> bool:
    """Whether the process catches SIGTERM (`SigCgt`): `chaos/__main__.py` installs its
    handlers first thing. Earlier, only the interpreter's own start-up has run."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt"))
    return bool(int(caught, 16) >> (signal.SIGTERM - 1) & 1)


# --- a run under test ----------------------------------------------------------------------


@dataclass
class Run:
    """A `python -m chaos` process, what it owned while it ran, and how it ended."""

    proc: subprocess.Popen[bytes]
    token: str
    out: Path
    logs: Path
    ports: set[int] = field(default_factory=set)

    def look(self) -> list[tuple[int, dict[str, str]]]:
        """The run's marked processes now; their listening ports are remembered."""
        mine = owned(self.token)
        self.ports |= listening_ports([pid for pid, _ in mine])
        return mine

    def wait_for(self, what: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + PATIENCE_S
        while not ready():
            if self.proc.poll() is not None:
                pytest.fail(f"the run ended (code {self.proc.returncode}) before {what}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {PATIENCE_S:.0f} s")
            time.sleep(0.01)
        self.look()

    def finish(self) -> tuple[int, str]:
        code = self.proc.wait(PATIENCE_S)
        return code, (self.logs / "stderr").read_text()


def start(args: list[str], tmp_path: Path) -> Run:
    logs = tmp_path / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "AMQP_URL")}
    env.pop(MARKER_ENV, None)
    env.pop(OWNER_ENV, None)
    with open(logs / "stdout", "wb") as out, open(logs / "stderr", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "chaos", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
            preexec_fn=terminal_signals,
        )
    return Run(proc, owner_token(proc.pid), tmp_path / "out", logs)


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    """Every run a test started is SIGKILLed and reaped at teardown, whatever happened."""
    started: list[Run] = []
    yield started
    for run in started:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
        stop_owned(run.token)


def assert_interrupted(run: Run, sig: int) -> None:
    """The run ended on `sig` in one line, and nothing of it is left."""
    code, err = run.finish()
    lines = err.splitlines()
    assert code == 128 + sig, (code, err)
    assert "Traceback" not in err, err
    # Progress lines (a long `chaos sim` off a terminal) may come first; then one line.
    assert lines and "interrupted" in lines[-1], err
    assert signal.Signals(sig).name in lines[-1], err
    assert all(line.startswith("chaos") for line in lines), err
    assert sum("interrupted" in line for line in lines) == 1, err
    assert_nothing_left(run)


def assert_nothing_left(run: Run) -> None:
    left = owned(run.token)
    assert not left, [(pid, cmdline(pid)) for pid, _ in left]
    named = [pid for pid in _pids() if str(run.out) in cmdline(pid)]  # a worker's --history
    assert not named, [cmdline(pid) for pid in named]
    assert not owned_dirs(run.token)
    assert not [p for p in run.ports if not port_free(p)], run.ports


def _pids() -> list[int]:
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]


# --- the moments ---------------------------------------------------------------------------


def has_redis(run: Run) -> bool:
    return any("redis-server" in cmdline(pid) for pid, _ in run.look())


def has_worker(run: Run) -> bool:
    return any(env[MARKER_ENV].startswith("worker-") for _, env in run.look())


def has_pool(run: Run) -> bool:
    return any(env[MARKER_ENV].startswith("pool-") for _, env in run.look())


def spawned(run: Run) -> bool:
    return handlers_installed(run.proc.pid)


def history_has(needle: bytes) -> Callable[[Run], bool]:
    """The first scenario's history holds `needle`: the raw one while it runs, or the
    merged one once its outputs are written (the raw one is deleted then)."""

    def ready(run: Run) -> bool:
        for name in ("history.raw.jsonl", "history.jsonl"):
            path = run.out / "crash_after_ack" / name
            with contextlib.suppress(OSError):
                if needle in path.read_bytes():
                    return True
        return False

    return ready


def file_exists(relative: str) -> Callable[[Run], bool]:
    return lambda run: (run.out / relative).exists()


_rng = random.Random(7)
#: Live moments: (event, delay drawn after it). The scenario runs three times over, so at
#: each of them the run still has seconds of work ahead (the next scenario starts once the
#: previous one's outputs are written).
LIVE_MOMENTS: dict[str, tuple[Callable[[Run], bool], float]] = {
    "spawn": (spawned, 0.0),
    "redis-up": (has_redis, 0.0),
    "worker-up": (has_worker, 0.0),
    "history-started": (history_has(b'"run_started"'), 0.0),
    "checking": (history_has(b'"run_finished"'), 0.0),
    "writing-outputs": (file_exists("crash_after_ack/history.jsonl"), 0.0),
    "next-scenario": (file_exists("crash_after_ack/journal.json"), 0.0),
    "random-after-spawn": (spawned, round(_rng.uniform(0.0, 3.0), 3)),
    "random-after-worker": (has_worker, round(_rng.uniform(0.0, 2.0), 3)),
}
LIVE_CASES = [
    (moment, signal.SIGINT if i % 2 == 0 else signal.SIGTERM)
    for i, moment in enumerate(LIVE_MOMENTS)
]
LIVE_ARGS = ["run", SCENARIO, SCENARIO, SCENARIO, "--mode", "live", "--quiet", "--out"]


@needs_live
@pytest.mark.parametrize(("moment", "sig"), LIVE_CASES, ids=[m for m, _ in LIVE_CASES])
def test_live_run_interrupted(moment: str, sig: int, tmp_path: Path, runs: list[Run]) -> None:
    run = start([*LIVE_ARGS, str(tmp_path / "out")], tmp_path)
    runs.append(run)
    ready, delay = LIVE_MOMENTS[moment]
    run.wait_for(moment, lambda: ready(run))
    if delay:
        time.sleep(delay)
        run.look()
    run.proc.send_signal(sig)
    assert_interrupted(run, sig)


@needs_live
def test_signals_during_the_clean_up_change_nothing(tmp_path: Path, runs: list[Run]) -> None:
    """More SIGINTs and SIGTERMs while the run stops: the first one decides, no traceback."""
    run = start([*LIVE_ARGS, str(tmp_path / "out")], tmp_path)
    runs.append(run)
    run.wait_for("a worker", lambda: has_worker(run))
    run.proc.send_signal(signal.SIGINT)
    for i in range(2000):  # until it has exited (send_signal is a no-op then)
        if run.proc.poll() is not None:
            break
        run.proc.send_signal((signal.SIGTERM, signal.SIGINT)[i % 2])
        time.sleep(0.002)
    assert_interrupted(run, signal.SIGINT)


#: A SIGTERM that lands at the first instruction of the SIGINT's handler (a trace function
#: sends it there, where CPython checks for signals again): the interleaving the loop above
#: hits once in a while, made certain. `armed` off: the handler only notes the signal.
NESTED = """
import os, signal, sys
from chaos import cli
cli._catch_signals()
cli._Guard.armed = False
def tracer(frame, event, arg):
    if event == "call" and frame.f_code is cli._on_signal.__code__:
        if frame.f_locals["signum"] == signal.SIGINT:
            os.kill(os.getpid(), signal.SIGTERM)
sys.settrace(tracer)
signal.raise_signal(signal.SIGINT)
sys.settrace(None)
cli._Guard.watchdog.cancel()
print(signal.Signals(cli._Guard.signum).name)
"""


def test_a_signal_inside_the_first_ones_handler_does_not_decide() -> None:
    out = subprocess.run(
        [sys.executable, "-c", NESTED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=terminal_signals,  # CI's background job would hand SIGINT down ignored
    )
    assert (out.returncode, out.stdout.strip()) == (0, "SIGINT"), out.stderr


def long_simulation(tmp_path: Path) -> Path:
    """crash_after_ack with 2000 evaluations: seconds of simulation, on any machine."""
    data = yaml.safe_load((ROOT / SCENARIO).read_text())
    data["name"] = "long_simulation"
    data["plan"] = str((ROOT / SCENARIO).parent.joinpath(data["plan"]).resolve())
    data["evaluations"] = 2000
    path = tmp_path / "long_simulation.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


_sim_rng = random.Random(11)
#: Simulation moments: (event, delay drawn after it). The long simulation and 2000 seeds on
#: two processes leave seconds of work after each.
SIM_MOMENTS: dict[str, tuple[Callable[[Run], bool], float]] = {
    "spawn": (spawned, 0.0),
    "next-scenario": (file_exists("crash_after_ack/journal.json"), 0.0),
    "random-after-spawn": (spawned, round(_sim_rng.uniform(0.0, 1.0), 3)),
    "pool-up": (has_pool, 0.0),
    "random-after-pool": (has_pool, round(_sim_rng.uniform(0.0, 1.0), 3)),
}
SIM_CASES = [
    ("run-sim", "spawn", signal.SIGINT),
    ("run-sim", "next-scenario", signal.SIGTERM),
    ("run-sim", "random-after-spawn", signal.SIGINT),
    ("sim-seeds", "spawn", signal.SIGTERM),
    ("sim-seeds", "pool-up", signal.SIGINT),
    ("sim-seeds", "random-after-pool", signal.SIGTERM),
]


@pytest.mark.parametrize(
    ("command", "moment", "sig"), SIM_CASES, ids=[f"{c}-{m}" for c, m, _ in SIM_CASES]
)
def test_simulation_interrupted(
    command: str, moment: str, sig: int, tmp_path: Path, runs: list[Run]
) -> None:
    if command == "run-sim":
        scenarios = [SCENARIO, str(long_simulation(tmp_path))]
        args = ["run", *scenarios, "--mode", "sim", "--out", str(tmp_path / "out")]
    else:  # two pool processes whatever the machine: 2000 seeds take seconds
        args = ["sim", SCENARIO, "--seeds", "2000", "--jobs", "2"]
    run = start(args, tmp_path)
    runs.append(run)
    ready, delay = SIM_MOMENTS[moment]
    run.wait_for(moment, lambda: ready(run))
    if delay:
        time.sleep(delay)
        run.look()
    run.proc.send_signal(sig)
    assert_interrupted(run, sig)


# --- a runner that is SIGKILLed ------------------------------------------------------------


@needs_live
@pytest.mark.parametrize("reaper", ["clean", "next-run"])
def test_what_a_sigkilled_runner_left_is_reaped(
    reaper: str, tmp_path: Path, runs: list[Run]
) -> None:
    dead = start([*LIVE_ARGS, str(tmp_path / "a" / "out")], tmp_path / "a")
    runs.append(dead)
    dead.wait_for("a worker", lambda: has_worker(dead))
    dead.proc.kill()
    dead.proc.wait(PATIENCE_S)
    left = dead.look()  # atexit cannot run on SIGKILL: everything is still there
    assert any("redis-server" in cmdline(pid) for pid, _ in left)
    assert any(env[MARKER_ENV].startswith("worker-") for _, env in left)
    assert owned_dirs(dead.token)

    if reaper == "clean":
        env = {k: v for k, v in os.environ.items() if k not in (MARKER_ENV, OWNER_ENV)}
        out = subprocess.run(
            [sys.executable, "-m", "chaos", "clean"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=PATIENCE_S,
            check=False,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stderr == "" and out.stdout.count("\n") == 1, out.stdout + out.stderr
        assert out.stdout.startswith("chaos clean: stopped "), out.stdout
    else:  # the next live run reaps first thing, before its own services start
        (tmp_path / "b").mkdir()
        nxt = start([*LIVE_ARGS, str(tmp_path / "b" / "out")], tmp_path / "b")
        runs.append(nxt)
        nxt.wait_for("its own redis-server", lambda: has_redis(nxt))
        nxt.proc.send_signal(signal.SIGINT)
        assert_interrupted(nxt, signal.SIGINT)
    assert_nothing_left(dead)


def test_clean_says_what_it_removed_in_one_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "chaos", "clean"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=PATIENCE_S,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("chaos clean: stopped ") and out.stdout.count("\n") == 1
