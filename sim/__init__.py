"""The deterministic simulator of the engine: the world a worker lives in, on simpy.

It knows nothing of scenarios or checks (`chaos.insim` runs a scenario file here, as
`chaos.runner` runs it live): a world (`sim.world`) of simulated services and
`SimWorker`s, on simpy's simulated clock, where a 10-minute retry tier costs nothing and
one seed gives one history, byte for byte.

What decides is not modelled but run: `engine.core.Evaluation` (every decision: what runs,
retry levels, pruning, passes, park, finish) and `engine.core.recovery`; the worker's
protocol, `engine.shell` (the controller, the orchestrator, the module, the heartbeat, the
sweeper), its effects carried out by `sim/drive.py` on the simulated services;
`engine.agent.FakeAgent.draw` (the live agent's own draw); the failpoint specs and firing
rule of `engine.failpoints`.

What is modelled, one idea a file, each mirroring the live shell's protocol points and
history events:
- `sim/redis.py`: the store's keys (named by `engine.runtime.store`) and each Lua script,
  atomic, with TTLs on simulated time; per-call latency, FIFO per connection; kills, with
  redis-py's retries (a script may run twice when its reply is lost); optional failover
  that loses the last N writes.
- `sim/broker.py`: durable queues, prefetch and manual ACK, requeue at the front on a
  dead connection, delay queues dead-lettering on TTL at their head (head-of-line blocking
  once one queue holds several TTLs: the `per_message_ttl` mutant), exclusive queues and
  mandatory returns, broker kills with robust reconnection, optional `consumer_timeout`
  and dead-letter loss (a scenario's `broker:` and `redis:` sections set these and the
  failover loss, `chaos.insim.run.scenario_options`); AMQP heartbeats, which notice a
  silent connection.
- `sim/network.py`: each worker's proxies to Redis and to the broker, as the live run's
  Toxiproxy gives it (`chaos.links`): latency, bandwidth, slicer, limit_data, timeout,
  reset_peer and slow_close toxics per stream, with the live proxy's seeded draws, and
  cut links; the runner's own clients go around them, as live.
- `sim/worker.py`: the worker process (boot, death, freeze), its tasks simpy processes;
  `sim/failpoints.py`; `sim/world.py`, what a worker needs of the run (the services,
  the clock, the machines' latencies).

What is not, and why: message bodies are not serialised (the plan travels as the `Plan`:
the live code only round-trips it; a rule's result is stored as its JSON, as live); Redis
calls are not grouped into pipeline batches (batching changes neither order nor
atomicity); log lines (no invariant reads them: a log line's level is checked as
`logging` checks it, nothing is written); metrics are not scraped (a worker leaves its
counters in its `worker_stopped`, as live); the events exchange has no consumer (none in a
run); a message's size on the network is estimated, not serialised (`sim.network`);
process start-up is a seeded delay; memory, CPU and clock skew do not exist. Known
liberties: a request is "sent" when issued (live, autopipelining sends it on the next loop
turn, so a crash in that same turn would drop it); a channel closed by `consumer_timeout`
is modelled as its connection closing (its private queue kept); the runner's cancel
client waits for a broker that is down instead of failing the run.
"""
