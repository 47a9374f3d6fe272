"""The services a live `dbos` run talks to: its own PostgreSQL, DBOS's system database.

The server is the run's own (`PostgresServer`: a private cluster, fsync on), since
scenarios kill and restart it: the workflows' rows, their steps' outputs, the queue and the
durable sleeps are this design's durable memory. Each run gets a system database of its own
on it (`DbosLive`), so that no run's workers recover another's workflows.
"""

from __future__ import annotations

from dataclasses import dataclass

from chaos.systems.one_server import OneServerServices
from chaos.systems.pg_store.postgres import PostgresServer, find_postgres_bin


@dataclass
class DbosServices(OneServerServices):
    server: PostgresServer | None = None

    DESIGN = "dbos"
    SERVICE = "postgres"
    SDK = "dbos"
    INSTALL_HINT = (
        "needs dbos (pip install -e '.[dbos]') and PostgreSQL 15 (postgres, initdb) on this machine"
    )
    WHAT = "its PostgreSQL"

    @staticmethod
    def found() -> bool:
        return find_postgres_bin() is not None

    @staticmethod
    def new() -> PostgresServer:
        return PostgresServer()

    @property
    def postgres(self) -> PostgresServer | None:
        return self.server
