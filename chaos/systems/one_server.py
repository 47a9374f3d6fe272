"""The services of a design whose durable memory is one server of the run's own (`temporal`:
its dev server; `dbos`: its PostgreSQL), which scenarios kill, stop, pause and restart by
the one name it has."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from chaos.systems.redis_rabbitmq.services import ServicesUnavailable, starting


@dataclass
class OneServerServices:
    """A design's subclass names the server's service, design, SDK and install hint, and
    how to find its binaries and make one."""

    server: Any = None  # the running server (PostgresServer, TemporalServer), or None

    DESIGN: ClassVar[str]
    SERVICE: ClassVar[str]  # the server's name as scenarios and faults say it
    SDK: ClassVar[str]  # the module the design's workers import
    INSTALL_HINT: ClassVar[str]
    WHAT: ClassVar[str]  # "its server": what a refusal to kill another service names

    @staticmethod
    def found() -> bool:
        """Whether the server's binaries are on this machine."""
        raise NotImplementedError

    @staticmethod
    def new() -> Any:
        """A server, not started yet (`start` starts it)."""
        raise NotImplementedError

    @property
    def killable(self) -> set[str]:
        return {self.SERVICE} if self.server is not None else set()

    @classmethod
    def own(cls, containers: bool = False) -> set[str]:
        return {cls.SERVICE}

    @classmethod
    def available(cls) -> str | None:
        """None when a live run can start here, else what is missing (one line)."""
        has_sdk = importlib.util.find_spec(cls.SDK) is not None
        return None if has_sdk and cls.found() else cls.INSTALL_HINT

    @classmethod
    def start(cls, containers: bool = False) -> Self:
        if containers:
            raise ServicesUnavailable(f"{cls.DESIGN} has no containers mode; use --mode live")
        if cls.available() is not None:
            raise ServicesUnavailable(cls.INSTALL_HINT)
        with starting() as started:
            server = started(cls.new())
        return cls(server=server)

    def service(self, name: str) -> Any:
        if name != self.SERVICE or self.server is None:
            raise ServicesUnavailable(f"cannot kill {name}: {self.DESIGN} has only {self.WHAT}")
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(graceful=False)
        self.server = None
