"""Worker processes of the live engine, started, killed and reaped by the harness.

Each worker is `python -m engine.worker` in its own session (process group), so a SIGKILL
reaches everything it started and nothing outlives the harness: `stop_all()` runs at exit.
atexit does not run when the harness itself is SIGKILLed, so each worker also carries the
stack's marker and owner variables (`chaos.stack.MARKER_ENV`, `OWNER_ENV`): the next run, or
`python -m chaos clean`, finds and reaps the workers of a dead harness like its services.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from chaos.stack import MARKER_ENV, OWNER_ENV, owner_token

_LIVE: set[WorkerProcess] = set()


class WorkerProcess:
    def __init__(
        self,
        args: Sequence[str],
        env: Mapping[str, str] | None = None,
        log_path: str | Path | None = None,
        name: str = "worker",
        module: Sequence[str] = ("engine.worker",),
        cwd: str | Path | None = None,
    ) -> None:
        self.module = list(module)  # e.g. ("chaos.mutants", "no_sweeper") for a mutant
        self.cwd = cwd  # another checkout's engine (`python -m` imports from the cwd first)
        self.args = list(args)
        self.env = dict(env or {})
        self.log_path = Path(log_path) if log_path else None
        self.name = name
        self.marker = f"worker-{uuid.uuid4().hex}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0  # where this process's lines start in a log shared with others

    def start(self) -> WorkerProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINE_")}
        env.update(self.env)
        env[MARKER_ENV] = self.marker  # found by a /proc scan even if this process dies
        env[OWNER_ENV] = owner_token()
        if self.log_path is not None and self.log_path.exists():
            self._log_offset = self.log_path.stat().st_size
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", *self.module, *self.args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.cwd,
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        _LIVE.add(self)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def is_ready(self) -> bool:
        """Whether this process has logged that it is ready (no waiting)."""
        if self.log_path is None or not self.log_path.exists():
            return False
        with open(self.log_path, "rb") as fh:
            fh.seek(self._log_offset)
            return b" ready: " in fh.read()

    def kill(self) -> None:
        """SIGKILL the worker's whole process group, as a crash would."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        _LIVE.discard(self)

    def pause(self) -> None:
        """SIGSTOP the worker's process group: everything in it stops, timers included."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT: the paused worker goes on where it stopped, every timer overdue."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGCONT)

    def terminate(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it does not stop in time (a paused worker is woken to
        hear the SIGTERM)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                os.killpg(self.proc.pid, signal.SIGCONT)
                self.proc.wait(timeout)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def wait_exit(self, timeout: float) -> int:
        """Wait for the worker to die on its own (a crash failpoint)."""
        assert self.proc is not None
        code = self.proc.wait(timeout)
        _LIVE.discard(self)
        return code

    def wait_for_log(self, needle: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.log_path and self.log_path.exists() and needle in self.log_path.read_text():
                return True
            if not self.alive:
                return False
            time.sleep(0.02)
        return False


def stop_all() -> None:
    for worker in list(_LIVE):
        worker.kill()


atexit.register(stop_all)
