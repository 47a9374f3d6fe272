"""The services a live `dbos` run talks to: its own PostgreSQL, DBOS's system database.

The server is the run's own (`PostgresServer`: a private cluster, fsync on), since
scenarios kill and restart it: the workflows' rows, their steps' outputs, the queue and the
durable sleeps are this design's durable memory. Each run gets a system database of its own
on it (`DbosLive`), so that no run's workers recover another's workflows.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from chaos.systems.pg_store.postgres import PostgresServer, find_postgres_bin
from chaos.systems.redis_rabbitmq.services import ServicesUnavailable, starting

INSTALL_HINT = (
    "needs dbos (pip install -e '.[dbos]') and PostgreSQL 15 (postgres, initdb) on this machine"
)


@dataclass
class DbosServices:
    postgres: PostgresServer | None = None

    @property
    def killable(self) -> set[str]:
        return {"postgres"} if self.postgres is not None else set()

    @staticmethod
    def own(containers: bool = False) -> set[str]:
        return {"postgres"}

    @classmethod
    def available(cls) -> str | None:
        """None when a live run can start here, else what is missing (one line)."""
        has_sdk = importlib.util.find_spec("dbos") is not None
        return None if has_sdk and find_postgres_bin() is not None else INSTALL_HINT

    @classmethod
    def start(cls, containers: bool = False) -> DbosServices:
        if containers:
            raise ServicesUnavailable("dbos has no containers mode; use --mode live")
        if cls.available() is not None:
            raise ServicesUnavailable(INSTALL_HINT)
        with starting() as started:
            postgres = started(PostgresServer())
        return cls(postgres=postgres)

    def service(self, name: str) -> PostgresServer:
        if name != "postgres" or self.postgres is None:
            raise ServicesUnavailable(f"cannot kill {name}: dbos has only its PostgreSQL")
        return self.postgres

    def stop(self) -> None:
        if self.postgres is not None:
            self.postgres.stop(graceful=False)
        self.postgres = None
