"""Issue 25, item 10: the runner's fault injectors survive the faults they run beside.

The loss injector of `broker.dead_letter_loss` takes lost retries off their delay queues on
a connection of its own; a broker kill beside it must not end the run in a traceback: it
waits for the broker, connects again and goes on. A failure of the injector itself ends
its scenario in one `ERROR` line (exit 4), and the next scenarios of the invocation run.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from chaos import cli
from chaos.runner import ScenarioRun
from chaos.scenario import load_scenario
from chaos.systems.redis_rabbitmq import live as runner
from chaos.systems.redis_rabbitmq.services import Services
from tests.live.conftest import ROOT

SCENARIO = ROOT / "scenarios" / "dead_letter_loss_with_broker_kill.yaml"


def of(history: list[dict], *kinds: str) -> list[dict]:
    return [e for e in history if e["ev"] in kinds]


def test_the_loss_injector_rides_out_a_broker_kill(services: Services, tmp_path: Path) -> None:
    loaded = load_scenario(SCENARIO)
    outcome = asyncio.run(ScenarioRun(loaded, services, tmp_path).run())  # no exception
    assert services.broker is not None
    if not services.broker.alive:
        services.broker.restart()
    assert outcome.result.ok, (outcome.result.verdicts, outcome.result.violations[:2])
    history = outcome.history
    [killed] = of(history, "service_killed")
    [restarted] = of(history, "service_restarted")
    assert killed["service"] == restarted["service"] == "broker"
    # Every retry the seed loses got its decision, taken or missed (it had expired while
    # the broker was down), whenever it was published ...
    drawn = {
        (e["attempt_id"], e["rule_id"], e["attempt"])
        for e in of(history, "retry_published")
        if loaded.spec.broker.loses(
            loaded.spec.seed, f"{e['attempt_id']}:{e['rule_id']}:{e['attempt']}"
        )
    }
    decided = of(history, "retry_lost", "retry_loss_missed")
    assert drawn and {(e["attempt_id"], e["rule_id"], e["attempt"]) for e in decided} == drawn
    # ... and the injector took lost retries off their queues after the broker came back.
    assert [e for e in of(history, "retry_lost") if e["t"] > restarted["t"]]


def test_a_failing_injector_ends_its_scenario_in_one_line_and_the_next_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def broken_take(*args: Any) -> bool:
        raise ValueError("the injector's own bug")

    monkeypatch.setattr(runner, "_take", broken_take)
    for name in ("REDIS_URL", "AMQP_URL"):
        monkeypatch.delenv(name, raising=False)
    after = ROOT / "scenarios" / "crash_before_ack.yaml"
    out = tmp_path / "out"
    code = cli.main(
        ["run", str(SCENARIO), str(after), "--mode", "live", "--quiet", "--out", str(out)]
    )
    printed = capsys.readouterr()
    assert code == cli.EXIT_HARNESS, printed
    assert "Traceback" not in printed.out + printed.err
    [line] = [x for x in printed.out.splitlines() if x.startswith("ERROR ")]
    assert line.startswith(
        "ERROR dead_letter_loss_with_broker_kill (live): broker.dead_letter_loss: the loss "
        "injector failed: ValueError: the injector's own bug"
    )
    assert (out / "dead_letter_loss_with_broker_kill" / "harness_error.txt").exists()
    assert any(x.startswith("PASS crash_before_ack (live)") for x in printed.out.splitlines())
    junit = (out / "junit.xml").read_text()  # CI's tab shows the scenario as an error
    assert '<testsuites name="chaos" tests=' in junit and 'errors="1"' in junit
