"""`pg-store` simulated: the same shell and simulated RabbitMQ, PostgreSQL as the store.

The store's operations are the same Python references (`sim.redis.REFERENCES`) that each
PL/pgSQL function is proven equal to (`tests/live/test_store_reference_live.py`), so the
simulator explores this design with `redis-rabbitmq`'s model of the store, named as this
design names it and timed as PostgreSQL answers: a durable commit per round trip, and
with `postgres.synchronous_commit: false` a kill that loses the commits its WAL writer had
not flushed yet (the last `wal_writer_delay_ms`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from chaos import acts
from chaos.systems.redis_rabbitmq.sim import RedisRabbitSim
from engine.core.messages import RESUME_REASON
from engine.keys import checkpoint_id
from sim.world import SimOptions

if TYPE_CHECKING:
    from chaos.insim.run import SimRun

#: One way of a round trip to PostgreSQL on loopback with a durable commit (uniform): a
#: commit's WAL flush is the most of it (group commit shares it among a batch).
PG_LATENCY_S = (0.3e-3, 1.5e-3)
#: A killed PostgreSQL answering again: WAL replay of a small database.
PG_BOOT_S = 0.1


class PgStoreSim(RedisRabbitSim):
    store_service = "postgres"
    store_link = "postgres"

    def __init__(self, run: SimRun) -> None:
        super().__init__(run)
        pg = run.spec.postgres
        self._durable = pg.synchronous_commit
        self._died_at: float | None = None
        if not self._durable:  # what the WAL writer had not flushed when it died
            self.redis.lag_s = pg.wal_writer_delay_ms / 1000
        self.redis.numbering = True  # checkpoints numbered, for a resume

    @staticmethod
    def sim_options(options: SimOptions) -> SimOptions:
        return dataclasses.replace(options, redis_latency_s=PG_LATENCY_S, redis_boot_s=PG_BOOT_S)

    def on_settled(self, a: acts.Settled) -> int:
        """`PgStoreLive.on_settled`: terminal, announced and out of the running index."""
        redis = self.redis
        if not redis.up:
            return 0
        running = redis.get(redis.running_index) or {}
        settled = redis.settled(a.attempt_ids)
        return len(settled) - sum(i in settled for i in running)

    def on_resume(self, a: acts.Resume) -> Generator[Any, Any, dict[str, Any]]:
        """`EngineClient.resume` (`eai.resume`'s reference, then the work published), on a
        connection of its own; its answer, or why it was refused."""
        kind, *rest = yield from self.store.call(
            self.redis.resume_from, a.attempt_id, a.checkpoint, RESUME_REASON
        )
        if kind != "ok":
            return {"refused": kind}
        body = {"type": "execute", "attempt_id": a.attempt_id, "reason": RESUME_REASON}
        body["published_ms"] = int(self.env.now * 1000)
        yield from self.publish_as_runner(body, f"{a.attempt_id}:resume:{rest[1]}", "runner-resume")
        number = int(rest[0])
        return {
            "run_id": a.attempt_id,
            "state": "running",
            "resume": {
                "checkpoint_id": checkpoint_id(number) if number else None,
                "attempt": int(rest[1]),
            },
            "discarded": list(rest[2:]),
        }

    def on_kill_service(self, a: acts.KillService) -> dict[str, Any]:
        if a.name == self.store_service:
            self._died_at = self.env.now
        return super().on_kill_service(a)

    def _store_back(self) -> dict[str, Any]:
        lost = 0
        if not self._durable and self._died_at is not None:
            lost = self.redis.lose_unreplicated(self._died_at)
        self._died_at = None
        self.redis.restart()
        return {} if self._durable else {"lost_writes": lost}
