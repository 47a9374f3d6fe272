"""The simulated world a worker lives in: its clock, its services and its machines.

`sim` knows nothing of scenarios or checks: whoever runs a simulation (`chaos.insim`)
builds a world, starts `SimWorker`s in it and reads what they recorded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol

import simpy

from sim.broker import SimBroker
from sim.network import Network
from sim.redis import SimRedis


@dataclass(frozen=True)
class SimOptions:
    """What the scenario file does not say: the simulated machines. Defaults model the
    loopback services of a live run; the fault knobs are off."""

    redis_latency_s: tuple[float, float] = (50e-6, 250e-6)  # each way, uniform
    broker_latency_s: tuple[float, float] = (100e-6, 500e-6)  # each way, uniform
    worker_boot_s: tuple[float, float] = (0.2, 0.4)  # interpreter start to `worker_started`
    redis_boot_s: float = 0.05  # a restarted redis-server answering
    broker_boot_s: float = 0.5  # a restarted RabbitMQ node answering
    reconnect_interval_s: float = 0.5  # aio-pika connect_robust
    consumer_timeout_s: float | None = None  # RabbitMQ's consumer_timeout; None: off
    dead_letter_loss: float = 0.0  # probability that a dead-lettered retry is lost
    redis_failover_loss: int = 0  # writes a Redis restart loses (a lagging replica)
    amqp_heartbeat_s: float = 60.0  # the workers' AMQP heartbeat (RabbitMQ's default)


class World(Protocol):
    """What a simulated worker needs of the run it belongs to."""

    env: simpy.Environment
    redis: SimRedis
    broker: SimBroker
    network: Network  # each worker's proxies to its store and to the broker
    store_link: str  # the name of a worker's link to the store ("redis", "postgres")
    options: SimOptions
    events: list[dict[str, Any]]  # every history event, in the order they happened
    net_rng: random.Random  # network latencies
    boot_rng: random.Random  # process start-up
    pauses: bool  # the run may pause workers (every step is then watched for a thaw)
    shell_errors: list[str]  # protocol errors of the shell, for the run to report
