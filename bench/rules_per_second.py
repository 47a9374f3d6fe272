"""Rules per second of one live worker, as a ratio to the raw SET (or durable INSERT) rate.

    python bench/rules_per_second.py [--rounds 7] [--evaluations 200]
    python bench/rules_per_second.py --against /tmp/before [--rounds 5]
    python bench/rules_per_second.py --against . --worker-arg=--event-loop=asyncio
    python bench/rules_per_second.py --store postgres [--rounds 3] [--evaluations 100]
    python bench/rules_per_second.py --store postgres --system pg [--rounds 3]

The baseline is measured in the same run, on the same Redis, because these machines are
noisy: one client doing sequential `SET`s is one round trip each. Each round measures the
SET rate, the engine, and the SET rate again, and compares the engine with the mean of the
two; the median ratio of the rounds is printed with its spread (median absolute
deviation), and what one rule costs the worker: CPU time and the Redis scripts it runs.
Target: a ratio of at least 1.0 (with group commit, a rule's durable bookkeeping should
cost no more than one amortised round trip), within +-15 %.

On PostgreSQL (`--store postgres`): the engine's durable design, `python -m engine.worker
--store postgres`, against the raw rate of durable commits on the same server. The run
starts a private PostgreSQL (`chaos.systems.pg_store.postgres.PostgresServer`: its own
loopback port and temp dir, fsync on, `synchronous_commit=on`, pg_stat_statements loaded),
migrates the engine's schema as its superuser and grants it to `eai_engine`, a role that
is neither superuser nor BYPASSRLS, as a live pg-store run does; RabbitMQ is the machine's,
as in the Redis mode. Each round measures the raw INSERT rate (one client, as
`eai_engine` over TCP, sequential single-row `INSERT`s into a scratch table, each its own
transaction and so its own WAL flush), the engine on PostgreSQL (the same workload as the
Redis mode: code_review.yaml, zero-latency agent, one worker), the INSERT rate again, then
the Redis design's round as above (SET, engine, SET). It prints each round, the Redis
design's lines as the default mode does, the median ratio rules/INSERT with its spread,
the PostgreSQL worker's CPU a rule, the engine's transactions a rule (`eai.apply`
statements, from pg_stat_statements) and the time each spent executing inside PostgreSQL,
and the median rules/s of both designs. Target (the issue's): a ratio of at least 1.0,
which only batching can give, since a rule makes about 1.6 store operations. The server
is stopped and its temp dir deleted, and each round's namespace (queues, exchanges, rows)
deleted, also on a failure, Ctrl-C or SIGTERM; a worker that exits fails the round at once
(either mode). Only the template data dir that `PostgresServer` caches stays.

With `--system pg` each round also runs PostgreSQL alone (`python -m engine.worker --system
pg`: jobs, retries and events as rows of the same server, no RabbitMQ), between the same two
INSERT measurements; its events are read from the outbox on each `NOTIFY eai_events`, one
statement on the measured server per wake-up. Goal (issue 28): at least 0.5x the INSERT rate.
Measured (2026-12-05, 05:50 UTC, at this commit, a machine loaded by another engineer's
simulations, load 2.6): rounds 0.56, 0.79, 0.59, median 0.59 (2,100 to 2,600 rules/s); in
the same rounds pg-store 0.56 (0.52..0.86) with its store's batches in two lanes.

Where it stands on PostgreSQL (2026-12-07, 10:41 UTC, with migration 0006, load about 0.5):
two runs of 5 rounds, median ratio rules/INSERT 1.16 (1.09..1.36) and 1.04 (0.93..1.19),
4,752 and 3,937 rules/s, 2.46 and 3.37 ms inside PostgreSQL a transaction of 12 rules: the
goal met. The migration cut PostgreSQL's time an operation to 0.60 to 0.67x
(`bench/store_replay.py --against`, which replays one round's batches on each schema alone);
what it changed and what was tried: bench/README.md's ninth look. The paragraphs below are
the history before it.

Earlier (2026-12-05, 02:12 to 02:14 UTC, at 0fc1dd8 with this mode
added; a busy 2-core machine shared with other engineers' runs, among them live pg-store
chaos runs with PostgreSQL servers of their own on the same disk; load average 3.0 to 3.6):
three runs of `--store postgres --rounds 3 --evaluations 100`, median ratio rules/INSERT
0.94 +- 27 % (rounds 0.52, 1.19, 0.94; INSERT 780 to 3,200/s, rules 940 to 1,220/s), 1.83 +-
8 % (1.83, 1.68, 4.63; INSERT 360 to 2,330/s, rules 1,560 to 2,520/s) and 0.75 +- 1 % (0.68,
0.76, 0.75; INSERT 3,450 to 4,020/s, rules 2,560 to 2,880/s). The Redis design in the same
rounds: ratio rules/SET 0.67, 0.69 and 0.50 (rules 2,370, 5,940 and 6,210/s median),
PostgreSQL/Redis rules/s 0.44, 0.30 and 0.46. So the goal is met in one run of three, and
not for the engine's sake: the ratio follows the disk. A durable commit costs about 100 us
here at a quiet moment (pg_test_fsync: fdatasync 8,900/s on this VM's disk), and a
sequential INSERT about 250 us (3,500 to 4,500/s); when the disk is busy (presumably the
other runs' servers syncing too) the INSERT rate falls to 360 to 1,200/s, and the engine,
with 0.042 to 0.045 transactions a rule (22 to 24 rules, about 36 to 39 operations, a
transaction), slows much less (with the machine, as the Redis design does). Batching works:
the batches reaching the database are large. What holds the ratio below 1.0 when commits are
cheap (the third run) is PostgreSQL executing the operations: 5.6 ms inside PostgreSQL a
transaction (wall time, partly waiting for a core on this loaded machine), about 145 us an
operation and 235 us a rule, on one backend, since the group commit keeps one batch in
flight; that is nearly all of a raw INSERT's 265 us in that run, and 67 % of the engine's
350 us a rule of wall time (2,870 rules/s), the rest being the commit, the round trip and
the worker's turn between batches. Where it goes inside (one 200-evaluation round with
`pg_stat_statements.track=all` and `track_functions=pl`, which inflate it: 4,264 operations,
1.64 a rule, in 114 transactions): each operation reads its evaluation's row (`eai._run`, 22
% of the time inside `eai.apply`, by self time) and writes it back (`eai._save`, an UPDATE
of `eai.runs`, 27 %), whichever operation of the same evaluation came before it in the
batch; `write_result` inserts a checkpoint and a run step (15 % itself, 2,600 calls). The
worker's CPU a rule is the Redis design's (85 to 115 us against 92 to 123).

A second look (2026-12-05, 02:23 to 02:37 UTC, at b213ffd; load 0.8 to 1.1, then 1.5 to 2.0):
four plain runs at that commit, median ratio 0.74, 0.71, 0.76 and 0.68 (4.63 to 5.51 ms inside
PostgreSQL a transaction). Reading and saving an evaluation's row once a batch cannot help
this workload: a batch's operations are on distinct evaluations (with the rows kept for the
batch, 4,203 of 4,264 row reads in 108 transactions were an evaluation's first in its batch:
1.01 operations an evaluation a batch; the worker holds an evaluation's lock across each of
its writes). The row's cost is physical: by self time a call (`track_functions=pl`, one
200-evaluation round), `_run` 38.6 us (the row's first lock in the transaction) and `_save`
38.4 us (an UPDATE that is never heap-only: `expires_at`, indexed by `runs_expiry`, changes
in every transaction, so each save adds an entry to the four indexes of `eai.runs`),
`write_result` 41 us, `_count_starts` 29 us, `apply` itself 24 us an operation. Tried, none
kept: the rows kept for the batch in transaction-local settings (7.5 and 9.3 ms a
transaction in two runs: nothing to save, the bookkeeping costs); `write_result`'s read and
write of its checkpoint as one `INSERT ... ON CONFLICT` statement, `_texts`/`_ints` without
an aggregate and `toast_tuple_target=128` on `eai.runs` (interleaved with the commit before,
three runs each: ratio 0.73, 0.80, 0.71 against 0.71, 0.76, 0.68, 4.95 to 5.40 ms against
5.06 to 5.51: within the noise); `runs_expiry` dropped (saves then heap-only) with fillfactor
50: `_run` 25 to 31 us and `_save` 38 to 55 against 37 to 52 and 46 to 55 in interleaved
profiled rounds on a busier machine, the transaction's total within the noise, and it would
cost the retention sweep its index. Left: fewer statements a batch (set-based: every row of a
batch locked in one statement, its checkpoints and starts inserted in one each), which the
one-function-an-operation design (and the mutants and references built on it) does not allow
as it stands; or a second batch in flight, which needs a proof that no call overtakes an
earlier one of its evaluation.

Where it stands (2026-12-02, third session, 13:00 UTC, a quiet machine): six plain runs of 7
rounds, median ratio 1.05 +- 7 %, 1.00 +- 9 %, 1.08 +- 5 %, 1.05 +- 5 %, 1.02 +- 4 %, 0.96 +- 9
% (rounds 0.78 to 1.39; 81 to 127 us of the worker's CPU a rule as the machine's speed
drifted): the target met at the median in five runs of six, narrowly. `--against` the
session's starting commit 9507016, 7 rounds: 6,080 against 5,043 rules/s (+21 %), 119
against 146 us of CPU a rule (-18 %). By change, each A/B against the commit before, 7
rounds: the group commit keeping its connection between batches instead of checking one
out of redis-py's pool each time (its lock, a read that must find nothing, its counters)
+13 % rules/s; writing the batch itself instead of through `send_packed_command`, whose
`asyncio.wait_for` costs a task and a timer a write, +3.8 %; the Lua scripts 17.5 % fewer
instructions inside Redis (`bench/script_cost.py`) and the shell's cuts below (530k -> 465k
instructions a rule), each within the noise alone. This benchmark now listens to the first
evaluation.started only (it unbinds the rest: 199 deliveries a round less for the broker
and itself, which share the worker's cores). A second or third batch in flight on the one
connection (a reader task reading them in order, so none can overtake another) measured no
better than one (+18.7 %, +17.4 % and +12.8 % for depths 2, 1 and 3 against the pool's
path): keeping the connection was the gain, not the overlap. Where a rule's wall time goes
now, at about 5,500 rules/s (1,000 evaluations; `/proc/PID/schedstat` and
`bench/evaluation_latency.py --idle`): about 181 us, of which the worker runs 128 to 132,
waits runnable 21 to 25 (Redis, RabbitMQ and this process on its core) and waits for
Redis's replies about 30 (an EVALSHA 21 us inside Redis, 1.62 a rule). Raising the
worker's concurrency to 128 evaluations changed nothing (-1.0 %, 7 rounds): it is not short
of work, it waits for Redis between batches.

Earlier (2026-12-02, 08:33 UTC, a quiet machine, load 0.6 to 0.9, with every cut below
merged): four plain runs of 7 rounds, median ratio 0.90 +- 6 %, 0.83 +- 8 %, 0.83 +- 6
% and 0.92 +- 2 % (rounds 0.76 to 1.05; 73 to 96 us of the worker's CPU a rule; SET 8,000 to
10,700/s, rules up to 9,900/s); `--against` the session's starting commit 1203731, 5 rounds:
9,496 against 7,102 rules/s (1.34x), 73 against 131 us of CPU a rule (-44 %). Below the
target of 1.0, and the worker alone no longer explains it: at 9,000 rules/s and 73 to 96 us
a rule it is busy 65 to 85 % of the time. Read from /proc over rounds of 1,000 evaluations
(09:05, quiet): the worker 106 to 146 us a rule, Redis 42 to 57 and RabbitMQ 40 to 50 (the
submissions included, so upper bounds), an EVALSHA 20 to 27 us inside Redis: the three share
two cores at about 200 to 250 us a rule. `bench/evaluation_latency.py` times every effect
the worker awaits: an evaluation waits in turn for about twenty round trips of 2 to 5 ms
under load (begin 9 ms, the started event 5, the first start markers 9, thirteen result
writes 3.7 ms each, one after another since the evaluation's lock is held across each, four
pass results published 2.6 ms then marked 4.6 ms, finish 5, the completed event and done
12). Those serial writes are not what holds the rate: a trial that released the lock across
the write (so that rules finishing together write in one batch) measured slower, 6,647
against 7,220 rules/s and +15 % CPU a rule over 7 interleaved rounds (more, smaller
batches). Left to try: cheaper scripts inside Redis (each one defines the shared Lua
functions and reads the fence and the lease), and the worker's own CPU. A second batch in
flight (`AutoPipeline(max_in_flight=2)`) measured no different (0.82 against 0.80, 5 rounds
each) and would let a later call overtake an earlier one (a cancelled task's write landing
after the lease's release).

With `--against`, the engine of another checkout (a `git worktree` of the commit before a
change) runs too, in rounds interleaved with this one's, and the median rates of both are
compared: the cost of a change, measured on the same machine in the same minutes, as the
median rate and the median CPU a rule (the steadier of the two on a busy machine).
`--worker-arg` passes a flag to this checkout's worker only: `--against .` with one
compares two settings of one engine.

What one rule costs (code_review.yaml's 13 rules, 200 evaluations a round, 64 at once,
zero-latency agent), counted in the worker (cProfile call counts, `INFO commandstats`):
- Redis: 1.65 scripts a rule (the result write, carrying the start markers of the rules it
  makes ready; a separate start marker when none does; the evaluation's begin, four pass
  marks, finish and done shared by its 13 rules), travelling about 12 to a batch: 0.15
  round trips a rule, one write and one read each.
- RabbitMQ: per evaluation one delivery in, one ACK and six publishes (started, four pass
  results, completed), each awaiting its confirm: 0.54 frames written a rule, 0.46
  confirms awaited, 0.08 deliveries.
So a rule costs about 0.7 round trips in all, most of them amortised; what limits the
worker is its CPU, not the wire.

CPU, and where it goes (2026-12-02, a busy 2-core machine shared with three other
engineers' runs, load 4 to 6: every figure here is inflated by that and noisy):
about 250 to 400 us of the worker's CPU a rule, 93 % user, 7 % system (was 220 us on
a quiet machine on 2026-12-01, 280 us at 03:50 today). py-spy over the worker
(`bench/worker_profile.py`, samples of wall time, 1,500 evaluations): the event loop's
socket writes 33 % (the seven AMQP frames and one Redis batch write of an evaluation's
13 rules; mostly the worker preempted inside `send()` while the broker or Redis it woke
runs, since system time is only 7 % of its CPU); the rest of the event loop (uvloop,
tasks, futures, timers) 15 %; aio-pika/aiormq/pamqp 15 % (pamqp marshals each publish in
Python, about 30 us); the shell's steps 10 %; the core 8 %; the driver and broker 5 %;
the fake agent's draws 4 %; the group commit and the store 6 %; redis-py 2 %;
prometheus_client 1 %.

What this round changed (A/B against the commit before it, `--against`, two runs of 9
and 7 interleaved rounds on that busy machine): the worker's median CPU a rule, the
steadier figure, 327 -> 254 us (-22 %) and 465 -> 327 us (-30 %); the median rate +5 %
(1,491 -> 1,561 rules/s) and +36 % (940 -> 1,276), the rates swinging 3x between rounds.
By change, as measured alone: Redis batches packed by hiredis and read by hand
instead of redis-py's pipeline (16 us -> 2.5 us to pack a script; one read timeout a batch
instead of a timer a reply); publishes built as aiormq properties instead of aio-pika
`Message`s (52 us -> 2.4 us a publish); one JSON encoder for results, the labelled
counters looked up once; the core scanning passes only when a rule became terminal (13 ->
10 us a rule). uvloop against asyncio's own loop (`--worker-arg=--event-loop=asyncio`):
no difference the noise lets through (CPU -10 % and -7 %, rate +19 % and -10 % in two
runs), so uvloop stays the default.

Quiet (the same machine later that day, load average under 0.3), two plain runs of 7
rounds: median ratio 0.61 +- 11 % (SET about 6,800/s, rules about 3,900/s, 227 us of CPU a
rule) and 0.69 +- 9 % (142 us a rule); `--against` 54c8d50, 5 rounds: 4,361 against 3,142
rules/s (1.39x), 200 against 285 us of CPU a rule (-30 %). Below the target still: a ratio
of 1.0 needs about 140 us a rule in every round, not in the best.

On the busy machine, the ratio to SET: median 0.33 +- 37 % over 7 rounds (range
0.20..0.54; SET 2,100 to 6,900/s, rules 680 to 1,700/s) on that machine: too noisy to
judge the target, still well short of 1.0. On a quiet machine the CPU cut predicts about
0.55 to 0.6 (0.46 at 03:50 today with 280 us a rule); 1.0 needs the CPU a rule near 140
us, and what is left is spread thin: the effect-driven shell and driver, the event loop,
and aiormq/pamqp's Python framing of six confirmed publishes an evaluation.

RabbitMQ's cost, cut (2026-12-02, later that morning; `engine.runtime.wire`). Through
aio-pika and aiormq a confirmed publish cost the worker about 95 us of CPU (80 to 100 user,
12 to 18 system; 20,000 publishes, 64 at once, on the same channel and broker) and a
delivery with its ACK 120 to 145 us: about 700 us an evaluation, some 55 us a rule. The
publish went through aiormq's frame queue and writer task, a drain future, the channel's
lock, a timer of its own and pamqp's marshalling in Python; each confirm came back through
aiormq's connection task (three reads, a lock, pamqp), the channel's queue and its reader
task. Now a publish or an ACK is one socket write of frames built from cached parts (the
bytes pamqp writes, tested), the connection's stream reader settles a publisher ack as its
bytes arrive (acks that a mandatory return may precede stay aiormq's), and one timer a
channel bounds the unconfirmed publishes: a publish costs 14 to 20 us (6 to 10 user, 7 to
12 system, mostly the `send`), a delivery with its ACK 85 to 100 us. cProfile of the
worker over 400 evaluations: 3.71 M Python calls to 2.59 M (-30 %); calls into aio-pika,
aiormq and pamqp 401 k to 80 k, into asyncio 385 k to 152 k. A/B against main's head
(`--against`, five runs of 7 to 9 interleaved rounds, load 2.4 to 5.6 while other
engineers benchmarked): the worker's median CPU a rule 227 -> 142 us (-37 %), 273 -> 185
(-32 %), 227 -> 165 (-27 %), 273 -> 185 (-32 %), 223 -> 181 (-19 %); the median rate
+43 %, +40 %, +34 %, +47 %, +28 %. Plain runs on that busy machine: median ratio 0.47 +-
7 % (162 us a rule, load 4.3), 0.40 +- 17 % (load 2.9), 0.35 +- 9 % (192 us, load 5.5);
on a quiet one the CPU cut predicts about 0.85 (this morning's quiet 0.60 at 196 us a rule,
with 30 % less CPU a rule, the worker being CPU-bound), which a quiet run still has to
confirm.
Tried and dropped: one `write` for all the frames of a loop pass (27 frames a write under
cProfile, yet no change A/B: CPU +0.0 %, rate -2.6 % over 9 rounds, and it would need care
for the order against aiormq's queue). What is left of RabbitMQ: a delivery, still read by
aiormq and aio-pika (three frames through pamqp, the channel's queue and reader task, an
`IncomingMessage`, two tasks), about 80 us, 6 us a rule; and the publishes' `send`s, where
py-spy finds the worker about a tenth of its wall time (preempted while the broker it woke
runs; its system time is 9 us a rule).

The engine's own code, cut (2026-12-02, second session): the same work in fewer
instructions, counted under callgrind, which a busy machine does not disturb (the slope
between two run lengths, so start-up drops out). The live shell, driver, store and agent in
one process on the real Redis with an in-memory broker: 695k -> 486k instructions a rule
(-30 %). The real worker of this benchmark (100 and 300 evaluations under callgrind):
991k -> about 780k a rule (-21 %; most of the rest is aiormq/pamqp's publishes and the event
loop). By change, each measured alone, in instructions a rule: effects as plain slotted
dataclasses rather than frozen ones (-56k: a frozen one builds itself through
`object.__setattr__`, a dozen effects a rule); the core (-64k; 1.39 M -> 0.63 M an
evaluation: each pass counts its rules not yet terminal instead of rereading them at every
input, states as plain names rather than read through their enum class, `dag.ready`
without a generator, actions not frozen); `RuleResult.to_json` written out with `json`'s
own escaper and float repr (-36k; 29.6k -> 10.2k an encoding, two a rule; the same text);
the counters as plain numbers that a collector shows at a scrape, and the default history,
which discards, not called (-31k); the fake agent's draw (-21k; 89.7k -> 66.6k, the same
values); a rule's task without the `_task` generator, its sub-steps inline (-11k); locks and
slots taken in place when free (-4k). Simulated histories stay byte-identical (2,900 runs
of 11 scenarios), and the simulator does 95.0 M -> 81.9 M instructions a seed (-14 %).

Measured by this benchmark, `--against` the commit before, 7 rounds each: at load 1.6 to
2.5, 4,551 against 3,570 rules/s (+27 %), 162 against 254 us of CPU a rule (-36 %), and
4,070 against 3,155 (+29 %), 215 against 269 us (-20 %); quieter (load 0.5 to 1.3), 4,523
against 4,080 (+11 %), 185 against 215 us (-14 %), and 5,128 against 4,623 (+11 %), 173
against 188 us (-8 %): the CPU falls less than the instructions (the kernel's share, the
socket writes, is unchanged). Plain runs of 7 rounds: median ratio 0.62 +- 5 % (load 1.6,
208 us a rule) and 0.68 +- 8 % (load 1.1, 188 us; SET 7,600 to 8,900/s). Not at 1.0 yet
(it needs about 110 to 130 us a rule). A rule now
costs the worker about 7 event-loop callbacks (counted on asyncio's loop: its task's
first step and done callback, 3.3 task wake-ups of which about 1.4 are waits for the
evaluation's lock, rules finishing together), about 15 effects through two to four
generator frames, and its share of six aiormq publishes. Left for later: a mailbox per
evaluation instead of its lock, or a rule's task running the next ready rule itself instead
of spawning it (each would save a task switch a rule, but changes the simulator's
interleavings: a deliberate change, to be made with the planted-bug seeds re-checked), and
the batch's replies read straight from hiredis rather than through redis-py.

Third session (branch cpu, 2026-12-02): the worker's instructions a rule under callgrind
(the slope between 100 and 300 evaluations) 530k -> 465k (-12 %). By change, at 300
evaluations (runs of one build differ by about 2k a rule): the history's events not built
where the host discards them (`Host.recording`, -28k), a rule's failpoints left out where
none is armed (`Host.failpoints`, -15k), the batch's replies read from the connection's
hiredis reader (-10k), tasks made by the loop's `create_task` (-5k), `RuleResult.to_json`
encoded once (-4k). This benchmark, `--against` main (7, 9 and 7 rounds of 200
evaluations, load 0.8 to 1.4): median rate -4.3 %, +8.1 %, -4.3 %, CPU a rule +2.5 %,
-11.1 %, 0.0 %; 7 rounds of 1,000 evaluations: rate -2.8 %, CPU -1.0 %; the worker's user
CPU alone, 6 interleaved rounds of 1,000: 133 against 142 us a rule (-6 %), system 16 and
15: within this machine's noise, smaller than the instructions say. Tried and dropped:
packing the batch in Python from a cache of each argument's RESP bytes instead of
`hiredis.pack_command`: replaying the 4,200 calls of a 200-evaluation run (18.1 arguments
a call, 4.1 of them never seen before: the result's JSON, a new evaluation's keys, the
clock), 39.9k instructions a call against hiredis's 24.2k; 17.4k against 25.4k only when
every argument is cached.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aio_pika  # noqa: E402
import asyncpg  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402

from chaos.workers import WorkerProcess  # noqa: E402
from engine.config import DEFAULT_REDIS_URL, DEFAULT_TENANT_ID, EngineConfig  # noqa: E402
from engine.plan import Plan, load_plan  # noqa: E402
from engine.runtime.pgqueue import PgQueue  # noqa: E402
from engine.runtime.pgstore import PostgresStore, migrate  # noqa: E402
from engine.submit import EngineClient  # noqa: E402


async def set_rate(n: int) -> float:
    r = aioredis.Redis.from_url(DEFAULT_REDIS_URL)
    key = f"bench:{uuid.uuid4().hex}"
    try:
        await r.set(key, "x")
        t0 = time.perf_counter()
        for i in range(n):
            await r.set(key, i)
        return n / (time.perf_counter() - t0)
    finally:
        await r.delete(key)
        await r.aclose()


#: The engine's role and database on the private PostgreSQL (as in a live pg-store run).
PG_ROLE = "eai_engine"
PG_DATABASE = "eai"
#: The statement the engine's PostgreSQL store runs, one a transaction (`_APPLY`).
_APPLY_QUERY = "SELECT eai.apply(%"


@dataclass
class PrivatePostgres:
    """The private PostgreSQL of a `--store postgres` run (`PostgresServer`: its own loopback
    port and temp dir, fsync on, `synchronous_commit=on`): the engine's schema migrated by
    the superuser, the engine connecting as a role that is neither superuser nor BYPASSRLS,
    as in a live pg-store run, and a scratch table for the raw INSERT baseline."""

    server: Any  # chaos.systems.pg_store.postgres.PostgresServer
    url: str  # the engine role's: holds its password, never printed
    statements: bool  # pg_stat_statements is loaded: the engine's transactions are counted
    _ids: Iterator[int]

    async def transactions(self) -> tuple[int, float]:
        """How many `eai.apply` statements (each one transaction) the server has run, and
        the milliseconds it spent executing them (their commits not included)."""
        if not self.statements:
            return 0, 0.0
        conn = await self.server.admin(database=PG_DATABASE)
        try:
            row = await conn.fetchrow(
                "SELECT coalesce(sum(calls), 0), coalesce(sum(total_exec_time), 0)"
                " FROM pg_stat_statements WHERE query LIKE $1",
                _APPLY_QUERY,
            )
        finally:
            await conn.close()
        return int(row[0]), float(row[1])

    async def insert_rate(self, n: int) -> float:
        """One client, as the engine's role over TCP, doing `n` sequential single-row INSERTs,
        each its own transaction and so its own durable commit (a WAL flush): INSERTs a
        second."""
        conn = await asyncpg.connect(self.url, server_settings={"synchronous_commit": "on"})
        try:
            sql = "INSERT INTO bench.raw_insert (id, body) VALUES ($1, $2)"
            await conn.execute(sql, next(self._ids), "x")  # prepared: one round trip each
            t0 = time.perf_counter()
            for _ in range(n):
                await conn.execute(sql, next(self._ids), "x")
            return n / (time.perf_counter() - t0)
        finally:
            await conn.close()

    async def settings(self) -> str:
        """What makes a commit durable here, as the server says, for the header line."""
        conn = await asyncpg.connect(self.url, server_settings={"synchronous_commit": "on"})
        try:
            names = ("server_version", "fsync", "synchronous_commit", "wal_sync_method")
            values = [await conn.fetchval(f"SHOW {name}") for name in names]
        finally:
            await conn.close()
        return ", ".join(f"{k} {v}" for k, v in zip(names, values, strict=True))


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    """A private PostgreSQL for the run, stopped and its temp dir deleted on the way out
    (also on a failure or Ctrl-C)."""
    from chaos.systems.pg_store.postgres import PostgresServer, find_postgres_bin

    bin_dir = find_postgres_bin()
    if bin_dir is None:
        raise SystemExit("--store postgres needs PostgreSQL (postgres, initdb) on this machine")
    # Counting the engine's transactions needs pg_stat_statements (postgresql-contrib)
    statements = (bin_dir.parent / "lib" / "pg_stat_statements.so").exists()
    settings = {"shared_preload_libraries": "pg_stat_statements"} if statements else {}
    server = PostgresServer(settings=settings)
    try:
        server.start()
        password = server.create_role(PG_ROLE)
        server.create_database(PG_DATABASE)

        async def prepare() -> None:
            conn = await server.admin(database=PG_DATABASE)
            try:
                await migrate(conn, grant=[PG_ROLE])
                await conn.execute(
                    "CREATE SCHEMA bench;"
                    " CREATE TABLE bench.raw_insert (id bigint PRIMARY KEY, body text NOT NULL);"
                    f" GRANT USAGE ON SCHEMA bench TO {PG_ROLE};"
                    f" GRANT INSERT ON bench.raw_insert TO {PG_ROLE}"
                )
                if statements:
                    await conn.execute("CREATE EXTENSION pg_stat_statements")
            finally:
                await conn.close()

        asyncio.run(prepare())
        yield PrivatePostgres(
            server, server.url(PG_ROLE, password, PG_DATABASE), statements, itertools.count()
        )
    finally:
        server.stop(graceful=False)


@dataclass(frozen=True)
class Rate:
    per_s: float  # rules per second, first evaluation.started to last evaluation.completed
    rules: int
    cpu_s: float  # the worker process's CPU time (user + system) over the same span
    # The store's calls over the same span, counted by the server: Redis scripts (INFO
    # commandstats), or on PostgreSQL the engine's `eai.apply` statements, each one
    # transaction (pg_stat_statements; 0 where that extension is missing).
    scripts: int
    store_ms: float = 0.0  # PostgreSQL: the time it spent executing those (pg_stat_statements)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _scripts(r: aioredis.Redis) -> int:
    """Scripts Redis ran (the commands inside them are counted apart by Redis)."""
    stats = await r.info("commandstats")
    return sum(int(stats.get(k, {}).get("calls", 0)) for k in ("cmdstat_evalsha", "cmdstat_eval"))


async def rule_rate(
    plan_path: Path,
    evaluations: int,
    tmp: Path,
    worker_args: list[str],
    engine_root: Path | None = None,
    redis_url: str = DEFAULT_REDIS_URL,
    module: tuple[str, ...] = ("engine.worker",),
    pg: PrivatePostgres | None = None,
    alone: bool = False,
) -> Rate:
    """One round of the engine: `evaluations` of the plan through one worker, its store
    Redis, or with `pg` that PostgreSQL (`--store postgres`), and with `alone` its queue too
    (`--system pg`: no RabbitMQ)."""
    plan = load_plan(plan_path)
    ns = f"bench{uuid.uuid4().hex[:6]}."
    if pg is None:
        config = EngineConfig(namespace=ns, redis_url=redis_url)
        store_args: list[str] = []
        env = {"REDIS_URL": redis_url}
    else:
        config = EngineConfig(
            namespace=ns,
            store="postgres",
            broker="postgres" if alone else "rabbitmq",
            database_url=pg.url,
        )
        store_args = ["--system", "pg"] if alone else ["--store", "postgres"]
        env = {"EAI_DATABASE_URL": pg.url, "EAI_TENANT_ID": DEFAULT_TENANT_ID}
    log = tmp / "worker.log"
    worker = WorkerProcess(
        [*store_args, "--namespace", ns, "--agent", json.dumps({"latency_ms": 0}), *worker_args],
        env=env,
        log_path=log,
        cwd=engine_root,
        module=module,
    )
    ids = [f"{ns}{i}" for i in range(evaluations)]

    async def store_calls(client: EngineClient) -> tuple[int, float]:
        return (await _scripts(client.store.redis), 0.0) if pg is None else await pg.transactions()

    try:
        async with EngineClient(config) as client:
            measured = False
            try:
                elapsed, cpu_s, calls, ms = await _measure(
                    client, plan, ids, worker, log, store_calls
                )
                final = await client.wait(ids, timeout_s=5)
                measured = True
            finally:  # also on a failure or Ctrl-C: the namespace's queues and state go
                await asyncio.to_thread(worker.terminate)  # first: it would declare them again
                try:
                    await _cleanup(client, ns)
                except Exception as exc:
                    if measured:
                        raise
                    print(f"cleaning up namespace {ns} failed: {exc!r}", file=sys.stderr)
            bad = {a: s for a, s in final.items() if s != "completed"}
            if bad:
                raise SystemExit(
                    f"{len(bad)} evaluations did not complete: {list(bad.items())[:3]}"
                )
        rules = len(ids) * len(plan.order)
        return Rate(rules / elapsed, rules, cpu_s, calls, ms)
    finally:
        worker.terminate()


async def _measure(
    client: EngineClient,
    plan: Plan,
    ids: list[str],
    worker: WorkerProcess,
    log: Path,
    store_calls: Callable[[EngineClient], Awaitable[tuple[int, float]]],
) -> tuple[float, float, int, float]:
    """The seconds from the first evaluation.started to the last evaluation.completed, the
    worker's CPU seconds, the store's calls over them and the store's time in those."""
    # Listen to the events (polling the store would load the store being measured), queue
    # every evaluation, and only then start the worker: the clock runs from the first
    # evaluation.started to the last evaluation.completed, so it measures the worker and
    # neither its start-up nor the submitter.
    if isinstance(client.broker, PgQueue):
        return await _measure_outbox(client, plan, ids, worker, log, store_calls)
    ch = client.broker.channel
    assert ch is not None and client.broker.events is not None
    events = await ch.declare_queue(exclusive=True)
    await events.bind(client.broker.events, "evaluation.completed")
    await events.bind(client.broker.events, "evaluation.started")
    pending = set(ids)
    all_done = asyncio.Event()
    first_start: list[float] = []
    cpu_at_start: list[float] = []  # the worker's start-up is not the rules' cost

    unbinding: list[asyncio.Task[Any]] = []

    async def on_event(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        if message.routing_key == "evaluation.started":
            if not first_start:
                first_start.append(time.perf_counter())
                cpu_at_start.append(_cpu_s(worker.pid))
                # Only the first is needed: the others would cost the broker and this
                # process, which share the worker's two cores, 199 deliveries.
                unbind = events.unbind(client.broker.events, "evaluation.started")
                unbinding.append(asyncio.ensure_future(unbind))
        else:
            pending.discard(json.loads(message.body)["attempt_id"])
        if not pending:
            all_done.set()

    await events.consume(on_event, no_ack=True)
    await asyncio.gather(*(client.submit(plan, a) for a in ids))
    calls, ms = await store_calls(client)
    worker.start()
    deadline = time.monotonic() + 300
    while not all_done.is_set():  # a worker that exits fails the round now, not in 300 s
        if not worker.alive:
            raise SystemExit(
                f"the worker exited ({worker.returncode}); its log: {log.read_text()[-500:]}"
            )
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out; worker log: {log.read_text()[-500:]}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_done.wait(), timeout=1.0)
    elapsed = time.perf_counter() - first_start[0]
    await asyncio.gather(*unbinding)
    cpu_s = _cpu_s(worker.pid) - cpu_at_start[0]
    calls_after, ms_after = await store_calls(client)
    return elapsed, cpu_s, calls_after - calls, ms_after - ms


async def _measure_outbox(
    client: EngineClient,
    plan: Plan,
    ids: list[str],
    worker: WorkerProcess,
    log: Path,
    store_calls: Callable[[EngineClient], Awaitable[tuple[int, float]]],
) -> tuple[float, float, int, float]:
    """`_measure` on `--system pg`: the events read from the outbox when PostgreSQL says
    some were written (`NOTIFY eai_events`), each read one statement on the measured
    server (counted in its transactions, as RabbitMQ's deliveries are not)."""
    assert isinstance(client.broker, PgQueue) and isinstance(client.store, PostgresStore)
    queue = client.broker
    wake = asyncio.Event()
    listener = await asyncpg.connect(client.store.url)
    await listener.add_listener("eai_events", lambda *_: wake.set())
    try:
        await asyncio.gather(*(client.submit(plan, a) for a in ids))
        calls, ms = await store_calls(client)
        worker.start()
        pending, after = set(ids), 0
        first_start: float | None = None
        cpu_at_start = 0.0
        deadline = time.monotonic() + 300
        while pending:
            if not worker.alive:
                raise SystemExit(f"the worker exited; its log: {log.read_text()[-500:]}")
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out; worker log: {log.read_text()[-500:]}")
            wake.clear()
            ((events),) = await queue._apply([["events_after", after, "evaluation.%", 5000]])
            for seq, topic, _, body in events:
                after = seq
                if topic == "evaluation.started" and first_start is None:
                    first_start = time.perf_counter()
                    cpu_at_start = _cpu_s(worker.pid)
                elif topic == "evaluation.completed":
                    pending.discard(body["attempt_id"])
            if pending:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), timeout=1.0)
        assert first_start is not None
        elapsed = time.perf_counter() - first_start
        cpu_s = _cpu_s(worker.pid) - cpu_at_start
        calls_after, ms_after = await store_calls(client)
        return elapsed, cpu_s, calls_after - calls, ms_after - ms
    finally:
        await listener.close()


async def _cleanup(client: EngineClient, ns: str) -> None:
    """The namespace's queues and exchanges (or jobs), and its state in the store."""
    if isinstance(client.broker, PgQueue):
        await client.broker.purge()
    if isinstance(client.store, PostgresStore):
        # The next round's tables as small as this one's (the server goes at the end)
        await client.store.purge([ns], namespace=True)
        if isinstance(client.broker, PgQueue):
            return
    else:
        r = client.store.redis
        keys = [k async for k in r.scan_iter(match=f"attempt:{ns}*", count=1000)]
        for i in range(0, len(keys), 1000):
            await r.delete(*keys[i : i + 1000])
    ch = client.broker.channel
    assert ch is not None
    for name in [client.broker.work_queue_name, *client.broker.delay_queues.values()]:
        await ch.queue_delete(name)
    for name in ("evaluation.events", "evaluation.control"):
        await ch.exchange_delete(f"{ns}{name}")


def _compare(args: argparse.Namespace) -> int:
    import tempfile

    worker_args = ["--max-evaluations", str(args.max_evaluations)]
    here: list[Rate] = []
    there: list[Rate] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):  # interleaved: both see the same machine's moods
            for root, rates, extra in (
                (None, here, args.worker_arg),
                (args.against.resolve(), there, []),
            ):
                rate = asyncio.run(
                    rule_rate(args.plan, args.evaluations, Path(tmp), worker_args + extra, root)
                )
                rates.append(rate)
            print(
                f"round {i + 1}: this engine {here[-1].per_s:8.0f} /s "
                f"({_cpu_us(here[-1]):.0f} us CPU a rule), against {there[-1].per_s:8.0f} /s "
                f"({_cpu_us(there[-1]):.0f} us)"
            )
    mine = statistics.median(r.per_s for r in here)
    theirs = statistics.median(r.per_s for r in there)
    print(f"median rules per second: this engine {mine:.0f} /s, {args.against}: {theirs:.0f} /s")
    print(f"ratio this/against: {mine / theirs:.3f} ({(mine / theirs - 1) * 100:+.1f} %)")
    # The worker's CPU a rule is steadier than its rate on a busy machine (a neighbour's
    # burst stretches the wall clock more than the work).
    cpu_mine = statistics.median(_cpu_us(r) for r in here)
    cpu_theirs = statistics.median(_cpu_us(r) for r in there)
    print(
        f"median CPU a rule: this engine {cpu_mine:.0f} us, {args.against}: {cpu_theirs:.0f} us "
        f"({(cpu_mine / cpu_theirs - 1) * 100:+.1f} %)"
    )
    return 0


def _cpu_us(rate: Rate) -> float:
    return rate.cpu_s / rate.rules * 1e6


def _spread(ratios: list[float]) -> tuple[float, float]:
    """The median and its spread: the median absolute deviation, as a share of the median
    (robust to one round that a neighbour's burst disturbed)."""
    mid = statistics.median(ratios)
    return mid, statistics.median(abs(r - mid) for r in ratios) / mid


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--evaluations", type=int, default=200, help="per round")
    p.add_argument("--sets", type=int, default=3000, help="SETs per baseline measurement")
    p.add_argument("--plan", type=Path, default=ROOT / "plans" / "code_review.yaml")
    p.add_argument("--max-evaluations", type=int, default=64, help="the worker's concurrency")
    p.add_argument("--against", type=Path, help="another checkout whose engine to compare with")
    p.add_argument("--rounds", type=int, default=7, help="A/B rounds")
    p.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="a flag for this engine's worker (repeat; e.g. --worker-arg=--event-loop=asyncio)",
    )
    p.add_argument(
        "--store",
        choices=("redis", "postgres"),
        default="redis",
        help="postgres: the engine on a private PostgreSQL against its raw durable INSERT rate, "
        "and the Redis design in the same rounds",
    )
    p.add_argument(
        "--system",
        choices=("pg",),
        help="with --store postgres: PostgreSQL alone too (`--system pg`, no RabbitMQ), "
        "against the same INSERT rate in the same rounds",
    )
    p.add_argument(
        "--inserts",
        type=int,
        default=1000,
        help="INSERTs per baseline measurement (--store postgres)",
    )
    args = p.parse_args()
    import tempfile

    if args.against is not None:
        if args.store != "redis":
            p.error("--against compares engines on Redis only")
        return _compare(args)
    if args.store == "postgres":
        return _on_postgres(args)

    worker_args = ["--max-evaluations", str(args.max_evaluations), *args.worker_arg]
    ratios: list[float] = []
    costs: list[Rate] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):  # A/B/A: each engine run between two baselines
            before = asyncio.run(set_rate(args.sets))
            rate = asyncio.run(rule_rate(args.plan, args.evaluations, Path(tmp), worker_args))
            after = asyncio.run(set_rate(args.sets))
            baseline = (before + after) / 2
            ratios.append(rate.per_s / baseline)
            costs.append(rate)
            print(
                f"round {i + 1}: SET {before:7.0f} then {after:7.0f} /s, "
                f"rules {rate.per_s:7.0f} /s ({rate.rules} rules), ratio {ratios[-1]:.2f}"
            )
    _report_redis(ratios, costs, args.rounds)
    return 0


def _report_redis(ratios: list[float], costs: list[Rate], rounds: int) -> None:
    ratio, spread = _spread(ratios)
    print(
        f"ratio rules/SET: median {ratio:.2f} +- {spread * 100:.0f} % "
        f"(median absolute deviation; range {min(ratios):.2f}..{max(ratios):.2f}, "
        f"{rounds} rounds)"
    )
    cpu = statistics.median(_cpu_us(c) for c in costs)
    scripts = statistics.median(c.scripts / c.rules for c in costs)
    print(f"one rule costs the worker {cpu:.0f} us of CPU, and Redis {scripts:.2f} scripts")
    print(
        f"target >= 1.00: {'OK' if ratio >= 1.0 else 'BELOW TARGET'}; spread <= 15 %: "
        f"{'OK' if spread <= 0.15 else 'TOO NOISY'}"
    )


def _on_postgres(args: argparse.Namespace) -> int:
    """Each round: the raw INSERT rate, the engine on PostgreSQL, the INSERT rate again; then
    the SET rate, the engine on Redis, the SET rate again (the default mode's round)."""
    import tempfile

    # A kill cleans up as Ctrl-C does: the private server stopped, the queues deleted
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    worker_args = ["--max-evaluations", str(args.max_evaluations), *args.worker_arg]
    pg_ratios: list[float] = []
    pg_costs: list[Rate] = []
    alone_ratios: list[float] = []
    alone_costs: list[Rate] = []
    ratios: list[float] = []
    costs: list[Rate] = []
    with private_postgres() as pg, tempfile.TemporaryDirectory() as tmp:
        print(f"private PostgreSQL: {asyncio.run(pg.settings())}")
        for i in range(args.rounds):
            before = asyncio.run(pg.insert_rate(args.inserts))
            rate = asyncio.run(
                rule_rate(args.plan, args.evaluations, Path(tmp), worker_args, pg=pg)
            )
            alone = None
            if args.system == "pg":
                alone = asyncio.run(
                    rule_rate(
                        args.plan, args.evaluations, Path(tmp), worker_args, pg=pg, alone=True
                    )
                )
            after = asyncio.run(pg.insert_rate(args.inserts))
            pg_ratios.append(rate.per_s / ((before + after) / 2))
            pg_costs.append(rate)
            if alone is not None:
                alone_ratios.append(alone.per_s / ((before + after) / 2))
                alone_costs.append(alone)
                print(
                    f"round {i + 1}: PostgreSQL alone (--system pg) {alone.per_s:7.0f} rules/s, "
                    f"ratio {alone_ratios[-1]:.2f}"
                )
            set_before = asyncio.run(set_rate(args.sets))
            on_redis = asyncio.run(rule_rate(args.plan, args.evaluations, Path(tmp), worker_args))
            set_after = asyncio.run(set_rate(args.sets))
            ratios.append(on_redis.per_s / ((set_before + set_after) / 2))
            costs.append(on_redis)
            print(
                f"round {i + 1}: INSERT {before:7.0f} then {after:7.0f} /s, rules on PostgreSQL "
                f"{rate.per_s:7.0f} /s ({rate.rules} rules), ratio {pg_ratios[-1]:.2f}\n"
                f"         SET    {set_before:7.0f} then {set_after:7.0f} /s, rules on Redis      "
                f"{on_redis.per_s:7.0f} /s ({on_redis.rules} rules), ratio {ratios[-1]:.2f}"
            )
    print("The Redis design, against the raw SET rate:")
    _report_redis(ratios, costs, args.rounds)
    if alone_ratios:
        mid, spread = _spread(alone_ratios)
        cpu = statistics.median(_cpu_us(c) for c in alone_costs)
        print(
            "PostgreSQL alone (--system pg), against the raw durable INSERT rate: ratio "
            f"rules/INSERT median {mid:.2f} +- {spread * 100:.0f} % (range "
            f"{min(alone_ratios):.2f}..{max(alone_ratios):.2f}); the worker {cpu:.0f} us of CPU "
            f"a rule; target >= 0.50: {'OK' if mid >= 0.5 else 'BELOW TARGET'}"
        )
    print("The PostgreSQL design, against the raw durable INSERT rate:")
    ratio, spread = _spread(pg_ratios)
    print(
        f"ratio rules/INSERT: median {ratio:.2f} +- {spread * 100:.0f} % "
        f"(median absolute deviation; range {min(pg_ratios):.2f}..{max(pg_ratios):.2f}, "
        f"{args.rounds} rounds)"
    )
    cpu = statistics.median(_cpu_us(c) for c in pg_costs)
    per_rule = statistics.median(c.scripts / c.rules for c in pg_costs)
    if pg.statements and per_rule > 0:
        scripts = statistics.median(c.scripts / c.rules for c in costs)
        inside = statistics.median(c.store_ms / c.scripts for c in pg_costs if c.scripts)
        print(
            f"one rule costs the worker {cpu:.0f} us of CPU, and PostgreSQL {per_rule:.3f} "
            f"transactions (eai.apply; {1 / per_rule:.1f} rules a transaction, about "
            f"{scripts / per_rule:.1f} operations if a rule makes as many as Redis scripts), "
            f"each executing {inside:.2f} ms inside PostgreSQL before its commit"
        )
    else:
        print(f"one rule costs the worker {cpu:.0f} us of CPU (no pg_stat_statements here)")
    print(
        f"target >= 1.00: {'OK' if ratio >= 1.0 else 'BELOW TARGET'}; spread <= 15 %: "
        f"{'OK' if spread <= 0.15 else 'TOO NOISY'}"
    )
    on_pg = statistics.median(r.per_s for r in pg_costs)
    on_redis = statistics.median(r.per_s for r in costs)
    print(
        f"median rules per second: PostgreSQL {on_pg:.0f} /s, Redis {on_redis:.0f} /s "
        f"(PostgreSQL/Redis {on_pg / on_redis:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
