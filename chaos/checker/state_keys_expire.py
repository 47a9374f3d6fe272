"""`state_keys_expire`: every `attempt:*` key carries a TTL of at most 7 days (`TTL` -1 is
none): a plain SET would have dropped it and the key would live forever.
"""

from __future__ import annotations

from collections import defaultdict

from chaos.checker.context import (
    STATE_KEY_PREFIX,
    TTL_SLACK_S,
    Context,
    Outcome,
    listed,
    of,
    timeline,
)
from chaos.checker.records import Violation
from engine.config import STATE_TTL_SECONDS


def _attempt_of(key: str) -> str:
    body = key[len(STATE_KEY_PREFIX) :]
    if ":rule:" in body:
        return body.split(":rule:", 1)[0]
    return body.rsplit(":", 1)[0] if ":" in body else body


def check_state_keys_expire(cx: Context) -> Outcome:
    """Every `attempt:*` key has a TTL (`TTL` >= 0) of at most 7 days (+ a minute). TTL 0
    is a lease (`owner`, PX) under a second from expiry; -2 (the key went away between
    listing and reading) is ignored; keys outside `attempt:*` (the engine's
    indexes) are not state keys and only counted."""
    out: list[Violation] = []
    bad: dict[str, list[str]] = defaultdict(list)
    checked = exempt = 0
    limit = STATE_TTL_SECONDS + TTL_SLACK_S
    for key, ttl in sorted(cx.final.key_ttls.items()):
        if not key.startswith(STATE_KEY_PREFIX):
            exempt += 1
            continue
        if ttl == -2:
            continue
        checked += 1
        if ttl == -1 or ttl > limit:  # 0: a short lease about to expire, still a TTL
            shown = "no TTL" if ttl == -1 else f"TTL {ttl} s"
            bad[_attempt_of(key)].append(f"{key} ({shown})")
    for a, keys in sorted(bad.items()):
        out.append(
            Violation(
                "state_keys_expire",
                a,
                None,
                f"{len(keys)} key(s) would outlive the 7-day TTL: {listed(keys, 3)}",
                timeline(of(cx.by_eval.get(a, []), "evaluation_terminal", "final_published")),
            )
        )
    cx.stats.update(keys_checked=checked, keys_exempt=exempt)
    return checked, out
