"""A throwaway Redis Sentinel topology: one primary, one replica, three sentinels.

Why: Sentinel's failover is asynchronous, so a primary that dies (or is paused) after
acknowledging writes it has not yet replicated loses them when its replica is promoted. A
scenario needs real processes to show that window: this module starts them, on free
loopback ports (127.0.0.1 only), each a `chaos.stack` service (own temp dir, own process
group, the marker and owner token that `python -m chaos clean` and the leftover checks look
for), and offers the faults: kill or pause the primary, kill a sentinel, restart a server.

Clients find the primary through the sentinels; `SentinelTopology.url` names them all::

    redis+sentinel://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/chaos/0

that is `redis+sentinel://` + the sentinels' `host:port`, comma separated + `/` + the master
name Sentinel monitors + `/` + the database number.

Each data server runs from a config file in its temp dir, so the `CONFIG REWRITE` Sentinel
sends with every `REPLICAOF` persists the role it gave: a killed server restarts on its port
with its data (AOF) and its last role, and Sentinel demotes a restarted old primary itself.

`replication_via` puts a TCP proxy on the replication link: the replica's `replicaof` is the
proxy's listen address. Two things follow, both handled here:

* Sentinel discovers a replica from the primary's `INFO replication` (the address the
  primary sees the link come from, plus the port the replica announces). Through a proxy the
  link comes from the proxy, so each data server sets `replica-announce-ip 127.0.0.1`: the
  replica is listed at its own address, whatever the proxy's source address.
* Sentinel sees the replica replicating from an address that is not the master's, and
  `failover-timeout` later "fixes" it (`+fix-slave-config`: `REPLICAOF <primary>`), which
  would quietly route replication around the proxy. While the replica's config still names
  the proxy, its ACL refuses `REPLICAOF host port` and allows only `REPLICAOF NO ONE`, so
  Sentinel can still promote it but not bypass the proxy (the ACL lives in an `aclfile`,
  which `CONFIG REWRITE` leaves alone; once promoted, the replica's rewritten config has no
  `replicaof` and the harness lifts the pin at its next call).

Everything blocks (plain sockets, a tiny RESP client): call it through `asyncio.to_thread`
from async code.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from chaos.stack import StackError, _Service, _tail
from chaos.systems.redis_rabbitmq.stack import RedisServer, find_redis_server

__all__ = ["RedisReplyError", "SentinelServer", "SentinelTopology", "redis_call"]

Address = tuple[str, int]

#: How long `start()` waits for the whole topology to agree (a busy 2-core CI machine).
START_TIMEOUT_S = 60.0
#: See SentinelTopology: below this, failovers ping-pong between the servers.
MIN_DOWN_AFTER_MS = 1500
#: How long a single probe of one instance may take before it counts as no answer.
PROBE_TIMEOUT_S = 1.0


# --- a tiny RESP2 client ----------------------------------------------------------------------


class RedisReplyError(Exception):
    """The server answered with an error (`-ERR ...`, `-NOPERM ...`)."""


def _read_reply(stream: Any) -> Any:
    line = stream.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("connection closed mid-reply")
    kind, body = line[:1], line[1:-2]
    if kind == b"+":
        return body.decode()
    if kind == b"-":
        raise RedisReplyError(body.decode(errors="replace"))
    if kind == b":":
        return int(body)
    if kind == b"$":
        size = int(body)
        if size < 0:
            return None
        data = stream.read(size + 2)
        if len(data) != size + 2:
            raise ConnectionError("connection closed mid-reply")
        return data[:-2].decode(errors="replace")
    if kind == b"*":
        count = int(body)
        return None if count < 0 else [_read_reply(stream) for _ in range(count)]
    raise ConnectionError(f"unexpected reply {line[:40]!r}")


def redis_call(address: Address, *args: str | int, timeout: float = PROBE_TIMEOUT_S) -> Any:
    """Send one command to a Redis or Sentinel instance and return its parsed reply.

    Why not redis-py: this runs from sync code and from threads alike, must never retry or
    keep a pool (a paused server must simply not answer within `timeout`), and its replies
    come back raw (redis-py reshapes SENTINEL replies per version). Raises OSError when the
    instance does not answer, RedisReplyError when it answers with an error.
    """
    parts = [str(a).encode() for a in args]
    payload = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
    with socket.create_connection(address, timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(payload)
        with sock.makefile("rb") as stream:
            return _read_reply(stream)


def _info(address: Address, section: str = "replication") -> dict[str, str]:
    text = redis_call(address, "INFO", section)
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key] = value.strip()
    return fields


def _pairs(flat: Sequence[Any]) -> dict[str, Any]:
    """A SENTINEL reply entry (`[k1, v1, k2, v2, ...]`) as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=False))


def _role(address: Address) -> list[Any] | None:
    """`ROLE` of an instance, None when it does not answer."""
    try:
        return redis_call(address, "ROLE")
    except (OSError, RedisReplyError):
        return None


# --- the processes ----------------------------------------------------------------------------

_OPEN_ACL = "user default on nopass ~* &* +@all\n"
#: Refuses `REPLICAOF host port` (Sentinel's +fix-slave-config, which would bypass the proxy)
#: and keeps `REPLICAOF NO ONE` (a promotion). Redis 7.0 logs a deprecation warning for the
#: first-arg rules; they work.
_PINNED_ACL = "user default on nopass ~* &* +@all -replicaof -slaveof +replicaof|no +slaveof|no\n"


class DataServer(RedisServer):
    """A `RedisServer` that runs from a config file, so Sentinel's `CONFIG REWRITE` sticks.

    `replicaof` is only the first start's role; afterwards whatever Sentinel last wrote
    wins, as it would in production. `via` is the address replication goes through when it
    is not the primary itself (a proxy): see the module docstring for the pin.
    """

    def __init__(
        self,
        *,
        replicaof: Address | None = None,
        min_replicas: tuple[int, int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.replicaof = replicaof
        self.min_replicas = min_replicas  # (to write, max lag in seconds)
        self.via: Address | None = None

    @property
    def address(self) -> Address:
        return (self.host, self.port)

    def _conf(self) -> Path:
        assert self._dir is not None
        return self._dir / "redis.conf"

    def _acl(self) -> Path:
        assert self._dir is not None
        return self._dir / "users.acl"

    def argv(self) -> list[str]:
        """RedisServer's command line with the config file first (redis-server's rule)."""
        argv = super().argv()
        return [argv[0], str(self._conf()), *argv[1:]]

    def configured_master(self) -> Address | None:
        """The `replicaof` of the config file (what a restart would replicate from)."""
        try:
            text = self._conf().read_text()
        except (OSError, AssertionError):
            return None
        for line in text.splitlines():
            words = line.split()
            if len(words) == 3 and words[0].lower() in ("replicaof", "slaveof"):
                return (words[1].strip('"'), int(words[2]))
        return None

    @property
    def pinned(self) -> bool:
        """Whether replication goes through `via` (so Sentinel must not re-point it)."""
        return self.via is not None and self.configured_master() == self.via

    def _write_files(self) -> None:
        if not self._conf().exists():
            lines = [
                "# chaos/systems/redis_rabbitmq/sentinel.py: Sentinel rewrites this file",
                "# (CONFIG REWRITE) when it changes the role; the command line overrides the rest.",
                f"aclfile {self._acl()}",
                # Through a proxy the primary sees the link come from the proxy: announce
                # our own address, so Sentinel lists (and promotes) the right server.
                f"replica-announce-ip {self.host}",
                # 7.0 delays a diskless full sync 5 s waiting for more replicas: no point.
                "repl-diskless-sync-delay 0",
            ]
            if self.min_replicas is not None:  # a primary refuses writes without a replica
                lines.append(f"min-replicas-to-write {self.min_replicas[0]}")
                lines.append(f"min-replicas-max-lag {self.min_replicas[1]}")
            if self.replicaof is not None:
                lines.append(f"replicaof {self.replicaof[0]} {self.replicaof[1]}")
            self._conf().write_text("\n".join(lines) + "\n")
        self._acl().write_text(_PINNED_ACL if self.pinned else _OPEN_ACL)

    def _launch(self) -> None:
        self._write_files()
        super()._launch()

    def settle_pin(self) -> None:
        """Lift the pin once the config no longer replicates through `via` (promoted)."""
        if self.via is None or self._dir is None:
            return
        wanted = _PINNED_ACL if self.pinned else _OPEN_ACL
        with contextlib.suppress(OSError):
            if self._acl().read_text() == wanted:
                return
        self._acl().write_text(wanted)
        if self.alive:
            with contextlib.suppress(OSError, RedisReplyError):
                redis_call(self.address, "ACL", "LOAD")


class SentinelServer(_Service):
    """A private `redis-server --sentinel` with a writable config file in its temp dir."""

    kind = "sentinel"

    def __init__(
        self,
        *,
        config: str,
        port: int | None = None,
        start_timeout: float = 10.0,
        binary: str | None = None,
        tmp_root: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(port=port, start_timeout=start_timeout, tmp_root=tmp_root)
        found = binary or find_redis_server()
        if found is None:
            raise StackError("redis-server not found on PATH")
        self.binary: str = found
        self.config = config

    @property
    def address(self) -> Address:
        return (self.host, self.port)

    def argv(self) -> list[str]:
        assert self._dir is not None
        return [
            self.binary,
            str(self._dir / "sentinel.conf"),
            "--sentinel",
            "--bind",
            self.host,
            "--port",
            str(self.port),
            "--dir",
            str(self._dir),
            "--daemonize",
            "no",
            "--logfile",
            "",
            # As RedisServer: the proc title would overwrite the marker in /proc/PID/environ.
            "--set-proc-title",
            "no",
        ]

    def _launch(self) -> None:
        assert self._dir is not None
        conf = self._dir / "sentinel.conf"
        if not conf.exists():  # a restart keeps what Sentinel wrote (its id, epochs, peers)
            conf.write_text(self.config)
        self._spawn(self.argv(), "sentinel.log", self._env())

    def _ready(self) -> bool:
        try:
            return redis_call(self.address, "PING", timeout=0.5) == "PONG"
        except (OSError, RedisReplyError):
            return False

    def _log_paths(self) -> list[Path]:
        return [self._dir / "sentinel.log"] if self._dir is not None else []

    def log_text(self) -> str:
        """The sentinel's log so far (its events: +sdown, +switch-master, ...)."""
        paths = self._log_paths()
        with contextlib.suppress(OSError):
            return paths[0].read_text(errors="replace") if paths else ""
        return ""


# --- the topology -----------------------------------------------------------------------------


class SentinelTopology:
    """One primary, one replica, three sentinels (quorum 2), started and stopped together.

    `replication_via(host, port)` gets the primary's address and returns the address the
    replica should replicate from (a proxy whose upstream is the primary); it is called once
    the primary runs, before the replica starts.

    `down_after_ms` is 2000 by default and must be at least 1500: Sentinel creates a fresh
    link to an instance on every `+switch-master` and sends its first PING only a ping
    period (1 s, or down-after if shorter) later, while it counts the silence from the link's
    creation. At down-after <= 1 s every new primary is briefly SDOWN right after a failover,
    and when two sentinels catch it at once it is ODOWN: a second failover, then a third
    (seen here at 500 ms: 7 epochs for 3 kills; at 1000 ms: now and then).
    """

    def __init__(
        self,
        master_name: str = "chaos",
        down_after_ms: int = 2000,
        failover_timeout_ms: int = 3000,
        persistence: bool = True,
        replication_via: Callable[[str, int], Address] | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        tmp_root: str | os.PathLike[str] | None = None,
        min_replicas: tuple[int, int] | None = None,
    ) -> None:
        if down_after_ms < MIN_DOWN_AFTER_MS:
            raise ValueError(
                f"down_after_ms must be >= {MIN_DOWN_AFTER_MS} (Sentinel's 1 s ping period: "
                f"below it a new primary looks down right after a failover); got {down_after_ms}"
            )
        self.master_name = master_name
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.replication_via = replication_via
        self.start_timeout_s = start_timeout_s
        self.servers: list[DataServer] = [
            DataServer(persistence=persistence, tmp_root=tmp_root, min_replicas=min_replicas)
            for _ in range(2)
        ]
        self.sentinels: list[SentinelServer] = []
        self._tmp_root = tmp_root
        self._paused: DataServer | None = None

    # -- life cycle

    @property
    def url(self) -> str:
        """`redis+sentinel://h:p,h:p,h:p/<master>/0` (see the module docstring)."""
        hosts = ",".join(f"{s.host}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.master_name}/0"

    def _sentinel_config(self, primary: Address) -> str:
        name = self.master_name
        return (
            "# chaos/systems/redis_rabbitmq/sentinel.py; Sentinel rewrites this file as it learns\n"
            "# the topology\n"
            "sentinel resolve-hostnames no\n"
            "sentinel announce-hostnames no\n"
            f"sentinel monitor {name} {primary[0]} {primary[1]} 2\n"
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}\n"
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {name} 1\n"
        )

    def start(self) -> Self:
        """Start everything; return once the replica is in sync and all three sentinels
        agree on the primary and know the replica and each other (StackError otherwise)."""
        try:
            primary, replica = self.servers
            primary.start()
            via = primary.address
            if self.replication_via is not None:
                via = tuple(self.replication_via(primary.host, primary.port))  # type: ignore[assignment]
                if via != primary.address:
                    replica.via = via
            replica.replicaof = via
            replica.start()
            self._wait("the replica in sync", self._replica_synced)
            config = self._sentinel_config(primary.address)
            self.sentinels = [
                SentinelServer(config=config, tmp_root=self._tmp_root) for _ in range(3)
            ]
            for sentinel in self.sentinels:
                sentinel.start()
            self._wait("the sentinels in agreement", self._sentinels_agree)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGKILL everything and delete every temp dir (throwaway: no graceful shutdown,
        which on a paused server would wait for a SIGCONT and on a primary for its replica)."""
        errors: list[str] = []
        for service in [*self.sentinels, *self.servers]:
            try:
                service.stop(graceful=False)
            except StackError as exc:
                errors.append(str(exc))
        self._paused = None
        if errors:
            raise StackError("; ".join(errors))

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- readiness facts

    def _replica_synced(self) -> str | None:
        replica = self.servers[1]
        try:
            info = _info(replica.address)
        except (OSError, RedisReplyError) as exc:
            return f"replica does not answer INFO: {exc}"
        if info.get("master_link_status") != "up":
            return f"replica link {info.get('master_link_status')}"
        return None

    def _sentinels_agree(self) -> str | None:
        """None when every sentinel has the primary, an OK replica and both peers."""
        primary, replica = self.servers
        for i, sentinel in enumerate(self.sentinels):
            try:
                addr = redis_call(
                    sentinel.address, "SENTINEL", "get-master-addr-by-name", self.master_name
                )
                replicas = [
                    _pairs(r)
                    for r in redis_call(sentinel.address, "SENTINEL", "replicas", self.master_name)
                ]
                peers = [
                    _pairs(p)
                    for p in redis_call(sentinel.address, "SENTINEL", "sentinels", self.master_name)
                ]
            except (OSError, RedisReplyError) as exc:
                return f"sentinel {i} does not answer: {exc}"
            if addr is None or (addr[0], int(addr[1])) != primary.address:
                return f"sentinel {i} says the primary is {addr}"
            known = {
                (r.get("ip"), int(r.get("port", 0))): r
                for r in replicas
                if r.get("flags") == "slave" and r.get("master-link-status") == "ok"
            }
            if replica.address not in known:
                return f"sentinel {i} does not know the replica yet ({replicas})"
            others = {s.port for j, s in enumerate(self.sentinels) if j != i}
            seen = {int(p.get("port", 0)) for p in peers if p.get("flags") == "sentinel"}
            if not others <= seen:
                return f"sentinel {i} knows sentinels {sorted(seen)}, not {sorted(others)}"
        return None

    def _wait(
        self, what: str, fact: Callable[[], str | None], timeout_s: float | None = None
    ) -> None:
        """Poll `fact` (None: it holds, else why not) until it holds or the time is up."""
        deadline = time.monotonic() + (self.start_timeout_s if timeout_s is None else timeout_s)
        while True:
            why = fact()
            if why is None:
                return
            if time.monotonic() > deadline:
                logs = _tail([p for s in self.sentinels for p in s._log_paths()][:1])
                raise StackError(f"timed out waiting for {what}: {why}; sentinel log: {logs}")
            time.sleep(0.05)

    # -- who is who

    def _settle(self) -> None:
        for server in self.servers:
            server.settle_pin()

    def primary_address(self) -> Address:
        """The master's address as the first sentinel that answers reports it."""
        for sentinel in self.sentinels:
            addr = self._master_seen_by(sentinel) if sentinel.alive else None
            if addr is not None:
                return addr
        raise StackError(f"no sentinel answers for master {self.master_name!r}")

    def _master_seen_by(self, sentinel: SentinelServer) -> Address | None:
        """The master's address as `sentinel` reports it (None: no answer)."""
        try:
            addr = redis_call(
                sentinel.address, "SENTINEL", "get-master-addr-by-name", self.master_name
            )
        except (OSError, RedisReplyError):
            return None
        return None if addr is None else (addr[0], int(addr[1]))

    def server_at(self, address: Address) -> DataServer:
        for server in self.servers:
            if server.address == tuple(address):
                return server
        raise StackError(f"no server of this topology at {address[0]}:{address[1]}")

    def primary(self) -> DataServer:
        """The server the sentinels currently name as master."""
        self._settle()
        return self.server_at(self.primary_address())

    def replica(self) -> DataServer:
        """The server the sentinels do not name as master."""
        current = self.primary()
        return next(s for s in self.servers if s is not current)

    # -- faults

    def kill_primary(self) -> DataServer:
        """SIGKILL the current primary's process group (a crash); return it."""
        server = self.primary()
        server.kill()
        return server

    def pause_primary(self) -> DataServer:
        """SIGSTOP the current primary's process group: it stops answering, timers and all,
        with its sockets open (a frozen VM, a long GC pause); return it."""
        server = self.primary()
        if server.pid is None:
            raise StackError(f"primary {server.host}:{server.port} is not running")
        server.pause()
        self._paused = server
        return server

    def resume_primary(self) -> DataServer:
        """SIGCONT the server `pause_primary` stopped (maybe no longer the primary)."""
        server = self._paused
        if server is None:
            raise StackError("no paused primary to resume")
        server.resume()
        self._paused = None
        self._settle()
        return server

    def kill_sentinel(self, i: int) -> SentinelServer:
        """SIGKILL sentinel `i`; the other two still make the quorum of 2 and a majority."""
        sentinel = self.sentinels[i]
        sentinel.kill()
        return sentinel

    def restart(self, server: DataServer | SentinelServer) -> None:
        """Start a killed (or kill and start a running) server on its port, data and config:
        a data server comes back in the role its config last had, and Sentinel takes it
        from there (an old primary is demoted to a replica of the new one)."""
        self._settle()
        if server is self._paused:
            self._paused = None
        server.restart()

    # -- waiting for Sentinel

    def wait_failover(self, from_address: Address, timeout_s: float = 60.0) -> Address:
        """The new primary's address, once a majority of the live sentinels name one other
        than `from_address` and it answers ROLE as master (StackError on timeout)."""
        from_address = (from_address[0], int(from_address[1]))
        found: list[Address] = []

        def fact() -> str | None:
            live = [s for s in self.sentinels if s.alive]
            votes: dict[Address, int] = {}
            for sentinel in live:
                key = self._master_seen_by(sentinel)
                if key is not None:
                    votes[key] = votes.get(key, 0) + 1
            new = [a for a, n in votes.items() if a != from_address and n > len(live) // 2]
            if not new:
                return f"sentinels say {votes or 'nothing'} ({len(live)} live)"
            role = _role(new[0])
            if not role or role[0] != "master":
                return f"{new[0][0]}:{new[0][1]} answers ROLE {role}"
            found.append(new[0])
            return None

        self._wait(f"a failover from {from_address[0]}:{from_address[1]}", fact, timeout_s)
        self._settle()
        return found[-1]

    def wait_replica_of(
        self, server: DataServer, primary: Address, timeout_s: float = 60.0
    ) -> None:
        """Wait until `server` answers ROLE as a connected replica of `primary` (in sync)."""
        primary = (primary[0], int(primary[1]))

        def fact() -> str | None:
            role = _role(server.address)
            if not role:
                return "no answer"
            if role[0] != "slave" or (role[1], int(role[2])) != primary or role[3] != "connected":
                return f"ROLE {role}"
            return None

        self._wait(
            f"{server.host}:{server.port} to replicate {primary[0]}:{primary[1]}", fact, timeout_s
        )
        self._settle()

    def __repr__(self) -> str:
        return f"<SentinelTopology {self.url} servers={self.servers}>"
