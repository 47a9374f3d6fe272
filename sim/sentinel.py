"""Redis behind Sentinel, simulated: a primary, one replica, and sentinels that promote it.

The data is one `SimRedis`. Replication is asynchronous: a write reaches the replica
`lag_s` after the primary applied it (a draw of the seed, up to `MAX_LAG_S`: a busy
machine, a replica fsyncing each write), and a failover loses what the primary applied in
its last `lag_s`, acknowledged or not; a client whose store waits for the replica
(`WAIT`, `sim.redis.RedisClient`) gets its reply only once the write is there. A partition
between the two (`partition`) stops replication: a failover then loses everything since
the cut, and a `WAIT` times out. A replica cut off for longer than Sentinel's validity
(ten times `down_after_s`) is not promoted. Availability is modelled as a live failover
has it: the primary killed,
every client fails and retries until the sentinels, `down_after_s` after its last answer
plus an election drawn from the seed, promote the replica; the killed server, restarted,
rejoins as a replica, so a second kill can fail over again. Restarted before the sentinels
declared it down, the old primary simply serves again, and nobody is promoted; restarted
after, it waits for the failover under way, as the live runner does.
"""

from __future__ import annotations

import random
from collections.abc import Generator
from typing import Any

import simpy

from sim.redis import SimRedis

#: After `down_after_s`, how long the sentinels take to agree the primary is down, elect a
#: leader and promote the replica (a draw of the seed within these bounds, in seconds; live,
#: on a 2-core machine with down-after 500 ms, the whole failover took 1.6 to 1.9 s).
ELECTION_S = (0.8, 1.6)
#: The longest replication lag drawn: live, under a loaded 2-core machine, a promoted
#: replica was seen to lack the primary's last 0.2 s of writes.
MAX_LAG_S = 0.3
#: Sentinels of the topology, and how many must be alive to elect a leader and fail over.
SENTINELS, MAJORITY = 3, 2
#: Sentinel's replica-validity-factor: a replica cut off longer than this many
#: down-after periods is not promoted.
VALIDITY_FACTOR = 10


class SimSentinel:
    def __init__(
        self,
        env: simpy.Environment,
        redis: SimRedis,
        rng: random.Random,
        down_after_s: float,
        boot_s: float,
        min_replicas_lag_s: float | None = None,
    ) -> None:
        self.env = env
        self.redis = redis
        self.rng = rng
        self.down_after_s = down_after_s
        self.boot_s = boot_s
        self.replicas = 1  # servers in sync that a failover can promote
        self.promoted = False  # the last outage ended with a promotion
        self.lost_writes = 0  # what the last promotion lost
        self._back: simpy.Event | None = None  # fires when a primary serves again
        self._died_at = 0.0
        self._decided: simpy.Event | None = None  # fires when the sentinels have decided
        self._cut = False  # the replication proxy is disabled
        self._via_proxy = True  # the first replica replicates through it
        self.sentinels_alive = SENTINELS
        self._stalled = False  # a failover was due while too few sentinels were alive
        self._frozen = False  # the primary is paused (SIGSTOP)
        redis.lag_s = rng.uniform(0.0, MAX_LAG_S)
        redis.min_replicas_lag_s = min_replicas_lag_s

    def _down(self) -> None:
        """The primary stopped answering: the sentinels promote the replica, if there is
        one, `down_after_s` after its last answer plus an election."""
        self._died_at = self.env.now
        self._back = self.env.event()
        self.promoted = False
        self._decided = None
        if self.replicas > 0:  # a promotion to come
            self._schedule_promotion()

    def _schedule_promotion(self) -> None:
        if self._decided is None:
            self._decided = self.env.event()
        delay = self.down_after_s + self.rng.uniform(*ELECTION_S)
        self.env.timeout(delay).callbacks.append(self._promote)

    def kill_primary(self) -> None:
        """SIGKILL the primary; the sentinels promote the replica, if there is one."""
        self.redis.kill()
        self._down()

    def pause_primary(self) -> None:
        """SIGSTOP the primary: to the sentinels it is down as if killed."""
        self.redis.pause()
        self._frozen = True  # nor does it send the replica anything
        self._replication_changed()
        self._down()

    def resume_primary(self) -> bool:
        """SIGCONT: it answers what waited; if the replica was promoted meanwhile, from data
        nobody keeps, and it then rejoins as a replica (the harness's REPLICAOF, at once);
        whether that happened."""
        promoted = self.redis.resume()
        self._frozen = False
        if promoted:
            self.replicas += 1
        self._replication_changed()
        return promoted

    def kill_sentinel(self) -> None:
        self.sentinels_alive -= 1

    def restart_sentinel(self) -> None:
        self.sentinels_alive += 1
        if self._stalled and self.sentinels_alive >= MAJORITY and not self._serving:
            self._stalled = False  # the majority is back: the failover goes ahead
            self._schedule_promotion()

    @property
    def _serving(self) -> bool:
        return self.redis.up and not self.redis.paused

    def partition(self, cut: bool) -> None:
        """Cut (or restore) the link between the first primary and its replica (the run's
        replication proxy); restored, the replica catches up. After a promotion that link
        is gone: the killed server rejoins the new primary directly."""
        self._cut = cut
        if self._via_proxy:
            self._replication_changed()

    def _replication_changed(self) -> None:
        self.redis.replica_attached = self.replicas > 0
        replicating = self.replicas > 0 and not (self._cut and self._via_proxy) and not self._frozen
        if replicating:
            self.redis.unreplicated_since = None
        elif self.redis.unreplicated_since is None:
            self.redis.unreplicated_since = self.env.now

    def _promote(self, _: simpy.Event) -> None:
        if not self._serving and self.sentinels_alive < MAJORITY:
            self._stalled = True  # no leader can be elected: undecided until one can
            return
        decided, self._decided = self._decided, None
        if decided is not None:
            decided.succeed()
        if self._serving:  # the old primary came back first: no failover
            return
        since = self.redis.unreplicated_since
        if since is not None and self.env.now - since > VALIDITY_FACTOR * self.down_after_s:
            return  # too long cut off to be trusted: nobody is promoted
        self.replicas -= 1
        self.promoted = True
        if self.redis.paused:  # it keeps its own data for what waits in its buffers
            self.redis.promoted_over_pause()
            self._frozen = False  # the new primary is not
        self.lost_writes = self.redis.lose_unreplicated(self._died_at)
        self._via_proxy = False
        self.redis.unreplicated_since = None
        self._replication_changed()  # no replica now: nothing it writes is replicated
        self._serve()

    def restart_killed(self) -> Generator[simpy.Event, Any, None]:
        """The killed server restarts: a replica of the new primary, or (nobody promoted
        yet) the primary again."""
        yield self.env.timeout(self.boot_s)
        declared = self.env.now - self._died_at >= self.down_after_s
        if not self.redis.up and declared and self._decided is not None:
            # declared down: the failover goes on (if it can), and it waits for it, as
            # the live runner does, rather than be a second primary
            yield self._decided
        if self.redis.up:
            self.replicas += 1  # a full sync: it holds everything from now on
            self._replication_changed()
        else:
            self._serve()

    def _serve(self) -> None:
        self.redis.restart()
        back, self._back = self._back, None
        if back is not None:
            back.succeed()

    def wait_back(self) -> Generator[simpy.Event, Any, bool]:
        """Until a primary serves again; whether a replica was promoted."""
        if self._back is not None:
            yield self._back
        return self.promoted
