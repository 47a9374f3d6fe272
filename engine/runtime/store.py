"""Redis, the second memory: rule results and statuses, keyed exactly as the seed keys them.

    attempt:{attemptId}:rule:{ruleId}:result   RuleResult JSON     (the first write wins)
    attempt:{attemptId}:rule:{ruleId}:status   failed_attempt_N | permanently_failed

Every write is one atomic command or Lua script and sets the 7-day TTL in the same step (a
plain SET would drop it). Around those two keys the engine keeps its own bookkeeping: the
plan (a resume after the ACK has no message to read it from), the evaluation state, the
owner lease that the heartbeat renews, the attempts started (to count reruns), and two
indexes the sweeper scans: evaluations running, and delayed retries with their due time.
It also remembers the namespace's RabbitMQ queues and exchanges (`{namespace}engine:topology`)
so `python -m engine.submit --purge` can remove exactly what the engine declared.

Every client gets the config's connect and read timeouts. The store's own client retries a
failed command for about 40 s (a Redis restart must not kill the worker); `probe()` makes
the first contact without retries, so a wrong URL or password fails at once and says why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import AuthenticationError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from engine.config import (
    EngineConfig,
    ServiceUnavailable,
    network_reason,
    scrubbed,
    secrets_of,
)
from engine.core import PERMANENTLY_FAILED, RuleResult, Snapshot, status_rank
from engine.core.states import TERMINAL_EVALUATION_STATUSES
from engine.keys import (
    eval_key,
    result_key,
    retry_member,
    runs_key,
    split_member,
    status_key,
)
from engine.plan import Plan
from engine.runtime.autopipeline import AutoPipeline
from engine.runtime.sentinel import sentinel_client
from engine.sentinel_url import is_sentinel_url
from engine.shell.replies import Begun, LeaseLost, Renewal, StatusWritten


def now_ms() -> int:
    return int(time.time() * 1000)


def _renewal(reply: Any) -> Renewal:
    """`_RENEW`'s reply: 0, or {1 or 2, the lease's PEXPIRETIME}."""
    if isinstance(reply, list):
        return Renewal(int(reply[0]), int(reply[1]))
    return Renewal(int(reply))


def glob_escape(text: str) -> str:
    """`text` as a literal inside a Redis MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def redis_unavailable(exc: BaseException, url: str, timeout_s: float) -> ServiceUnavailable:
    """What a failed first contact with Redis means, as the one line `ServiceUnavailable`."""
    if isinstance(exc, ServiceUnavailable):
        return exc
    if isinstance(exc, AuthenticationError):
        reason = "wrong user name or password" if secrets_of(url) else "it requires a password"
        return ServiceUnavailable("Redis", url, reason, "REDIS_URL", login=True)
    text = scrubbed(str(exc), url)
    if isinstance(exc, RedisError) and ("WRONGPASS" in text or "NOAUTH" in text):
        return ServiceUnavailable("Redis", url, text, "REDIS_URL", login=True)
    reason = network_reason(exc, timeout_s)
    if reason is not None:
        return ServiceUnavailable("Redis", url, reason, "REDIS_URL")
    return ServiceUnavailable(
        "Redis", url, f"{type(exc).__name__}: {text}", "REDIS_URL", todo="check REDIS_URL"
    )


def redis_client(config: EngineConfig, *, retries: int = 40) -> aioredis.Redis:
    """A client with the config's timeouts; `retries` > 0 rides out a Redis restart (and,
    through Sentinel, a failover: `engine.runtime.sentinel`)."""
    retry = Retry(ExponentialBackoff(cap=1.0, base=0.02), retries=retries)
    settings = {
        "decode_responses": True,
        "retry": retry if retries > 0 else Retry(NoBackoff(), 0),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError] if retries > 0 else [],
        "socket_connect_timeout": config.connect_timeout_s,
        "socket_timeout": config.read_timeout_s,
        "health_check_interval": 0,
    }
    if is_sentinel_url(config.redis_url):
        return sentinel_client(config.redis_url, **settings)
    return aioredis.Redis.from_url(config.redis_url, **settings)


async def probe_redis(config: EngineConfig) -> None:
    """PING once without retries (the first answer must come within the connect timeout);
    raise `ServiceUnavailable` saying why not."""
    quick = dataclasses.replace(config, read_timeout_s=config.connect_timeout_s)
    try:
        client = redis_client(quick, retries=0)
    except ValueError as exc:  # a malformed URL
        reason = scrubbed(str(exc), config.redis_url)
        raise ServiceUnavailable(
            "Redis", config.redis_url, reason, "REDIS_URL", todo="fix REDIS_URL"
        ) from None
    try:
        await client.ping()
    except (RedisError, OSError) as exc:
        raise redis_unavailable(exc, config.redis_url, config.connect_timeout_s) from None
    finally:
        await client.aclose()


_TERMINAL = ",".join(sorted(s.value for s in TERMINAL_EVALUATION_STATUSES))

# What a script costs inside Redis (`bench/script_cost.py` counts it under callgrind, in
# instructions, per evaluation of code_review.yaml): about 10k to run one at all, 1.4k more
# for each of its KEYS and ARGV (converted into Lua, then collected), and its
# `redis.call`s: a GET about 3.4k, an MGET of three keys 9.3k (so merging reads saves
# little), a write with a TTL 6.6k (EXPIRE, PEXPIRE) to 10.7k and 13.6k (SET with PX or
# EX, which Redis rewrites to PXAT). So the scripts skip writes that would write nothing,
# and work that changes nothing (decoding a plan to take its rules out of an index that is
# not there).

# Shared by the scripts below: whether a state is terminal (ARGV carries the list), and
# taking every rule of an evaluation out of the retries index (its plan names the rules;
# a terminal evaluation leaves every index, so that no sweeper ever acts on it again).
# `terminal` looks for the state in the list as it is first: only a state found there
# (a terminal one, or one that is part of a name in it) builds the two strings of the
# exact test. `unindex_retries` decodes the plan only when there is a retries index to take
# its rules out of (decoding code_review.yaml's JSON costs 170k instructions, more than the
# rest of the script), and takes them out in one ZREM per thousand (Lua's `unpack` has a
# limit) rather than one each.
_LUA_TERMINAL = """
local function terminal(state, list)
  return state and string.find(list, state, 1, true) ~= nil
    and string.find(',' .. list .. ',', ',' .. state .. ',', 1, true) ~= nil
end
"""
_LUA_UNINDEX_RETRIES = """
local function unindex_retries(plan_key, retries, attempt_id)
  local raw = redis.call('GET', plan_key)
  if not raw or redis.call('EXISTS', retries) == 0 then return end
  local ok, plan = pcall(cjson.decode, raw)
  if not ok or type(plan) ~= 'table' or type(plan['passes']) ~= 'table' then return end
  local members = {}
  for _, p in ipairs(plan['passes']) do
    if type(p) == 'table' and type(p['rules']) == 'table' then
      for _, r in ipairs(p['rules']) do
        if type(r) == 'table' and type(r['id']) == 'string' then
          members[#members + 1] = attempt_id .. '\\31' .. r['id']
          if #members == 1000 then
            redis.call('ZREM', retries, unpack(members))
            members = {}
          end
        end
      end
    end
  end
  if #members > 0 then redis.call('ZREM', retries, unpack(members)) end
end
"""


# The fence: every acquisition of the lease writes a new token (`n:worker`, n one more
# than the last); an owner's write carries its token and lands only while that token is
# the current one and no other worker holds the lease, so a worker that lost its lease
# (paused, lagging, partitioned) cannot write over its successor. Each fenced write also
# runs the lease on from the store's clock: an owner that writes, starts or announces
# holds a lease good for another `stale_ms`. A token Redis lost is written back (nobody
# else acquired since: that would have written one). An empty token is an unfenced write
# (tools and tests, never the owner). A lease the owner still holds only has its TTL
# renewed (PEXPIRE: the value is the owner's already; 6.6k instructions where SET PX
# costs 10.7k); a lapsed one is written again.
_LUA_FENCE = """
local function fenced(fence_key, owner_key, token, lease_ms, ttl)
  if token == '' then return nil end
  local me = string.match(token, '^%d+:(.*)$')
  local cur = redis.call('GET', fence_key)
  if cur and cur ~= token then return cur end
  local holder = redis.call('GET', owner_key)
  if holder and holder ~= me then return holder end
  if not cur then redis.call('SET', fence_key, token, 'EX', ttl) end
  if holder then
    redis.call('PEXPIRE', owner_key, lease_ms)
  else
    redis.call('SET', owner_key, me, 'PX', lease_ms)
  end
  return nil
end
"""
_LUA_NEXT_FENCE = """
local function next_fence(fence_key, me, ttl)
  local cur = redis.call('GET', fence_key)
  local n = (cur and tonumber(string.match(cur, '^(%d+):'))) or 0
  local token = (n + 1) .. ':' .. me
  redis.call('SET', fence_key, token, 'EX', ttl)
  return token
end
"""

#: What a fenced script returns, with the current token or holder, when it wrote nothing.
FENCED = "!fenced"


# The store's clock in ms: due times are stamped when a write lands, not when it was sent.
_LUA_NOW = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""


_SHARED = {
    "terminal": _LUA_TERMINAL,
    "unindex_retries": _LUA_UNINDEX_RETRIES,
    "fenced": _LUA_FENCE,
    "next_fence": _LUA_NEXT_FENCE,
    "now_ms": _LUA_NOW,
}


def _script(body: str) -> str:
    """A script with the shared functions above that it calls defined first (each one
    defined costs every run a closure, and the script's compiled code grows)."""
    used = [src for name, src in _SHARED.items() if re.search(rf"(?<![\w.]){name}\(", body)]
    return "".join(used) + body


def _fenced_script(body: str) -> str:
    """An owner's script: its last two KEYS are the fence and the lease, its last three ARGV
    the token (`n:worker`), the lease in ms and the TTL; nothing is written unless the
    token is current (see `_LUA_FENCE`). `NK` is the number of KEYS before the fence's."""
    return _script(
        """
local NK, NA = #KEYS - 2, #ARGV - 3
local other = fenced(KEYS[NK + 1], KEYS[NK + 2], ARGV[NA + 1], ARGV[NA + 2], ARGV[NA + 3])
if other then return {'"""
        + FENCED
        + """', other} end
"""
        + body
    )


# Store a result (the first write wins) and count the starts of the rules it makes ready,
# in one round trip: a rule's start marker rides on its dependency's result, and so does
# the owner's look at the evaluation state, so a cancel is seen before the next start.
# KEYS: result, retries index, state, runs keys..., fence, owner. ARGV: json, ttl, member,
# terminal list, attempts..., token, lease_ms, ttl. Returns {'' when this write won,
# else the stored result; '' or the terminal state (then nothing is counted: those rules
# must not start); start counts...}, or {FENCED, holder}.
_WRITE_RESULT = _fenced_script("""
local won = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[3])
local out = {'', ''}
if not won then out[1] = redis.call('GET', KEYS[1]) end
local state = redis.call('GET', KEYS[3])
if terminal(state, ARGV[4]) then
  out[2] = state
  return out
end
for i = 4, NK do
  out[i - 1] = redis.call('HINCRBY', KEYS[i], ARGV[i + 1], 1)
  redis.call('EXPIRE', KEYS[i], ARGV[2])
end
return out
""")

# KEYS: status, retries index, state, fence, owner. ARGV: status, rank, ttl, member,
# delay_ms ('' = not retrying), terminal list, token, lease_ms, ttl. Returns {'' when
# written, else the kept status (the write would have moved the attempt count back); '' or
# the evaluation's terminal state; the due time indexed, or ''}, or {FENCED, holder}. The
# due time is the store's clock when the write lands plus the delay, not the worker's clock
# when it sent the write: a write held up by a Redis outage would otherwise index a retry
# already overdue, and the sweeper would publish it at once, skipping its tier. The retry
# of a terminal evaluation never enters the retries index.
_WRITE_STATUS = _fenced_script("""
local state = redis.call('GET', KEYS[3])
local over = terminal(state, ARGV[6])
local seen = ''
if over then seen = state end
local cur = redis.call('GET', KEYS[1])
if cur then
  local rank = 0
  if cur == 'permanently_failed' then rank = 1000000
  else rank = tonumber(string.match(cur, '^failed_attempt_(%d+)$')) or 0 end
  if rank >= tonumber(ARGV[2]) then return {cur, seen, ''} end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
if ARGV[5] ~= '' and not over then
  local due = now_ms() + tonumber(ARGV[5])
  redis.call('ZADD', KEYS[2], due, ARGV[4])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
  return {'', seen, due}
end
redis.call('ZREM', KEYS[2], ARGV[4])
return {'', seen, ''}
""")

# Start (or resume) an evaluation in one round trip: the lease, the terminal check, the
# plan, the state, the running index and the snapshot of every rule.
# KEYS: owner, state, plan, final_published, running index, passes, retries index, fence,
# results..., statuses...
# ARGV: me, lease_ms, plan json ('' = use the stored one), ttl, now_ms, attempt_id, terminal
# list. Returns {'held', holder} | {'terminal', state, published} | {'noplan'} |
# {'ok', plan json, {results and statuses}, {published passes}, fence token}: every
# acquisition gets a new token, which fences off whoever held the lease before. A terminal
# evaluation leaves the retries index here, and the running index once announced (until
# then the sweeper must be able to bring it back, to be announced).
_BEGIN = _script("""
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return {'held', cur} end
local state = redis.call('GET', KEYS[2])
if terminal(state, ARGV[7]) then
  local published = redis.call('GET', KEYS[4]) or ''
  unindex_retries(KEYS[3], KEYS[7], ARGV[6])
  if published ~= '' then redis.call('ZREM', KEYS[5], ARGV[6]) end
  return {'terminal', state, published}
end
local plan = ARGV[3]
if plan == '' then plan = redis.call('GET', KEYS[3]) else
  redis.call('SET', KEYS[3], plan, 'NX', 'EX', ARGV[4]) end
if not plan then return {'noplan'} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local token = next_fence(KEYS[8], ARGV[1], ARGV[4])
redis.call('SET', KEYS[2], 'running', 'EX', ARGV[4])
redis.call('ZADD', KEYS[5], ARGV[5], ARGV[6])
redis.call('EXPIRE', KEYS[5], ARGV[4])
local values = {}
if #KEYS > 8 then values = redis.call('MGET', unpack(KEYS, 9)) end
for i = 1, #values do if not values[i] then values[i] = '' end end
return {'ok', plan, values, redis.call('HKEYS', KEYS[6]), token}
""")

# Count the starts of rule attempts (more than one means a crash lost a run), unless the
# evaluation is over: the owner's look at the state before a start, in a round trip it
# makes anyway; the fenced write also runs the lease on, so a rule starts under a lease
# good for another `stale_ms` by the store's clock. A delayed retry's attempt leaves the
# retries index as it starts: its message is held by the owner until the outcome is
# durable (a redelivery restarts it should the owner die), so the sweeper must not take a
# long attempt for a lost retry; the status written at its end indexes the next due time.
# KEYS: state, retries index, runs keys..., fence, owner. ARGV: ttl, terminal list,
# attempts..., retry members ('' for a first attempt)..., token, lease_ms, ttl. Returns
# {'' or the terminal state (then nothing is counted); start counts...}, or {FENCED,
# holder}.
_MARK_STARTED = _fenced_script("""
local state = redis.call('GET', KEYS[1])
if terminal(state, ARGV[2]) then return {state} end
local out = {''}
local n = NK - 2
for k = 1, n do
  local key = KEYS[k + 2]
  out[k + 1] = redis.call('HINCRBY', key, ARGV[k + 2], 1)
  redis.call('EXPIRE', key, ARGV[1])
  if ARGV[k + 2 + n] ~= '' then redis.call('ZREM', KEYS[2], ARGV[k + 2 + n]) end
end
return out
""")

# KEYS: passes, fence, owner. ARGV: pass id, outcome, ttl, token, lease_ms, ttl.
_MARK_PASS = _fenced_script("""
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {1}
""")

# After evaluation.completed is out: flag it, leave both indexes, give the lease back.
# 0, and nothing written, when the terminal state is gone: a Redis that lost its last
# writes swallowed it (and maybe results) after the check, and the owner must restore it.
# KEYS: final_published, running index, owner, state, plan, retries index.
# ARGV: ttl, attempt_id, me, terminal list.
_DONE = _script("""
if not terminal(redis.call('GET', KEYS[4]), ARGV[4]) then return 0 end
redis.call('SET', KEYS[1], '1', 'EX', ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[2])
unindex_retries(KEYS[5], KEYS[6], ARGV[2])
if redis.call('GET', KEYS[3]) == ARGV[3] then redis.call('DEL', KEYS[3]) end
return 1
""")

# The owner's final state, written only once the store holds everything the verdicts name:
# each result (a Redis that lost acknowledged writes may have dropped some) is written
# again from the owner's memory (`SET NX`: a result that is there stays), each permanent
# failure too. One round trip, the one that writes the state anyway. Usually nothing was
# lost: one EXISTS over the results (by the thousand: `unpack`'s limit) says so, and their
# `SET NX`s, which would write nothing, are skipped (about 12k instructions each).
# KEYS: state, results..., statuses..., fence, owner. ARGV: status, ttl, terminal list,
# number of results, result json..., status values..., token, lease_ms, ttl. Returns
# {'' when written, else the kept terminal state; the positions (1-based, results then
# statuses) of what had vanished and was restored}, or {FENCED, holder}.
_FINISH = _fenced_script("""
local cur = redis.call('GET', KEYS[1])
if terminal(cur, ARGV[3]) then return {cur} end
local out = {''}
local n = tonumber(ARGV[4])
local found = 0
for i = 2, n + 1, 1000 do
  found = found + redis.call('EXISTS', unpack(KEYS, i, math.min(i + 999, n + 1)))
end
if found < n then
  for i = 1, n do
    if redis.call('SET', KEYS[1 + i], ARGV[4 + i], 'NX', 'EX', ARGV[2]) then out[#out + 1] = i end
  end
end
for i = n + 2, NK do
  if redis.call('GET', KEYS[i]) ~= ARGV[i + 3] then
    redis.call('SET', KEYS[i], ARGV[i + 3], 'EX', ARGV[2])
    out[#out + 1] = i - 1
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return out
""")

# Only delayed retries are left: out of the running index, lease given back. Each retry
# waited for must have a way back: its entry in the retries index stays as it is (`NX`),
# and one that is gone (its attempt had started, and its message died with the private
# queue of a worker that crashed holding it) is indexed as due now, so the sweeper
# re-publishes it after the grace should no message come: no evaluation stays parked with
# nobody to wake it.
# KEYS: state, running index, owner, retries index, fence, owner. ARGV: ttl, attempt_id,
# me, terminal list, retry members..., token, lease_ms, ttl.
_PARK = _fenced_script("""
if not terminal(redis.call('GET', KEYS[1]), ARGV[4]) then
  redis.call('SET', KEYS[1], 'parked', 'EX', ARGV[1])
  if NA > 4 then
    local now = now_ms()
    for i = 5, NA do redis.call('ZADD', KEYS[4], 'NX', now, ARGV[i]) end
    redis.call('EXPIRE', KEYS[4], ARGV[1])
  end
end
redis.call('ZREM', KEYS[2], ARGV[2])
if redis.call('GET', KEYS[3]) == ARGV[3] then redis.call('DEL', KEYS[3]) end
return {1}
""")

# KEYS: owner, running index, state, fence. ARGV: me, lease_ms, now_ms, attempt_id,
# terminal list, ttl, token. {1, PEXPIRETIME} while still ours (when the lease runs out
# once renewed, by the store's clock: the heartbeat records it); 0 when lost. A terminal
# evaluation is not stamped again: once announced it leaves the index (`_DONE`), and a
# stale stamp lets the sweeper announce or drop it. The fence decides what is ours: a
# lease that lapsed while nobody acquired it (the token is still the current one: a late
# heartbeat) is the owner's again, and any other token, or none, means lost. 2 when the
# state is gone too: a Redis that lost acknowledged writes forgot an evaluation its owner
# is running (nobody else can have begun it: `begin` writes the state), so it is the
# owner's again, and the owner writes back its plan. The state is read once: what this
# script writes to it is known. A lease still held is renewed with PEXPIRE, as in
# `fenced`.
_RENEW = _script("""
if ARGV[7] == '' then return 0 end
local cur = redis.call('GET', KEYS[1])
local fence = redis.call('GET', KEYS[4])
if (fence and fence ~= ARGV[7]) or (cur and cur ~= ARGV[1]) then return 0 end
if not fence then redis.call('SET', KEYS[4], ARGV[7], 'EX', ARGV[6]) end
if cur then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
local state = redis.call('GET', KEYS[3])
local forgotten = not state
if forgotten then
  redis.call('SET', KEYS[3], 'running', 'EX', ARGV[6])
  state = 'running'
end
if not terminal(state, ARGV[5]) then
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
  redis.call('EXPIRE', KEYS[2], ARGV[6])
end
if forgotten then return {2, redis.call('PEXPIRETIME', KEYS[1])} end
return {1, redis.call('PEXPIRETIME', KEYS[1])}
""")

# KEYS: owner. ARGV: me.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: state, plan, retries index. ARGV: new state, ttl, terminal list, attempt_id. Nil
# when written; else the state kept. Writing a terminal state (a cancel) takes the
# evaluation's rules out of the retries index at once; the running index follows once the
# final state is announced (`_DONE`).
_SET_STATE = _script("""
local cur = redis.call('GET', KEYS[1])
if terminal(cur, ARGV[3]) then return cur end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
if terminal(ARGV[1], ARGV[3]) then unindex_retries(KEYS[2], KEYS[3], ARGV[4]) end
return false
""")

# An evaluation that ended without announcing (another final state won): out of both
# indexes. KEYS: running index, plan, retries index. ARGV: attempt_id.
_UNINDEX = _script("""
redis.call('ZREM', KEYS[1], ARGV[1])
unindex_retries(KEYS[2], KEYS[3], ARGV[1])
return 1
""")

# KEYS: running index, owner, state, final_published. ARGV: attempt_id, threshold_ms,
# now_ms, terminal list. 1 when claimed. A terminal evaluation already announced leaves
# the index instead, never to be re-published (one not announced yet is claimed: the
# resume announces it).
_CLAIM_STALE = _script("""
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if (not s) or tonumber(s) > tonumber(ARGV[2]) then return 0 end
if terminal(redis.call('GET', KEYS[3]), ARGV[4]) and redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
return 1
""")

# KEYS: retries index, state, status. ARGV: member, threshold_ms, new_score, terminal list.
# The rule's status when claimed ('' when not, or when it has none): read in the same
# step as the claim, so the retry published is the one after the attempt judged overdue
# (an owner writing `failed_attempt_N+1` in between cannot make the sweeper skip a tier).
# The member of a terminal evaluation leaves the index instead.
_CLAIM_RETRY = _script("""
local s = redis.call('ZSCORE', KEYS[1], ARGV[1])
if (not s) or tonumber(s) > tonumber(ARGV[2]) then return '' end
if terminal(redis.call('GET', KEYS[2]), ARGV[4]) then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return ''
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
return redis.call('GET', KEYS[3]) or ''
""")


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
        self.topology_key = config.name("engine:topology")
        self.redis = client or redis_client(config)
        r = self.redis
        self.batch = AutoPipeline(
            r, wait_replicas=config.wait_replicas, wait_timeout_ms=config.wait_timeout_ms
        )
        self._write_result = self.batch.register(_WRITE_RESULT)
        self._write_status = self.batch.register(_WRITE_STATUS)
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
        self._finish = self.batch.register(_FINISH)
        self._unindex = self.batch.register(_UNINDEX)

    async def close(self) -> None:
        await self.redis.aclose()

    def _fence(self, attempt_id: str, fence: str | None) -> tuple[list[str], list[object]]:
        """The KEYS and ARGV a fenced script ends with (None: an unfenced write)."""
        keys = [eval_key(attempt_id, "fence"), eval_key(attempt_id, "owner")]
        return keys, [fence or "", self.config.stale_ms, self.ttl]

    async def _owner_call(
        self, attempt_id: str, fence: str | None, script: object, keys: list, args: list
    ) -> list:
        """Run a fenced script; raise `LeaseLost` when the fence refused the write."""
        fkeys, fargs = self._fence(attempt_id, fence)
        reply = await self.batch.call(script, keys=[*keys, *fkeys], args=[*args, *fargs])
        if isinstance(reply, list) and reply and reply[0] == FENCED:
            raise LeaseLost(f"{attempt_id}: the lease is {reply[1]}'s now")
        return reply

    async def probe(self) -> None:
        """Fail fast, in one line, when Redis is unreachable or refuses the credentials."""
        await probe_redis(self.config)

    # --- what the namespace left behind -------------------------------------------------

    async def remember_topology(self, names: Iterable[str]) -> None:
        """Note the namespace's queues and exchanges (`queue:NAME`, `exchange:NAME`)."""
        members = list(names)
        if members:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.sadd(self.topology_key, *members)
                pipe.expire(self.topology_key, self.ttl)
                await pipe.execute()

    async def topology(self) -> set[str]:
        return set(await self.redis.smembers(self.topology_key))

    async def purge(self, prefixes: Iterable[str], namespace: bool) -> int:
        """Delete every `attempt:{prefix}*` key and, with `namespace`, the namespace's own
        index and topology keys; return how many keys went."""
        deleted = 0
        for prefix in prefixes:
            pattern = f"attempt:{glob_escape(prefix)}*"
            batch: list[str] = []
            async for key in self.redis.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 1000:
                    deleted += await self.redis.unlink(*batch)
                    batch = []
            if batch:
                deleted += await self.redis.unlink(*batch)
        if namespace:
            deleted += await self.redis.unlink(
                self.running_index, self.retries_index, self.topology_key
            )
        return deleted

    # --- rules --------------------------------------------------------------------------

    async def write_result(
        self,
        attempt_id: str,
        result: RuleResult,
        starts: Sequence[tuple[str, int]] = (),
        fence: str | None = None,
    ) -> tuple[RuleResult | None, list[int], str | None]:
        """Store a result unless one is there already, and count the given starts.

        Returns the result that was there before (None when this write won); for each
        (rule, attempt) in `starts`, how many times that attempt has now been started; and
        the evaluation's state if it is terminal (a cancel): then nothing was counted, and
        those rules must not start.
        """
        reply = await self._owner_call(
            attempt_id,
            fence,
            self._write_result,
            keys=[
                result_key(attempt_id, result.rule_id),
                self.retries_index,
                eval_key(attempt_id, "state"),
                *(runs_key(attempt_id, r) for r, _ in starts),
            ],
            args=[
                result.to_json(),
                self.ttl,
                retry_member(attempt_id, result.rule_id),
                _TERMINAL,
                *(n for _, n in starts),
            ],
        )
        existing = RuleResult.from_json(reply[0]) if reply[0] else None
        return existing, [int(c) for c in reply[2:]], reply[1] or None

    async def write_status(
        self,
        attempt_id: str,
        rule_id: str,
        status: str,
        delay_ms: int | None = None,
        fence: str | None = None,
    ) -> StatusWritten:
        """Write a status unless it would move the attempt count back; with a delay, index
        the retry as due that long after the write lands (by the store's clock)."""
        kept, over, due = await self._owner_call(
            attempt_id,
            fence,
            self._write_status,
            keys=[
                status_key(attempt_id, rule_id),
                self.retries_index,
                eval_key(attempt_id, "state"),
            ],
            args=[
                status,
                status_rank(status),
                self.ttl,
                retry_member(attempt_id, rule_id),
                "" if delay_ms is None else delay_ms,
                _TERMINAL,
            ],
        )
        return StatusWritten(kept or None, over or None, int(due) if due != "" else None)

    async def mark_started(
        self, attempt_id: str, starts: Sequence[tuple[str, int]], fence: str | None = None
    ) -> tuple[list[int], str | None]:
        """Count the starts of rule attempts (more than one means a crash lost a run), unless
        the evaluation is terminal: then its state comes back and nothing is counted. With
        no starts it is only that look at the state (before a level-1 retry)."""
        reply = await self._owner_call(
            attempt_id,
            fence,
            self._mark_started,
            keys=[
                eval_key(attempt_id, "state"),
                self.retries_index,
                *(runs_key(attempt_id, r) for r, _ in starts),
            ],
            args=[
                self.ttl,
                _TERMINAL,
                *(n for _, n in starts),
                *(retry_member(attempt_id, r) if n > 1 else "" for r, n in starts),
            ],
        )
        return [int(c) for c in reply[1:]], reply[0] or None

    async def begin(
        self, attempt_id: str, me: str, rule_ids: Sequence[str], plan: Plan | str | None
    ) -> Begun:
        """Take the lease and load everything the evaluation needs, in one round trip.

        `rule_ids` are those of `plan` (stored when given); with None, the stored plan is
        used and its rules must be the ones passed (the caller read it first).
        """
        plan_json = plan.to_json() if isinstance(plan, Plan) else plan
        keys = [eval_key(attempt_id, w) for w in ("owner", "state", "plan", "final_published")]
        keys += [self.running_index, eval_key(attempt_id, "passes"), self.retries_index]
        keys += [eval_key(attempt_id, "fence")]
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
        return Begun(plan_json=reply[1], snapshot=snap, fence=reply[4])

    async def stored_plan(self, attempt_id: str) -> str | None:
        return await self.redis.get(eval_key(attempt_id, "plan"))

    async def done(self, attempt_id: str, me: str) -> bool:
        """evaluation.completed is published: flag it, unindex, give the lease back. False,
        with nothing written, when the terminal state is no longer in Redis (lost writes)."""
        return bool(
            await self.batch.call(
                self._done,
                keys=[
                    eval_key(attempt_id, "final_published"),
                    self.running_index,
                    eval_key(attempt_id, "owner"),
                    eval_key(attempt_id, "state"),
                    eval_key(attempt_id, "plan"),
                    self.retries_index,
                ],
                args=[self.ttl, attempt_id, me, _TERMINAL],
            )
        )

    async def finish(
        self,
        attempt_id: str,
        status: str,
        results: Mapping[str, RuleResult],
        failed: Sequence[str],
        fence: str | None = None,
    ) -> tuple[str | None, list[str]]:
        """Write the final state, once every result in `results` and every permanent failure
        in `failed` is in Redis again (restored from memory when a lossy restart dropped it).

        Returns the terminal state kept instead (None when this write won) and the rules
        whose result or status had vanished and were written again.
        """
        names = [*results, *failed]
        reply = await self._owner_call(
            attempt_id,
            fence,
            self._finish,
            keys=[
                eval_key(attempt_id, "state"),
                *(result_key(attempt_id, r) for r in results),
                *(status_key(attempt_id, r) for r in failed),
            ],
            args=[
                status,
                self.ttl,
                _TERMINAL,
                len(results),
                *(v.to_json() for v in results.values()),
                *(PERMANENTLY_FAILED for _ in failed),
            ],
        )
        return reply[0] or None, [names[int(i) - 1] for i in reply[1:]]

    async def park(
        self, attempt_id: str, me: str, fence: str | None = None, waiting: Sequence[str] = ()
    ) -> None:
        """Park the evaluation until one of the `waiting` rules' retries comes due."""
        await self._owner_call(
            attempt_id,
            fence,
            self._park,
            keys=[
                eval_key(attempt_id, "state"),
                self.running_index,
                eval_key(attempt_id, "owner"),
                self.retries_index,
            ],
            args=[
                self.ttl,
                attempt_id,
                me,
                _TERMINAL,
                *(retry_member(attempt_id, r) for r in waiting),
            ],
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

        A terminal state is written once: whoever wins publishes evaluation.completed. A
        terminal state written (a cancel) takes the evaluation out of the retries index.
        """
        return await self.batch.call(
            self._set_state,
            keys=[eval_key(attempt_id, "state"), eval_key(attempt_id, "plan"), self.retries_index],
            args=[state, self.ttl, _TERMINAL, attempt_id],
        )

    async def mark_pass_published(
        self, attempt_id: str, pass_id: str, outcome: str, fence: str | None = None
    ) -> None:
        await self._owner_call(
            attempt_id,
            fence,
            self._mark_pass,
            keys=[eval_key(attempt_id, "passes")],
            args=[pass_id, outcome, self.ttl],
        )

    # --- ownership, heartbeats, indexes ---------------------------------------------------

    async def renew(self, fences: Mapping[str, str], me: str) -> dict[str, int]:
        """The heartbeat: extend each lease still ours and stamp the running index. Per
        evaluation (mapped to the fence token its owner holds): 1 still ours, 0 lost, 2
        forgotten by Redis and ours again (`_RENEW`), a `Renewal` that also carries when the
        lease runs out once renewed (its PEXPIRETIME). The fence decides what is ours."""
        ids = list(fences)
        if not ids:
            return {}
        now = now_ms()
        out = await asyncio.gather(
            *[
                self.batch.call(
                    self._renew,
                    keys=[
                        eval_key(a, "owner"),
                        self.running_index,
                        eval_key(a, "state"),
                        eval_key(a, "fence"),
                    ],
                    args=[me, self.config.stale_ms, now, a, _TERMINAL, self.ttl, fences[a]],
                )
                for a in ids
            ]
        )
        return {a: _renewal(v) for a, v in zip(ids, out, strict=True)}

    async def reinstate(self, attempt_id: str, plan: Plan | str) -> bool:
        """Write back the plan `begin` stored, unless it is there (a forgotten evaluation's
        resume needs it); True when it had vanished."""
        key = eval_key(attempt_id, "plan")
        plan_json = plan if isinstance(plan, str) else plan.to_json()
        return bool(await self.redis.set(key, plan_json, nx=True, ex=self.ttl))

    async def holder(self, attempt_id: str) -> str | None:
        """Who holds the lease now (a look, to route a message; it decides nothing)."""
        return await self.redis.get(eval_key(attempt_id, "owner"))

    async def release(self, attempt_id: str, me: str) -> None:
        await self.batch.call(self._release, keys=[eval_key(attempt_id, "owner")], args=[me])

    async def unindex(self, attempt_id: str) -> None:
        """Out of the running and retries indexes: an evaluation whose final state another
        writer won (a cancel) leaves them without announcing."""
        await self.batch.call(
            self._unindex,
            keys=[self.running_index, eval_key(attempt_id, "plan"), self.retries_index],
            args=[attempt_id],
        )

    async def stale_evaluations(self, older_than_ms: int, limit: int = 100) -> list[str]:
        return await self.redis.zrangebyscore(
            self.running_index, "-inf", now_ms() - older_than_ms, start=0, num=limit
        )

    async def claim_stale(self, attempt_id: str, older_than_ms: int) -> bool:
        now = now_ms()
        return bool(
            await self.batch.call(
                self._claim_stale,
                keys=[
                    self.running_index,
                    eval_key(attempt_id, "owner"),
                    eval_key(attempt_id, "state"),
                    eval_key(attempt_id, "final_published"),
                ],
                args=[attempt_id, now - older_than_ms, now, _TERMINAL],
            )
        )

    async def overdue_retries(self, grace_ms: int, limit: int = 100) -> list[str]:
        return await self.redis.zrangebyscore(
            self.retries_index, "-inf", now_ms() - grace_ms, start=0, num=limit
        )

    async def claim_retry(self, member: str, grace_ms: int) -> str | None:
        """Claim an overdue retry; the rule's status read with the claim (None: not claimed,
        or no status to retry from)."""
        now = now_ms()
        attempt_id, rule_id = split_member(member)
        status = await self.batch.call(
            self._claim_retry,
            keys=[
                self.retries_index,
                eval_key(attempt_id, "state"),
                status_key(attempt_id, rule_id),
            ],
            args=[member, now - grace_ms, now + grace_ms, _TERMINAL],
        )
        return status or None
