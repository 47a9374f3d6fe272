"""Redis through Sentinel, as the seed deploys it: `redis+sentinel://` URLs.

    redis+sentinel://[user:password@]host:port[,host:port...]/master_name[/db]

The hosts are the sentinels; `master_name` is the name they monitor. The client asks them
where the primary is and asks again when its connection breaks or the server it reaches
says it is a replica now (a failover happened): redis-py's `SentinelConnectionPool` does
that, and a `READONLY` answer becomes a connection error, so the store's retry policy rides
a failover out like a restart. The credentials are the primary's (the sentinels here take
none); they are never printed (`redacted_sentinel_url`).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote

SCHEME = "redis+sentinel"


@dataclass(frozen=True)
class SentinelTarget:
    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None


def is_sentinel_url(url: str) -> bool:
    return url.startswith(f"{SCHEME}://")


def _split(url: str) -> tuple[str, str, str, str]:
    """(userinfo, hosts, path, query) of a sentinel URL, without urllib (its netloc holds
    several ports, which `urlsplit(...).port` refuses)."""
    rest = url[len(SCHEME) + 3 :]
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    return (userinfo if at else ""), hosts, path, query


def parse_sentinel_url(url: str) -> SentinelTarget:
    """The sentinels, master name and db of a `redis+sentinel://` URL; ValueError (one line,
    never quoting the URL) when it is not one."""
    userinfo, hosts, path, query = _split(url)
    sentinels = []
    for item in hosts.split(","):
        host, colon, port = item.rpartition(":")
        if not colon or not port.isdigit() or not host or not 0 < int(port) < 65536:
            raise ValueError(
                "REDIS_URL: expected redis+sentinel://host:port[,host:port...]/master[/db]; "
                "a sentinel is not host:port"
            )
        sentinels.append((host.strip("[]"), int(port)))
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError(
            "REDIS_URL: expected redis+sentinel://host:port[,host:port...]/master[/db]; "
            "the path must be the master's name and an optional db number"
        )
    user, _, password = userinfo.partition(":")
    for key, value in parse_qsl(query):
        if key.lower() == "password":
            password = value
    return SentinelTarget(
        sentinels=tuple(sentinels),
        master=unquote(parts[0]),
        db=int(parts[1]) if len(parts) == 2 else 0,
        username=unquote(user) or None,
        password=unquote(password) or None,
    )


def redacted_sentinel_url(url: str) -> str:
    """The URL with its password masked, for logs and error lines."""
    userinfo, hosts, path, query = _split(url)
    if userinfo:
        user = userinfo.partition(":")[0]
        userinfo = f"{user}:***@" if ":" in userinfo else f"{user}@"
    if "password" in query.lower():
        query = "&".join(
            f"{k}=***" if k.lower() == "password" else f"{k}={v}"
            for k, v in parse_qsl(query, keep_blank_values=True)
        )
    tail = (f"/{path}" if path else "") + (f"?{query}" if query else "")
    return f"{SCHEME}://{userinfo}{hosts}{tail}"


def sentinel_secrets(url: str) -> list[str]:
    target = parse_sentinel_url(url)
    return [target.password] if target.password else []
