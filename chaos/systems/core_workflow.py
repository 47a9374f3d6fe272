"""What the peers that run the engine's core as their own workflow share (`temporal`,
`dbos`): the job an evaluation starts with, and their worker processes.

A job is plain data (the workflow engines keep it in their histories): the plan as its file
spells it, the retry numbers, the fake agent's profile and the time scale, from which the
workflow rebuilds the same `engine.core.Evaluation` on every replay.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.plan import Plan
from engine.policy import RetryPolicy

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Job:
    """What a workflow is started with."""

    attempt_id: str
    plan: dict[str, Any]
    policy: dict[str, Any]
    agent: dict[str, Any]
    time_scale: float
    max_parallel: int = 4

    @classmethod
    def of(
        cls,
        attempt_id: str,
        plan: Plan,
        policy: RetryPolicy,
        agent: dict[str, Any],
        time_scale: float,
        max_parallel: int = 4,
    ) -> Job:
        numbers = {
            "immediate_retries": policy.immediate_retries,
            "max_attempts": policy.max_attempts,
            "tiers_ms": list(policy.tiers_ms),
            "jitter": policy.jitter,
            "jitter_buckets": policy.jitter_buckets,
            "seed": policy.seed,
        }
        return cls(attempt_id, plan.to_dict(), numbers, agent, time_scale, max_parallel)

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(**{**self.policy, "tiers_ms": tuple(self.policy["tiers_ms"])})


class ReadyProcess:
    """A worker process (`python -m MODULE ARGS`) in a session of its own, waited for by the
    line it prints once it serves (not for time); `kill` SIGKILLs its whole group."""

    def __init__(
        self, module: str, args: list[str], ready_line: str, env: dict[str, str] | None = None
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # blocks until it serves, or it died
        if ready_line not in line:
            self.kill()
            raise RuntimeError(f"{module} did not start (exit {self.proc.returncode}): {line!r}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
