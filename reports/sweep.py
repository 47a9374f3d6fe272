"""A report over many simulated seeds (`chaos sim SCENARIO --seeds N --report`): what faults
cost as distributions, not single runs. Each seed is measured where it ran (`measure`,
in the explorer's processes: `chaos.checker.budgets.measure`); the report gathers them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from chaos.checker.cost import CAUSE_TEXT, CAUSES, NOT_RUN_TEXT, RERUN_CAUSES
from chaos.checker.latency import RetryLatency, percentiles
from reports import plots
from reports.build import UNITS_TEXT
from reports.runs import written_whole

#: The measures carry each retry's production estimate already (`RetryLatency.estimate`):
#: any scale makes the plot draw it beside the scenario time.
_PRODUCTION_KNOWN = 1.0


def build_sweep_report(name: str, measures: list[dict[str, Any]], out: Path) -> Path:
    """report.html, summary.md, metrics.json and the plots of one sweep, in `out` (whole)."""
    with written_whole(out) as tmp:
        ratios = [m["duplicated_ratio"] for m in measures if m["reference_tokens"]]
        by_cause = {c: sum(m["duplicated_by_cause"][c] for m in measures) for c in CAUSES}
        reruns = {c: sum(m["reruns_by_cause"][c] for m in measures) for c in RERUN_CAUSES}
        latencies = [
            RetryLatency(
                "", "", int(level), None, seconds, "", fault_s=fault_s, estimate=production
            )
            for m in measures
            for level, seconds, production, fault_s in m["retries"]
        ]

        def levels(of: Callable[[RetryLatency], float]) -> dict[str, Any]:
            return {
                f"level_{n}": percentiles([of(x) for x in latencies if x.level == n])
                for n in (1, 2, 3)
            }

        metrics = {
            "scenario": name,
            "seeds": len(measures),
            "duplicated_ratio": percentiles(ratios),
            "duplicated_tokens": percentiles([float(m["duplicated_tokens"]) for m in measures]),
            "duplicated_by_cause": by_cause,
            "reruns_by_cause": reruns,
            "not_run_tokens": sum(m["not_run_tokens"] for m in measures),
            "retry_latency_scenario_s": levels(lambda x: x.seconds),
            "retry_latency_production_estimate_s": levels(lambda x: x.production_s(1.0)),
            "retry_latency_in_fault_windows_s": levels(lambda x: x.fault_s),
            "recovery_scenario_s": percentiles([s for m in measures for s in m["recoveries"]]),
            "seeds_with_unfinished_evaluations": sum(1 for m in measures if m["unfinished"]),
        }
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        images = {
            "latency.png": plots.latency_cdf(latencies, _PRODUCTION_KNOWN),
            "duplicated.png": _ratio_histogram(ratios, name),
        }
        for file, data in images.items():
            (tmp / file).write_bytes(data)
        (tmp / "summary.md").write_text(_summary(metrics))
        (tmp / "report.html").write_text(_html(metrics, images))
    return out


def _ratio_histogram(ratios: list[float], name: str) -> bytes:
    fig, ax = plt.subplots(figsize=(7, 4))
    if ratios:
        ax.hist(ratios, bins=min(40, max(5, len(ratios) // 10)), color="#e45756")
    ax.set_xlabel("duplicated tokens / the fault-free bill, per seed")
    ax.set_ylabel("seeds")
    ax.set_title(f"{name}: what faults added to the LLM bill", fontsize=10)
    ax.grid(alpha=0.3)
    return plots.png(fig)


def _fmt(p: dict[str, Any], key: str) -> str:
    return "-" if not p.get("n") else f"{p[key]:.3g}"


def _lines(metrics: dict[str, Any]) -> list[tuple[str, str]]:
    ratio = metrics["duplicated_ratio"]
    rows = [
        ("seeds", str(metrics["seeds"])),
        (
            "duplicated tokens / the fault-free bill, p50 / p95 / max",
            " / ".join(_fmt(ratio, k) for k in ("p50", "p95", "max")),
        ),
        ("seeds with unfinished evaluations", str(metrics["seeds_with_unfinished_evaluations"])),
        ("recovery p99 (scenario s, as happened)", _fmt(metrics["recovery_scenario_s"], "p99")),
    ]
    units = (
        ("scenario s", "retry_latency_scenario_s"),
        ("production estimate s", "retry_latency_production_estimate_s"),
        ("in fault windows s", "retry_latency_in_fault_windows_s"),
    )
    for n in (1, 2, 3):
        for unit, key in units:
            p = metrics[key][f"level_{n}"]
            rows.append(
                (
                    f"retry latency level {n} p50 / p99 ({unit})",
                    f"{_fmt(p, 'p50')} / {_fmt(p, 'p99')}",
                )
            )
    rows += [(f"duplicated tokens: {c}", str(t)) for c, t in metrics["duplicated_by_cause"].items()]
    rows.append(("tokens of the reference never run: not_run", str(metrics["not_run_tokens"])))
    rows += [(f"reruns: {c}", str(n)) for c, n in metrics["reruns_by_cause"].items()]
    return rows


def _legend() -> list[tuple[str, str]]:
    return [*CAUSE_TEXT.items(), ("not_run", NOT_RUN_TEXT)]


def _summary(metrics: dict[str, Any]) -> str:
    lines = [f"# {metrics['scenario']}: what faults cost over {metrics['seeds']} seeds", ""]
    lines += ["| measure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in _lines(metrics)]
    lines += ["", "Causes:", ""] + [f"- `{name}`: {text}" for name, text in _legend()]
    lines += ["", UNITS_TEXT]
    return "\n".join(lines) + "\n"


def _html(metrics: dict[str, Any], images: dict[str, bytes]) -> str:
    import base64
    import html

    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in _lines(metrics)
    )
    figures = "".join(
        f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,'
        f'{base64.b64encode(data).decode()}"></figure>'
        for name, data in images.items()
    )
    title = html.escape(f"{metrics['scenario']}: what faults cost over {metrics['seeds']} seeds")
    legend = "".join(
        f"<dt><code>{html.escape(name)}</code></dt><dd>{html.escape(text)}</dd>"
        for name, text in _legend()
    )
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        "<style>body{font:14px/1.4 system-ui,sans-serif;margin:2em}td{border:1px solid #ccc;"
        "padding:4px 8px}table{border-collapse:collapse}img{max-width:100%}</style></head>"
        f"<body><h1>{title}</h1><table>{rows}</table><h2>Causes</h2><dl>{legend}</dl>"
        f"<p>{html.escape(UNITS_TEXT)}</p>{figures}</body></html>\n"
    )
