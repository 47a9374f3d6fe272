"""`redis+sentinel://` URLs: parsed into sentinels, master and db; bad ones are one line
that never quotes the URL; the password is never shown."""

from __future__ import annotations

import pytest

from engine.config import env_config, redacted, scrubbed, secrets_of
from engine.sentinel_url import SentinelTarget, parse_sentinel_url


def test_a_sentinel_url_names_the_sentinels_the_master_and_the_db() -> None:
    url = "redis+sentinel://app:s3cret@127.0.0.1:26379,127.0.0.1:26380,[::1]:26381/chaos/2"
    assert parse_sentinel_url(url) == SentinelTarget(
        sentinels=(("127.0.0.1", 26379), ("127.0.0.1", 26380), ("::1", 26381)),
        master="chaos",
        db=2,
        username="app",
        password="s3cret",
    )
    assert parse_sentinel_url("redis+sentinel://h:1/m") == SentinelTarget((("h", 1),), "m")
    assert parse_sentinel_url("redis+sentinel://h:1/m?password=p%40ss").password == "p@ss"


def test_its_password_is_never_shown() -> None:
    url = "redis+sentinel://app:s3cret@127.0.0.1:26379,127.0.0.1:26380/chaos/0"
    shown = redacted(url)
    assert "s3cret" not in shown
    assert shown == "redis+sentinel://app:***@127.0.0.1:26379,127.0.0.1:26380/chaos/0"
    assert secrets_of(url) == ["s3cret"]
    assert scrubbed("AUTH s3cret refused", url) == "AUTH *** refused"
    query = redacted("redis+sentinel://h:1/m?password=s3cret&x=1")
    assert "s3cret" not in query and "password=***" in query
    assert redacted("redis+sentinel://h:1") == "redis+sentinel://h:1"  # no secret in it


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis+sentinel://127.0.0.1/chaos", "a sentinel is not host:port"),
        ("redis+sentinel://127.0.0.1:0/chaos", "a sentinel is not host:port"),
        ("redis+sentinel://:26379/chaos", "a sentinel is not host:port"),
        ("redis+sentinel://127.0.0.1:26379", "the path must be the master's name"),
        ("redis+sentinel://127.0.0.1:26379/chaos/zero", "the path must be the master's name"),
        ("redis+sentinel://u:s3cret@127.0.0.1:1/a/b/c", "the path must be the master's name"),
    ],
)
def test_a_bad_sentinel_url_is_one_line_without_the_url(url: str, why: str) -> None:
    with pytest.raises(ValueError) as info:
        env_config(redis_url=url)
    line = str(info.value)
    assert line.startswith("REDIS_URL: expected redis+sentinel://host:port") and why in line
    assert "\n" not in line and "s3cret" not in line
