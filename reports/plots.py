"""The report's plots, as PNG bytes (matplotlib, no display): a timeline per run (rules
as bars, reruns in red, faults as marks, as Jepsen draws its timelines), retry latency
CDFs per level (scenario time and the production estimate), and duplicated tokens by
cause."""

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
    "extra_calls": "#72b7b2",
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
    """The CDF of retry latency per level: in scenario seconds (as the run timed it), and,
    when the scale is known, as a production estimate (only the tier waits and the agent's
    calls scaled back; fault windows and the rest as they happened), dashed."""
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for level, name in LEVELS.items():
        mine = [x for x in latencies if x.level == level]
        if not mine:
            continue
        ys = [(i + 1) / len(mine) for i in range(len(mine))]
        line = ax.step(
            sorted(x.seconds for x in mine),
            ys,
            where="post",
            label=f"{name}, n={len(mine)}: scenario s",
        )
        if scale:
            ax.step(
                sorted(x.production_s(scale) for x in mine),
                ys,
                where="post",
                ls="--",
                color=line[0].get_color(),
                label=f"{name}: production estimate s",
            )
        drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "no rule failed: no retry to time", ha="center", va="center")
    else:
        ax.legend(fontsize=7, loc="lower right")
        ax.set_xscale("symlog", linthresh=1e-3)
    ax.set_xlabel(
        "first failure to success or permanent failure (s): solid, scenario time as it "
        "happened;\ndashed, production estimate (tier waits and agent calls scaled back, "
        "fault windows as they happened)",
        fontsize=8,
    )
    ax.set_ylabel("fraction of rules")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.set_title("Retry latency, per retry level", fontsize=10)
    return png(fig)


def cost_bars(labels: list[str], by_cause: list[dict[str, int]]) -> bytes:
    """Duplicated tokens per run, stacked by cause (the figures' `duplicated_by_cause`,
    which add up to the run's duplicated tokens), the most expensive run first. Runs
    without any duplicated token are named below the plot, not drawn as empty bars."""
    totals = [sum(b.values()) for b in by_cause]
    order = sorted((i for i, t in enumerate(totals) if t), key=lambda i: (-totals[i], i))
    spared = [labels[i] for i, t in enumerate(totals) if not t]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(order) + 3), 4.2))
    xs = range(len(order))
    bottom = [0] * len(order)
    for cause in CAUSES:
        values = [by_cause[i].get(cause, 0) for i in order]
        if any(values):
            ax.bar(xs, values, 0.6, bottom=bottom, color=COLORS[cause], label=cause)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    if order:
        ax.set_xticks(list(xs))
        ax.set_xticklabels([_short(labels[i]) for i in order], fontsize=7, rotation=20, ha="right")
        ax.legend(fontsize=8, title="cause", title_fontsize=8)
    else:
        ax.set_xticks([])
        ax.text(0.5, 0.5, "no run paid a duplicated token", ha="center", va="center")
    if len(order) < 4:  # a bar or two: keep them bars, not a wall of colour
        ax.set_xlim((len(order) - 1) / 2 - 2, (len(order) - 1) / 2 + 2)
    if spared:
        shown = "\n".join(_short(label, 60) for label in spared[:6])
        more = f"\nand {len(spared) - 6} more" if len(spared) > 6 else ""
        ax.set_xlabel(f"runs without duplicated tokens:\n{shown}{more}", fontsize=7)
    ax.set_ylabel("duplicated tokens (paid beyond the fault-free bill)")
    ax.set_title("Duplicated LLM tokens by cause, per run (most first)", fontsize=10)
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
