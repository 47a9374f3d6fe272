"""The services a live `pg` run talks to: its own PostgreSQL, store and queue at once.

No broker: the work queue, the delayed retries, the forwards and the events are rows of the
same database (`engine.runtime.pgqueue`). PostgreSQL is the run's own, started, migrated and
granted as for `pg-store` (`chaos.systems.pg_store.services`).
"""

from __future__ import annotations

from chaos.systems.pg_store.postgres import PostgresServer, find_postgres_bin
from chaos.systems.pg_store.services import PgServices, engine_database
from chaos.systems.redis_rabbitmq.services import ServicesUnavailable, starting

INSTALL_HINT = (
    "needs PostgreSQL 15 (postgres, initdb) on this machine (Debian: apt-get install postgresql)"
)


class PgAloneServices(PgServices):
    """`PgServices` without a broker."""

    def __repr__(self) -> str:  # the URL holds a password
        return f"PgAloneServices(postgres={self.postgres!r})"

    @staticmethod
    def own(containers: bool = False) -> set[str]:
        return {"postgres"}

    @classmethod
    def available(cls) -> str | None:
        return None if find_postgres_bin() is not None else INSTALL_HINT

    @classmethod
    def start(cls, containers: bool = False) -> PgAloneServices:
        if containers:
            raise ServicesUnavailable("pg has no containers mode yet; use --mode live")
        with starting() as started:
            if find_postgres_bin() is None:
                raise ServicesUnavailable(INSTALL_HINT)
            postgres = started(PostgresServer())
            url = engine_database(postgres)
        return cls(database_url=url, amqp_url="", postgres=postgres)

    def configure(self, consumer_timeout_s: float | None) -> None:
        """Nothing: no broker (`broker:` settings are refused for this design)."""
