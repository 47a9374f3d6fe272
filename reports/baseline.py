"""Against a baseline: each scenario's cost, recovery and retry latency beside an earlier
run's (`chaos report RUN --baseline EARLIER_RUN`, `chaos run ... --baseline DIR`), so a
nightly job catches a regression in what faults cost, not only a broken invariant.

Pure: two sets of per-run metrics in (`reports.build.metrics`, keyed by scenario and mode),
rows out. A figure got worse when it grew by more than the tolerance (a ratio of the
baseline's value); a scenario's budget `max_regression_ratio` fails a `chaos run` whose
figure grew by more than that."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Mapping
from typing import Any

from reports.runs import ReportError, Run

#: What "worse" means unless `--tolerance` says: 10 % more than the baseline's value.
DEFAULT_TOLERANCE = 0.10

Key = tuple[str, str]  # (scenario name, mode)


def _p99(*path: str) -> Callable[[dict[str, Any]], float | None]:
    def get(m: dict[str, Any]) -> float | None:
        node: Any = m
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        return node.get("p99") if isinstance(node, dict) else None

    return get


def _latency(level: int) -> Callable[[dict[str, Any]], float | None]:
    """p99 retry latency of `level`, as a production estimate (scenario seconds when the
    run recorded no time_scale): what `max_p99_retry_l*_s` bound."""

    def get(m: dict[str, Any]) -> float | None:
        entry = (m.get("retry_latency") or {}).get(f"level_{level}") or {}
        return (
            _p99()(entry.get("production_estimate_s") or {})
            if "production_estimate_s" in entry
            else _p99()(entry.get("scenario_s") or {})
        )

    return get


#: The figures compared, larger is worse: name -> how to read it from a run's metrics.
FIGURES: dict[str, Callable[[dict[str, Any]], float | None]] = {
    "duplicated_tokens": lambda m: (m.get("cost") or {}).get("duplicated_tokens"),
    "duplicated_ratio": lambda m: (m.get("cost") or {}).get("duplicated_ratio"),
    "recovery_p99_s": _p99("recovery", "next_rule_start_s"),
    "retry_p99_l1_s": _latency(1),
    "retry_p99_l2_s": _latency(2),
    "retry_p99_l3_s": _latency(3),
}
#: What each figure is, for the tables.
FIGURE_TEXT = {
    "duplicated_tokens": "tokens paid beyond the fault-free reference's bill",
    "duplicated_ratio": "duplicated tokens / the fault-free reference's bill",
    "recovery_p99_s": "p99, a fault that stops work to the next rule start, scenario s",
    "retry_p99_l1_s": "p99 retry latency, level 1, production estimate s",
    "retry_p99_l2_s": "p99 retry latency, level 2, production estimate s",
    "retry_p99_l3_s": "p99 retry latency, level 3, production estimate s",
}
HEADERS = ["scenario", "mode", "figure", "baseline", "this run", "change", "worse"]


def keyed(runs: list[Run], per_run: list[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    """Each run's metrics by (scenario, mode); of several runs of one, the first."""
    out: dict[Key, dict[str, Any]] = {}
    for run, m in zip(runs, per_run, strict=True):
        out.setdefault((run.scenario, run.mode), m)
    return out


def change(base: float | None, now: float | None) -> float:
    """How much `now` grew over `base`, as a ratio of `base` (inf: from nothing to some, or
    measured now and not in the baseline, e.g. the first retries of a level; -inf: gone)."""
    if base is None or now is None:
        return math.inf if base is None else -math.inf
    if base == now:
        return 0.0
    if base == 0:
        return math.inf if now > 0 else -math.inf
    return (now - base) / abs(base)


def compare(
    current: Mapping[Key, dict[str, Any]],
    baseline: Mapping[Key, dict[str, Any]],
    tolerance: float = DEFAULT_TOLERANCE,
) -> list[dict[str, Any]]:
    """A row per figure of each (scenario, mode) both hold, measured in both: the two
    values, the change (a ratio of the baseline's) and whether it is worse beyond
    `tolerance`. A figure measured on one side only (no retry of a level in one run) is
    shown, as new (worse) or gone. Raises ReportError when they share no scenario."""
    common = [k for k in current if k in baseline]
    if not common:
        mine = ", ".join(f"{s} ({m})" for s, m in sorted(current)) or "none"
        theirs = ", ".join(f"{s} ({m})" for s, m in sorted(baseline)) or "none"
        raise ReportError(f"baseline: no scenario in common (this run: {mine}; baseline: {theirs})")
    rows = []
    for scenario, mode in common:
        for name, get in FIGURES.items():
            base, now = get(baseline[(scenario, mode)]), get(current[(scenario, mode)])
            if base is None and now is None:
                continue
            ratio = change(base, now)
            rows.append(
                {
                    "scenario": scenario,
                    "mode": mode,
                    "figure": name,
                    "baseline": base,
                    "current": now,
                    # JSON has no infinity: None, with `new` saying which way
                    "change": ratio if math.isfinite(ratio) else None,
                    "new": ratio == math.inf,
                    "worse": ratio > tolerance,
                }
            )
    return rows


def over_budget(rows: list[dict[str, Any]], limits: Mapping[str, float | None]) -> list[str]:
    """One line per figure that grew by more than its scenario's `max_regression_ratio`
    (`limits`: scenario name -> that budget, None: not set)."""
    out = []
    for r in rows:
        limit = limits.get(r["scenario"])
        if limit is not None and _grew(r) > limit:
            out.append(
                f"{r['scenario']} ({r['mode']}): {r['figure']} {_n(r['baseline'])} -> "
                f"{_n(r['current'])} ({_pct(r)}) > max_regression_ratio {_n(limit)}"
            )
    return out


def _n(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4g}"


def _grew(row: dict[str, Any]) -> float:
    """A row's change as a number (inf: new, -inf: gone)."""
    if row["change"] is None:
        return math.inf if row["new"] else -math.inf
    return float(row["change"])


def _pct(row: dict[str, Any]) -> str:
    ratio = _grew(row)
    if ratio == math.inf:
        return "from 0" if row["baseline"] == 0 else "new"
    if ratio == -math.inf:
        return "gone"
    return f"{ratio:+.1%}"


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The rows as text, worse ones first."""
    ordered = sorted(rows, key=lambda r: not r["worse"])
    return [
        [
            r["scenario"],
            r["mode"],
            r["figure"],
            _n(r["baseline"]),
            _n(r["current"]),
            _pct(r),
            "WORSE" if r["worse"] else "",
        ]
        for r in ordered
    ]


def sentence(rows: list[dict[str, Any]], tolerance: float) -> str:
    """What the table says, in one line."""
    worse = [r for r in rows if r["worse"]]
    scenarios = len({(r["scenario"], r["mode"]) for r in rows})
    head = f"{scenarios} scenario(s) compared, tolerance {tolerance:.0%}: "
    if not worse:
        return head + "nothing got worse."
    return (
        head
        + f"{len(worse)} figure(s) got worse: "
        + ", ".join(f"{r['scenario']} {r['figure']} {_pct(r)}" for r in worse)
        + "."
    )


def against(
    runs: list[Run], base: list[Run], tolerance: float, price: float | None = None
) -> dict[str, Any]:
    """The comparison of `runs` with the earlier `base`, as the report shows it and
    `metrics.json` keeps it: the baseline's folders, the tolerance and the rows."""
    from reports.build import metrics

    if not base:
        raise ReportError("baseline: no run in it")
    now = keyed(runs, [metrics(r, price)[0] for r in runs])
    then = keyed(base, [metrics(r, price)[0] for r in base])
    return {
        "baseline": sorted({str(r.path) for r in base}),
        "not_in_baseline": [f"{s} ({m})" for s, m in now if (s, m) not in then],
        "tolerance": tolerance,
        "rows": compare(now, then, tolerance),
    }


TITLE = "Against the baseline"


def _intro(doc: dict[str, Any]) -> str:
    return (
        f"{sentence(doc['rows'], doc['tolerance'])} Baseline: {', '.join(doc['baseline'])}. "
        + (
            f"Not in the baseline (not compared): {', '.join(doc['not_in_baseline'])}. "
            if doc.get("not_in_baseline")
            else ""
        )
        + "Change: this run's value over the baseline's; worse: more than the tolerance "
        "(larger is worse for every figure)."
    )


def _legend() -> list[tuple[str, str]]:
    return list(FIGURE_TEXT.items())


def summary_md(doc: dict[str, Any]) -> list[str]:
    """The section of `summary.md`."""
    lines = [f"# {TITLE}", "", _intro(doc), ""]
    lines += ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(doc["rows"])]
    lines += ["", *(f"- `{name}`: {text}" for name, text in _legend())]
    return lines


def report_html(doc: dict[str, Any]) -> str:
    """The section of `report.html`."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADERS)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td>{'<strong>WORSE</strong>' if v == 'WORSE' else html.escape(v)}</td>" for v in row
        )
        + "</tr>"
        for row in table_rows(doc["rows"])
    )
    legend = "".join(
        f"<dt><code>{html.escape(n)}</code></dt><dd>{html.escape(t)}</dd>" for n, t in _legend()
    )
    return (
        f'<h2 id="baseline">{TITLE}</h2><p>{html.escape(_intro(doc))}</p>'
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table><dl>{legend}</dl>"
    )
