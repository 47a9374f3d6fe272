"""A private PostgreSQL primary and its streaming standby, for the `pg` design's failover fault.

Why: "failover to a standby" is the `pg` design's answer to a dead store, and it has a price
the scenarios must measure: with asynchronous replication (PostgreSQL's default) a commit
the primary acknowledged may not have reached the standby when the primary dies, and is
lost on promotion; with `synchronous_commit = remote_apply` and the standby named in
`synchronous_standby_names` (the mitigation) none is, at the cost of a round trip per commit.

Both nodes are `PostgresServer`s (a subclass each, reusing its life cycle, credentials,
kills and reaping): the primary is copied from the template as usual; the standby's data dir
is made by `pg_basebackup -R` from the running primary (as the `postgres` OS user, like
initdb), through a replication role that pg_hba admits from 127.0.0.1 only. Each node lives
in its own temp dir, on its own free loopback port, marked with the stack's owner variables,
so `chaos clean` / `stop_owned` reap both after their owner died.

On loopback the standby keeps up, so a plain kill of the primary loses next to nothing: the
loss is made reliable as Sentinel's scenarios make it, by cutting the standby off first.
`pause_replication` empties its `primary_conninfo` (a reload: the walreceiver goes, and no
other comes), so every commit the primary acknowledges from then on is lost on promotion
(asynchronous) or waits for a standby that never answers (synchronous); `replicate_through`
sends the stream through an address of the caller's (a run's proxy, whose link a scenario
cuts). Not SIGSTOP: a stopped standby's kernel still takes the WAL into its socket buffer
and replays it once continued, and a walsender stopped holding a spinlock stalls the primary.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import asyncpg

from chaos.stack import StackError, _tail
from chaos.systems.pg_store.postgres import (
    PostgresServer,
    _ident,
    scram_verifier,
)

__all__ = ["REPLICATION_ROLE", "STANDBY_NAME", "PostgresPair"]

#: The role the standby streams as: REPLICATION, not a superuser.
REPLICATION_ROLE = "replicator"
#: The standby's application_name and replication slot: what synchronous_standby_names names.
STANDBY_NAME = "chaos_standby"

#: Written per node and passed as `hba_file`: the template's pg_hba also admits replication
#: over the unix socket and ::1, for every role; here only the replication role, from 127.0.0.1.
_HBA = (
    "# written by chaos.systems.pg.standby: replication from 127.0.0.1 only\n"
    "local all all scram-sha-256\n"
    "host all all 127.0.0.1/32 scram-sha-256\n"
    f"host replication {REPLICATION_ROLE} 127.0.0.1/32 scram-sha-256\n"
)

#: Both nodes. Dynamic shared memory in the data dir (`mmap`), not in /dev/shm: a SIGKILLed
#: postmaster's POSIX segments outlive it and nobody removes them, while the data dir goes
#: with the node's temp dir.
_NODE_SETTINGS = {
    "wal_level": "replica",
    "max_wal_senders": "4",
    "max_replication_slots": "4",
    "hot_standby": "on",
    "dynamic_shared_memory_type": "mmap",
    # how soon a standby whose stream broke tries again (default 5 s): it streams again
    # within a tenth of a second of its link or its conninfo coming back
    "wal_retrieve_retry_interval": "100ms",
}

#: Transient errors while a node changes role (a connection cut by the promotion).
_TRANSIENT = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError)

_T = TypeVar("_T")


def _conninfo(**params: str) -> str:
    """A libpq keyword/value connection string, each value quoted (paths may hold spaces)."""
    quoted = (v.replace("\\", "\\\\").replace("'", "\\'") for v in params.values())
    return " ".join(f"{k}='{v}'" for k, v in zip(params, quoted, strict=True))


def _lsn(text: str) -> int:
    """A WAL location `X/Y` (pg_lsn as text) as a byte position."""
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) + int(low, 16)


def _literal(value: str) -> str:
    """A SQL string literal (standard_conforming_strings: only quotes are doubled)."""
    return "'" + value.replace("'", "''") + "'"


def _poll(probe: Callable[[], _T | None], timeout: float, what: str) -> _T:
    """Until `probe` returns something other than None; StackError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got is not None:
            return got
        if time.monotonic() > deadline:
            raise StackError(f"postgres pair: no {what} within {timeout:.0f} s")
        time.sleep(0.02)


class _ReplicationNode(PostgresServer):
    """A `PostgresServer` whose pg_hba admits the replication role from 127.0.0.1 only."""

    def _write_private(self, path: Path, text: str) -> None:
        """A 0600 file the server's OS user owns (libpq ignores a readable passfile), replaced
        whole: a walreceiver connecting meanwhile reads the old one or the new one."""
        part = path.with_name(path.name + ".part")
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        self._chown(part)
        os.replace(part, path)

    def _launch(self) -> None:
        assert self._dir is not None
        self._chown(self._dir)
        hba = self._dir / "pg_hba.conf"
        self._write_private(hba, _HBA)
        self.settings["hba_file"] = str(hba)
        super()._launch()


class _PrimaryNode(_ReplicationNode):
    kind = "pgprimary"


class _StandbyNode(_ReplicationNode):
    """The standby: its data dir is a base backup of the running primary, not a template copy,
    and its roles (the superuser's password too) are the primary's."""

    kind = "pgstandby"

    def __init__(
        self,
        *,
        primary: PostgresServer,
        application_name: str,
        replication_password: str,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.primary = primary
        self.application_name = application_name
        self._replication_password = replication_password
        #: Where the standby streams from: the primary, or an address in front of it.
        self.upstream: tuple[str, int] = (primary.host, primary.port)

    def password(self, user: str | None = None) -> str:
        """The primary's superuser password (the standby is a copy of it), or a role's made
        here after promotion, else the primary's for that role."""
        name = user or self.superuser
        if name != self.superuser:
            with contextlib.suppress(KeyError):
                return super().password(name)
        return self.primary.password(name)

    def _launch(self) -> None:
        data = self.data_dir
        assert data is not None
        if not data.exists():
            self._base_backup(data)
        super()._launch()  # the data dir exists: no template copy, the server starts on it

    def _base_backup(self, data: Path) -> None:
        """`pg_basebackup -R` as the server's OS user: standby.signal and primary_conninfo
        (with our application_name and a passfile, never the password itself) are written,
        and a replication slot keeps the primary from recycling WAL the standby still needs."""
        assert self._dir is not None
        self._chown(self._dir)
        argv = [
            str(self.bin_dir / "pg_basebackup"),
            f"--pgdata={data}",
            "--write-recovery-conf",
            "--wal-method=stream",
            "--checkpoint=fast",
            "--create-slot",
            f"--slot={self.application_name}",
            "--no-password",
            f"--dbname={self.conninfo()}",
        ]
        self._run(argv, "pg_basebackup")

    def conninfo(self) -> str:
        """`primary_conninfo` to `upstream`: our application_name and a passfile (written
        here, any port of that host), never the password itself."""
        assert self._dir is not None
        host, port = self.upstream
        passfile = self._dir / "replication.pgpass"
        self._write_private(
            passfile, f"{host}:*:*:{REPLICATION_ROLE}:{self._replication_password}\n"
        )
        return _conninfo(
            host=host,
            port=str(port),
            user=REPLICATION_ROLE,
            application_name=self.application_name,
            passfile=str(passfile),
            connect_timeout="10",
        )

    def set_conninfo(self, conninfo: str) -> None:
        """`primary_conninfo` changed and the configuration reloaded: the walreceiver stops
        and, unless it is empty, starts again with it (PostgreSQL 13+)."""
        self.execute(f"ALTER SYSTEM SET primary_conninfo = {_literal(conninfo)}")
        self.execute("SELECT pg_reload_conf()")

    def receiver(self) -> dict[str, Any] | None:
        """The standby's `pg_stat_wal_receiver` row (status, sender_port), None when no
        walreceiver runs."""
        rows = self.fetch("SELECT status, sender_host, sender_port FROM pg_stat_wal_receiver")
        return dict(rows[0]) if rows else None

    def _set_superuser_password(self, began: float) -> None:
        """Nothing to set: a standby is read-only and its superuser is the primary's."""
        self._password_set = True

    def in_recovery(self) -> bool | None:
        """`pg_is_in_recovery()`, None when the node does not answer now."""
        try:
            return bool(self.fetch("SELECT pg_is_in_recovery() AS r")[0]["r"])
        except _TRANSIENT:
            return None

    def promote(self, timeout: float) -> None:
        """`pg_ctl promote --wait` as the server's OS user (pg_ctl refuses root)."""
        data = self.data_dir
        if data is None or not self.alive:
            raise StackError("postgres pair: the standby is not running, nothing to promote")
        argv = [
            str(self.bin_dir / "pg_ctl"),
            "promote",
            f"--pgdata={data}",
            "--wait",
            f"--timeout={max(1, round(timeout))}",
        ]
        self._run(argv, "promote")


class PostgresPair:
    """A private primary and a hot standby streaming from it, for failover faults.

    `synchronous=False`: asynchronous replication (the default; a failover may lose the last
    acknowledged commits). `synchronous=True`: `synchronous_commit = remote_apply` and the
    standby in `synchronous_standby_names`, so a commit is acknowledged only once the standby
    applied it (nothing acknowledged is lost). Beware then: the primary's commits, setup
    statements included, wait for the standby while it is down.

    Life cycle: `start` (primary, replication role, base backup, standby, streaming), then
    `kill_primary` (SIGKILL of the primary's every process), `promote` (the standby takes
    writes), `stop` (both nodes and their temp dirs; also after a failed start). A context
    manager. Credentials as `PostgresServer`'s: drawn per pair and never printed. In between,
    `pause_replication` / `resume_replication` cut the standby off and bring it back, and
    `replicate_through` sends its stream through a proxy.
    """

    def __init__(
        self,
        *,
        synchronous: bool = False,
        application_name: str = STANDBY_NAME,
        settings: Mapping[str, str] | None = None,
        start_timeout: float = 30.0,
        bin_dir: str | os.PathLike[str] | None = None,
        tmp_root: str | os.PathLike[str] | None = None,
    ) -> None:
        if not re.fullmatch(r"[a-z0-9_]{1,63}", application_name):
            # also the replication slot's name, which allows nothing else
            raise ValueError(f"application_name must match [a-z0-9_]{{1,63}}: {application_name!r}")
        self.synchronous = synchronous
        self.application_name = application_name
        self.start_timeout = start_timeout
        self.promoted = False
        #: Seconds the last `promote` took, None before one.
        self.promote_seconds: float | None = None
        self._replication_password = secrets.token_urlsafe(24)
        node_settings = {**_NODE_SETTINGS, **(settings or {})}
        common: dict[str, Any] = {
            "start_timeout": start_timeout,
            "bin_dir": bin_dir,
            "tmp_root": tmp_root,
        }
        # remote_apply on the command line from the start: without a synchronous standby
        # named it is a local commit, so setup does not wait for a standby not yet there.
        self.primary = _PrimaryNode(
            synchronous_commit="remote_apply" if synchronous else "on",
            settings=dict(node_settings),
            **common,
        )
        self.standby = _StandbyNode(
            primary=self.primary,
            application_name=application_name,
            replication_password=self._replication_password,
            settings=dict(node_settings),
            **common,
        )

    # -- where clients connect

    @property
    def primary_port(self) -> int:
        return self.primary.port

    @property
    def standby_port(self) -> int:
        return self.standby.port

    @property
    def primary_url(self) -> str:
        """The primary's superuser URL (holds a secret: do not print it)."""
        return self.primary.url()

    @property
    def standby_url(self) -> str:
        """The standby's superuser URL (read-only until promoted; holds a secret)."""
        return self.standby.url()

    @property
    def writable(self) -> PostgresServer:
        """The node that takes writes: the standby once promoted, else the primary."""
        return self.standby if self.promoted else self.primary

    @property
    def url(self) -> str:
        """The writable node's superuser URL: where a client reconnects after a failover."""
        return self.writable.url()

    # -- life cycle

    def start(self) -> Self:
        """Primary, replication role, standby from a base backup, until it streams (and, when
        synchronous, until the primary counts it as its synchronous standby). On any failure
        both nodes are stopped and their temp dirs deleted before the error propagates."""
        if self.primary.alive and self.standby.alive:
            return self  # started already (its role exists: a second setup would fail)
        try:
            self.primary.start()
            verifier = scram_verifier(self._replication_password)
            self.primary.execute(
                f"CREATE ROLE {_ident(REPLICATION_ROLE)} LOGIN REPLICATION NOSUPERUSER "
                f"PASSWORD '{verifier}'"
            )
            self.standby.start()
            self.wait_streaming(self.start_timeout)
            if self.synchronous:
                # ALTER SYSTEM, not the command line: set before the standby streamed, it
                # would have made every setup commit above wait for it.
                name = self.application_name
                self.primary.execute(f"ALTER SYSTEM SET synchronous_standby_names = '\"{name}\"'")
                self.primary.execute("SELECT pg_reload_conf()")
                self.wait_streaming(self.start_timeout, sync_state="sync")
        except BaseException:
            with contextlib.suppress(Exception):  # the start's error is the one to see
                self.stop(graceful=False)
            raise
        return self

    def replication(self) -> dict[str, Any] | None:
        """The standby's row of the primary's pg_stat_replication (state, sync_state, lsns),
        None while it is not connected."""
        rows = self.primary.fetch(
            "SELECT state, sync_state, sent_lsn::text, replay_lsn::text"
            " FROM pg_stat_replication WHERE application_name = $1",
            self.application_name,
        )
        return dict(rows[0]) if rows else None

    def wait_streaming(self, timeout: float | None = None, sync_state: str | None = None) -> None:
        """Until the primary shows the standby `streaming` (with that `sync_state` if given)."""

        def probe() -> bool | None:
            row = self.replication()
            if row is None or row["state"] != "streaming":
                return None
            return True if sync_state is None or row["sync_state"] == sync_state else None

        try:
            _poll(probe, timeout or self.start_timeout, f"standby streaming ({sync_state})")
        except StackError as exc:
            raise StackError(f"{exc}; standby log: {_tail(self.standby._log_paths())}") from None

    def pause_replication(self, timeout: float | None = None) -> None:
        """Cut the standby off its primary: `primary_conninfo` emptied, until the walreceiver
        has gone from the standby and the walsender from the primary. From then on no WAL
        reaches the standby: an asynchronous primary goes on acknowledging commits a
        promotion loses; a synchronous one acknowledges none (each waits in `SyncRep`)."""
        limit = timeout or self.start_timeout
        self.standby.set_conninfo("")

        def probe() -> bool | None:
            gone = self.standby.receiver() is None and self.replication() is None
            return True if gone else None

        _poll(probe, limit, "end of the standby's stream")

    def resume_replication(self, timeout: float | None = None) -> None:
        """The standby streams again from `upstream` (and, when synchronous, is the primary's
        synchronous standby again: the commits that waited are acknowledged)."""
        self.standby.set_conninfo(self.standby.conninfo())
        self.wait_streaming(timeout, sync_state="sync" if self.synchronous else None)

    def replicate_through(self, host: str, port: int, timeout: float | None = None) -> None:
        """Stream through `host:port` from now on (a TCP proxy in front of the primary, so a
        scenario can cut the link): until the standby's walreceiver streams from there."""
        limit = timeout or self.start_timeout
        self.standby.upstream = (host, port)
        self.standby.set_conninfo(self.standby.conninfo())

        def probe() -> bool | None:
            row = self.standby.receiver()
            there = row is not None and row["status"] == "streaming" and row["sender_port"] == port
            return True if there else None

        _poll(probe, limit, f"stream through {host}:{port}")
        self.wait_streaming(limit, sync_state="sync" if self.synchronous else None)

    def lag_bytes(self) -> int | None:
        """WAL the primary wrote that the standby has not replayed (bytes): what a promotion
        now would lose, commits acknowledged or not. None when a node does not answer."""
        try:
            [primary] = self.primary.fetch("SELECT pg_current_wal_lsn()::text AS l")
            [standby] = self.standby.fetch("SELECT pg_last_wal_replay_lsn()::text AS l")
        except _TRANSIENT:
            return None
        if primary["l"] is None or standby["l"] is None:
            return None
        return max(0, _lsn(primary["l"]) - _lsn(standby["l"]))

    def kill_primary(self) -> None:
        """SIGKILL the primary's postmaster and every process it forked (`PostgresServer.kill`):
        a crash, no shutdown; its temp dir stays until `stop`."""
        self.primary.kill()

    def promote(self, timeout: float | None = None) -> float:
        """Promote the standby (`pg_ctl promote`) and wait until `pg_is_in_recovery()` is
        false: from then on `url` / `writable` are the standby's. Returns the seconds it took."""
        limit = timeout or self.start_timeout
        began = time.monotonic()
        self.standby.promote(limit)

        def probe() -> bool | None:
            return True if self.standby.in_recovery() is False else None

        _poll(probe, max(1.0, began + limit - time.monotonic()), "end of recovery")
        self.promoted = True
        self.promote_seconds = time.monotonic() - began
        return self.promote_seconds

    def stop(self, graceful: bool = True, timeout: float = 30.0) -> None:
        """Stop both nodes (the standby first) and delete their temp dirs; the first error is
        raised once both were tried."""
        errors: list[Exception] = []
        for node in (self.standby, self.primary):
            try:
                node.stop(graceful=graceful, timeout=timeout)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        mode = "sync" if self.synchronous else "async"
        return f"<PostgresPair {mode} primary={self.primary!r} standby={self.standby!r}>"

    # -- measuring a failover

    def missing_commits(
        self,
        table: str,
        id_column: str,
        acknowledged: Iterable[Any],
        database: str = "postgres",
    ) -> list[Any]:
        """The ids of `acknowledged` (commits the primary confirmed) that the standby lacks,
        in their order: after `promote`, the commits the failover lost. `table` may be
        schema-qualified (`schema.table`)."""
        wanted = list(dict.fromkeys(acknowledged))
        if not wanted:
            return []
        name = ".".join(_ident(part) for part in table.split("."))
        column = _ident(id_column)
        rows = self.standby.fetch(
            f"SELECT {column} AS id FROM {name} WHERE {column} = ANY($1)",
            wanted,
            database=database,
        )
        present = {row["id"] for row in rows}
        return [value for value in wanted if value not in present]

    def lost_commits(
        self,
        table: str,
        id_column: str,
        acknowledged: Iterable[Any],
        database: str = "postgres",
    ) -> int:
        """How many acknowledged commits the standby lacks (see `missing_commits`)."""
        return len(self.missing_commits(table, id_column, acknowledged, database))
