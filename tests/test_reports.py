"""Reports (`reports/`, `python -m chaos report`): what faults cost, from runs' outputs.

The numbers are read from histories: hand-written ones pin each cause and level, and
simulated runs of the shipped scenarios must agree with the checker's own counts."""

from __future__ import annotations

import contextlib
import html
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest

from chaos.cli import main
from chaos.insim import outputs, run_scenario
from chaos.scenario import load_scenario
from reports import build_report, find_runs, plots
from reports.cost import duplicated_cost, figures
from reports.latency import percentiles, recoveries, retry_latencies

ROOT = Path(__file__).resolve().parents[1]


def ev(t: float, ev: str, src: str = "w1", pid: int = 11, **fields: Any) -> dict[str, Any]:
    return {"t": t, "ev": ev, "src": src, "pid": pid, **fields}


def start(t: float, rule: str, src: str = "w1", attempt: int = 1, pid: int = 11) -> dict:
    return ev(t, "rule_started", src, pid, attempt_id="a", rule_id=rule, attempt=attempt, try_no=1)


def done(t: float, rule: str, tokens: int, src: str = "w1", pid: int = 11) -> dict:
    return ev(t, "rule_finished", src, pid, attempt_id="a", rule_id=rule, attempt=1, tokens=tokens)


def test_each_rerun_is_charged_to_its_cause() -> None:
    history = [
        start(0.0, "ww"),
        done(0.1, "ww", 100),  # finished, never written: the write window
        start(0.0, "sw"),  # in flight when its worker died after the ACK
        start(0.0, "rd"),  # in flight when its worker died before the ACK
        ev(0.3, "worker_killed", "runner", 11, worker=0),
        ev(0.5, "sweeper_resumed", "w2", 12, attempt_id="a"),
        start(0.6, "ww", "w2", pid=12),
        done(0.7, "ww", 120, "w2", 12),
        start(0.6, "sw", "w2", pid=12),
        done(0.7, "sw", 130, "w2", 12),
        ev(0.8, "delivered", "w3", 13, attempt_id="a", redelivered=True),
        start(0.9, "rd", "w3", pid=13),
        done(1.0, "rd", 140, "w3", 13),
        ev(1.0, "result_persisted", "w3", 13, attempt_id="a", rule_id="rd", won=True),
        ev(1.1, "service_restarted", "runner", 1, service="redis", lost_writes=3),
        start(1.2, "rd", "w3", pid=13),  # its result was lost with Redis' writes
        done(1.3, "rd", 150, "w3", 13),
    ]
    cost = duplicated_cost(history)
    assert [(x.rule_id, x.cause, x.tokens) for x in cost.reruns] == [
        ("ww", "write_window", 120),
        ("sw", "sweeper_resume", 130),
        ("rd", "redelivery", 140),
        ("rd", "lost_state", 150),
    ]
    assert cost.tokens_total == 640
    # Each call paid twice is duplicated for its rerun's cause; a call cut short by a
    # crash recorded no tokens, so its rerun pays it once (sw, and rd's first rerun).
    f = figures(history)
    assert f.duplicated_by_cause["write_window"] == 120
    assert f.duplicated_by_cause["lost_state"] == 150
    assert f.duplicated_tokens == 270 == sum(f.duplicated_by_cause.values())
    assert f.reference_tokens == 370 == f.tokens_total - f.duplicated_tokens
    assert f.reruns_by_cause["sweeper_resume"] == 1 and f.reruns == 4
    # Against the reference call by call: a call it never makes is `extra_calls`, one of
    # its calls this run never made is `not_run`; paid = bill - not_run + duplicated.
    ref = {("a", "ww", 1, 1): 100, ("a", "sw", 1, 1): 130, ("a", "rd", 1, 1): 140}
    ref[("a", "gone", 1, 1)] = 77
    g = figures(history, reference_calls=ref)
    assert (g.reference_tokens, g.not_run_tokens) == (447, 77)
    assert g.duplicated_by_cause["extra_calls"] == 0
    assert g.tokens_total == g.reference_tokens - g.not_run_tokens + g.duplicated_tokens
    del ref[("a", "sw", 1, 1)]
    h = figures(history, reference_calls=ref)
    assert h.duplicated_by_cause["extra_calls"] == 130
    assert h.tokens_total == h.reference_tokens - h.not_run_tokens + h.duplicated_tokens
    # Without the lost writes, a start after the write is the engine's bug, or a mutant's.
    unexplained = [e for e in history if e["ev"] != "service_restarted"]
    assert duplicated_cost(unexplained).reruns[-1].cause == "after_completion"
    assert duplicated_cost(unexplained, mutant="ignore_lease").reruns[-1].cause == "mutant"


def test_retry_latency_is_timed_from_the_first_failure_and_leveled() -> None:
    def fail(t: float, rule: str) -> dict:
        return ev(t, "rule_failed", attempt_id="a", rule_id=rule, attempt=1, tokens=1)

    def status(t: float, rule: str, value: str) -> dict:
        return ev(t, "status_written", attempt_id="a", rule_id=rule, status=value)

    def written(t: float, rule: str) -> dict:
        return ev(t, "result_persisted", attempt_id="a", rule_id=rule, won=True)

    history = [
        fail(1.0, "immediate"),
        written(1.5, "immediate"),
        fail(1.0, "delayed"),
        status(1.1, "delayed", "failed_attempt_1"),
        status(2.0, "delayed", "failed_attempt_2"),
        written(4.0, "delayed"),
        fail(1.0, "given_up"),
        status(3.0, "given_up", "permanently_failed"),
        fail(1.0, "unfinished"),
        written(0.5, "never_failed"),
    ]
    got = {(x.rule_id, x.level, x.tier, x.seconds, x.outcome) for x in retry_latencies(history)}
    assert got == {
        ("immediate", 1, None, 0.5, "succeeded"),
        ("delayed", 2, 2, 3.0, "succeeded"),
        ("given_up", 3, None, 2.0, "permanently_failed"),
    }
    assert percentiles([3.0, 1.0, 2.0]) == {
        "n": 3, "p50": 2.0, "p95": 3.0, "p99": 3.0, "max": 3.0, "mean": 2.0,
    }  # fmt: skip
    assert percentiles([]) == {"n": 0}


def test_recovery_is_timed_for_the_evaluations_the_killed_worker_held() -> None:
    history = [
        ev(0.0, "evaluation_started", "w1", 11, attempt_id="a"),
        ev(0.0, "evaluation_started", "w2", 12, attempt_id="b"),
        ev(1.0, "worker_killed", "runner", 11, worker=0),  # the killed worker's pid
        ev(1.4, "rule_started", "w2", 12, attempt_id="a", rule_id="r"),
        ev(2.0, "evaluation_terminal", "w2", 12, attempt_id="a"),
    ]
    [rec] = recoveries(history)
    assert (rec.fault, rec.attempt_id) == ("worker_killed worker 0", "a")
    assert rec.next_start_s == pytest.approx(0.4) and rec.end_s == pytest.approx(1.0)


def test_recovery_is_timed_for_the_evaluations_held_behind_a_cut_link() -> None:
    history = [
        ev(0.0, "evaluation_started", "w1", 11, attempt_id="a"),
        ev(0.0, "evaluation_started", "w2", 12, attempt_id="b"),
        ev(1.0, "link_cut", "runner", None, link="redis", workers=[0], pids=[11]),
        ev(1.7, "rule_started", "w2", 12, attempt_id="a", rule_id="r"),
        ev(2.5, "evaluation_terminal", "w2", 12, attempt_id="a"),
    ]
    [rec] = recoveries(history)  # b's worker kept its link: not caught
    assert (rec.fault, rec.attempt_id) == ("link_cut redis of workers [0]", "a")
    assert rec.next_start_s == pytest.approx(0.7) and rec.end_s == pytest.approx(1.5)


@pytest.mark.parametrize("name", ["crash_after_ack", "transient_llm_errors", "worker_kill_storm"])
def test_a_report_agrees_with_the_checker_and_renders_every_plot(name: str, tmp_path: Path) -> None:
    outcome = run_scenario(load_scenario(ROOT / "scenarios" / f"{name}.yaml"))
    outputs(outcome, tmp_path / "run" / name)
    report = build_report(find_runs([tmp_path / "run"]), tmp_path / "report", 0.5)
    metrics = json.loads((report / "metrics.json").read_text())
    [run] = metrics["runs"]
    stats = outcome.result.stats
    assert run["cost"]["reruns"] == stats["reruns"]
    assert run["cost"]["duplicated_tokens"] == stats["duplicated_tokens"]
    assert run["cost"]["tokens_total"] == stats["tokens_total"]
    assert run["cost"]["duplicated_usd"] == pytest.approx(stats["duplicated_tokens"] / 1000 * 0.5)
    assert run["settings"]["time_scale"] == outcome_scale(name)
    # The fault-free bill is the reference's (the core alone): a run without faults pays it.
    assert run["cost"]["reference_tokens"] == stats["reference_tokens"] > 0
    if name == "transient_llm_errors":
        assert stats["reference_tokens"] == stats["tokens_total"]
    page = (report / "report.html").read_text()
    assert "http://" not in page and "https://" not in page  # nothing from the network
    assert page.count("data:image/png;base64,") == 3
    for png in sorted(report.glob("*.png")):
        pixels = matplotlib.image.imread(io.BytesIO(png.read_bytes()), format="png")
        height, width = pixels.shape[:2]
        assert height > 200 and width > 400, png.name
        assert pixels.std() > 0.05, f"{png.name} is blank"
    summary = (report / "summary.md").read_text()
    assert summary.startswith("# Verdicts\n\n**1 of 1 runs passed**")  # verdicts first
    assert summary.index("# What the faults cost") > summary.index("| run | verdict |")


def outcome_scale(name: str) -> float:
    return load_scenario(ROOT / "scenarios" / f"{name}.yaml").spec.time_scale


def test_chaos_run_report_and_chaos_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    scenario = str(ROOT / "scenarios" / "crash_after_ack.yaml")
    out = tmp_path / "out"
    assert main(["run", scenario, "--mode", "sim", "--report", "--out", str(out)]) == 0
    assert (out / "report" / "report.html").is_file()
    again = tmp_path / "again"
    assert main(["report", str(out / "crash_after_ack"), "--out", str(again)]) == 0
    assert (again / "metrics.json").is_file()
    capsys.readouterr()
    assert main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"chaos report: {tmp_path / 'missing'}: no such file or directory"]
    assert main(["report", str(tmp_path)]) == 2  # a folder without runs
    assert not (tmp_path / "report").exists()  # nothing half-written


def test_a_cost_budget_exceeded_fails_the_run_and_the_report_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import yaml

    doc = yaml.safe_load((ROOT / "scenarios" / "crash_after_ack.yaml").read_text())
    doc["plan"] = str(ROOT / "plans" / "code_review.yaml")
    tight = tmp_path / "tight.yaml"
    tight.write_text(yaml.safe_dump({**doc, "budgets": {"max_duplicated_ratio": 0.01}}))
    loose = tmp_path / "loose.yaml"
    loose.write_text(
        yaml.safe_dump({**doc, "budgets": {"max_duplicated_ratio": 50, "max_p99_recovery_s": 60}})
    )
    out = tmp_path / "out"
    assert main(["run", str(tight), "--mode", "sim", "--report", "--out", str(out)]) == 1
    journal = json.loads((out / doc["name"] / "journal.json").read_text())
    [failure] = journal["budget_failures"]
    assert failure.startswith("duplicated_ratio ") and "> max_duplicated_ratio 0.01" in failure
    assert "| max_duplicated_ratio | 0.01 |" in (out / "report" / "summary.md").read_text()
    assert "EXCEEDED" in (out / "report" / "report.html").read_text()
    out2 = tmp_path / "out2"
    assert main(["run", str(loose), "--mode", "sim", "--report", "--out", str(out2)]) == 0
    stats = json.loads((out2 / doc["name"] / "journal.json").read_text())["stats"]
    assert 0 < stats["duplicated_ratio"] < 50 and 0 < stats["recovery_p99_s"] < 60
    capsys.readouterr()


def _chromium(args: list[str], tmp: Path) -> str:
    """Headless Chromium (Debian's `chromium`, which .ci/run installs when it is missing),
    with a profile of its own; its whole process group is killed if it hangs."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:  # .ci/run installs it and sets CHAOS_REQUIRE_CHROMIUM=1: there it must run
        missing = "no chromium on PATH: `apt-get install chromium` to see the report in a browser"
        if os.environ.get("CHAOS_REQUIRE_CHROMIUM") == "1":
            pytest.fail(missing, pytrace=False)
        pytest.skip(missing)
    cmd = [
        exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
        f"--user-data-dir={tmp / 'profile'}", "--virtual-time-budget=10000", *args,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True, text=True
    )
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, f"chromium exited {proc.returncode}"
    return out


PROBE = """<script>
window.addEventListener("load", () => {
  for (const img of document.images) {
    const p = document.createElement("p");
    p.className = "probe";
    p.textContent = `${img.complete} ${img.naturalWidth}x${img.naturalHeight}`;
    document.body.appendChild(p);
  }
});
</script></body>"""


def test_the_report_renders_in_a_browser_with_every_plot(tmp_path: Path) -> None:
    outcome = run_scenario(load_scenario(ROOT / "scenarios" / "worker_kill_storm.yaml"))
    outputs(outcome, tmp_path / "run" / "worker_kill_storm")
    report = build_report(find_runs([tmp_path / "run"]), tmp_path / "report")
    page = (report / "report.html").read_text()
    # Each embedded plot decoded by the browser at the size of its PNG file.
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", PROBE))
    dom = _chromium(["--dump-dom", probe.as_uri()], tmp_path)
    seen = re.findall(r'<p class="probe">(\w+) (\d+)x(\d+)</p>', dom)
    expected = []
    slug = "worker_kill_storm-sim-seed-8"  # the plots are named after their run
    for name in ("cost.png", f"{slug}-timeline.png", f"{slug}-latency.png"):  # page order
        height, width = matplotlib.image.imread(report / name).shape[:2]
        expected.append(("true", str(width), str(height)))
    assert seen == expected
    # And the page as a person sees it: a screenshot that is not blank.
    shot = tmp_path / "shot.png"
    _chromium(
        [f"--screenshot={shot}", "--window-size=1200,2000", (report / "report.html").as_uri()],
        tmp_path,
    )
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (2000, 1200)
    assert pixels.std() > 0.05


def test_chaos_compare_shows_what_each_memory_buys(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    scenario = str(ROOT / "scenarios" / "crash_after_ack.yaml")
    assert main(["compare", scenario, "--mode", "sim", "--seeds", "3", "--out", str(out)]) == 0
    rows = {r["mutant"]: r for r in json.loads((out / "compare.json").read_text())["rows"]}
    engine, rabbit_only, as_written = rows[None], rows["no_redis_results"], rows["no_sweeper"]
    assert engine["failed"] == {} and engine["finished_rules_paid_again_tokens"] == 0
    assert rabbit_only["failed"] == {"no_completed_rerun": 3}
    assert rabbit_only["finished_rules_paid_again_tokens"] > 0
    assert "paid" in rabbit_only["what_broke"] and "already finished" in rabbit_only["what_broke"]
    assert as_written["failed"] == {"all_terminal": 3} and as_written["unfinished_evaluations"] > 0
    assert "unfinished" in as_written["what_broke"]

    # The numbers are the journals': the engine's duplicated tokens are its checker's
    # reruns; RabbitMQ only pays those and, on top, the reruns after completion.
    def stats(folder: str) -> list[dict[str, Any]]:
        journals = sorted((out / folder).glob("*/journal.json"))
        assert len(journals) == 3
        return [json.loads(j.read_text())["stats"] for j in journals]

    tokens = sorted(s["duplicated_tokens"] for s in stats("engine"))
    assert engine["duplicated_tokens"]["p50"] == tokens[1]
    assert all(s["completed_reruns"] > 0 for s in stats("no_redis_results"))
    paid = sum(s["duplicated_tokens"] for s in stats("no_redis_results"))
    assert rabbit_only["duplicated_tokens"]["mean"] * 3 == pytest.approx(paid)
    after = sum(
        s["duplicated_by_cause"][c]
        for s in stats("no_redis_results")
        for c in ("mutant", "after_completion", "lost_state")
    )
    assert rabbit_only["finished_rules_paid_again_tokens"] == after
    assert (out / "compare.md").read_text().count("\n| ") == 4  # the header and 3 designs
    assert (out / "compare.png").stat().st_size > 10_000
    # compare.html: self-contained (the plot embedded), what broke and the table
    page = (out / "compare.html").read_text()
    assert page.count("data:image/png;base64,") == 1 and "http" not in page and 'src="' in page
    assert page.count("<tr>") == 4  # the header and 3 designs
    for row in rows.values():
        assert html.escape(row["what_broke"]) in page
    assert "mutant <code>no_redis_results</code>" in page and "(as shipped)" in page


def test_chaos_compare_sentinel_weighs_the_answers_to_lost_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the frozen primary that acknowledges writes nobody keeps, either of the engine's
    answers is enough; min-replicas-to-write is not (the old primary wakes with no replica
    and refuses what waited, but what it acknowledged in its last lag before freezing is
    lost all the same), and without any the evaluations are announced with results Redis
    lost."""
    out = tmp_path / "cmp"
    scenario = str(ROOT / "scenarios" / "sentinel_paused_primary.yaml")
    argv = ["compare", scenario, "--designs", "sentinel", "--mode", "sim", "--seeds", "2"]
    assert main([*argv, "--out", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads((out / "compare.json").read_text())["rows"]}
    assert list(rows) == [
        "WAIT + restore",
        "WAIT only",
        "restore only",
        "min-replicas only",
        "none",
    ]
    assert rows["WAIT + restore"]["failed"] == {}
    assert rows["WAIT only"]["failed"] == {} and rows["restore only"]["failed"] == {}
    assert rows["none"]["failed"]["matches_reference"] == 2
    assert rows["min-replicas only"]["failed"]["matches_reference"] == 2
    # the servers' setting at work there, and only there: writes refused (-NOREPLICAS)
    refused = [(out / d).glob("*/history.jsonl") for d in ("min_replicas", "unmitigated")]
    assert any("NOREPLICAS" in h.read_text() for h in refused[0])
    assert not any("NOREPLICAS" in h.read_text() for h in refused[1])
    # a scenario with one Redis has nothing to compare there: one line, exit 2
    single = str(ROOT / "scenarios" / "crash_after_ack.yaml")
    capsys.readouterr()
    assert main([*argv[:1], single, *argv[2:], "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "redis.topology: expected sentinel" in err


def test_chaos_sim_report_gathers_every_seed(tmp_path: Path) -> None:
    scenario = str(ROOT / "scenarios" / "transient_llm_errors.yaml")
    out = tmp_path / "sweep"
    assert main(["sim", scenario, "--seeds", "12", "--jobs", "1", "--report", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["seeds"] == 12
    levels = metrics["retry_latency_production_estimate_s"]
    assert levels["level_1"]["n"] > 0 and levels["level_2"]["n"] > 0  # its errors retry
    # Level 2 waits out a delay tier (30 s in production), level 1 does not.
    assert levels["level_2"]["p50"] > 30 > levels["level_1"]["p50"]
    scenario = metrics["retry_latency_scenario_s"]  # as it happened, at time_scale 0.001
    assert scenario["level_2"]["p50"] < 1 and scenario["level_2"]["n"] == levels["level_2"]["n"]
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3 and "http" not in page


def test_a_sweep_report_names_its_failing_and_costly_seeds_with_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The failing seeds (the mutant's) and the most expensive ones, each with its faults
    and a replay command that reproduces it; recovery as a distribution; fault coverage."""
    scenario = str(ROOT / "scenarios" / "crash_after_ack.yaml")
    out = tmp_path / "sweep"
    argv = ["sim", scenario, "--seeds", "12", "--jobs", "1", "--mutant", "no_redis_results"]
    assert main([*argv, "--report", str(out)]) == 1
    printed = capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    failing = metrics["failing_seeds"]
    assert failing and all(r["failed"] == ["no_completed_rerun"] for r in failing)
    for r in failing:  # as the console printed them
        assert f"  seed {r['seed']}: no_completed_rerun: {r['message']}" in printed
        assert r["faults"] == {"crash at rule_after_write": 1}  # the crash that exposes it
    # The replay command re-explores that one seed: the same failure, the same message.
    first = failing[0]
    command = shlex.split(first["replay"])
    assert command[:4] == ["python", "-m", "chaos", "sim"] and "--mutant" in command
    assert main(command[3:]) == 1
    assert f"seed {first['seed']}: no_completed_rerun: {first['message']}" in (
        capsys.readouterr().out
    )
    costly = metrics["most_expensive_seeds"]
    tokens = [r["duplicated_tokens"] for r in costly]
    assert 0 < len(costly) <= 10 and tokens == sorted(tokens, reverse=True) and tokens[-1] > 0
    assert all(sum(r["duplicated_by_cause"].values()) == r["duplicated_tokens"] for r in costly)
    assert all(
        r["replay"].endswith(f"--first-seed {r['seed']} --mutant no_redis_results") for r in costly
    )
    # Fault coverage: every seed either had the crash or no fault at all.
    coverage = metrics["fault_coverage"]
    crashed = coverage["kinds"]["crash at rule_after_write"]["seeds"]
    assert coverage["seeds_known"] == 12 and crashed + coverage["seeds_without_faults"] == 12
    assert crashed >= len(failing)  # no fault, nothing to break
    recovery = metrics["recovery_scenario_s"]
    assert recovery["n"] > 0 and recovery["p50"] <= recovery["p95"] <= recovery["p99"]
    assert (out / "recovery.png").stat().st_size > 10_000
    page = (out / "report.html").read_text()
    summary = (out / "summary.md").read_text()
    for text in (page, summary):
        assert "Failing seeds" in text and "Most expensive seeds" in text
        assert "Fault coverage" in text and "recovery p50 / p95 / p99" in text
    assert f"`{first['replay']}`" in summary
    assert html.escape(first["replay"]) in page


def test_a_report_reads_at_a_glance(tmp_path: Path) -> None:
    """A headline of verdicts before any cost, a table of contents, a section per run with
    its verdicts, case counts, links to its files and its plots, and provenance; and
    `chaos run` writes summary.md (verdicts first) without --report."""
    out = tmp_path / "out"
    scenario = str(ROOT / "scenarios" / "crash_after_ack.yaml")
    assert main(["run", scenario, scenario, "--mode", "sim", "--out", str(out)]) == 0
    summary = (out / "summary.md").read_text()  # no --report: the summary alone
    assert summary.startswith("# Verdicts\n\n**2 of 2 runs passed**")
    assert not (out / "report").exists()
    broken = tmp_path / "broken"
    argv = ["run", scenario, "--mode", "sim", "--mutant", "no_sweeper", "--out", str(broken)]
    assert main(argv) == 1
    report = build_report(find_runs([out, broken]), tmp_path / "report")
    page = (report / "report.html").read_text()
    head = "2 of 3 runs passed; failing: crash_after_ack · sim · seed 2 · mutant no_sweeper"
    assert head in page and page.index(head) < page.index("What the faults cost</h2>")
    for slug in ("crash_after_ack-sim-seed-2", "crash_after_ack-sim-seed-2-2"):
        assert f'<a href="#{slug}">' in page and f'<section id="{slug}">' in page
        assert (report / f"{slug}-timeline.png").is_file()
    assert '<a href="../out/crash_after_ack/journal.json">journal.json</a>' in page
    assert "<td>all_terminal</td><td>fail</td><td>3</td>" in page  # verdict and cases
    made = json.loads((report / "metrics.json").read_text())["provenance"]
    assert made["modes"] == ["sim"] and made["seeds"] == [2] and made["mutants"] == ["no_sweeper"]
    assert made["commit"] != "" and "commit " in page


def test_the_timeline_draws_each_fault_from_when_it_fired() -> None:
    """Fault windows from the runner's `fault_fired` / `fault_healed`, network faults too; a
    kill never healed is an instant at the kill, not at the supervisor's later notice; a
    worker's own crash opens its window at the crash."""
    runner = {"src": "runner", "pid": 1}
    history = [
        ev(10.0, "submitted", **runner, attempt_id="a"),
        ev(11.0, "fault_fired", **runner, fault="slow", action="add_toxic", target=0, fault_id=1),
        ev(
            12.0,
            "fault_fired",
            **runner,
            fault="faults[1]",
            action="kill_worker",
            target=0,
            fault_id=2,
        ),
        ev(12.4, "worker_killed", "runner", 11, worker=0),  # the supervisor's notice
        ev(13.0, "fault_healed", **runner, fault_id=1),
        ev(13.5, "crash", "w2", 12, failpoint="after_ack"),
        ev(13.7, "worker_exited", "runner", 12, worker=1, code=-9, fault_id=3),
        ev(
            14.0,
            "fault_fired",
            **runner,
            fault="faults[2]#1",
            action="cut_link",
            target=0,
            fault_id=4,
        ),
        ev(14.5, "fault_healed", **runner, fault_id=3),
        ev(15.0, "rule_started", "w3", 13, attempt_id="a", rule_id="r"),
    ]
    assert plots.fault_marks(history) == [
        plots.FaultMark(1.0, 3.0, "slow (add_toxic)", network=True),
        plots.FaultMark(2.0, None, "kill_worker w0", network=False),
        plots.FaultMark(3.5, 4.5, "crash@after_ack w1", network=False),
        plots.FaultMark(4.0, 5.0, "cut_link", network=True, open_end=True),  # never healed
    ]
    assert plots.fault_marks([]) == []


def test_the_latency_plot_draws_the_scenario_tiers_and_percentiles(tmp_path: Path) -> None:
    """The tiers where they fall in scenario seconds (tiers_ms scaled by the run's recorded
    time_scale), and p50/p95/p99 marks, on a simulated run of `delay_tiers`; the fault
    windows of `amqp_blackhole` as the runner fired and healed its toxics."""
    assert plots.tier_lines({}) == [] == plots.tier_lines({"tiers_ms": [30000]})
    for name in ("delay_tiers", "amqp_blackhole"):
        outputs(run_scenario(load_scenario(ROOT / "scenarios" / f"{name}.yaml")), tmp_path / name)
    tiers_run, blackhole = find_runs([tmp_path / "delay_tiers", tmp_path / "amqp_blackhole"])
    tiers = plots.tier_lines(tiers_run.settings)
    assert [(label, round(at, 6), s) for label, at, s in tiers] == [
        ("tier 1: 30 s production", 0.3, 30.0),
        ("tier 2: 10 min production", 6.0, 600.0),
    ]
    latencies = retry_latencies(tiers_run.history)
    assert latencies, "delay_tiers retries no rule: nothing to plot"
    fig = plots.latency_figure(latencies, None, tiers_run.settings)
    [ax] = fig.axes
    dashdot = [line.get_xdata()[0] for line in ax.lines if line.get_gid() == "tier"]
    assert dashdot == pytest.approx([0.3, 6.0])
    marked = [text.get_text() for text in ax.texts]
    assert any(t.startswith("p50") for t in marked) and any("p99" in t for t in marked)
    assert plots.percentile_marks([3.0, 1.0, 1.0, 2.0]) == [
        ("p50", 1.0, 0.5),
        ("p95=p99", 3.0, 0.99),
    ]
    assert ax.get_xaxis().get_majorticklocs().size > 3  # not a single tick label
    windows = plots.fault_marks(blackhole.history)
    assert [(m.label, m.network, m.end is not None) for m in windows] == [
        ("blackhole_down (add_toxic)", True, True),
        ("blackhole_up (add_toxic)", True, True),
    ]
    assert all(m.end - m.start == pytest.approx(5.0) for m in windows if m.end is not None)


def test_lost_writes_are_the_sum_of_what_restarts_and_failovers_counted() -> None:
    """One figure, read once (`reports.cost.lost_writes`): the summary line's `(lost writes
    N)`, the journal's stats and `compare --designs standby` all show it; a run whose store
    counted nothing shows none, not a zero."""
    from chaos.journal import faults_text
    from reports.compare import Row, standby_rows
    from reports.cost import lost_writes

    history = [
        {"ev": "service_restarted", "t": 1.0, "lost_writes": 2},
        {"ev": "redis_failover", "t": 2.0, "promoted": True, "lost_writes": 16},
        {"ev": "redis_failover", "t": 3.0, "promoted": True},
    ]
    assert lost_writes(history) == 18
    assert lost_writes([{"ev": "redis_failover", "t": 1.0, "promoted": True}]) is None
    fired = {"faults_fired": {"kill_service": 1}}
    assert faults_text({**fired, "lost_writes": 18}) == "faults kill_service (lost writes 18)"
    assert faults_text(fired) == "faults kill_service"
    row = Row("asynchronous standby", None, runs=2, lost_writes=[16, 0], write_waits=[0.5])
    assert standby_rows([row])[0][2] == "16 (1 of 2 runs)"
    assert standby_rows([Row("none", None)])[0][2] == "-"
