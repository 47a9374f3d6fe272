"""A report over many simulated seeds (`chaos sim SCENARIO --seeds N --report`): what faults
cost as distributions, not single runs. Each seed is measured where it ran (`measure`,
in the explorer's processes: `chaos.checker.budgets.measure`); the report gathers them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from reports import plots
from reports.build import UNITS_TEXT
from reports.cost import CAUSE_TEXT, CAUSES, NOT_RUN_TEXT, RERUN_CAUSES
from reports.latency import RetryLatency, percentiles
from reports.runs import written_whole

#: The measures carry each retry's production estimate already (`RetryLatency.estimate`):
#: any scale makes the plot draw it beside the scenario time.
_PRODUCTION_KNOWN = 1.0


#: How many of the most expensive seeds the report lists.
TOP_SEEDS = 10
#: How many failing seeds the page and summary.md list (metrics.json has them all).
SHOWN_FAILING = 20


def faults_of(variant: dict[str, Any]) -> dict[str, int]:
    """A seed's swarm variant's faults by kind (`kill_worker`, `crash at rule_after_write`,
    `redis.lose_last_writes`), each with how many times it is set to fire: which faults a
    seed had, for the fault coverage and the seed tables."""
    kinds: dict[str, int] = {}
    for fault in variant.get("faults", []):
        action = str(fault.get("action", "crash"))
        kind = f"{action} at {fault['failpoint']}" if "failpoint" in fault else action
        kinds[kind] = kinds.get(kind, 0) + int(fault.get("count", 1))
    for section in ("broker", "redis"):
        settings = variant.get(section)
        if isinstance(settings, dict):
            for key in ("consumer_timeout_s", "dead_letter_loss", "lose_last_writes"):
                if settings.get(key):
                    kinds[f"{section}.{key}"] = 1
    return kinds


def build_sweep_report(
    name: str, measures: list[dict[str, Any]], out: Path, replay: str = ""
) -> Path:
    """report.html, summary.md, metrics.json and the plots of one sweep, in `out` (whole).
    A measure may carry its seed's `seed`, `failed`, `message` and `faults` (`faults_of`);
    `replay` is the command that re-explores one seed, with `{seed}` in it."""
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
            "failing_seeds": [
                _seed_row(m, replay) for m in measures if m.get("failed") and "seed" in m
            ],
            "most_expensive_seeds": [
                _seed_row(m, replay)
                for m in sorted(
                    (m for m in measures if m["duplicated_tokens"] > 0 and "seed" in m),
                    key=lambda m: (-m["duplicated_tokens"], m["seed"]),
                )[:TOP_SEEDS]
            ],
            "fault_coverage": _coverage(measures),
        }
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        images = {
            "latency.png": plots.latency_cdf(latencies, _PRODUCTION_KNOWN),
            "duplicated.png": _ratio_histogram(ratios, name),
            "recovery.png": _recovery_plot(
                [s for m in measures for s in m["recoveries"]], metrics["recovery_scenario_s"]
            ),
        }
        for file, data in images.items():
            (tmp / file).write_bytes(data)
        (tmp / "summary.md").write_text(_summary(metrics))
        (tmp / "report.html").write_text(_html(metrics, images))
    return out


def _seed_row(m: dict[str, Any], replay: str) -> dict[str, Any]:
    """One seed in the failing or most expensive table: what broke, what it paid, its faults
    and the command that replays it."""
    return {
        "seed": m["seed"],
        "failed": list(m.get("failed", [])),
        "message": m.get("message", ""),
        "duplicated_tokens": m["duplicated_tokens"],
        "duplicated_ratio": m["duplicated_ratio"],
        "duplicated_by_cause": {c: t for c, t in m["duplicated_by_cause"].items() if t},
        "faults": dict(m.get("faults", {})),
        "replay": replay.format(seed=m["seed"]) if replay else "",
    }


def _coverage(measures: list[dict[str, Any]]) -> dict[str, Any]:
    """Per fault kind, how many seeds had it and how many firings they were set to."""
    kinds: dict[str, dict[str, int]] = {}
    for m in measures:
        for kind, n in m.get("faults", {}).items():
            got = kinds.setdefault(kind, {"seeds": 0, "firings": 0})
            got["seeds"] += 1
            got["firings"] += n
    known = [m for m in measures if "faults" in m]
    return {
        "kinds": dict(sorted(kinds.items())),
        "seeds_without_faults": sum(1 for m in known if not m["faults"]),
        "seeds_known": len(known),
    }


def _recovery_plot(recoveries: list[float], p: dict[str, Any]) -> bytes:
    """Recovery over every seed: a histogram and its CDF, p50/p95/p99 marked."""
    fig, (hist, cdf) = plt.subplots(1, 2, figsize=(10, 4))
    if recoveries:
        hist.hist(recoveries, bins=min(40, max(5, len(recoveries) // 10)), color="#4c78a8")
        ordered = sorted(recoveries)
        ys = [(i + 1) / len(ordered) for i in range(len(ordered))]
        cdf.step(ordered, ys, where="post", color="#4c78a8")
        for key, color in (("p50", "#54a24b"), ("p95", "#f58518"), ("p99", "#e45756")):
            for ax in (hist, cdf):
                ax.axvline(p[key], color=color, ls="--", label=f"{key} {p[key]:.3g} s")
        cdf.legend(fontsize=8, loc="lower right")
    else:
        for ax in (hist, cdf):
            ax.text(0.5, 0.5, "no recovery in any seed", ha="center", va="center")
    hist.set_ylabel("recoveries")
    cdf.set_ylabel("fraction of recoveries")
    cdf.set_ylim(0, 1.05)
    for ax in (hist, cdf):
        ax.set_xlabel("fault to the next rule start (scenario s, as happened)", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Recovery over every seed (n={len(recoveries)})", fontsize=10)
    return plots.png(fig)


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
        (
            "recovery p50 / p95 / p99 (scenario s, as happened)",
            " / ".join(_fmt(metrics["recovery_scenario_s"], k) for k in ("p50", "p95", "p99")),
        ),
        ("failing seeds", str(len(metrics["failing_seeds"]))),
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


def _faults_text(faults: dict[str, int]) -> str:
    return ", ".join(f"{k} x{n}" for k, n in faults.items()) or "none"


def _tables(
    metrics: dict[str, Any],
) -> list[tuple[str, str, list[str], list[list[str]], str]]:
    """The seed tables and the fault coverage: (title, what it is, headers, rows, what an
    empty table means)."""
    failing = [
        [
            str(r["seed"]),
            ", ".join(r["failed"]),
            r["message"],
            _faults_text(r["faults"]),
            r["replay"],
        ]
        for r in metrics["failing_seeds"][:SHOWN_FAILING]
    ]
    more = len(metrics["failing_seeds"]) - SHOWN_FAILING
    if more > 0:
        failing.append(["...", f"{more} more in metrics.json", "", "", ""])
    expensive = [
        [
            str(r["seed"]),
            f"{r['duplicated_tokens']:,}",
            f"{r['duplicated_ratio']:.3g}",
            ", ".join(f"{c} {t:,}" for c, t in r["duplicated_by_cause"].items()),
            _faults_text(r["faults"]),
            r["replay"],
        ]
        for r in metrics["most_expensive_seeds"]
    ]
    cov = metrics["fault_coverage"]
    coverage = [
        [kind, f"{c['seeds']} / {cov['seeds_known']}", str(c["firings"])]
        for kind, c in cov["kinds"].items()
    ]
    coverage.append(
        ["(no fault at all)", f"{cov['seeds_without_faults']} / {cov['seeds_known']}", "0"]
    )
    return [
        (
            "Failing seeds",
            "every seed that broke an invariant (or a budget, or its exercised minimum); "
            "the replay command re-explores exactly that seed",
            ["seed", "failed", "first violation", "faults", "replay"],
            failing,
            "none: every seed held every invariant",
        ),
        (
            f"Most expensive seeds (top {TOP_SEEDS} by duplicated tokens)",
            "the seeds whose faults added the most to the LLM bill, with the causes",
            ["seed", "duplicated tokens", "ratio to fault-free", "by cause", "faults", "replay"],
            expensive,
            "none: no seed paid more than the fault-free bill",
        ),
        (
            "Fault coverage",
            "which faults the seeds' swarm variants had: seeds with each kind, and the "
            "firings they were set to (a seed keeps each of the scenario's faults on a coin flip)",
            ["fault", "seeds", "firings"],
            coverage,
            "",
        ),
    ]


def _legend() -> list[tuple[str, str]]:
    return [*CAUSE_TEXT.items(), ("not_run", NOT_RUN_TEXT)]


def _headline(metrics: dict[str, Any]) -> str:
    """At a glance: how many seeds failed, which invariants, and the recovery p99."""
    failing = metrics["failing_seeds"]
    counts: dict[str, int] = {}
    for r in failing:
        for name in r["failed"]:
            counts[name] = counts.get(name, 0) + 1
    broke = ", ".join(f"{k} in {n}" for k, n in sorted(counts.items()))
    verdict = f"{len(failing)} of {metrics['seeds']} seeds failing" + (
        f" ({broke})" if broke else ""
    )
    recovery = _fmt(metrics["recovery_scenario_s"], "p99")
    return f"{verdict}; recovery p99 {recovery} scenario s"


def _summary(metrics: dict[str, Any]) -> str:
    lines = [f"# {metrics['scenario']}: what faults cost over {metrics['seeds']} seeds", ""]
    lines += [f"**{_headline(metrics)}**", ""]
    lines += ["| measure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in _lines(metrics)]
    for title, what, headers, rows, empty in _tables(metrics):
        lines += ["", f"## {title}", "", what + ".", ""]
        if not rows:
            lines.append(empty)
            continue
        lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        for row in rows:
            cells = [c.replace("|", "\\|") for c in row]
            if cells[-1] and headers[-1] == "replay":
                cells[-1] = f"`{cells[-1]}`"
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Causes:", ""] + [f"- `{name}`: {text}" for name, text in _legend()]
    lines += ["", UNITS_TEXT]
    return "\n".join(lines) + "\n"


def _html(metrics: dict[str, Any], images: dict[str, bytes]) -> str:
    import base64
    import html

    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in _lines(metrics)
    )

    def figure(name: str) -> str:
        data = base64.b64encode(images[name]).decode()
        return (
            f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,{data}"></figure>'
        )

    figures = "".join(figure(name) for name in images if name != "recovery.png")
    title = html.escape(f"{metrics['scenario']}: what faults cost over {metrics['seeds']} seeds")
    sections = ""
    for t, what, headers, body, empty in _tables(metrics):
        head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
        trs = "".join(
            "<tr>"
            + "".join(
                f"<td><code>{html.escape(c)}</code></td>"
                if headers[i] == "replay"
                else f"<td>{html.escape(c)}</td>"
                for i, c in enumerate(row)
            )
            + "</tr>"
            for row in body
        )
        table = f"<table><tr>{head}</tr>{trs}</table>" if body else f"<p>{html.escape(empty)}</p>"
        sections += f"<h2>{html.escape(t)}</h2><p>{html.escape(what)}.</p>{table}"
    legend = "".join(
        f"<dt><code>{html.escape(name)}</code></dt><dd>{html.escape(text)}</dd>"
        for name, text in _legend()
    )
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        "<style>body{font:14px/1.4 system-ui,sans-serif;margin:2em}td{border:1px solid #ccc;"
        "padding:4px 8px;vertical-align:top}th{background:#eee;text-align:left;padding:4px 8px}"
        "table{border-collapse:collapse}img{max-width:100%}code{font-size:12px}</style></head>"
        f"<body><h1>{title}</h1><p><b>{html.escape(_headline(metrics))}</b></p>{sections}"
        f"<h2>Recovery</h2>{figure('recovery.png')}<h2>Every measure</h2><table>{rows}</table>"
        f"<h2>Causes</h2><dl>{legend}</dl><p>{html.escape(UNITS_TEXT)}</p>{figures}"
        "</body></html>\n"
    )
