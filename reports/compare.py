"""Designs side by side on the same scenarios. `memories`, the source documents' argument measured:
the engine with both memories, with RabbitMQ only (`no_redis_results`: no stored results
to resume from) and as the seed's design was written (`no_sweeper`: nothing resumes an
evaluation whose worker died after the ACK). `sentinel`, the answers to a Sentinel
failover losing acknowledged writes: WAIT for a replica, the results written back before
the announcement, the server's own min-replicas-to-write, each alone, all, and none.
`durable`, the durable designs (`chaos.systems`) on the same faults: what each pays twice,
leaves unfinished, and how fast it recovers and retries. `standby`, PostgreSQL failing over
to a synchronous or an asynchronous standby: the acknowledged writes each promotion lost
(its protection) beside how long each result write waited (its cost). Read
from the runs' journals and histories, so every number can be checked against them; over
many seeds in the simulator, as distributions."""

from __future__ import annotations

import base64
import html
import json
import statistics
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from reports import plots
from reports.cost import CAUSES, RERUN_CAUSES, lost_writes
from reports.latency import percentiles, result_write_waits
from reports.measure import measure
from reports.runs import Run


@dataclass(frozen=True)
class Design:
    """One engine to compare: the shipped one with `mutant` applied (None: as shipped) and
    the scenario's `redis` (`postgres`) section updated with `redis` (`postgres`); `key`
    names its runs' folder."""

    label: str
    key: str
    mutant: str | None
    what: str
    redis: tuple[tuple[str, Any], ...] = ()
    system: str | None = None  # the system under test (`chaos.systems`; None: the scenario's)
    postgres: tuple[tuple[str, Any], ...] = ()


#: The design sets `chaos compare --designs` takes; the first design of each is the shipped
#: engine, which must not break.
DESIGNS: dict[str, tuple[Design, ...]] = {
    "memories": (
        Design("both memories", "engine", None, "the engine as shipped"),
        Design("RabbitMQ only", "no_redis_results", "no_redis_results", "no stored results"),
        Design(
            "the source documents as written",
            "no_sweeper",
            "no_sweeper",
            "no sweeper after the ACK",
        ),
    ),
    "sentinel": (
        Design("WAIT + restore", "engine", None, "the engine as shipped"),
        Design("WAIT only", "no_restore", "no_restore", "nothing written back at the end"),
        Design("restore only", "no_wait", "no_wait", "writes count before a replica has them"),
        Design(
            "min-replicas only",
            "min_replicas",
            "unmitigated",
            "the primary refuses writes without a replica (min-replicas-to-write 1)",
            (("min_replicas_to_write", 1),),
        ),
        Design("none", "unmitigated", "unmitigated", "neither WAIT nor restore"),
    ),
    "standby": (
        Design(
            "synchronous standby",
            "sync",
            None,
            "remote_apply: each commit waits for the standby to apply it (the mitigation)",
            system="pg",
            postgres=(("standby", "sync"),),
        ),
        Design(
            "asynchronous standby",
            "async",
            None,
            "PostgreSQL's default replication: a promotion may lose the last commits",
            system="pg",
            postgres=(("standby", "async"),),
        ),
    ),
    "durable": (
        Design(
            "Redis + RabbitMQ",
            "redis-rabbitmq",
            None,
            "the first document's engine",
            system="redis-rabbitmq",
        ),
        Design(
            "PostgreSQL store + RabbitMQ",
            "pg-store",
            None,
            "the same shell, PostgreSQL as the store",
            system="pg-store",
        ),
        Design(
            "PostgreSQL alone",
            "pg",
            None,
            "the same shell; work, retries and events as rows of the same database",
            system="pg",
        ),
        Design(
            "Temporal",
            "temporal",
            None,
            "the engine's core as a workflow, an activity a call (1 s heartbeat timeout, 1 s "
            "sticky schedule-to-start, 10 ms timer shift)",
            system="temporal",
        ),
        Design(
            "DBOS",
            "dbos",
            None,
            "the engine's core as a workflow on PostgreSQL, a step a call; no takeover of its "
            "own (an operator recovers a dead worker's executor after 3 s)",
            system="dbos",
        ),
    ),
}
#: The retry levels a comparison sets apart: immediate, delayed, after a permanent failure.
LEVELS = (1, 2, 3)


@dataclass
class Row:
    variant: str
    mutant: str | None
    runs: int = 0
    duplicated_tokens: list[int] = field(default_factory=list)
    duplicated_ratio: list[float] = field(default_factory=list)
    finished_rerun_tokens: list[int] = field(default_factory=list)
    unfinished: list[int] = field(default_factory=list)
    retry_scenario_seconds: list[float] = field(default_factory=list)  # as it happened
    retry_seconds: list[float] = field(default_factory=list)  # the production estimate
    recovery_seconds: list[float] = field(default_factory=list)
    duplicated_usd: list[float] = field(default_factory=list)  # the checker's, per run
    retry_by_level: dict[int, list[float]] = field(  # production estimates, by level
        default_factory=lambda: {level: [] for level in LEVELS}
    )
    failed: Counter[str] = field(default_factory=Counter)  # invariant -> runs it failed
    duplicated_by_cause: Counter[str] = field(default_factory=Counter)  # summed over runs
    reruns_by_cause: Counter[str] = field(default_factory=Counter)
    lost_writes: list[int] = field(default_factory=list)  # per run whose store counted them
    write_waits: list[float] = field(default_factory=list)  # seconds, every result write

    def add(self, run: Run) -> None:
        self.runs += 1
        stats = run.journal.get("stats") or {}
        m = measure(  # the figures the run's checker recorded: one definition everywhere
            run.history, run.settings.get("time_scale"), stats, run.extra.get("mutant")
        )
        self.duplicated_tokens.append(m["duplicated_tokens"])
        self.duplicated_ratio.append(m["duplicated_ratio"])
        after = ("mutant", "after_completion", "lost_state")
        self.finished_rerun_tokens.append(sum(m["duplicated_by_cause"][c] for c in after))
        self.duplicated_by_cause.update(m["duplicated_by_cause"])
        self.reruns_by_cause.update(m["reruns_by_cause"])
        self.unfinished.append(m["unfinished"])
        self.retry_scenario_seconds += [scenario for _, scenario, _, _ in m["retries"]]
        self.retry_seconds += [production for _, _, production, _ in m["retries"]]
        for level, _, production, _ in m["retries"]:
            self.retry_by_level.setdefault(int(level), []).append(production)
        self.duplicated_usd.append(float(stats.get("duplicated_usd") or 0.0))
        self.recovery_seconds += m["recoveries"]
        verdicts = run.journal.get("verdicts") or {}
        self.failed.update(name for name, v in verdicts.items() if v == "fail")
        lost = lost_writes(run.history)
        if lost is not None:
            self.lost_writes.append(lost)
        self.write_waits += result_write_waits(run.history)

    def lost_text(self) -> str:
        """`16 (1 of 1 runs)`: the acknowledged writes lost in all, and in how many runs;
        `-` when no run's store counted them."""
        if not self.lost_writes:
            return "-"
        losing = sum(1 for n in self.lost_writes if n)
        return f"{sum(self.lost_writes):,} ({losing} of {len(self.lost_writes)} runs)"

    def sentence(self) -> str:
        """What broke, in one sentence."""
        if not self.runs:
            return "not run"
        if not self.failed:
            return f"nothing broke: every invariant held in {self.runs} run(s)"
        parts = []
        if sum(self.finished_rerun_tokens):
            parts.append(
                f"paid {sum(self.finished_rerun_tokens):,} tokens again for rules already "
                f"finished (mean {statistics.fmean(self.finished_rerun_tokens):,.0f} a run)"
            )
        if sum(self.unfinished):
            stuck = sum(1 for u in self.unfinished if u)
            parts.append(
                f"left {sum(self.unfinished)} evaluation(s) unfinished in {stuck} of "
                f"{self.runs} run(s)"
            )
        broke = ", ".join(f"{name} in {n}/{self.runs}" for name, n in self.failed.most_common())
        return "; ".join([*parts, f"failed {broke}"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "mutant": self.mutant,
            "runs": self.runs,
            "duplicated_tokens": percentiles([float(t) for t in self.duplicated_tokens]),
            "duplicated_ratio": percentiles(self.duplicated_ratio),
            "duplicated_by_cause": {c: self.duplicated_by_cause[c] for c in CAUSES},
            "reruns_by_cause": {c: self.reruns_by_cause[c] for c in RERUN_CAUSES},
            "finished_rules_paid_again_tokens": sum(self.finished_rerun_tokens),
            "unfinished_evaluations": sum(self.unfinished),
            "retry_latency_scenario_s": percentiles(self.retry_scenario_seconds),
            "retry_latency_production_estimate_s": percentiles(self.retry_seconds),
            "recovery_scenario_s": percentiles(self.recovery_seconds),
            "duplicated_usd": percentiles(self.duplicated_usd),
            "retry_latency_production_estimate_s_by_level": {
                str(level): percentiles(values) for level, values in self.retry_by_level.items()
            },
            "failed": dict(self.failed),
            "what_broke": self.sentence(),
            "lost_writes": list(self.lost_writes),
            "result_write_wait_s": percentiles(self.write_waits),
        }


def compare(runs_by_design: dict[str, list[Run]], designs: tuple[Design, ...]) -> list[Row]:
    """A row per design, from its runs (`runs_by_design[design.key]`)."""
    rows = []
    for design in designs:
        row = Row(design.label, design.mutant)
        for run in runs_by_design.get(design.key, []):
            row.add(run)
        rows.append(row)
    return rows


def _n(values: list[float] | list[int], p: str = "p50") -> str:
    got = percentiles([float(v) for v in values])
    if not got["n"]:
        return "-"
    value = got[p]
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


#: The comparison table's columns (compare.md and compare.html).
HEADERS = (
    "design",
    "runs",
    "duplicated tokens (median / p95)",
    "ratio to fault-free (median)",
    "unfinished evaluations",
    "p99 retry latency (scenario s / production estimate s)",
    "p99 recovery (scenario s)",
    "what broke",
)


def table_rows(rows: list[Row]) -> list[list[str]]:
    """The comparison table's cells, one row per design."""
    return [
        [
            r.variant,
            str(r.runs),
            f"{_n(r.duplicated_tokens)} / {_n(r.duplicated_tokens, 'p95')}",
            _n(r.duplicated_ratio),
            str(sum(r.unfinished)),
            f"{_n(r.retry_scenario_seconds, 'p99')} / {_n(r.retry_seconds, 'p99')}",
            _n(r.recovery_seconds, "p99"),
            r.sentence(),
        ]
        for r in rows
    ]


#: The durable designs' table (`--designs durable`): cost, what never ended, and the
#: recovery and retry latencies per level that a choice of design turns on.
DURABLE_HEADERS = (
    "design",
    "runs",
    "duplicated tokens (median / p95)",
    "duplicated cost USD (median / p95)",
    "unfinished evaluations",
    "p99 recovery (scenario s)",
    "p99 retry latency L1 / L2 / L3 (production estimate s)",
    "what broke",
)


def durable_rows(rows: list[Row]) -> list[list[str]]:
    return [
        [
            r.variant,
            str(r.runs),
            f"{_n(r.duplicated_tokens)} / {_n(r.duplicated_tokens, 'p95')}",
            f"{_n(r.duplicated_usd)} / {_n(r.duplicated_usd, 'p95')}",
            str(sum(r.unfinished)),
            _n(r.recovery_seconds, "p99"),
            " / ".join(_n(r.retry_by_level.get(level, []), "p99") for level in LEVELS),
            r.sentence(),
        ]
        for r in rows
    ]


#: The standby's table (`--designs standby`): what a failover lost that the engine had been
#: told was written (the protection), beside how long result writes waited (the cost).
STANDBY_HEADERS = (
    "design",
    "runs",
    "acknowledged writes lost (runs that lost some)",
    "result write wait p50 / p99 / max (s)",
    "duplicated tokens (median / p95)",
    "unfinished evaluations",
    "what broke",
)


def standby_rows(rows: list[Row]) -> list[list[str]]:
    return [
        [
            r.variant,
            str(r.runs),
            r.lost_text(),
            " / ".join(_n(r.write_waits, p) for p in ("p50", "p99", "max")),
            f"{_n(r.duplicated_tokens)} / {_n(r.duplicated_tokens, 'p95')}",
            str(sum(r.unfinished)),
            r.sentence(),
        ]
        for r in rows
    ]


#: Which table a comparison shows (`--designs`): the default's, `durable` or `standby`.
TABLES = {
    "durable": (DURABLE_HEADERS, durable_rows),
    "standby": (STANDBY_HEADERS, standby_rows),
}


def _table(rows: list[Row], kind: str) -> tuple[tuple[str, ...], list[list[str]]]:
    """The headers and cells of `kind`'s table (`TABLES`; any other kind: the default)."""
    headers, cells = TABLES.get(kind, (HEADERS, table_rows))
    return headers, cells(rows)


def table_md(rows: list[Row], kind: str = "") -> str:
    headers, cells_of = _table(rows, kind)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cells) + " |" for cells in cells_of]
    return "\n".join(lines) + "\n"


def compare_html(rows: list[Row], title: str, plot: bytes, kind: str = "") -> str:
    """compare.html: self-contained (the plot embedded), what broke first, then the table."""
    headers, cells_of = _table(rows, kind)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"
        for cells in cells_of
    )
    broke = "".join(
        f"<li><b>{html.escape(r.variant)}</b>"
        + (f" (mutant <code>{html.escape(r.mutant)}</code>)" if r.mutant else " (as shipped)")
        + f": {html.escape(r.sentence())}</li>"
        for r in rows
    )
    image = base64.b64encode(plot).decode()
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title>"
        "<style>body{font:14px/1.4 system-ui,sans-serif;margin:2em}td,th{border:1px solid #ccc;"
        "padding:4px 8px;vertical-align:top;text-align:left}th{background:#eee}"
        "table{border-collapse:collapse}img{max-width:100%}</style></head>"
        f"<body><h1>{html.escape(title)}</h1><h2>What broke</h2><ul>{broke}</ul>"
        f"<h2>Side by side</h2><table><tr>{head}</tr>{body}</table>"
        f'<h2>Over the runs</h2><figure><img alt="compare.png" '
        f'src="data:image/png;base64,{image}"><figcaption>'
        + (
            "each measure per run, the designs side by side, over the runs (seeds)"
            if kind in TABLES
            else "duplicated tokens and unfinished evaluations per run, over the runs (seeds)"
        )
        + "</figcaption></figure>"
        f"<p>Files: compare.md, compare.json, compare.png, each design's runs in its folder "
        f"(generated {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}).</p></body></html>\n"
    )


def write_comparison(
    rows: list[Row],
    out: Path,
    scenarios: list[str],
    title: str = "The source documents' argument, measured",
    kind: str = "",
) -> None:
    """compare.md, .json, .png and .html in `out`; `kind`: which table and plot (the
    `--designs`: `TABLES` has those of its own, the others share the default)."""
    out.mkdir(parents=True, exist_ok=True)
    title = f"{title}: {', '.join(scenarios)}"
    (out / "compare.md").write_text(f"# {title}\n\n" + table_md(rows, kind))
    doc = {"scenarios": scenarios, "rows": [r.to_dict() for r in rows]}
    (out / "compare.json").write_text(json.dumps(doc, indent=2) + "\n")
    boxes = {"durable": plots.durable_boxes, "standby": plots.standby_boxes}
    plot = boxes.get(kind, plots.compare_boxes)(rows)
    (out / "compare.png").write_bytes(plot)
    (out / "compare.html").write_text(compare_html(rows, title, plot, kind))
