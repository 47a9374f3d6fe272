"""`python -m chaos`: SIGINT and SIGTERM are caught before anything heavy is imported.

Until `chaos.cli.main` installs its own handlers (its first line), nothing has been started,
so a signal in those first moments ends the process at once with one line and the usual
code (130 SIGINT, 143 SIGTERM) instead of a KeyboardInterrupt traceback from an import.
"""

import os
import signal
import sys


def _before_start(signum: int, _frame: object) -> None:
    """Only imports have run: there is nothing to stop, so leave without unwinding them."""
    name = signal.Signals(signum).name
    os.write(2, f"chaos: interrupted ({name}) before it started anything\n".encode())
    os._exit(128 + signum)


if __name__ == "__main__":
    for _sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_sig, _before_start)

    from chaos.cli import main

    sys.exit(main(exiting=True))
