"""The PostgreSQL store's group commit (`GroupCommit`, `Lanes`), on its own: which calls go
together, and that no call of an evaluation overtakes an earlier one while the lanes run
batches side by side. The batches run on a stand-in `run` here (the order of calls is the
property; `tests/live/test_pgstore_live.py` runs them on PostgreSQL)."""

from __future__ import annotations

import asyncio
from typing import Any

from engine.runtime.pgstore import GroupCommit, Lanes


class Backend:
    """Runs a batch over a few loop turns and records what was in flight meanwhile."""

    def __init__(self) -> None:
        self.in_flight: list[set[str]] = []
        self.most_at_once = 0
        self.applied: dict[str, list[int]] = {}

    async def run(self, ops: list[list[Any]]) -> list[Any]:
        mine = {op[1] for op in ops}
        for other in self.in_flight:
            assert not mine & other, f"{sorted(mine & other)} in two batches at once"
        self.in_flight.append(mine)
        self.most_at_once = max(self.most_at_once, len(self.in_flight))
        for _ in range(3):
            await asyncio.sleep(0)
        for op in ops:
            self.applied.setdefault(op[1], []).append(op[2])
        self.in_flight.remove(mine)
        return [op[2] for op in ops]


async def _calls_in_three_turns(batch: GroupCommit | Lanes, ids: list[str]) -> list[Any]:
    """Each evaluation's second and third calls made while its first is still in flight, as
    a cancelled task's write is followed by the lease's release."""
    futures = []
    for n in range(3):
        futures += [batch.call(["op", a, n]) for a in ids]
        await asyncio.sleep(0)
    return list(await asyncio.gather(*futures))


def test_calls_made_in_one_turn_go_as_one_batch_and_later_ones_wait_for_it() -> None:
    backend = Backend()
    batch = GroupCommit(backend.run)
    ids = [f"att-{i}" for i in range(10)]
    replies = asyncio.run(_calls_in_three_turns(batch, ids))
    assert replies == [n for n in range(3) for _ in ids]
    assert backend.most_at_once == 1
    assert batch.batches == 2 and batch.largest == 20  # the 2nd and 3rd turns waited together
    assert all(backend.applied[a] == [0, 1, 2] for a in ids)


def test_lanes_run_batches_side_by_side_and_keep_each_evaluations_order() -> None:
    backend = Backend()
    lanes = Lanes(backend.run, 2)
    ids = [f"att-{i}" for i in range(41)]
    replies = asyncio.run(_calls_in_three_turns(lanes, ids))
    assert replies == [n for n in range(3) for _ in ids]
    assert backend.most_at_once == 2  # both lanes' batches in flight together
    assert all(backend.applied[a] == [0, 1, 2] for a in ids)  # none overtook another
    assert all(0 < lane.largest < 2 * len(ids) for lane in lanes.lanes)  # shared out


def test_an_operation_without_an_evaluation_takes_a_lane_too() -> None:
    backend = Backend()
    lanes = Lanes(backend.run, 3)
    assert asyncio.run(_one(lanes)) == "x"
    assert lanes.batches == 1


async def _one(lanes: Lanes) -> Any:
    return await lanes.call(["purge", None, "x"])
