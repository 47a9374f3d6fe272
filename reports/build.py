"""A report of one or more runs: `report.html` (self-contained: its plots are embedded,
nothing is loaded from the network), the plots as PNG files, `summary.md` (fit for a CI
job summary) and `metrics.json`. Written into a temporary folder first and moved into
place whole, so a failed report leaves nothing half-written."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from chaos.checker.budgets import figures_of
from chaos.checker.cost import (
    CAUSE_TEXT,
    CAUSES,
    NOT_RUN_TEXT,
    RERUN_CAUSES,
    Cost,
    duplicated_cost,
)
from chaos.checker.latency import RetryLatency, percentiles, recoveries, retry_latencies
from chaos.checker.records import BUDGETS
from reports import plots
from reports.runs import Run, written_whole

#: Money per 1,000 tokens when neither the command line nor the run says (USD).
DEFAULT_PRICE_PER_1K = 0.01
#: What the latency figures are, for every table and plot that shows them.
UNITS_TEXT = (
    "Retry latency: a rule's first failure to its result written or its permanent failure. "
    "Scenario s: as the run timed it. Production estimate s: the part that scales with the "
    "scenario's time_scale (the engine's tier waits and the agent's calls) scaled back to "
    "production, everything else (fault windows, leases, hops) kept as it happened. In "
    "fault windows s: the part spent while a fault was open, as it happened. Recovery: a "
    "fault that stops work to the next rule start, scenario s (leases and the sweeper's "
    "period do not scale)."
)


def metrics(run: Run, price: float | None) -> tuple[dict[str, Any], Cost, list[RetryLatency]]:
    """The numbers of one run, its cost, and its retry latencies. The cost figures are the
    ones its checker recorded (`figures_of`: one definition for every output). The price
    per 1,000 tokens: `price`, else the scenario's, else `DEFAULT_PRICE_PER_1K`."""
    settings = run.settings
    price_per_1k = price if price is not None else settings.get("price_per_1k_tokens")
    if not isinstance(price_per_1k, int | float):
        price_per_1k = DEFAULT_PRICE_PER_1K
    scale = settings.get("time_scale")
    latencies = retry_latencies(run.history)
    mutant = run.extra.get("mutant")
    cost = duplicated_cost(run.history, mutant)
    stats = run.journal.get("stats")
    f = figures_of(stats if isinstance(stats, dict) else None, run.history, mutant)
    by_level: dict[str, Any] = {}
    for level in (1, 2, 3):
        mine = [x for x in latencies if x.level == level]
        entry: dict[str, Any] = {
            "scenario_s": percentiles([x.seconds for x in mine]),
            "in_fault_windows_s": percentiles([x.fault_s for x in mine]),
        }
        if scale:
            entry["production_estimate_s"] = percentiles([x.production_s(scale) for x in mine])
        by_level[f"level_{level}"] = entry
    recs = recoveries(run.history)
    return (
        {
            "run": run.label,
            "path": str(run.path),
            "ok": run.journal.get("ok"),
            "settings": settings,
            "retry_latency": by_level,
            "recovery": {
                "faults": len({(r.fault, r.at) for r in recs}),
                "next_rule_start_s": percentiles(
                    [r.next_start_s for r in recs if r.next_start_s is not None]
                ),
                "evaluation_end_s": percentiles([r.end_s for r in recs if r.end_s is not None]),
                "never_resumed": sum(1 for r in recs if r.next_start_s is None),
            },
            "budgets": budgets(run),
            "cost": {
                "tokens_total": f.tokens_total,
                "reference_tokens": f.reference_tokens,
                "reference_from": f.reference_from,
                "not_run_tokens": f.not_run_tokens,
                "duplicated_tokens": f.duplicated_tokens,
                "duplicated_ratio": f.duplicated_ratio,
                "duplicated_usd": f.usd(price_per_1k),
                "price_per_1k_tokens": price_per_1k,
                "duplicated_by_cause": dict(f.duplicated_by_cause),
                "reruns": f.reruns,
                "reruns_by_cause": dict(f.reruns_by_cause),
            },
        },
        cost,
        latencies,
    )


def budgets(run: Run) -> list[dict[str, Any]]:
    """Each budget the scenario set, against the value the run's checker measured."""
    stats = run.journal.get("stats")
    stats = stats if isinstance(stats, dict) else {}
    limits = stats.get("budgets")
    out = []
    for name, limit in sorted((limits if isinstance(limits, dict) else {}).items()):
        value = stats.get(BUDGETS.get(name, ""))
        within = None if value is None else value <= limit
        out.append({"budget": name, "limit": limit, "value": value, "ok": within})
    return out


def build_report(runs: list[Run], out: str | Path, price: float | None = None) -> Path:
    """Write the report of `runs` into the folder `out` (replaced whole); return it."""
    out = Path(out)
    with written_whole(out) as tmp:
        per_run, images = [], []
        for i, run in enumerate(runs):
            numbers, cost, latencies = metrics(run, price)
            per_run.append(numbers)
            scale = run.settings.get("time_scale")
            for kind, data in (
                ("timeline", plots.timeline(run, cost)),
                ("latency", plots.latency_cdf(latencies, scale)),
            ):
                name = f"run{i + 1}-{kind}.png"
                (tmp / name).write_bytes(data)
                images.append((run.label, kind, name, data))
        data = plots.cost_bars(
            [m["run"] for m in per_run], [m["cost"]["duplicated_by_cause"] for m in per_run]
        )
        (tmp / "cost.png").write_bytes(data)
        images.append(("all runs", "duplicated tokens by cause", "cost.png", data))
        document = {"runs": per_run}
        (tmp / "metrics.json").write_text(json.dumps(document, indent=2, default=str) + "\n")
        (tmp / "summary.md").write_text(summary_md(per_run))
        (tmp / "report.html").write_text(report_html(per_run, images))
    return out


def _s(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _rows(per_run: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for m in per_run:
        c, rec = m["cost"], m["recovery"]
        rows.append(
            [
                m["run"],
                "pass" if m["ok"] else "fail",
                str(c["reruns"]),
                str(c["tokens_total"]),
                str(c["reference_tokens"]),
                str(c["duplicated_tokens"]),
                _s(c["duplicated_ratio"]),
                f"{c['duplicated_usd']:.4f}",
                str(c["not_run_tokens"]),
                _s(rec["next_rule_start_s"].get("p99")),
            ]
        )
    return rows


HEADERS = [
    "run",
    "verdict",
    "reruns",
    "tokens paid",
    "fault-free bill",
    "duplicated tokens",
    "ratio to fault-free",
    "USD",
    "not_run tokens",
    "p99 recovery (scenario s)",
]
LATENCY_HEADERS = [
    "run",
    "level",
    "n",
    "p50 / p99 (scenario s)",
    "p50 / p99 (production estimate s)",
    "p99 in fault windows (s, as happened)",
]
LEVEL_NAMES = {1: "1 (immediate)", 2: "2 (delayed)", 3: "3 (permanent)"}


def _latency_rows(per_run: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for m in per_run:
        for n, name in LEVEL_NAMES.items():
            lat = m["retry_latency"][f"level_{n}"]
            if not lat["scenario_s"]["n"]:
                continue
            prod = lat.get("production_estimate_s", {})
            rows.append(
                [
                    m["run"],
                    name,
                    str(lat["scenario_s"]["n"]),
                    f"{_s(lat['scenario_s']['p50'])} / {_s(lat['scenario_s']['p99'])}",
                    f"{_s(prod.get('p50'))} / {_s(prod.get('p99'))}",
                    _s(lat["in_fault_windows_s"]["p99"]),
                ]
            )
    return rows


SETTINGS = ["time_scale", "heartbeat_ms", "stale_ms", "sweep_ms", "sweeper", "tiers_ms"]


def _settings_rows(per_run: list[dict[str, Any]]) -> list[list[str]]:
    """What bounds recovery (the lease a heartbeat renews, the sweeper's period) and scales
    time, per run."""
    return [[m["run"], *(_s(m["settings"].get(k)) for k in SETTINGS)] for m in per_run]


def _budget_rows(per_run: list[dict[str, Any]]) -> list[list[str]]:
    verdict = {True: "yes", False: "EXCEEDED", None: "not measured"}
    return [
        [m["run"], b["budget"], _s(b["limit"]), _s(b["value"]), verdict[b["ok"]]]
        for m in per_run
        for b in m["budgets"]
    ]


def _cause_rows(
    per_run: list[dict[str, Any]], key: str, causes: tuple[str, ...]
) -> list[list[str]]:
    return [[m["run"], *(str(m["cost"][key][c]) for c in causes)] for m in per_run]


#: How the cost figures add up, for the legend of every output.
IDENTITY_TEXT = (
    "tokens paid = fault-free bill - not_run + duplicated tokens; the duplicated tokens "
    "are the sum of their causes. A call (rule, attempt, try) costs the same whoever makes "
    "it: its first paid instance is the fault-free bill's, every later one is duplicated, "
    "for the cause of the rerun that made it. A call cut short by a crash records no "
    "tokens, so its rerun is counted as a rerun but pays the call once."
)


def _legend() -> list[tuple[str, str]]:
    return [*CAUSE_TEXT.items(), ("not_run", NOT_RUN_TEXT)]


def summary_md(per_run: list[dict[str, Any]]) -> str:
    def table(headers: list[str], rows: list[list[str]]) -> list[str]:
        return [
            "| " + " | ".join(headers) + " |",
            "|" + "---|" * len(headers),
            *("| " + " | ".join(row) + " |" for row in rows),
        ]

    lines = ["# What the faults cost", "", IDENTITY_TEXT, "", *table(HEADERS, _rows(per_run))]
    rows = _budget_rows(per_run)
    if rows:
        lines += ["", "Budgets:", "", *table(["run", "budget", "limit", "value", "within"], rows)]
    lines += ["", "Duplicated tokens by cause:", ""]
    lines += table(["run", *CAUSES], _cause_rows(per_run, "duplicated_by_cause", CAUSES))
    lines += ["", "Reruns by cause:", ""]
    lines += table(["run", *RERUN_CAUSES], _cause_rows(per_run, "reruns_by_cause", RERUN_CAUSES))
    lines += ["", "Causes:", ""]
    lines += [f"- `{name}`: {text}" for name, text in _legend()]
    lines += ["", "Retry latency:", "", UNITS_TEXT, ""]
    lines += (
        table(LATENCY_HEADERS, _latency_rows(per_run))
        if _latency_rows(per_run)
        else ["No rule failed: no retry to time."]
    )
    lines += ["", "Settings that bound recovery and scale time:", ""]
    lines += table(["run", *SETTINGS], _settings_rows(per_run))
    return "\n".join(lines) + "\n"


def report_html(per_run: list[dict[str, Any]], images: list[tuple[str, str, str, bytes]]) -> str:
    def table(headers: list[str], rows: list[list[str]]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in rows
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    figures = "".join(
        f'<figure><img alt="{html.escape(kind)} of {html.escape(label)}" '
        f'src="data:image/png;base64,{base64.b64encode(data).decode()}">'
        f"<figcaption>{html.escape(label)}: {html.escape(kind)}</figcaption></figure>"
        for label, kind, _, data in images
    )
    rows = _budget_rows(per_run)
    budget_html = ""
    if rows:
        headers = ["run", "budget", "limit", "value", "within"]
        budget_html = f"<h2>Budgets</h2>{table(headers, rows)}"
    legend = "".join(
        f"<dt><code>{html.escape(name)}</code></dt><dd>{html.escape(text)}</dd>"
        for name, text in _legend()
    )
    latency_rows = _latency_rows(per_run)
    latency = (
        table(LATENCY_HEADERS, latency_rows)
        if latency_rows
        else "<p>No rule failed: no retry to time.</p>"
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>What the faults cost</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
td, th {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; }}
figcaption {{ color: #666; font-size: 12px; }}
dt {{ font-weight: 600; margin-top: .4em; }} dd {{ margin-left: 1.5em; }}
</style></head><body>
<h1>What the faults cost</h1>
<p>{html.escape(IDENTITY_TEXT)}</p>
{table(HEADERS, _rows(per_run))}
{budget_html}
<h2>Duplicated tokens by cause</h2>
{table(["run", *CAUSES], _cause_rows(per_run, "duplicated_by_cause", CAUSES))}
<h2>Reruns by cause</h2>
{table(["run", *RERUN_CAUSES], _cause_rows(per_run, "reruns_by_cause", RERUN_CAUSES))}
<h3>Causes</h3>
<dl>{legend}</dl>
<h2>Retry latency</h2>
<p>{html.escape(UNITS_TEXT)}</p>
{latency}
<h2>Settings that bound recovery and scale time</h2>
{table(["run", *SETTINGS], _settings_rows(per_run))}
<h2>Plots</h2>
{figures}
</body></html>
"""
