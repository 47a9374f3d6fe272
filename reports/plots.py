"""The report's plots, as PNG bytes (matplotlib, no display): a timeline per run (rules
as bars, reruns in red, faults as marks, as Jepsen draws its timelines), retry latency
CDFs per level, and duplicated cost by cause."""

from __future__ import annotations

import io
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display, no GUI toolkit
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from chaos.checker.context import event_time
from chaos.checker.cost import CAUSES, Cost
from chaos.checker.latency import STOPPING, RetryLatency

if TYPE_CHECKING:
    from reports.runs import Run

#: At most this many evaluations get a lane in a timeline (the first ones submitted).
TIMELINE_EVALUATIONS = 6
LEVELS = {1: "level 1 (immediate)", 2: "level 2 (delayed)", 3: "level 3 (permanent)"}
COLORS = {
    "first": "#4c78a8",
    "rerun": "#e45756",
    "fault": "#222222",
    "write_window": "#f58518",
    "redelivery": "#e45756",
    "sweeper_resume": "#b279a2",
    "in_flight": "#ff9da6",
    "lost_state": "#9d755d",
    "mutant": "#54a24b",
    "after_completion": "#000000",
}


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def timeline(run: Run, cost: Cost) -> bytes:
    """One lane per rule of each evaluation shown; a bar per execution, red when it is a
    rerun; a vertical mark at each fault that stopped work."""
    history = run.history
    t0 = min((event_time(e) for e in history), default=0.0)
    order: list[str] = []
    for e in history:
        a = e.get("attempt_id")
        if e.get("ev") == "submitted" and a not in order:
            order.append(str(a))
    shown = order[:TIMELINE_EVALUATIONS]
    lanes: dict[str, list[str]] = defaultdict(list)
    for x in cost.executions:
        if x.attempt_id in shown and x.rule_id not in lanes[x.attempt_id]:
            lanes[x.attempt_id].append(x.rule_id)
    rows = [(a, r) for a in shown for r in lanes[a]]
    fig, ax = plt.subplots(figsize=(11, max(2.5, 0.22 * len(rows) + 1.2)))
    index = {row: i for i, row in enumerate(rows)}
    end_of_run = max((event_time(e) for e in history), default=t0) - t0
    last: dict[str, float] = {}  # a process's last event: where an unfinished call ended
    for e in history:
        last[str(e.get("src"))] = event_time(e) - t0
    for x in cost.executions:
        row = index.get((x.attempt_id, x.rule_id))
        if row is None:
            continue
        start = x.start - t0
        end = x.end - t0 if x.end is not None else last.get(x.src, end_of_run)
        width = max(end - start, end_of_run / 400)
        color = COLORS["rerun"] if x.cause else COLORS["first"]
        ax.barh(row, width, left=start, height=0.7, color=color, alpha=0.9 if x.end else 0.4)
    for e in history:
        if e.get("ev") in STOPPING or e.get("ev") == "failpoint_fired":
            ax.axvline(event_time(e) - t0, color=COLORS["fault"], lw=0.8, ls="--", alpha=0.7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{a.rsplit('-', 1)[-1]}·{r}" for a, r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run started (scenario time)")
    ax.set_title(f"{run.label}: executions (red: reruns), faults (dashed)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return png(fig)


def latency_cdf(latencies: list[RetryLatency], scale: float | None) -> bytes:
    """The CDF of retry latency per level, in production time when the scale is known."""
    fig, ax = plt.subplots(figsize=(7, 4))
    unit = "production seconds" if scale else "scenario seconds"
    drawn = False
    for level, name in LEVELS.items():
        values = sorted(x.seconds / (scale or 1.0) for x in latencies if x.level == level)
        if not values:
            continue
        ys = [(i + 1) / len(values) for i in range(len(values))]
        ax.step(values, ys, where="post", label=f"{name}, n={len(values)}")
        drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "no rule failed: no retry to time", ha="center", va="center")
    else:
        ax.legend(fontsize=8, loc="lower right")
        ax.set_xscale("symlog", linthresh=1e-3)
    ax.set_xlabel(f"first failure to success or permanent failure ({unit})")
    ax.set_ylabel("fraction of rules")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.set_title("Retry latency, per retry level", fontsize=10)
    return png(fig)


def cost_bars(labels: list[str], costs: list[Cost]) -> bytes:
    """Per run: the fault-free bill, and the duplicated tokens stacked by cause."""
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(costs) + 3), 4))
    xs = range(len(costs))
    ax.bar(xs, [c.reference_tokens for c in costs], color="#cccccc", label="fault-free calls")
    bottom = [c.reference_tokens for c in costs]
    for cause in CAUSES:
        values = [c.by_cause()[cause] for c in costs]
        if any(values):
            ax.bar(xs, values, bottom=bottom, color=COLORS[cause], label=cause.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(list(xs))
    ax.set_xticklabels([_short(label) for label in labels], fontsize=7, rotation=20, ha="right")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=8)
    ax.set_title("LLM tokens: the fault-free bill and what faults added, by cause", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return png(fig)


def _short(label: str, width: int = 38) -> str:
    return label if len(label) <= width else label[: width - 1] + "…"


def compare_boxes(rows: list[Any]) -> bytes:
    """The three designs side by side: duplicated tokens and unfinished evaluations per
    run, as distributions over the runs (seeds)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r.variant}\n({r.runs} runs)" for r in rows]
    left.boxplot([r.duplicated_tokens or [0] for r in rows], tick_labels=labels)
    left.set_ylabel("duplicated tokens per run")
    left.set_title("What faults cost in LLM calls", fontsize=10)
    right.boxplot([r.unfinished or [0] for r in rows], tick_labels=labels)
    right.set_ylabel("evaluations left unfinished per run")
    right.set_title("What never ended", fontsize=10)
    for ax in (left, right):
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    return png(fig)
