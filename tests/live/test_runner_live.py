"""The live runner never hangs on a client library that does not return.

A robust AMQP connection may swallow its cancellation while it waits for a broker: an act
waiting on one would hold the run, and CI, for ever. Each act has `ACT_LIMIT_S`; past it
the scenario ends in a `HarnessError` naming the act, everything the run started is
stopped, and the stuck work is cancelled and left behind rather than waited for.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from chaos import acts, runner
from chaos.runner import HarnessError, ScenarioRun
from chaos.scenario import load_scenario
from chaos.systems.redis_rabbitmq.live import RedisRabbitLive
from chaos.systems.redis_rabbitmq.services import Services
from tests.live.conftest import ROOT

pytestmark = [pytest.mark.live, pytest.mark.slow]


def test_an_act_that_swallows_its_cancellation_ends_the_run_in_a_harness_error(
    services: Services, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = asyncio.Event()
    swallowed: list[str] = []

    async def stuck(self: RedisRabbitLive, a: acts.Announced) -> set[str]:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            swallowed.append("cancel")  # as a reconnecting robust connection does
            await release.wait()
        return set()

    monkeypatch.setattr(RedisRabbitLive, "on_announced", stuck)
    monkeypatch.setattr(runner, "ACT_LIMIT_S", 10.0)
    run = ScenarioRun(
        load_scenario(ROOT / "scenarios" / "crash_before_ack.yaml"), services, tmp_path
    )

    async def main() -> str:
        try:
            await run.run()
        except HarnessError as exc:
            return str(exc)
        finally:
            release.set()  # only now: had the runner waited for the stuck act, never
        return "no error"

    said = asyncio.run(main())
    assert said == "the runner's Announced did not end within 10 s"
    assert swallowed == ["cancel"]
    assert all(s.proc is None or not s.proc.alive for s in run.conductor.slots)
