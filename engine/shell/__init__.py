"""The worker's protocol, written once: generators that yield plain effects.

The pure core (`engine.core`) decides; this layer says in what order the worker talks to
the store, the broker and the history to carry out a decision, with no asyncio, no simpy
and no I/O in it. Each step is a generator of `effects`, carried out by two small drivers:
`engine.runtime.drive` over Redis and RabbitMQ, and `sim.drive` over the simulated ones.
So the simulator explores the code that ships (FoundationDB's and TigerBeetle's rule).

The controller (`controller.py`, with `reevaluate.py`), the orchestrator
(`orchestrator.py`), the module (`module.py`), the heartbeat (`heartbeat.py`) and the
sweeper (`sweeper.py`) are here; steps that run tasks of their own get a `Host` (asyncio
tasks live, simpy processes in sim). What stays in the drivers is I/O only: decoding a
delivery, naming a queue, the clock, the agent's latency.
"""
