"""`python -m chaos`: SIGINT and SIGTERM are caught before anything heavy is imported.

Until `chaos.cli.main` installs its own handlers (its first line), nothing has been started,
so a signal in those first moments ends the process at once with one line and the usual
code (130 SIGINT, 143 SIGTERM) instead of a KeyboardInterrupt traceback from an import.
"""

import os
import signal
import sys
from types import FrameType


def _before_start(signum: int, frame: FrameType | None) -> None:
    """Only imports have run: there is nothing to stop, so leave without unwinding them.
    A signal that interrupts this handler (Python runs them with none blocked) came second:
    the one being handled decides."""
    while frame is not None:
        if frame.f_code is _before_start.__code__:
            return
        frame = frame.f_back
    name = signal.Signals(signum).name
    os.write(2, f"chaos: interrupted ({name}) before it started anything\n".encode())
    os._exit(128 + signum)


if __name__ == "__main__":
    for _sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_sig, _before_start)

    from chaos.cli import main

    sys.exit(main(exiting=True))
