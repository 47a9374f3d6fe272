"""Redis, simulated: a dict with TTLs on simulated time, and the store's scripts on it.

`SimRedis` keeps the keys `engine.runtime.store` names (its own key functions are used),
and each method below is one of that module's Lua scripts or commands, with the same
semantics, run atomically (one simpy callback, no yield inside). Values are kept as the
objects they stand for (a `Plan`, a status) rather than their JSON: the scripts only
compare and copy them. A rule's result is kept as its JSON, encoded and decoded by
`RuleResult` as the live store does: what a resumed evaluation reads back is what the
engine's own encoding kept. Expiry is lazy, as in Redis: a key past its TTL is gone when read.

`RedisClient` is one process's connection: each call travels (seeded latency, requests and
replies in FIFO order like one pipelined connection), is applied when it reaches Redis,
and the reply travels back. A call in flight is applied even if its caller is cancelled
or dies (the request was sent). While Redis is down, calls fail and are retried with
redis-py's backoff (40 retries, then `ConnectionError`); a reply lost to a Redis kill is
retried too, so a script can run twice, as with the live client's retry policy.

A worker's client goes through its proxy (`sim.network`): while the proxy is calm (no
toxic, not cut) nothing changes; else each request and reply passes the toxics. A request
lost upstream is never applied; a reply lost downstream was (the write stands), and
redis-py waits `read_timeout_s` (its `socket_timeout`), drops the connection and retries
on a new one; a connection closed or reset, or refused by a cut proxy, fails at once and
is retried with the backoff. A worker cut off keeps running its tasks meanwhile.

Persistence is the scenario stack's: `appendfsync always`, so a kill loses nothing
acknowledged, unless `failover_loss` > 0, which models a failover to a replica that
lacked the last N writes (those writes are rolled back at the restart).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import simpy

from engine.core import PERMANENTLY_FAILED, RuleResult, Snapshot, status_rank
from engine.core.states import TERMINAL_EVALUATION_STATUSES
from engine.keys import eval_key, result_key, retry_member, runs_key, split_member, status_key
from engine.shell.replies import Begun, LeaseLost, Renewal, StatusWritten
from sim.network import DOWN, UP, Conn, Link, size_of

TERMINAL = frozenset(s.value for s in TERMINAL_EVALUATION_STATUSES)

#: The store's operations: each Lua script of `engine.runtime.store` and the `SimRedis`
#: method that is its Python reference. One table, proven equal reply for reply and key for
#: key on a real Redis by `tests/live/test_store_reference_live.py`.
REFERENCES: dict[str, str] = {
    "_BEGIN": "begin",
    "_RENEW": "renew",
    "_WRITE_RESULT": "write_result",
    "_WRITE_STATUS": "write_status",
    "_MARK_STARTED": "mark_started",
    "_MARK_PASS": "mark_pass_published",
    "_PARK": "park",
    "_FINISH": "finish",
    "_DONE": "done",
    "_SET_STATE": "set_state",
    "_RELEASE": "release",
    "_UNINDEX": "unindex",
    "_CLAIM_STALE": "claim_stale",
    "_CLAIM_RETRY": "claim_retry",
}
#: The operations the live store runs as scripts, through its `AutoPipeline` (one batch in
#: flight); the others (reads, `SET NX` of a plan) are plain commands on a pooled connection.
SCRIPTS: frozenset[str] = frozenset(REFERENCES.values())
_MISSING = object()
_LOST = object()  # an attempt that got no reply


class _Refused:
    """What a write refused by `min-replicas-to-write` returns (live: `-NOREPLICAS`, which
    the store raises as `NotReplicated`); nothing of it was written."""


NOREPLICAS = _Refused()


_Done = Callable[[Any, bool], None]  # a request's reply, and whether a zombie gave it


class _Pause:
    """A paused server: what arrived meanwhile waits in its buffers (`held`) and runs when
    it resumes (`over` fires then). `data` is set when the sentinels promoted the replica
    over it: the old primary then answers the held requests from its own data (copied at
    the promotion), which nobody keeps afterwards."""

    def __init__(self, over: simpy.Event) -> None:
        self.over = over
        self.held: list[
            tuple[Callable[..., Any], tuple[Any, ...], Callable[[Any, bool], None]]
        ] = []
        self.data: tuple[dict[str, Any], dict[str, float]] | None = None


class Fenced:
    """What a fenced script returns when it wrote nothing (the live `{FENCED, holder}`):
    `RedisClient.call` raises `LeaseLost` with it, as the live store does."""

    def __init__(self, attempt_id: str, other: str) -> None:
        self.attempt_id = attempt_id
        self.other = other


def _rank(status: str) -> int:
    """The rank `_WRITE_STATUS` gives a stored status (0 for anything unknown)."""
    if status == PERMANENTLY_FAILED:
        return 1_000_000
    if status.startswith("failed_attempt_") and status[15:].isdigit():
        return int(status[15:])
    return 0


class SimRedis:
    def __init__(
        self,
        env: simpy.Environment,
        *,
        running_index: str,
        retries_index: str,
        ttl_s: int,
        lease_ms: int,
        failover_loss: int = 0,
    ) -> None:
        self.env = env
        self.running_index = running_index
        self.retries_index = retries_index
        self.ttl = ttl_s
        self.lease_s = lease_ms / 1000.0
        self.data: dict[str, Any] = {}
        self.expires: dict[str, float] = {}  # key -> simulated time it expires at
        self.up = True
        self.epoch = 0  # one more at every kill: a reply in flight across it is lost
        self._journal: deque[dict[str, tuple[Any, float | None]]] | None = (
            deque(maxlen=failover_loss) if failover_loss > 0 else None
        )
        self._op: dict[str, tuple[Any, float | None]] | None = None
        # Behind Sentinel (`sim.sentinel`): how long a write takes to reach the replica, and
        # the writes of that last stretch, which a failover loses
        self.lag_s: float | None = None
        # since when no replica receives the writes (a cut link, or none there): None while
        # one does; a `WAIT` then times out
        self.unreplicated_since: float | None = None
        self._recent: deque[tuple[float, dict[str, tuple[Any, float | None]]]] = deque()
        # min-replicas-to-write 1 (`sim.sentinel`): writes are refused while no replica is
        # attached, or none acknowledged within this many seconds (None: never refused)
        self.min_replicas_lag_s: float | None = None
        self.replica_attached = True
        self._pause: _Pause | None = None  # paused: what arrives waits
        self._zombie: _Pause | None = None  # paused, and a replica promoted over it
        # PostgreSQL's checkpoints are numbered in the order their results became durable
        # (`migrations/0003_eai_resume.sql`): kept, as the rules in that order, under
        # `attempt:{a}:checkpoints`, only for the designs that have them (None: Redis)
        self.numbering = False
        self._synced = False  # the running operation's commit is synchronous (`synced`)
        # `settled`'s: the keys written since it last looked (None: it never has), the ids
        # it is asked of, those of them it found settled, and when to read one again
        self._written: set[str] | None = None
        self._asked: Sequence[str] | None = None  # the ids it was asked of
        self._found: set[str] = set()  # those of them terminal and announced
        self._settled_keys: dict[str, str] = {}  # their two keys -> their attempt id
        self._expiring: list[tuple[float, str]] = []  # (when a key expires, its id), a heap

    # --- the server -------------------------------------------------------------------

    def _refuses_writes(self) -> bool:
        """min-replicas-to-write: no good replica (acknowledgements come every second, and
        Redis counts whole seconds: a cut is noticed up to a second past the lag)."""
        if self.min_replicas_lag_s is None:
            return False
        since = self.unreplicated_since
        if not self.replica_attached:
            return True
        return since is not None and self.env.now - since > self.min_replicas_lag_s + 1.0

    def apply(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Run one command or script atomically (journaled when failovers may lose it)."""
        if self._journal is None and self.lag_s is None:
            return fn(*args)
        self._op = {}
        try:
            value = fn(*args)
            if self._op and self._refuses_writes():  # -NOREPLICAS at its first write
                for key, (old, exp) in self._op.items():
                    self._restore(key, old, exp)
                self._op = None
                return NOREPLICAS
            return value
        finally:
            if self._op:
                if self._journal is not None:
                    self._journal.append(self._op)
                if self.lag_s is not None:
                    now, recent = self.env.now, self._recent
                    recent.append((now, self._op))
                    since = self.unreplicated_since
                    cutoff = (now if since is None else since) - self.lag_s
                    while recent and recent[0][0] < cutoff:  # the replica has those
                        recent.popleft()
                    if self._synced:
                        recent.clear()
            self._op = None
            self._synced = False

    def synced(self) -> None:
        """The running operation commits synchronously (PostgreSQL's, whatever the role's
        setting): the WAL is flushed up to it, with every commit before it, which no kill
        can take any more."""
        if self.lag_s is not None:
            self._synced = True

    def lose_unreplicated(self, died_at: float) -> int:
        """A failover: the replica promoted lacks what the primary applied in its last
        `lag_s` before it died, or before its link to the replica was cut; those writes are
        undone (newest first); how many."""
        since = self.unreplicated_since
        cutoff = (died_at if since is None else min(since, died_at)) - (self.lag_s or 0.0)
        lost = [op for t, op in self._recent if t > cutoff]
        for op in reversed(lost):
            for key, (value, exp) in op.items():
                self._restore(key, value, exp)
        self._recent.clear()
        return len(lost)

    def kill(self) -> None:
        self.up = False
        self.epoch += 1
        for pause in (self._pause, self._zombie):  # what waited in its buffers is gone
            if pause is not None:
                pause.held.clear()
                pause.over.succeed()
        self._pause = self._zombie = None

    # --- a paused server (SIGSTOP): it neither answers nor refuses ----------------------

    @property
    def paused(self) -> bool:
        return self._pause is not None

    def pause(self) -> None:
        if self._pause is None:
            self._pause = _Pause(self.env.event())

    def serve(
        self, fn: Callable[..., Any], args: tuple[Any, ...], done: Callable[[Any, bool], None]
    ) -> simpy.Event | None:
        """A request arrives: applied now and `done(reply, False)`; while paused it waits
        (the event returned fires when the server resumes, `done` called by then, with
        True if a replica was promoted over it meanwhile: the reply of a primary nobody
        follows any more)."""
        pause = self._pause
        if pause is None:
            done(self.apply(fn, args), False)
            return None
        pause.held.append((fn, args, done))
        return pause.over

    def promoted_over_pause(self) -> None:
        """The sentinels promote the replica while this primary is paused: the old one keeps
        a copy of its data for what waited in its buffers; new arrivals reach the new."""
        pause, self._pause = self._pause, None
        assert pause is not None
        pause.data = (
            {k: dict(v) if isinstance(v, dict) else v for k, v in self.data.items()},
            dict(self.expires),
        )
        self._zombie = pause

    def _zombie_apply(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """`fn` on the replaced primary's own data, which has no replica any more."""
        if self.min_replicas_lag_s is None:
            return fn(*args)
        self._op = {}
        try:
            value = fn(*args)
            if self._op:  # -NOREPLICAS at its first write
                for key, (old, exp) in self._op.items():
                    self._restore(key, old, exp)
                return NOREPLICAS
            return value
        finally:
            self._op = None

    def resume(self) -> bool:
        """SIGCONT: what waited runs, in order, and is answered; whether a replica had been
        promoted over it (then its writes went to data that is dropped right after)."""
        pause = self._zombie or self._pause
        self._pause = self._zombie = None
        if pause is None:
            return False
        if pause.data is None:
            for fn, args, done in pause.held:
                done(self.apply(fn, args), False)
        else:
            kept = self.data, self.expires
            self.data, self.expires = pause.data
            try:  # with no replica: min-replicas-to-write refuses its writes too
                for fn, args, done in pause.held:
                    done(self._zombie_apply(fn, args), True)
            finally:
                self.data, self.expires = kept
        pause.over.succeed()
        return pause.data is not None

    def restart(self) -> int:
        """Back up; returns how many acknowledged writes the failover lost."""
        lost = 0
        if self._journal:  # a failover to a replica that missed the last writes
            lost = len(self._journal)
            for op in reversed(self._journal):
                for key, (value, exp) in op.items():
                    self._restore(key, value, exp)
            self._journal.clear()
        self.up = True
        return lost

    # --- primitives -------------------------------------------------------------------

    def _touch(self, key: str) -> None:
        if self._written is not None:
            self._written.add(key)
        op = self._op
        if op is not None and key not in op:
            value = self.data.get(key, _MISSING)
            op[key] = (dict(value) if isinstance(value, dict) else value, self.expires.get(key))

    def _restore(self, key: str, value: Any, exp: float | None) -> None:
        if self._written is not None:
            self._written.add(key)
        if value is _MISSING:
            self.data.pop(key, None)
        else:
            self.data[key] = value
        if exp is None:
            self.expires.pop(key, None)
        else:
            self.expires[key] = exp

    def get(self, key: str) -> Any:
        exp = self.expires.get(key)
        if exp is not None and exp < self.env.now:  # Redis: expired once now > when
            self._del(key)
            return None
        return self.data.get(key)

    def _set(self, key: str, value: Any, ex_s: float | None) -> None:
        """SET key value [EX s]: without EX the key loses any TTL it had."""
        self._touch(key)
        self.data[key] = value
        if ex_s is None:
            self.expires.pop(key, None)
        else:
            self.expires[key] = self.env.now + ex_s

    def _expire(self, key: str, s: float) -> None:
        if self.get(key) is not None:
            self._touch(key)
            self.expires[key] = self.env.now + s

    def _del(self, key: str) -> None:
        self._touch(key)
        self.data.pop(key, None)
        self.expires.pop(key, None)

    def _container(self, key: str) -> dict:
        """A hash or sorted set, created on first write (member -> value or score)."""
        value = self.get(key)
        self._touch(key)
        if value is None:
            value = self.data[key] = {}
        return value

    def _zadd(self, key: str, member: str, score: float) -> None:
        """An index entry, whose key lives no longer than the state it points at."""
        self._container(key)[member] = score
        self._expire(key, self.ttl)

    def _zrem(self, key: str, member: str) -> None:
        z = self.get(key)
        if z is not None and member in z:
            self._touch(key)
            del z[member]
            if not z:  # Redis deletes a sorted set with its last member
                self._del(key)

    def _zrange_upto(self, key: str, top: float, limit: int) -> list[str]:
        z = self.get(key) or {}
        hits = sorted((s, m) for m, s in z.items() if s <= top)
        return [m for _, m in hits[:limit]]

    def _now_ms(self) -> int:
        """The store's clock (`now_ms()` in the scripts): the simulated one."""
        return int(self.env.now * 1000)

    def ttl_of(self, key: str) -> int:
        """`TTL key`: seconds left, rounded as Redis rounds; -1 no TTL; -2 no key."""
        if self.get(key) is None:
            return -2
        return _seconds_left(self.expires.get(key), self.env.now)

    def ttls(self, prefix: str) -> dict[str, int]:
        """`ttl_of` each of `keys(prefix)`, in its order: one look at each key, not three
        (the final state reads every key of a run)."""
        now, data, expires = self.env.now, self.data, self.expires
        out: dict[str, int] = {}
        for k in sorted(k for k in data if k.startswith(prefix)):
            exp = expires.get(k)
            if exp is not None and exp < now:  # `get`: expired once now > when
                self._del(k)
            elif data.get(k) is not None:
                out[k] = _seconds_left(exp, now)
        return out

    def keys(self, prefix: str) -> list[str]:
        return sorted(
            k for k in list(self.data) if k.startswith(prefix) and self.get(k) is not None
        )

    # --- the store's scripts and commands (engine.runtime.store), one method each ------

    def ping(self) -> str:
        return "PONG"

    def _fenced(self, a: str, token: str | None) -> Fenced | None:
        """`fenced` of `_LUA_FENCE`: refused unless the token is the current one and no
        other worker holds the lease; then the lease runs on from now."""
        if not token:
            return None
        me = token.partition(":")[2]
        fence_key, owner = eval_key(a, "fence"), eval_key(a, "owner")
        cur = self.get(fence_key)
        if cur is not None and cur != token:
            return Fenced(a, cur)
        holder = self.get(owner)
        if holder is not None and holder != me:
            return Fenced(a, holder)
        if cur is None:
            self._set(fence_key, token, self.ttl)
        self._set(owner, me, self.lease_s)
        return None

    def _next_fence(self, a: str, me: str) -> str:
        key = eval_key(a, "fence")
        cur = self.get(key)
        head = cur.partition(":")[0] if cur else ""
        token = f"{(int(head) if head.isdigit() else 0) + 1}:{me}"
        self._set(key, token, self.ttl)
        return token

    def write_result(
        self,
        a: str,
        result: RuleResult,
        starts: Sequence[tuple[str, int]],
        fence: str | None = None,
    ) -> tuple[RuleResult | None, list[int], str | None] | Fenced:
        refused = self._fenced(a, fence)
        if refused is not None:
            return refused
        existing = self.set_result(result_key(a, result.rule_id), result)
        if existing is None:
            self._number(a, result.rule_id)
        self._zrem(self.retries_index, retry_member(a, result.rule_id))
        over = self._over(a)
        if over is not None:  # the evaluation is over: nothing counted, nothing starts
            return existing, [], over
        return existing, self._count_starts(a, starts), None

    def _number(self, a: str, rule_id: str) -> None:
        """The rule's result is durable: the run's next checkpoint (PostgreSQL's trigger)."""
        if self.numbering:
            key = eval_key(a, "checkpoints")
            self._set(key, [*(r for r in self.get(key) or () if r != rule_id), rule_id], self.ttl)

    def resume_from(self, a: str, number: int | None, reason: str) -> list[str]:
        """`eai.resume`: keep the results of the first `number` checkpoints (None: all),
        delete every other result and status, and the passes when anything went; take the
        lease (the fence moves on to `n:resume`) and stamp the running index."""
        plan = self.get(eval_key(a, "plan"))
        state = self.get(eval_key(a, "state"))
        if plan is None:
            return ["unknown"]
        if state in TERMINAL:
            return ["terminal", state]
        order = [
            r for r in self.get(eval_key(a, "checkpoints")) or () if self.get(result_key(a, r))
        ]
        if number is not None and not 1 <= number <= len(order):
            return ["nocheckpoint", str(len(order))]
        upto = len(order) if number is None else number
        kept = set(order[:upto])
        gone = sorted(
            r
            for r in plan.rules
            if r not in kept
            and (self.get(result_key(a, r)) is not None or self.get(status_key(a, r)) is not None)
        )
        for r in gone:
            self._del(result_key(a, r))
            self._del(status_key(a, r))
            self._zrem(self.retries_index, retry_member(a, r))
        if gone:
            self._del(eval_key(a, "passes"))
        self._set(eval_key(a, "checkpoints"), order[:upto], self.ttl)
        attempt = int(self.get(eval_key(a, "resumes")) or 1) + 1
        self._set(eval_key(a, "resumes"), attempt, self.ttl)
        self._del(eval_key(a, "owner"))
        self._next_fence(a, "resume")
        self._set(eval_key(a, "state"), "running", self.ttl)
        self._zadd(self.running_index, a, self._now_ms())
        return ["ok", str(upto), str(attempt), *gone]

    def set_result(self, key: str, result: RuleResult) -> RuleResult | None:
        """The script's `SET key value NX EX ttl`: the result stored before, if one was (the
        first write wins). A seam of its own: the script mutants edit this one call."""
        existing = self.get(key)
        if existing is None:
            self._set(key, result.to_json(), self.ttl)
            return None
        return RuleResult.from_json(existing)

    def _over(self, a: str) -> str | None:
        """The evaluation's state if it is terminal (the scripts' `terminal(state)`)."""
        state = self.get(eval_key(a, "state"))
        return state if state in TERMINAL else None

    def _unindex_retries(self, a: str) -> None:
        """`unindex_retries`: every rule of the stored plan out of the retries index."""
        plan = self.get(eval_key(a, "plan"))
        if plan is None:
            return
        for rule_id in plan.rules:
            self._zrem(self.retries_index, retry_member(a, rule_id))

    def _count_starts(
        self, a: str, starts: Sequence[tuple[str, int]], unindex: bool = False
    ) -> list[int]:
        """The start markers; with `unindex` (`_MARK_STARTED`), a delayed retry's attempt
        also leaves the retries index as it starts."""
        counts = []
        for rule_id, attempt in starts:
            if unindex and attempt > 1:
                self._zrem(self.retries_index, retry_member(a, rule_id))
            key = runs_key(a, rule_id)
            runs = self._container(key)
            field = str(attempt)
            runs[field] = runs.get(field, 0) + 1
            counts.append(runs[field])
            self._expire(key, self.ttl)
        return counts

    def mark_started(
        self, a: str, starts: Sequence[tuple[str, int]], fence: str | None = None
    ) -> tuple[list[int], str | None] | Fenced:
        refused = self._fenced(a, fence)
        if refused is not None:
            return refused
        over = self._over(a)
        if over is not None:
            return [], over
        return self._count_starts(a, starts, unindex=True), None

    def write_status(
        self, a: str, rule_id: str, status: str, delay_ms: int | None, fence: str | None = None
    ) -> StatusWritten | Fenced:
        """`_WRITE_STATUS`: the retry is due `delay_ms` after the write lands (store clock)."""
        refused = self._fenced(a, fence)
        if refused is not None:
            return refused
        over = self._over(a)
        key = status_key(a, rule_id)
        cur = self.get(key)
        if cur is not None and _rank(cur) >= status_rank(status):
            return StatusWritten(cur, over, None)
        self._set(key, status, self.ttl)
        member = retry_member(a, rule_id)
        if delay_ms is not None and over is None:
            due = self._now_ms() + delay_ms
            self._zadd(self.retries_index, member, due)
            return StatusWritten(None, over, due)
        self._zrem(self.retries_index, member)
        return StatusWritten(None, over, None)

    def begin(self, a: str, me: str, rule_ids: Sequence[str], plan: Any, now_ms: int) -> Begun:
        owner = eval_key(a, "owner")
        cur = self.get(owner)
        if cur is not None and cur != me:
            return Begun(holder=cur)
        state = self.get(eval_key(a, "state"))
        if state in TERMINAL:
            published = bool(self.get(eval_key(a, "final_published")))
            self._unindex_retries(a)
            if published:
                self._zrem(self.running_index, a)
            return Begun(terminal=state, published=published)
        plan_key = eval_key(a, "plan")
        if plan is None:
            plan = self.get(plan_key)
        elif self.get(plan_key) is None:
            self._set(plan_key, plan, self.ttl)
        if plan is None:
            return Begun(no_plan=True)
        self._set(owner, me, self.lease_s)
        token = self._next_fence(a, me)
        self._set(eval_key(a, "state"), "running", self.ttl)
        self._zadd(self.running_index, a, now_ms)
        return Begun(plan_json=None, snapshot=self.snapshot(a, rule_ids), fence=token)

    def snapshot(self, a: str, rule_ids: Sequence[str]) -> Snapshot:
        results = {}
        statuses = {}
        for r in rule_ids:
            value = self.get(result_key(a, r))
            if value is not None:
                results[r] = RuleResult.from_json(value)
        for r in rule_ids:
            value = self.get(status_key(a, r))
            if value is not None:
                statuses[r] = value
        passes = self.get(eval_key(a, "passes")) or {}
        return Snapshot(results=results, statuses=statuses, published_passes=frozenset(passes))

    def stored_plan(self, a: str) -> Any:
        return self.get(eval_key(a, "plan"))

    def record(self, a: str) -> tuple[str | None, Any, bool]:
        return (
            self.get(eval_key(a, "state")),
            self.get(eval_key(a, "plan")),
            bool(self.get(eval_key(a, "final_published"))),
        )

    def settled(self, attempt_ids: Sequence[str]) -> AbstractSet[str]:
        """Those of `attempt_ids` terminal and announced (`record`'s state and flag), as
        the harness asks every 0.1 s simulated (`on_settled`, the same ids each time): read
        again only where one of the two keys was written or reached its expiry since the
        last time (a run of 10,000 evaluations asks about 500 times): a key's value changes
        only by a write or by its expiry, so what a read found holds until then. The set is
        this server's own, kept up to date: read it, never change it."""
        now, found, keys, expiring = self.env.now, self._found, self._settled_keys, self._expiring
        if attempt_ids is not self._asked:  # other ids: every one read
            self._asked = attempt_ids
            found.clear()
            expiring.clear()
            again: Iterable[str] = attempt_ids
        else:
            due: set[str] = set()
            for key in self._written or ():
                a = keys.get(key)
                if a is not None:
                    due.add(a)
            while expiring and expiring[0][0] < now:
                due.add(heapq.heappop(expiring)[1])
            again = sorted(due)
        self._written = set()
        for a in again:
            state, pub = eval_key(a, "state"), eval_key(a, "final_published")
            keys[state] = keys[pub] = a
            until = min(self.expires.get(state, math.inf), self.expires.get(pub, math.inf))
            if until < math.inf:  # read again once it passed (a later write: sooner)
                heapq.heappush(expiring, (until, a))
            if self.get(state) in TERMINAL and self.get(pub):
                found.add(a)
            else:
                found.discard(a)
        return found

    def flag_announced(self, a: str) -> None:
        """The outbox's flag (migration 0005): the final state's own transaction wrote its
        `evaluation.completed`, so no recovery announces it again."""
        self._set(eval_key(a, "final_published"), "1", self.ttl)

    def done(self, a: str, me: str) -> bool:
        if self._over(a) is None:  # the final state was lost: nothing written
            return False
        self._set(eval_key(a, "final_published"), "1", self.ttl)
        self._zrem(self.running_index, a)
        self._unindex_retries(a)
        self.release(a, me)
        return True

    def finish(
        self,
        a: str,
        status: str,
        results: Mapping[str, RuleResult],
        failed: Sequence[str],
        fence: str | None = None,
    ) -> tuple[str | None, list[str]] | Fenced:
        refused = self._fenced(a, fence)
        if refused is not None:
            return refused
        over = self._over(a)
        if over is not None:
            return over, []
        restored = []
        for rule_id, result in results.items():
            key = result_key(a, rule_id)
            if self.get(key) is None:
                self._set(key, result.to_json(), self.ttl)
                self._number(a, rule_id)
                restored.append(rule_id)
        for rule_id in failed:
            key = status_key(a, rule_id)
            if self.get(key) != PERMANENTLY_FAILED:
                self._set(key, PERMANENTLY_FAILED, self.ttl)
                restored.append(rule_id)
        self._set(eval_key(a, "state"), status, self.ttl)
        return None, restored

    def park(
        self, a: str, me: str, fence: str | None = None, waiting: Sequence[str] = ()
    ) -> Fenced | None:
        """`_PARK`: a retry waited for and no longer indexed is indexed as due now."""
        refused = self._fenced(a, fence)
        if refused is not None:
            return refused
        if self.get(eval_key(a, "state")) not in TERMINAL:
            self._set(eval_key(a, "state"), "parked", self.ttl)
            if waiting:
                index = self._container(self.retries_index)
                for rule_id in waiting:
                    index.setdefault(retry_member(a, rule_id), self._now_ms())
                self._expire(self.retries_index, self.ttl)
        self._zrem(self.running_index, a)
        self.release(a, me)
        return None

    def set_state(self, a: str, state: str) -> str | None:
        cur = self.get(eval_key(a, "state"))
        if cur in TERMINAL:
            return cur
        self._set(eval_key(a, "state"), state, self.ttl)
        if state in TERMINAL:
            self._unindex_retries(a)
        return None

    def mark_pass_published(
        self, a: str, pass_id: str, outcome: str, fence: str | None = None
    ) -> Fenced | None:
        refused = self._fenced(a, fence)
        if refused is not None:
            return refused
        key = eval_key(a, "passes")
        self._container(key)[pass_id] = outcome
        self._expire(key, self.ttl)
        return None

    def renew(self, fences: Mapping[str, str], me: str, now_ms: int) -> dict[str, Renewal]:
        """`_RENEW`: each answer with the lease's PEXPIRETIME once renewed."""
        out: dict[str, Renewal] = {}
        for a, token in fences.items():
            owner = eval_key(a, "owner")
            cur = self.get(owner)
            fence = self.get(eval_key(a, "fence"))
            if (
                not token
                or (fence is not None and fence != token)
                or (cur is not None and cur != me)
            ):
                out[a] = Renewal(0)
                continue
            if fence is None:
                self._set(eval_key(a, "fence"), token, self.ttl)
            self._set(owner, me, self.lease_s)
            forgotten = self.get(eval_key(a, "state")) is None
            if forgotten:
                self._set(eval_key(a, "state"), "running", self.ttl)
            if self._over(a) is None:
                self._zadd(self.running_index, a, now_ms)
            out[a] = Renewal(2 if forgotten else 1, self._pexpiretime(owner))
        return out

    def _pexpiretime(self, key: str) -> int:
        """`PEXPIRETIME` of a key that exists: when it expires, in ms of the simulated clock
        (-1: no TTL)."""
        exp = self.expires.get(key)
        return -1 if exp is None else round(exp * 1000)

    def reinstate(self, a: str, plan: Any) -> bool:
        key = eval_key(a, "plan")
        if self.get(key) is not None:
            return False
        self._set(key, plan, self.ttl)
        return True

    def holder(self, a: str) -> str | None:
        return self.get(eval_key(a, "owner"))

    def release(self, a: str, me: str) -> None:
        owner = eval_key(a, "owner")
        if self.get(owner) == me:
            self._del(owner)

    def unindex(self, a: str) -> None:
        self._zrem(self.running_index, a)
        self._unindex_retries(a)

    def stale_evaluations(self, older_than_ms: int, now_ms: int) -> list[str]:
        return self._zrange_upto(self.running_index, now_ms - older_than_ms, 100)

    def claim_stale(self, a: str, older_than_ms: int, now_ms: int) -> bool:
        z = self.get(self.running_index) or {}
        score = z.get(a)
        if score is None or score > now_ms - older_than_ms:
            return False
        if self._over(a) is not None and self.get(eval_key(a, "final_published")):
            self._zrem(self.running_index, a)
            return False
        if self.get(eval_key(a, "owner")) is not None:
            return False
        self._container(self.running_index)[a] = now_ms
        return True

    def overdue_retries(self, grace_ms: int, now_ms: int) -> list[str]:
        return self._zrange_upto(self.retries_index, now_ms - grace_ms, 100)

    def claim_retry(self, member: str, grace_ms: int, now_ms: int) -> str | None:
        """`_CLAIM_RETRY`: the rule's status, read with the claim (None: not claimed)."""
        z = self.get(self.retries_index) or {}
        score = z.get(member)
        if score is None or score > now_ms - grace_ms:
            return None
        a, rule_id = split_member(member)
        if self._over(a) is not None:
            self._zrem(self.retries_index, member)
            return None
        self._container(self.retries_index)[member] = now_ms + grace_ms
        return self.get(status_key(a, rule_id))


class _Batch:
    """Scripts that travel together: `sent` fires when they may go (None: at once)."""

    __slots__ = ("at", "calls", "sent")

    def __init__(self, sent: simpy.Event | None, at: float) -> None:
        self.sent = sent
        self.at = at
        self.calls = 0


class RedisClient:
    """One process's connection to `SimRedis` (see the module docstring)."""

    RETRIES = 40

    def __init__(
        self,
        env: simpy.Environment,
        redis: SimRedis,
        rng: random.Random,
        latency_s: tuple[float, float],
        *,
        link: Link | None = None,
        read_timeout_s: float = 30.0,
        wait_replicas: int = 0,
        wait_timeout_s: float = 1.0,
    ) -> None:
        self.env = env
        self.redis = redis
        self.wait_replicas = wait_replicas  # the live store's WAIT after each batch
        self.wait_timeout_s = wait_timeout_s
        self._uniform = rng.uniform
        self._lo, self._hi = latency_s
        self._out_at = 0.0  # arrival of the last request: requests stay in order
        self._in_at = 0.0  # arrival of the last reply: replies too
        self.link = link  # the worker's proxy to Redis (None: the runner's own client)
        self.read_timeout_s = read_timeout_s  # redis-py's socket_timeout
        self.conn = link.open(None) if link is not None else None
        self._flying: _Batch | None = None  # the scripts' batch in flight (`call`)
        self._next: _Batch | None = None  # the scripts waiting for it to land

    def hang_up(self) -> None:
        """The process died: its socket goes, what it sent still lands."""
        if self.conn is not None:
            self.conn.discard()

    def now_ms(self) -> int:
        return int(self.env.now * 1000)

    def call(
        self, fn: Callable[..., Any], *args: Any, batched: bool = False
    ) -> Generator[simpy.Event, Any, Any]:
        """`fn(*args)` applied in Redis, its reply back. `batched`: one of the store's
        scripts, which the live store sends through its `AutoPipeline`: one batch in
        flight at a time, so a script called while one travels waits for it and goes out
        with the next (a reply slowed down holds back every script after it, as live);
        plain commands go on a connection of their own."""
        if not batched:
            return (yield from self._call(fn, args))
        batch = self._board()
        try:
            sent = batch.sent
            if batch is not self._flying or (sent is not None and not sent.processed):
                # Waiting for the batch, or boarding it as it leaves while the calls that
                # waited for it are still to go: after them, as live (one queue, in order).
                yield sent
            return (yield from self._call(fn, args, self.wait_replicas > 0))
        finally:
            self._alight(batch)

    def _replicated(self, applied_at: float) -> bool:
        """Whether the replica received a write applied at `applied_at`: replication ran
        from then until `lag_s` later (a `WAIT` it answers)."""
        redis = self.redis
        if redis.lag_s is None:
            return True
        since = redis.unreplicated_since
        return since is None or since > applied_at + redis.lag_s

    def _board(self) -> _Batch:
        """The batch a script call rides: the one in flight if it left at this very instant
        (the same event-loop turn, live), else the next one."""
        now, flying = self.env.now, self._flying
        if flying is None:
            batch = self._flying = _Batch(None, now)
        elif flying.at == now:
            batch = flying
        else:
            batch = self._next
            if batch is None:
                batch = self._next = _Batch(self.env.event(), now)
        batch.calls += 1
        return batch

    def _alight(self, batch: _Batch) -> None:
        """A call of `batch` is over; the last one lands the batch and sends the next."""
        batch.calls -= 1
        if batch is not self._flying or batch.calls > 0:
            return
        nxt, self._next = self._next, None
        if nxt is not None and nxt.calls == 0:  # every call in it was cancelled
            nxt = None
        self._flying = nxt
        if nxt is not None:
            nxt.at = self.env.now
            assert nxt.sent is not None
            nxt.sent.succeed()

    def _call(
        self, fn: Callable[..., Any], args: tuple[Any, ...], replicated: bool = False
    ) -> Generator[Any, Any, Any]:
        """`replicated`: its batch ends with `WAIT`, so the reply comes once the replica
        holds the write (`SimRedis.lag_s` after it was applied); a primary that dies before
        loses the write and the reply both, and the client tries again."""
        link = self.link
        if link is not None and not link.calm:  # toxics, or cut: through the proxy
            return (yield from self._through(fn, args))
        env, redis = self.env, self.redis
        failures = 0
        while True:
            now = env.now
            at = now + self._uniform(self._lo, self._hi)
            if at < self._out_at:
                at = self._out_at
            self._out_at = at
            box: list[Any] = []  # [epoch, reply, from a primary replaced meanwhile]
            held: list[simpy.Event] = []  # it arrived at a paused server

            def arrive(_: simpy.Event, box: list[Any] = box, held: list = held) -> None:
                if redis.up:
                    epoch = redis.epoch
                    over = redis.serve(fn, args, lambda v, z: box.extend((epoch, v, z)))
                    if over is not None:
                        held.append(over)

            request = env.timeout(at - now)
            request.callbacks.append(arrive)  # runs even if the caller is interrupted
            yield request
            if held and not box:  # no answer until it resumes, or redis-py's timeout
                yield held[0] | env.timeout(self.read_timeout_s)
            if box:
                now = env.now
                back = now + self._uniform(self._lo, self._hi)
                if replicated and redis.lag_s is not None:
                    back += redis.lag_s  # WAIT: until the replica holds it
                if back < self._in_at:
                    back = self._in_at
                self._in_at = back
                yield env.timeout(back - now)
                if replicated and (box[2] or not self._replicated(now)):
                    yield env.timeout(max(0.0, now + self.wait_timeout_s - env.now))
                    raise ConnectionError("not replicated (simulated WAIT timed out)")
                if redis.epoch == box[0]:
                    if isinstance(box[1], Fenced):
                        raise LeaseLost(f"{box[1].attempt_id}: the lease is {box[1].other}'s now")
                    if box[1] is NOREPLICAS:
                        raise ConnectionError("NOREPLICAS (simulated min-replicas-to-write)")
                    return box[1]
            failures += 1  # connection refused or reset: redis-py's Retry
            if failures > self.RETRIES:
                raise ConnectionError("Redis unreachable (simulated)")
            yield env.timeout(min(1.0, 0.02 * 2**failures))

    # --- through a proxy with toxics (sim.network) --------------------------------------

    def _through(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Generator[Any, Any, Any]:
        """`call` on a link that is not calm: a refused or closed connection fails at once,
        a reply that does not come fails after `read_timeout_s` (redis-py then drops the
        connection); either way the retry runs on a new connection, with the backoff."""
        assert self.link is not None
        failures = 0
        while True:
            conn = self.conn
            if conn is None or not conn.open:
                conn = self.conn = self.link.open(None)
            if conn is not None:
                got = yield from self._attempt(conn, fn, args)
                if got is not _LOST:
                    if isinstance(got, Fenced):
                        raise LeaseLost(f"{got.attempt_id}: the lease is {got.other}'s now")
                    if got is NOREPLICAS:
                        raise ConnectionError("NOREPLICAS (simulated min-replicas-to-write)")
                    return got
            failures += 1
            if failures > self.RETRIES:
                raise ConnectionError("Redis unreachable (simulated)")
            yield self.env.timeout(min(1.0, 0.02 * 2**failures))

    def _attempt(self, conn: Conn, fn: Callable[..., Any], args: tuple[Any, ...]) -> Generator:
        env, redis = self.env, self.redis
        now = env.now
        at = conn.pass_(UP, size_of(args), now + self._uniform(self._lo, self._hi))
        reply = env.event()
        if at is not None:
            at = max(at, self._out_at)
            self._out_at = at

            def arrive(_: simpy.Event, at: float = at) -> None:
                if conn.closed_at is not None and conn.closed_at < at:
                    return  # dropped in the proxy with its connection
                if not redis.up:  # the proxy's upstream is refused: it closes this one
                    conn.close("server")
                    return
                epoch = redis.epoch
                # applied, whatever becomes of the reply (a paused server: once it resumes)
                redis.serve(fn, args, lambda value, _: answer(value, epoch))

            def answer(value: Any, epoch: int) -> None:
                t = env.now
                back = conn.pass_(DOWN, size_of(value), t + self._uniform(self._lo, self._hi))
                if back is None:
                    return  # the reply is lost after the write was applied
                back = max(back, self._in_at)
                self._in_at = back

                def deliver(_: simpy.Event) -> None:
                    if redis.epoch != epoch:
                        conn.close("server")
                    elif (conn.closed_at is None or conn.closed_at >= back) and not (
                        reply.triggered
                    ):
                        reply.succeed(value)

                env.timeout(back - t).callbacks.append(deliver)

            env.timeout(at - now).callbacks.append(arrive)
        yield reply | conn.closed() | env.timeout(self.read_timeout_s)
        if reply.triggered:
            return reply.value
        conn.close("client")  # a timeout: redis-py disconnects; a close: already gone
        return _LOST


def _seconds_left(expires_at: float | None, now: float) -> int:
    """What `TTL` answers for a key that exists: seconds left, rounded as Redis rounds
    them; -1 without a TTL."""
    if expires_at is None:
        return -1
    return int((round((expires_at - now) * 1000) + 500) // 1000)


#: Where the event of an outbox is a final state's announcement (written by `finish`, or
#: by a cancel's `set_state`), its transaction flags it published too.
FINAL_STATE_OPS = frozenset({"finish", "set_state"})


def took_effect(op: str, reply: Any) -> bool:
    """Whether the operation `op` changed what its event announces (migration 0005's
    `eai._took_effect`): not refused by the fence, a begin that took the lease, a final
    state that won."""
    if isinstance(reply, Fenced):
        return False
    if op == "begin":
        return reply.snapshot is not None
    if op == "finish":
        return reply[0] is None
    if op == "set_state":
        return reply is None
    return True


def announcing(
    store: SimRedis, jobs: Any, op: str, call: Callable[..., Any], event: Any
) -> Callable[..., Any]:
    """`call` (the reference of `op`) and its event's outbox row (`jobs`, `sim.pgqueue`) in
    one transaction, as `eai.apply`'s `announce` (migrations 0004, 0005): the row only if
    the operation took effect; begin's sets `resumed`; a final state's flags it published;
    a synchronous commit, as every event's."""

    def both(*args: Any) -> Any:
        reply = call(*args)
        if took_effect(op, reply):
            body = dict(event.body)
            if op == "begin":
                body["resumed"] = not reply.snapshot.empty
            elif op in FINAL_STATE_OPS:
                store.flag_announced(args[0])
            jobs.apply("event", event.routing_key, event.message_id, body)
            store.synced()
        return reply

    return both
