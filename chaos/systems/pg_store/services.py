"""The services a live `pg-store` run talks to: its own PostgreSQL (the store) and RabbitMQ.

PostgreSQL is always the run's own (`postgres.PostgresServer`: a private cluster, fsync on,
`scram-sha-256`), since scenarios kill it; the schema is migrated by its superuser and the
engine connects as a role that is neither a superuser nor BYPASSRLS, so row-level security
holds for it. RabbitMQ is the run's own node too, or the one `AMQP_URL` names (then a
fault that would kill it is refused before the run starts, as for `redis-rabbitmq`).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from chaos.systems.pg_store.postgres import PostgresServer, find_postgres_bin
from chaos.systems.redis_rabbitmq.services import (
    ServicesUnavailable,
    configure_broker,
    own_broker,
    probe_given,
    starting,
)
from chaos.systems.redis_rabbitmq.stack import RabbitNode, find_rabbitmq_server

INSTALL_HINT = (
    "needs PostgreSQL 15 (postgres, initdb) and rabbitmq-server on this machine "
    "(Debian: apt-get install postgresql rabbitmq-server)"
)
#: The engine's role and database on the run's PostgreSQL.
ENGINE_ROLE = "eai_engine"
DATABASE = "eai"


@dataclass
class PgServices:
    database_url: str  # the engine role's: holds its password, never printed
    amqp_url: str
    postgres: PostgresServer | None = None
    broker: RabbitNode | None = None

    def __repr__(self) -> str:  # the URL holds a password
        return f"PgServices(postgres={self.postgres!r}, broker={self.broker!r})"

    @property
    def killable(self) -> set[str]:
        return {n for n, s in (("postgres", self.postgres), ("broker", self.broker)) if s}

    @staticmethod
    def own(containers: bool = False) -> set[str]:
        """The services a run starts itself here (the broker: unless AMQP_URL names one)."""
        return {"postgres"} | ({"broker"} if containers or "AMQP_URL" not in os.environ else set())

    @classmethod
    def available(cls) -> str | None:
        """None when a live run can start here, else what is missing (one line)."""
        amqp_ok = "AMQP_URL" in os.environ or find_rabbitmq_server() is not None
        return None if find_postgres_bin() is not None and amqp_ok else INSTALL_HINT

    @classmethod
    def start(cls, containers: bool = False) -> PgServices:
        if containers:
            raise ServicesUnavailable("pg-store has no containers mode yet; use --mode live")
        amqp_url = os.environ.get("AMQP_URL")
        probe_given(None, amqp_url)  # before starting anything of our own
        with starting() as started:
            if find_postgres_bin() is None:
                raise ServicesUnavailable(INSTALL_HINT)
            postgres = started(PostgresServer())
            url = engine_database(postgres)
            broker, amqp_url = own_broker(amqp_url, started, INSTALL_HINT)
        return cls(database_url=url, amqp_url=amqp_url, postgres=postgres, broker=broker)

    def service(self, name: str) -> PostgresServer | RabbitNode:
        svc = self.postgres if name == "postgres" else self.broker
        if svc is None:
            raise ServicesUnavailable(f"cannot kill {name}: it is not this run's own instance")
        return svc

    def configure(self, consumer_timeout_s: float | None) -> None:
        """The broker's `consumer_timeout`, as `Services.configure`."""
        configure_broker(self.broker, consumer_timeout_s)

    def durability(self, synchronous_commit: bool, wal_writer_delay_ms: int) -> None:
        """How durable the engine's commits are for the next scenario (`postgres:`): the
        engine role's `synchronous_commit`, the server's `wal_writer_delay` (reloaded)."""
        assert self.postgres is not None
        mode = "on" if synchronous_commit else "off"
        self.postgres.execute(f"ALTER ROLE {ENGINE_ROLE} SET synchronous_commit = {mode}")
        self.postgres.execute(f"ALTER SYSTEM SET wal_writer_delay = {int(wal_writer_delay_ms)}")
        self.postgres.execute("SELECT pg_reload_conf()")

    def stop(self) -> None:
        for svc in (self.postgres, self.broker):
            if svc is not None:
                svc.stop(graceful=False)
        self.postgres = self.broker = None


def engine_database(postgres: PostgresServer) -> str:
    """The engine's database, migrated, and its role (granted, RLS holding for it); its URL."""
    from engine.runtime.pgstore import migrate

    password = postgres.create_role(ENGINE_ROLE)
    postgres.create_database(DATABASE)

    async def schema() -> None:
        conn = await postgres.admin(database=DATABASE)
        try:
            await migrate(conn, grant=[ENGINE_ROLE])
        finally:
            await conn.close()

    asyncio.run(schema())
    return postgres.url(ENGINE_ROLE, password, DATABASE)
