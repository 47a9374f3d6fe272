"""One truth for every figure: what faults cost is defined once (`reports.cost`,
`reports.latency`) and every output shows the same numbers under the same names.

Several shipped scenarios run in the simulator with `--report`, as a user runs them, with
every budget set (loose, so each is measured and passes); then the summary line, the
journal, the report's `metrics.json` and `summary.md`, the budgets, `compare` and a sweep's
report must agree on every figure, and the figures must add up: tokens paid = the
fault-free reference's bill - not_run + duplicated tokens, the causes summing to the
duplicated tokens. The reference's bill is computed here again, independently, from the
scenario (`chaos.reference.reference_for`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from chaos.reference import reference_for
from chaos.scenario import load_scenario
from reports import find_runs
from reports.compare import DESIGNS, compare, write_comparison
from reports.cost import CAUSE_TEXT, CAUSES, RERUN_CAUSES
from reports.sweep import build_sweep_report

ROOT = Path(__file__).resolve().parents[1]
#: Faults of every kind the cost split names: a crash in the write window and after the
#: ACK, a storm of kills, a cancel (work never run), a network blackhole (retry latency
#: through a fault window), transient errors (retries of every level), a lagging owner.
SCENARIOS = [
    "crash_after_ack",
    "worker_kill_storm",
    "cancel_while_owner_dead",
    "amqp_blackhole",
    "transient_llm_errors",
    "lagging_worker",
    "crash_in_write_window",
]
#: Every budget, loose: each is measured (its value shown) and none fails the run.
LOOSE = {
    "max_duplicated_tokens": 10**9,
    "max_reruns": 10**6,
    "max_duplicated_ratio": 10**6,
    "max_duplicated_usd": 10**6,
    "max_p99_retry_l1_s": 10**9,
    "max_p99_retry_l2_s": 10**9,
    "max_p99_retry_l3_s": 10**9,
    "max_p99_recovery_s": 10**9,
}
FIGURE_OF_BUDGET = {
    "max_duplicated_tokens": "duplicated_tokens",
    "max_reruns": "reruns",
    "max_duplicated_ratio": "duplicated_ratio",
    "max_duplicated_usd": "duplicated_usd",
}


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The scenarios, every budget set, run in one `chaos run --mode sim --report`; the
    output folder and each scenario's summary line."""
    tmp = tmp_path_factory.mktemp("figures")
    files = []
    for name in SCENARIOS:
        path = ROOT / "scenarios" / f"{name}.yaml"
        doc = yaml.safe_load(path.read_text())
        doc["plan"] = str((path.parent / doc["plan"]).resolve())
        doc["budgets"] = {**(doc.get("budgets") or {}), **LOOSE}
        copy = tmp / f"{name}.yaml"
        copy.write_text(yaml.safe_dump(doc))
        files.append(str(copy))
    out = tmp / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "chaos", "run", *files, "--mode", "sim", "--report"]
    done = subprocess.run(
        [*cmd, "--quiet", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {}
    for name in SCENARIOS:
        [line] = [ln for ln in done.stdout.splitlines() if ln.startswith(f"PASS {name} (sim)")]
        lines[name] = line
    return out, lines


def journal(out: Path, name: str) -> dict[str, Any]:
    return json.loads((out / name / "journal.json").read_text())


def parse_line(line: str) -> dict[str, Any]:
    """The figures a summary line shows, read back."""
    reruns = re.search(r"; reruns (\d+)(?: \(([^)]*)\))?;", line)
    cost = re.search(
        r"; duplicated tokens (-?\d+)(?: \(([^)]*)\))? = ([\d.]+)% of the fault-free bill (\d+)"
        r"(?:, not_run (\d+))?;",
        line,
    )
    assert reruns and cost, line

    def split(text: str | None) -> dict[str, int]:
        pairs = [p.rsplit(" ", 1) for p in (text or "").split(", ") if p]
        return {cause: int(n) for cause, n in pairs}

    return {
        "reruns": int(reruns[1]),
        "reruns_by_cause": split(reruns[2]),
        "duplicated_tokens": int(cost[1]),
        "duplicated_by_cause": split(cost[2]),
        "percent": float(cost[3]),
        "reference_tokens": int(cost[4]),
        "not_run_tokens": int(cost[5] or 0),
    }


def nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in counts.items() if v}


def md_table(text: str, title: str) -> list[dict[str, str]]:
    """The rows of the markdown table after the line `title` (or starting at it, for the
    first table, whose header starts with `| run |`)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(title))
    while not lines[start].startswith("|"):
        start += 1
    rows = []
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in ln.strip("|").split("|")), strict=True)))
    return rows


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_output_agrees_on_every_figure(ran: tuple[Path, dict[str, str]], name: str) -> None:
    out, lines = ran
    j = journal(out, name)
    stats = j["stats"]
    # The figures add up: paid = bill - not_run + duplicated, the causes sum exactly.
    assert sum(stats["duplicated_by_cause"].values()) == stats["duplicated_tokens"]
    assert sum(stats["reruns_by_cause"].values()) == stats["reruns"]
    assert set(stats["duplicated_by_cause"]) == set(CAUSES) == set(CAUSE_TEXT)
    assert set(stats["reruns_by_cause"]) == set(RERUN_CAUSES)
    assert stats["tokens_total"] == (
        stats["reference_tokens"] - stats["not_run_tokens"] + stats["duplicated_tokens"]
    )
    assert stats["duplicated_tokens"] >= 0 and stats["not_run_tokens"] >= 0
    # The bill is the fault-free reference's, computed here again from the scenario.
    loaded = load_scenario(ROOT / "scenarios" / f"{name}.yaml")
    seed = j["extra"]["seed"]
    ref = reference_for(loaded, seed, loaded.evaluations(seed))
    assert stats["reference_tokens"] == sum(o.tokens for o in ref.evaluations.values()) > 0
    assert stats["reference_from"] == "the fault-free reference"
    price = loaded.spec.budgets.price_per_1k_tokens
    assert stats["duplicated_usd"] == pytest.approx(stats["duplicated_tokens"] / 1000 * price)
    ratio = stats["duplicated_tokens"] / stats["reference_tokens"]
    assert stats["duplicated_ratio"] == pytest.approx(ratio, abs=1e-6)

    # The summary line.
    line = parse_line(lines[name])
    assert line["reruns"] == stats["reruns"]
    assert line["reruns_by_cause"] == nonzero(stats["reruns_by_cause"])
    assert line["duplicated_tokens"] == stats["duplicated_tokens"]
    assert line["duplicated_by_cause"] == nonzero(stats["duplicated_by_cause"])
    assert line["reference_tokens"] == stats["reference_tokens"]
    assert line["not_run_tokens"] == stats["not_run_tokens"]
    assert line["percent"] == pytest.approx(100 * ratio, abs=0.051)

    # The report's metrics.json.
    metrics = json.loads((out / "report" / "metrics.json").read_text())
    [run] = [r for r in metrics["runs"] if r["run"].startswith(f"{name} · ")]
    cost = run["cost"]
    for key in (
        "tokens_total",
        "reference_tokens",
        "not_run_tokens",
        "duplicated_tokens",
        "duplicated_ratio",
        "duplicated_usd",
        "duplicated_by_cause",
        "reruns",
        "reruns_by_cause",
    ):
        assert cost[key] == stats[key], key
    # The budgets: each value shown is the figure the checker bounded.
    shown = {b["budget"]: b for b in run["budgets"]}
    assert set(shown) == set(LOOSE)
    for budget, figure in FIGURE_OF_BUDGET.items():
        assert shown[budget]["value"] == stats[figure] == cost[figure], budget
        assert shown[budget]["ok"] is True
    for level in (1, 2, 3):
        lat = run["retry_latency"][f"level_{level}"]
        if lat["scenario_s"]["n"]:
            value = shown[f"max_p99_retry_l{level}_s"]["value"]
            assert value == pytest.approx(lat["production_estimate_s"]["p99"], abs=1e-6)
            assert lat["in_fault_windows_s"]["p99"] <= lat["scenario_s"]["max"]

    # summary.md: the same numbers in its tables.
    md = (out / "report" / "summary.md").read_text()
    [row] = [r for r in md_table(md, "# What the faults cost") if r["run"] == run["run"]]
    assert int(row["tokens paid"]) == stats["tokens_total"]
    assert int(row["fault-free bill"]) == stats["reference_tokens"]
    assert int(row["duplicated tokens"]) == stats["duplicated_tokens"]
    assert int(row["reruns"]) == stats["reruns"]
    assert int(row["not_run tokens"]) == stats["not_run_tokens"]
    [by] = [r for r in md_table(md, "Duplicated tokens by cause:") if r["run"] == run["run"]]
    assert {c: int(by[c]) for c in CAUSES} == stats["duplicated_by_cause"]
    [by] = [r for r in md_table(md, "Reruns by cause:") if r["run"] == run["run"]]
    assert {c: int(by[c]) for c in RERUN_CAUSES} == stats["reruns_by_cause"]
    for budget, figure in FIGURE_OF_BUDGET.items():
        [b] = [
            r for r in md_table(md, "Budgets:") if (r["run"], r["budget"]) == (run["run"], budget)
        ]
        assert float(b["value"]) == pytest.approx(stats[figure], rel=5e-3)  # shown to 3 digits
    # Every cause is explained in the legend, in summary.md and the page.
    page = (out / "report" / "report.html").read_text()
    for cause in (*CAUSES, "not_run"):
        assert f"- `{cause}`: " in md and f"<code>{cause}</code>" in page

    # compare: the same figures, from the same journal.
    runs = find_runs([out / name])
    [row_c] = compare({"engine": runs}, DESIGNS["memories"][:1])
    cmp = row_c.to_dict()
    assert cmp["duplicated_tokens"]["p50"] == stats["duplicated_tokens"]
    assert cmp["duplicated_ratio"]["p50"] == pytest.approx(stats["duplicated_ratio"])
    assert cmp["duplicated_by_cause"] == stats["duplicated_by_cause"]
    assert cmp["reruns_by_cause"] == stats["reruns_by_cause"]
    write_comparison([row_c], out / "compare" / name, [name])
    table = (out / "compare" / name / "compare.md").read_text()
    assert f"| both memories | 1 | {stats['duplicated_tokens']:,} / " in table or (
        f"| both memories | 1 | {stats['duplicated_tokens']} / " in table
    )


def test_the_issue_example_pays_its_write_window_once_over(
    ran: tuple[Path, dict[str, str]],
) -> None:
    """`crash_after_ack`, seed 2 (the issue's example: then 51,591 paid, 4,826 over the
    fault-free bill of 46,765): whatever the run paid over the bill is duplicated, all of it
    in the write window. Its sweeper resumes reran calls cut short by the crash, which paid
    nothing: reruns, not duplicated tokens."""
    out, lines = ran
    stats = journal(out, "crash_after_ack")["stats"]
    assert stats["reference_tokens"] == 46765
    over = stats["tokens_total"] - stats["reference_tokens"]
    assert over > 0 and stats["duplicated_tokens"] == over
    assert nonzero(stats["duplicated_by_cause"]) == {"write_window": over}
    reruns = nonzero(stats["reruns_by_cause"])
    assert set(reruns) == {"write_window", "sweeper_resume"}
    assert (
        f"reruns {sum(reruns.values())} (write_window {reruns['write_window']}, sweeper_resume "
        f"{reruns['sweeper_resume']}); duplicated tokens {over} (write_window {over}) "
        in lines["crash_after_ack"]
    )
    # A cancel leaves calls of the reference unmade: not_run, never a negative cost.
    cancel = journal(out, "cancel_while_owner_dead")["stats"]
    assert cancel["not_run_tokens"] > 0 and cancel["duplicated_tokens"] >= 0


def test_latency_is_in_scenario_seconds_and_an_honest_production_estimate(
    ran: tuple[Path, dict[str, str]],
) -> None:
    """`amqp_blackhole`: a 5-second blackhole delays a delayed retry by about 5 s, in
    production as in the run: only the tier waits and the agent's calls scale with
    `time_scale` (0.001), not the fault (it used to print 6.33e+03 production s)."""
    out, _ = ran
    metrics = json.loads((out / "report" / "metrics.json").read_text())
    [run] = [r for r in metrics["runs"] if r["run"].startswith("amqp_blackhole · ")]
    lat = run["retry_latency"]["level_2"]
    scale = run["settings"]["time_scale"]
    scenario, estimate = lat["scenario_s"]["p99"], lat["production_estimate_s"]["p99"]
    assert lat["in_fault_windows_s"]["p99"] == pytest.approx(5.0, abs=0.01)
    assert scenario > 5.0  # the blackhole, as it happened
    assert estimate < scenario / scale / 5  # not the whole of it scaled up
    assert estimate > 30  # at least one tier wait of 30 s, in production
    md = (out / "report" / "summary.md").read_text()
    assert "p50 / p99 (scenario s)" in md and "p50 / p99 (production estimate s)" in md


def test_a_sweep_reads_the_same_figures(ran: tuple[Path, dict[str, str]]) -> None:
    """A sweep's report gathers `measure`s, which read the figures the checker recorded."""
    from reports.measure import measure

    out, _ = ran
    runs = find_runs([out / name for name in SCENARIOS])
    measures = [measure(r.history, r.settings.get("time_scale"), r.journal["stats"]) for r in runs]
    target = build_sweep_report("all", measures, out / "sweep")
    got = json.loads((target / "metrics.json").read_text())
    stats = [r.journal["stats"] for r in runs]
    for key in ("duplicated_by_cause", "reruns_by_cause"):
        want = {c: sum(s[key][c] for s in stats) for c in stats[0][key]}
        assert got[key] == want
    assert got["not_run_tokens"] == sum(s["not_run_tokens"] for s in stats)


def test_the_production_estimate_scales_only_what_scales() -> None:
    """A level-2 retry: a tier wait of 0.3 s and a call of 0.1 s (both scaled by
    `time_scale` 0.01), a 2-second fault from 1.1 s to 3.1 s that swallows most of the
    wait, the rest of the 2.6 s spent in hops. Only the 0.1 s of wait outside the fault
    and the call scale back (20 s); the fault and the hops stay as they happened."""
    from reports.latency import retry_latencies

    def ev(t: float, name: str, src: str = "w1", **fields: Any) -> dict[str, Any]:
        return {"t": t, "src": src, "pid": 11, "ev": name, **fields}

    rule = {"attempt_id": "a", "rule_id": "r"}
    history = [
        ev(0.9, "rule_started", **rule, attempt=1, try_no=1),
        ev(1.0, "rule_failed", **rule, attempt=1, try_no=1, tokens=5),
        ev(1.0, "status_written", **rule, status="failed_attempt_1"),
        ev(1.0, "retry_published", **rule, attempt=2, tier=1, delay_ms=300),
        ev(1.1, "fault_fired", "runner", fault="blackhole", fault_id=1),
        ev(3.1, "fault_healed", "runner", fault_id=1),
        ev(3.5, "rule_started", **rule, attempt=2, try_no=1),
        ev(3.6, "rule_finished", **rule, attempt=2, try_no=1, tokens=5),
        ev(3.6, "result_persisted", **rule, attempt=2, won=True),
    ]
    [x] = retry_latencies(history)
    assert (x.level, x.seconds) == (2, pytest.approx(2.6))
    assert x.fault_s == pytest.approx(2.0) and x.scaled_s == pytest.approx(0.2)
    assert x.production_s(0.01) == pytest.approx(2.6 - 0.2 + 0.2 / 0.01)
    assert x.production_s(None) == x.seconds  # no scale known: scenario time
