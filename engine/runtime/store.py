"""Redis, the second memory: rule results and statuses, keyed exactly as the seed keys them.

    attempt:{attemptId}:rule:{ruleId}:result   RuleResult JSON     (the first write wins)
    attempt:{attemptId}:rule:{ruleId}:status   failed_attempt_N | permanently_failed

Every write is one atomic command or Lua script and sets the 7-day TTL in the same step (a
plain SET would drop it). Around those two keys the engine keeps its own bookkeeping: the
plan (a resume after the ACK has no message to read it from), the evaluation state, the
owner lease that the heartbeat renews, the attempts started (to count reruns), and two
indexes the sweeper scans: evaluations running, and delayed retries with their due time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from engine.config import EngineConfig
from engine.core import RuleResult, Snapshot, status_rank
from engine.core.states import TERMINAL_EVALUATION_STATUSES
from engine.runtime.autopipeline import AutoPipeline


def result_key(attempt_id: str, rule_id: str) -> str:
    return f"attempt:{attempt_id}:rule:{rule_id}:result"


def status_key(attempt_id: str, rule_id: str) -> str:
    return f"attempt:{attempt_id}:rule:{rule_id}:status"


def runs_key(attempt_id: str, rule_id: str) -> str:
    return f"attempt:{attempt_id}:rule:{rule_id}:runs"


def eval_key(attempt_id: str, what: str) -> str:
    """plan | state | passes | owner | final_published"""
    return f"attempt:{attempt_id}:{what}"


def retry_member(attempt_id: str, rule_id: str) -> str:
    return f"{attempt_id}\x1f{rule_id}"


def split_member(member: str) -> tuple[str, str]:
    attempt_id, _, rule_id = member.partition("\x1f")
    return attempt_id, rule_id


def now_ms() -> int:
    return int(time.time() * 1000)


_TERMINAL = ",".join(sorted(s.value for s in TERMINAL_EVALUATION_STATUSES))

# Store a result (the first write wins) and count the starts of the rules it makes ready,
# in one round trip: a rule's start marker rides on its dependency's result.
# KEYS: result, retries index, runs keys... ARGV: json, ttl, member, attempts...
# Returns {'' when this write won, else the stored result; start counts...}.
_WRITE_RESULT = """
local won = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[3])
local out = {''}
if not won then out[1] = redis.call('GET', KEYS[1]) end
for i = 3, #KEYS do
  out[i - 1] = redis.call('HINCRBY', KEYS[i], ARGV[i + 1], 1)
  redis.call('EXPIRE', KEYS[i], ARGV[2])
end
return out
"""

# KEYS: status, retries index. ARGV: status, rank, ttl, member, due_ms ('' = not retrying).
# Nil when written; the current status when it would have moved the attempt count back.
_WRITE_STATUS = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local rank = 0
  if cur == 'permanently_failed' then rank = 1000000
  else rank = tonumber(string.match(cur, '^failed_attempt_(%d+)$')) or 0 end
  if rank >= tonumber(ARGV[2]) then return cur end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
if ARGV[5] ~= '' then redis.call('ZADD', KEYS[2], ARGV[5], ARGV[4])
else redis.call('ZREM', KEYS[2], ARGV[4]) end
return false
"""

# Start (or resume) an evaluation in one round trip: the lease, the terminal check, the
# plan, the state, the running index and the snapshot of every rule.
# KEYS: owner, state, plan, final_published, running index, passes, results..., statuses...
# ARGV: me, lease_ms, plan json ('' = use the stored one), ttl, now_ms, attempt_id, terminal
# list. Returns {'held', holder} | {'terminal', state, published} | {'noplan'} |
# {'ok', plan json, {results and statuses}, {published passes}}.
_BEGIN = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return {'held', cur} end
local state = redis.call('GET', KEYS[2])
if state and string.find(',' .. ARGV[7] .. ',', ',' .. state .. ',', 1, true) then
  return {'terminal', state, redis.call('GET', KEYS[4]) or ''}
end
local plan = ARGV[3]
if plan == '' then plan = redis.call('GET', KEYS[3]) else
  redis.call('SET', KEYS[3], plan, 'NX', 'EX', ARGV[4]) end
if not plan then return {'noplan'} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SET', KEYS[2], 'running', 'EX', ARGV[4])
redis.call('ZADD', KEYS[5], ARGV[5], ARGV[6])
local values = {}
if #KEYS > 6 then values = redis.call('MGET', unpack(KEYS, 7)) end
for i = 1, #values do if not values[i] then values[i] = '' end end
return {'ok', plan, values, redis.call('HKEYS', KEYS[6])}
"""

# KEYS: runs keys... ARGV: ttl, attempts... The number of starts of each attempt so far.
_MARK_STARTED = """
local out = {}
for i = 1, #KEYS do
  out[i] = redis.call('HINCRBY', KEYS[i], ARGV[i + 1], 1)
  redis.call('EXPIRE', KEYS[i], ARGV[1])
end
return out
"""

# KEYS: passes. ARGV: pass id, outcome, ttl.
_MARK_PASS = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""

# After evaluation.completed is out: flag it, leave the running index, give the lease back.
# KEYS: final_published, running index, owner. ARGV: ttl, attempt_id, me.
_DONE = """
redis.call('SET', KEYS[1], '1', 'EX', ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[2])
if redis.call('GET', KEYS[3]) == ARGV[3] then redis.call('DEL', KEYS[3]) end
return 1
"""

# Only delayed retries are left: out of the running index, lease given back.
# KEYS: state, running index, owner. ARGV: ttl, attempt_id, me, terminal list.
_PARK = """
local cur = redis.call('GET', KEYS[1])
if not (cur and string.find(',' .. ARGV[4] .. ',', ',' .. cur .. ',', 1, true)) then
  redis.call('SET', KEYS[1], 'parked', 'EX', ARGV[1])
end
redis.call('ZREM', KEYS[2], ARGV[2])
if redis.call('GET', KEYS[3]) == ARGV[3] then redis.call('DEL', KEYS[3]) end
return 1
"""

# KEYS: owner. ARGV: expected holder, me, lease_ms. 1 when taken over.
_STEAL = """
local cur = redis.call('GET', KEYS[1])
if (not cur) or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"""

# KEYS: owner, running index. ARGV: me, lease_ms, now_ms, attempt_id. 1 while still ours.
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
return 1
"""

# KEYS: owner. ARGV: me.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: state. ARGV: new state, ttl, terminal list. Nil when written; else the state kept.
_SET_STATE = """
local cur = redis.call('GET', KEYS[1])
if cur and string.find(',' .. ARGV[3] .. ',', ',' .. cur .. ',', 1, true) then return cur end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return false
"""

# KEYS: running index, owner. ARGV: attempt_id, threshold_ms, now_ms. 1 when claimed.
_CLAIM_STALE = """
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if (not s) or tonumber(s) > tonumber(ARGV[2]) then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
return 1
"""

# KEYS: retries index. ARGV: member, threshold_ms, new_score. 1 when claimed.
_CLAIM_RETRY = """
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if (not s) or tonumber(s) > tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
return 1
"""


@dataclass(frozen=True)
class Begun:
    """What `RedisStore.begin` found: exactly one of the outcomes is set."""

    holder: str | None = None  # another worker holds the lease
    terminal: str | None = None  # the evaluation is over (and `published` says if announced)
    published: bool = False
    no_plan: bool = False
    plan_json: str | None = None
    snapshot: Snapshot | None = None


@dataclass(frozen=True)
class EvaluationRecord:
    """What Redis holds of one evaluation as a whole."""

    state: str | None
    plan_json: str | None
    final_published: bool


class RedisStore:
    def __init__(self, config: EngineConfig, client: aioredis.Redis | None = None) -> None:
        self.config = config
        self.ttl = config.state_ttl_s
        self.running_index = config.name("engine:running")
        self.retries_index = config.name("engine:retries")
        self.redis = client or aioredis.Redis.from_url(
            config.redis_url,
            decode_responses=True,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.02), retries=40),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            socket_connect_timeout=2.0,
            health_check_interval=0,
        )
        r = self.redis
        self.batch = AutoPipeline(r)
        self._write_result = self.batch.register(_WRITE_RESULT)
        self._write_status = self.batch.register(_WRITE_STATUS)
        self._steal = self.batch.register(_STEAL)
        self._renew = self.batch.register(_RENEW)
        self._release = self.batch.register(_RELEASE)
        self._set_state = self.batch.register(_SET_STATE)
        self._claim_stale = self.batch.register(_CLAIM_STALE)
        self._claim_retry = self.batch.register(_CLAIM_RETRY)
        self._begin = self.batch.register(_BEGIN)
        self._mark_started = self.batch.register(_MARK_STARTED)
        self._done = self.batch.register(_DONE)
        self._mark_pass = self.batch.register(_MARK_PASS)
        self._park = self.batch.register(_PARK)

    async def close(self) -> None:
        await self.redis.aclose()

    # --- rules --------------------------------------------------------------------------

    async def write_result(
        self, attempt_id: str, result: RuleResult, starts: Sequence[tuple[str, int]] = ()
    ) -> tuple[RuleResult | None, list[int]]:
        """Store a result unless one is there already, and count the given starts.

        Returns the result that was there before (None when this write won) and, for each
        (rule, attempt) in `starts`, how many times that attempt has now been started.
        """
        reply = await self.batch.call(
            self._write_result,
            keys=[
                result_key(attempt_id, result.rule_id),
                self.retries_index,
                *(runs_key(attempt_id, r) for r, _ in starts),
            ],
            args=[
                result.to_json(),
                self.ttl,
                retry_member(attempt_id, result.rule_id),
                *(n for _, n in starts),
            ],
        )
        existing = RuleResult.from_json(reply[0]) if reply[0] else None
        return existing, [int(c) for c in reply[1:]]

    async def write_status(
        self, attempt_id: str, rule_id: str, status: str, due_ms: int | None = None
    ) -> str | None:
        """Write a status unless it would move the attempt count back; return the kept one."""
        return await self.batch.call(
            self._write_status,
            keys=[status_key(attempt_id, rule_id), self.retries_index],
            args=[
                status,
                status_rank(status),
                self.ttl,
                retry_member(attempt_id, rule_id),
                "" if due_ms is None else due_ms,
            ],
        )

    async def mark_started(self, attempt_id: str, starts: Sequence[tuple[str, int]]) -> list[int]:
        """Count the starts of rule attempts; more than one means a crash lost a run."""
        reply = await self.batch.call(
            self._mark_started,
            keys=[runs_key(attempt_id, r) for r, _ in starts],
            args=[self.ttl, *(n for _, n in starts)],
        )
        return [int(c) for c in reply]

    async def begin(
        self, attempt_id: str, me: str, rule_ids: Sequence[str], plan_json: str | None
    ) -> Begun:
        """Take the lease and load everything the evaluation needs, in one round trip.

        `rule_ids` are those of `plan_json` when given; with None, the stored plan is used
        and its rules must be the ones passed (the caller read it first).
        """
        keys = [eval_key(attempt_id, w) for w in ("owner", "state", "plan", "final_published")]
        keys += [self.running_index, eval_key(attempt_id, "passes")]
        keys += [result_key(attempt_id, r) for r in rule_ids]
        keys += [status_key(attempt_id, r) for r in rule_ids]
        reply = await self.batch.call(
            self._begin,
            keys=keys,
            args=[
                me,
                self.config.stale_ms,
                plan_json or "",
                self.ttl,
                now_ms(),
                attempt_id,
                _TERMINAL,
            ],
        )
        kind = reply[0]
        if kind == "held":
            return Begun(holder=reply[1])
        if kind == "terminal":
            return Begun(terminal=reply[1], published=bool(reply[2]))
        if kind == "noplan":
            return Begun(no_plan=True)
        values, passes = reply[2], reply[3]
        n = len(rule_ids)
        found = zip(rule_ids, values[:n], strict=True)
        results = {r: RuleResult.from_json(v) for r, v in found if v}
        statuses = {r: v for r, v in zip(rule_ids, values[n:], strict=True) if v}
        snap = Snapshot(results=results, statuses=statuses, published_passes=frozenset(passes))
        return Begun(plan_json=reply[1], snapshot=snap)

    async def stored_plan(self, attempt_id: str) -> str | None:
        return await self.redis.get(eval_key(attempt_id, "plan"))

    async def done(self, attempt_id: str, me: str) -> None:
        """evaluation.completed is published: flag it, unindex, give the lease back."""
        await self.batch.call(
            self._done,
            keys=[
                eval_key(attempt_id, "final_published"),
                self.running_index,
                eval_key(attempt_id, "owner"),
            ],
            args=[self.ttl, attempt_id, me],
        )

    async def park(self, attempt_id: str, me: str) -> None:
        await self.batch.call(
            self._park,
            keys=[eval_key(attempt_id, "state"), self.running_index, eval_key(attempt_id, "owner")],
            args=[self.ttl, attempt_id, me, _TERMINAL],
        )

    async def snapshot(self, attempt_id: str, rule_ids: Sequence[str]) -> Snapshot:
        """Everything Redis knows of the rules of one evaluation, in one round trip."""
        keys = [result_key(attempt_id, r) for r in rule_ids]
        keys += [status_key(attempt_id, r) for r in rule_ids]
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.mget(keys)
            pipe.hgetall(eval_key(attempt_id, "passes"))
            values, passes = await pipe.execute()
        n = len(rule_ids)
        found = zip(rule_ids, values[:n], strict=True)
        results = {r: RuleResult.from_json(v) for r, v in found if v}
        statuses = {r: v for r, v in zip(rule_ids, values[n:], strict=True) if v}
        return Snapshot(results=results, statuses=statuses, published_passes=frozenset(passes))

    # --- evaluations --------------------------------------------------------------------

    async def record(self, attempt_id: str) -> EvaluationRecord:
        state, plan, published = await self.redis.mget(
            [eval_key(attempt_id, w) for w in ("state", "plan", "final_published")]
        )
        return EvaluationRecord(state=state, plan_json=plan, final_published=bool(published))

    async def set_state(self, attempt_id: str, state: str) -> str | None:
        """Set the evaluation state unless it is terminal already; return the kept terminal one.

        A terminal state is written once: whoever wins publishes evaluation.completed.
        """
        return await self.batch.call(
            self._set_state, keys=[eval_key(attempt_id, "state")], args=[state, self.ttl, _TERMINAL]
        )

    async def mark_pass_published(self, attempt_id: str, pass_id: str, outcome: str) -> None:
        await self.batch.call(
            self._mark_pass,
            keys=[eval_key(attempt_id, "passes")],
            args=[pass_id, outcome, self.ttl],
        )

    async def mark_final_published(self, attempt_id: str) -> None:
        await self.redis.set(eval_key(attempt_id, "final_published"), "1", ex=self.ttl)

    # --- ownership, heartbeats, indexes ---------------------------------------------------

    async def steal(self, attempt_id: str, holder: str, me: str) -> bool:
        """Take over from a holder known to be dead (its private queue is gone)."""
        return bool(
            await self.batch.call(
                self._steal,
                keys=[eval_key(attempt_id, "owner")],
                args=[holder, me, self.config.stale_ms],
            )
        )

    async def renew(self, attempt_ids: Iterable[str], me: str) -> dict[str, bool]:
        """The heartbeat: extend each lease still ours and stamp the running index."""
        ids = list(attempt_ids)
        if not ids:
            return {}
        now = now_ms()
        out = await asyncio.gather(
            *[
                self.batch.call(
                    self._renew,
                    keys=[eval_key(a, "owner"), self.running_index],
                    args=[me, self.config.stale_ms, now, a],
                )
                for a in ids
            ]
        )
        return {a: bool(v) for a, v in zip(ids, out, strict=True)}

    async def release(self, attempt_id: str, me: str) -> None:
        await self.batch.call(self._release, keys=[eval_key(attempt_id, "owner")], args=[me])

    async def unindex_running(self, attempt_id: str) -> None:
        await self.redis.zrem(self.running_index, attempt_id)

    async def stale_evaluations(self, older_than_ms: int, limit: int = 100) -> list[str]:
        return await self.redis.zrangebyscore(
            self.running_index, "-inf", now_ms() - older_than_ms, start=0, num=limit
        )

    async def claim_stale(self, attempt_id: str, older_than_ms: int) -> bool:
        now = now_ms()
        return bool(
            await self.batch.call(
                self._claim_stale,
                keys=[self.running_index, eval_key(attempt_id, "owner")],
                args=[attempt_id, now - older_than_ms, now],
            )
        )

    async def overdue_retries(self, grace_ms: int, limit: int = 100) -> list[str]:
        return await self.redis.zrangebyscore(
            self.retries_index, "-inf", now_ms() - grace_ms, start=0, num=limit
        )

    async def claim_retry(self, member: str, grace_ms: int) -> bool:
        now = now_ms()
        return bool(
            await self.batch.call(
                self._claim_retry,
                keys=[self.retries_index],
                args=[member, now - grace_ms, now + grace_ms],
            )
        )

    async def status_of(self, attempt_id: str, rule_id: str) -> str | None:
        return await self.redis.get(status_key(attempt_id, rule_id))
