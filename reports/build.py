"""A report of one or more runs: `report.html` (self-contained: its plots are embedded,
nothing is loaded from the network), the plots as PNG files, `summary.md` (fit for a CI
job summary) and `metrics.json`. Written into a temporary folder first and moved into
place whole, so a failed report leaves nothing half-written."""

from __future__ import annotations

import base64
import html
import json
import os
import re
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from reports import baseline, plots
from reports.cost import (
    CAUSE_TEXT,
    CAUSES,
    NOT_RUN_TEXT,
    RERUN_CAUSES,
    Cost,
    duplicated_cost,
)
from reports.latency import RetryLatency, percentiles, recoveries, retry_latencies
from reports.measure import BUDGETS, figures_of
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
            "verdicts": _verdicts(run),
            "failures": [
                *map(str, run.journal.get("budget_failures") or []),
                *map(str, run.journal.get("exercise_failures") or []),
            ],
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


def build_report(
    runs: list[Run],
    out: str | Path,
    price: float | None = None,
    against: dict[str, Any] | None = None,
) -> Path:
    """Write the report of `runs` into the folder `out` (replaced whole); return it.
    `against`: their comparison with a baseline (`reports.baseline.against`), shown too."""
    out = Path(out)
    with written_whole(out) as tmp:
        per_run, images = [], []
        slugs = run_slugs(runs)
        for run, slug in zip(runs, slugs, strict=True):
            numbers, cost, latencies = metrics(run, price)
            numbers["slug"] = slug
            numbers["files"] = _files(run, out)
            per_run.append(numbers)
            scale = run.settings.get("time_scale")
            for kind, data in (
                ("timeline", plots.timeline(run, cost)),
                ("latency", plots.latency_cdf(latencies, scale, run.settings)),
            ):
                name = f"{slug}-{kind}.png"
                (tmp / name).write_bytes(data)
                images.append((run.label, kind, name, data))
        data = plots.cost_bars(
            [m["run"] for m in per_run], [m["cost"]["duplicated_by_cause"] for m in per_run]
        )
        (tmp / "cost.png").write_bytes(data)
        images.append(("all runs", "duplicated tokens by cause", "cost.png", data))
        made = provenance(runs)
        document: dict[str, Any] = {"provenance": made, "runs": per_run}
        if against is not None:
            document["against_baseline"] = against
        (tmp / "metrics.json").write_text(json.dumps(document, indent=2, default=str) + "\n")
        (tmp / "summary.md").write_text(summary_md(per_run, made, against))
        (tmp / "report.html").write_text(report_html(per_run, images, made, against))
    return out


def write_summary(
    runs: list[Run],
    path: str | Path,
    price: float | None = None,
    against: dict[str, Any] | None = None,
) -> Path:
    """`summary.md` alone (verdicts first, then cost), for a CI job summary: what `chaos run`
    writes into its output folder without `--report` (no plots drawn)."""
    per_run = [metrics(run, price)[0] for run in runs]
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(summary_md(per_run, provenance(runs), against))
    tmp.replace(path)
    return path


def run_slugs(runs: list[Run]) -> list[str]:
    """A file-name-safe name per run, after its scenario, mode and seed (`-2`, `-3`, ...
    when two runs share one): the plots are named after what they show."""
    out: list[str] = []
    for run in runs:
        base = re.sub(r"[^A-Za-z0-9_.-]+", "-", run.label.replace(" · ", "-")).strip("-")
        slug, n = base or "run", 1
        while slug in out:
            n += 1
            slug = f"{base}-{n}"
        out.append(slug)
    return out


def _verdicts(run: Run) -> dict[str, dict[str, Any]]:
    """Each invariant's verdict and the cases it judged, as the run's journal has them."""
    verdicts = run.journal.get("verdicts")
    cases = run.journal.get("cases")
    cases = cases if isinstance(cases, dict) else {}
    return {
        str(name): {"verdict": str(v), "cases": cases.get(name)}
        for name, v in (verdicts if isinstance(verdicts, dict) else {}).items()
    }


#: The files of a run a reader may want next to its verdicts, when the run has them.
RUN_FILES = ("journal.json", "history.jsonl", "harness_error.txt")


def _files(run: Run, out: Path) -> dict[str, str]:
    """A run's journal, history and worker logs, as links relative to the report's folder."""
    found = [run.path / name for name in RUN_FILES if (run.path / name).is_file()]
    found += sorted(run.path.glob("*.log")) + sorted(run.path.glob("logs/*.log"))
    return {f.name: os.path.relpath(f.resolve(), out.resolve()) for f in found}


def provenance(runs: list[Run]) -> dict[str, Any]:
    """Where the numbers come from: the commit of the harness, the modes, seeds and mutants
    of the runs, and when the report was made."""
    return {
        "made": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "commit": _commit(),
        "modes": sorted({run.mode for run in runs}),
        "seeds": sorted({s for run in runs if isinstance(s := run.extra.get("seed"), int)}),
        "mutants": sorted({str(m) for run in runs if (m := run.extra.get("mutant"))}),
        "runs": len(runs),
    }


def _commit() -> str:
    """The harness's git commit (with `+changes` when its tree differs), or `unknown`."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}+changes" if dirty else head or "unknown"


def headline(per_run: list[dict[str, Any]]) -> str:
    """`3 of 4 runs passed; failing: x · sim · seed 2 (all_terminal)`, or all passed."""
    failing = [m for m in per_run if not m.get("ok")]
    text = f"{len(per_run) - len(failing)} of {len(per_run)} runs passed"
    if not failing:
        return text
    named = []
    for m in failing:
        broken = [k for k, v in m.get("verdicts", {}).items() if v["verdict"] == "fail"]
        why = ", ".join(broken) or "; ".join(m.get("failures") or []) or "not ok"
        named.append(f"{m['run']} ({why})")
    return f"{text}; failing: {'; '.join(named)}"


def _verdict_rows(per_run: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for m in per_run:
        verdicts = m.get("verdicts", {})
        judged = sum(v["cases"] or 0 for v in verdicts.values())
        broken = [k for k, v in verdicts.items() if v["verdict"] == "fail"]
        unknown = [k for k, v in verdicts.items() if v["verdict"] == "unknown"]
        unknown += [f"{k} (n/a)" for k, v in verdicts.items() if v["verdict"] == "n/a"]
        rows.append(
            [
                m["run"],
                "PASS" if m.get("ok") else "FAIL",
                str(judged),
                ", ".join(broken) or "-",
                ", ".join(unknown) or "-",
                "; ".join(m.get("failures") or []) or "-",
            ]
        )
    return rows


VERDICT_HEADERS = ["run", "verdict", "cases judged", "broken", "unknown", "budgets, exercised"]


def _provenance_text(made: dict[str, Any]) -> str:
    seeds = ", ".join(map(str, made["seeds"])) or "-"
    mutants = ", ".join(made["mutants"]) or "none"
    return (
        f"commit {made['commit']}; modes {', '.join(made['modes']) or '-'}; seeds {seeds}; "
        f"mutants {mutants}; {made['runs']} run(s); made {made['made']}"
    )


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


def summary_md(
    per_run: list[dict[str, Any]],
    made: dict[str, Any] | None = None,
    against: dict[str, Any] | None = None,
) -> str:
    def table(headers: list[str], rows: list[list[str]]) -> list[str]:
        return [
            "| " + " | ".join(headers) + " |",
            "|" + "---|" * len(headers),
            *("| " + " | ".join(row) + " |" for row in rows),
        ]

    lines = ["# Verdicts", "", f"**{headline(per_run)}**", ""]
    if made is not None:
        lines += [_provenance_text(made), ""]
    lines += table(VERDICT_HEADERS, _verdict_rows(per_run))
    lines += ["", "# What the faults cost", "", IDENTITY_TEXT, "", *table(HEADERS, _rows(per_run))]
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
    if against is not None:
        lines += ["", *baseline.summary_md(against)]
    return "\n".join(lines) + "\n"


def report_html(
    per_run: list[dict[str, Any]],
    images: list[tuple[str, str, str, bytes]],
    made: dict[str, Any] | None = None,
    against: dict[str, Any] | None = None,
) -> str:
    def table(headers: list[str], rows: list[list[str]]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in rows
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def figure(label: str, kind: str, name: str, data: bytes) -> str:
        return (
            f'<figure><img alt="{html.escape(kind)} of {html.escape(label)}" '
            f'src="data:image/png;base64,{base64.b64encode(data).decode()}">'
            f"<figcaption>{html.escape(label)}: {html.escape(kind)} "
            f"(<code>{html.escape(name)}</code>)</figcaption></figure>"
        )

    cost_figures = "".join(figure(*i) for i in images if i[0] == "all runs")
    sections = []
    for m in per_run:
        verdicts = table(
            ["invariant", "verdict", "cases"],
            [[k, v["verdict"], _s(v["cases"])] for k, v in m.get("verdicts", {}).items()],
        )
        links = " · ".join(
            f'<a href="{html.escape(href)}">{html.escape(name)}</a>'
            for name, href in m.get("files", {}).items()
        )
        plotted = "".join(figure(*i) for i in images if i[0] == m["run"])
        state = "PASS" if m.get("ok") else "FAIL"
        sections.append(
            f'<section id="{html.escape(m.get("slug", ""))}"><h2>{html.escape(m["run"])}: '
            f"{state}</h2><p>{links}</p>{verdicts}{plotted}</section>"
        )
    toc = "".join(
        f'<li><a href="#{html.escape(m.get("slug", ""))}">{html.escape(m["run"])}</a> '
        f"{'PASS' if m.get('ok') else '<strong>FAIL</strong>'}</li>"
        for m in per_run
    )
    made_html = f"<p class=made>{html.escape(_provenance_text(made))}</p>" if made else ""
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
.headline {{ font-size: 16px; }} .made {{ color: #666; font-size: 12px; }}
section {{ border-top: 2px solid #ddd; margin-top: 2em; }}
</style></head><body>
<h1>Chaos runs: verdicts and what the faults cost</h1>
<p class=headline><strong>{html.escape(headline(per_run))}</strong></p>
{made_html}
<nav><ul>
<li><a href="#verdicts">Verdicts</a></li><li><a href="#cost">What the faults cost</a></li>
<li><a href="#latency">Retry latency</a></li><li><a href="#settings">Settings</a></li>
{'<li><a href="#baseline">Against the baseline</a></li>' if against is not None else ""}
<li>Runs<ul>{toc}</ul></li></ul></nav>
<h2 id="verdicts">Verdicts</h2>
{table(VERDICT_HEADERS, _verdict_rows(per_run))}
<h2 id="cost">What the faults cost</h2>
<p>{html.escape(IDENTITY_TEXT)}</p>
{table(HEADERS, _rows(per_run))}
{budget_html}
<h2>Duplicated tokens by cause</h2>
{cost_figures}
{table(["run", *CAUSES], _cause_rows(per_run, "duplicated_by_cause", CAUSES))}
<h2>Reruns by cause</h2>
{table(["run", *RERUN_CAUSES], _cause_rows(per_run, "reruns_by_cause", RERUN_CAUSES))}
<h3>Causes</h3>
<dl>{legend}</dl>
<h2 id="latency">Retry latency</h2>
<p>{html.escape(UNITS_TEXT)}</p>
{latency}
<h2 id="settings">Settings that bound recovery and scale time</h2>
{table(["run", *SETTINGS], _settings_rows(per_run))}
{baseline.report_html(against) if against is not None else ""}
{"".join(sections)}
</body></html>
"""
