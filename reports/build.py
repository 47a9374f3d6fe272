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

from chaos.checker.cost import CAUSES, Cost, duplicated_cost
from chaos.checker.latency import percentiles, recoveries, retry_latencies
from chaos.checker.records import BUDGETS
from reports import plots
from reports.runs import Run, written_whole

#: Money per 1,000 tokens when neither the command line nor the run says (USD).
DEFAULT_PRICE_PER_1K = 0.01


def metrics(run: Run, price: float | None) -> tuple[dict[str, Any], Cost, list[Any]]:
    """The numbers of one run, its cost, and its retry latencies. The price per 1,000
    tokens: `price`, else the scenario's, else `DEFAULT_PRICE_PER_1K`."""
    settings = run.settings
    price_per_1k = price if price is not None else settings.get("price_per_1k_tokens")
    if not isinstance(price_per_1k, int | float):
        price_per_1k = DEFAULT_PRICE_PER_1K
    scale = settings.get("time_scale")
    latencies = retry_latencies(run.history)
    cost = duplicated_cost(run.history, run.extra.get("mutant"))
    by_level: dict[str, Any] = {}
    for level in (1, 2, 3):
        seconds = [x.seconds for x in latencies if x.level == level]
        entry: dict[str, Any] = {"scenario_s": percentiles(seconds)}
        if scale:
            entry["production_s"] = percentiles([s / scale for s in seconds])
        by_level[f"level_{level}"] = entry
    recs = recoveries(run.history)
    stats = run.journal.get("stats")
    known = stats.get("reference_tokens") if isinstance(stats, dict) else None
    reference = known if isinstance(known, int) else cost.reference_tokens
    duplicated = cost.duplicated_tokens
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
                "tokens_total": cost.tokens_total,
                "reference_tokens": reference,
                "reference_from": "the fault-free reference" if known else "first executions",
                "duplicated_tokens": duplicated,
                "duplicated_ratio": round(duplicated / reference, 6) if reference else None,
                "duplicated_money": round(duplicated / 1000 * price_per_1k, 6),
                "price_per_1k_tokens": price_per_1k,
                "reruns": len(cost.reruns),
                "by_cause_tokens": cost.by_cause(),
                "by_cause_reruns": {c: sum(1 for x in cost.reruns if x.cause == c) for c in CAUSES},
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
        per_run, costs, images = [], [], []
        for i, run in enumerate(runs):
            numbers, cost, latencies = metrics(run, price)
            per_run.append(numbers)
            costs.append(cost)
            scale = run.settings.get("time_scale")
            for kind, data in (
                ("timeline", plots.timeline(run, cost)),
                ("latency", plots.latency_cdf(latencies, scale)),
            ):
                name = f"run{i + 1}-{kind}.png"
                (tmp / name).write_bytes(data)
                images.append((run.label, kind, name, data))
        data = plots.cost_bars([r.label for r in runs], costs)
        (tmp / "cost.png").write_bytes(data)
        images.append(("all runs", "cost", "cost.png", data))
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
        c, lat, rec = m["cost"], m["retry_latency"], m["recovery"]
        unit = "production_s" if "production_s" in lat["level_1"] else "scenario_s"
        p99 = [_s(lat[f"level_{n}"][unit].get("p99")) for n in (1, 2, 3)]
        rows.append(
            [
                m["run"],
                "pass" if m["ok"] else "fail",
                str(c["reruns"]),
                str(c["duplicated_tokens"]),
                _s(c["duplicated_ratio"]),
                f"{c['duplicated_money']:.4f}",
                *p99,
                _s(rec["next_rule_start_s"].get("p99")),
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


HEADERS = [
    "run",
    "verdict",
    "reruns",
    "duplicated tokens",
    "ratio to fault-free",
    "money",
    "p99 retry L1",
    "p99 retry L2",
    "p99 retry L3",
    "p99 recovery",
]


def summary_md(per_run: list[dict[str, Any]]) -> str:
    lines = [
        "# What the faults cost",
        "",
        "Retry latency in production seconds where the run's time scale is known, else in",
        "scenario seconds; recovery: a stopping fault to the next rule start (scenario s).",
        "",
        "| " + " | ".join(HEADERS) + " |",
        "|" + "---|" * len(HEADERS),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(per_run)]
    rows = _budget_rows(per_run)
    if rows:
        lines += [
            "",
            "Budgets:",
            "",
            "| run | budget | limit | value | within |",
            "|---|---|---|---|---|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", "Settings that bound recovery and scale time:", ""]
    lines += ["| run | " + " | ".join(SETTINGS) + " |", "|" + "---|" * (len(SETTINGS) + 1)]
    lines += ["| " + " | ".join(row) + " |" for row in _settings_rows(per_run)]
    lines += ["", "Duplicated tokens by cause:", ""]
    lines += ["| run | " + " | ".join(CAUSES) + " |", "|" + "---|" * (len(CAUSES) + 1)]
    for m in per_run:
        by = m["cost"]["by_cause_tokens"]
        lines.append(f"| {m['run']} | " + " | ".join(str(by[c]) for c in CAUSES) + " |")
    return "\n".join(lines) + "\n"


def report_html(per_run: list[dict[str, Any]], images: list[tuple[str, str, str, bytes]]) -> str:
    def table(headers: list[str], rows: list[list[str]]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in rows
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    causes = [[m["run"], *(str(m["cost"]["by_cause_tokens"][c]) for c in CAUSES)] for m in per_run]
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
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>What the faults cost</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
td, th {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; }}
figcaption {{ color: #666; font-size: 12px; }}
</style></head><body>
<h1>What the faults cost</h1>
<p>Retry latency in production seconds where the run's time scale is known; recovery from a
stopping fault to the next rule start, in scenario seconds.</p>
{table(HEADERS, _rows(per_run))}
{budget_html}
<h2>Settings that bound recovery and scale time</h2>
{table(["run", *SETTINGS], _settings_rows(per_run))}
<h2>Duplicated tokens by cause</h2>
{table(["run", *CAUSES], causes)}
<h2>Plots</h2>
{figures}
</body></html>
"""
