"""Processes of ours that must not outlive the one that started them (a pool's, a forked
checker's): Linux's `PR_SET_PDEATHSIG`, so that a parent killed outright (SIGKILL, or a
SIGTERM it does not catch) leaves nothing behind computing for nobody."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux; elsewhere nothing), and exit now if
    `parent` died already (before the line that asked)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)
