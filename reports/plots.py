"""The report's plots, as PNG bytes (matplotlib, no display): a timeline per run (rules
as bars, reruns in red, the runner's faults as shaded windows in lanes of their own, as
Jepsen draws its nemesis), retry latency CDFs per level (scenario time and the production
estimate, p50/p95/p99 marked, the delay tiers drawn), and duplicated tokens by cause.

What a plot draws is computed by small pure functions (`fault_marks`, `tier_lines`), so a
test can check what is drawn without reading pixels."""

from __future__ import annotations

import io
import textwrap
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display, no GUI toolkit
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, PercentFormatter

from engine.failpoints import TIMED_ACTIONS
from reports.cost import CAUSES, Cost
from reports.history import (
    LINK_ACTIONS,
    TARGETED_ACTIONS,
    WORKER_ACTIONS,
    event_time,
    stall_ends,
)
from reports.latency import RetryLatency, percentiles

if TYPE_CHECKING:
    from reports.runs import Run

#: At most this many evaluations get a lane in a timeline (the first ones submitted).
TIMELINE_EVALUATIONS = 6
LEVELS = {1: "level 1 (immediate)", 2: "level 2 (delayed)", 3: "level 3 (permanent)"}
COLORS = {
    "first": "#4c78a8",
    "rerun": "#e45756",
    "fault": "#7f7f7f",
    "network": "#9467bd",
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


@dataclass(frozen=True)
class FaultMark:
    """A fault as the timeline draws it, in seconds since the run's first event: from the
    moment it fired (the runner's `fault_fired`, a worker's own `crash` or stalling
    failpoint) to its heal (`fault_healed`), or an instant when it was never healed (a kill
    whose worker stayed down, a cancel). A never-healed network fault or pause stays open
    to the end of the run (`open_end`)."""

    start: float
    end: float | None  # None: an instant
    label: str  # also its lane: repetitions of one fault share a lane
    network: bool  # a fault on a link (Toxiproxy), not on a process
    open_end: bool = False


def fault_marks(history: list[dict[str, Any]]) -> list[FaultMark]:
    """What the timeline draws for the faults of `history`, sorted by time. Kills are read
    from the runner's `fault_fired` (when the fault fired), never from the supervisor's
    later notice (`worker_killed`, `worker_exited`)."""
    if not history:
        return []
    t0 = min(map(event_time, history))
    end_of_run = max(map(event_time, history)) - t0
    healed: dict[Any, float] = {}
    for e in history:
        if e.get("ev") == "fault_healed" and e.get("fault_id") is not None:
            healed.setdefault(e["fault_id"], event_time(e) - t0)
    crashes: dict[Any, tuple[float, str]] = {}
    stalled = stall_ends(history)
    out: list[FaultMark] = []
    for e in history:
        ev, t = e.get("ev"), event_time(e) - t0
        if ev == "fault_fired":
            action = str(e.get("action") or "fault")
            label, network = _fault_label(e), action in LINK_ACTIONS
            end = healed.get(e.get("fault_id"))
            if end is None and (network or "pause" in action or "stop" in action):
                out.append(FaultMark(t, end_of_run, label, network, open_end=True))
            elif end is None or end <= t:
                out.append(FaultMark(t, None, label, network))
            else:
                out.append(FaultMark(t, end, label, network))
        elif ev == "crash":
            crashes[e.get("pid")] = (t, f"crash@{e.get('failpoint') or 'unknown'}")
        elif ev == "worker_exited" and e.get("pid") in crashes:
            start, label = crashes.pop(e.get("pid"))
            end = healed.get(e.get("fault_id"))
            label = f"{label} w{e.get('worker')}" if e.get("worker") is not None else label
            out.append(FaultMark(start, end if end and end > start else None, label, False))
        elif ev == "failpoint_fired" and e.get("action") in TIMED_ACTIONS:
            end = stalled[id(e)] - t0
            label = f"{e['action']}@{e.get('failpoint')}"
            out.append(FaultMark(t, end if end > t else None, label, False))
    for start, label in crashes.values():  # no supervisor noted the exit
        out.append(FaultMark(start, None, label, False))
    return sorted(out, key=lambda m: (m.start, m.label))


def _fault_label(e: Mapping[str, Any]) -> str:
    """`kill_worker w1`, `cancel #0`, `blackhole_down (add_toxic)`: the action and what it
    hit, and the fault's own name when the scenario gave it one (not `faults[0]#3`)."""
    action, target = str(e.get("action") or "fault"), e.get("target")
    if action in WORKER_ACTIONS:
        base = f"{action} w{target}"
    elif action in TARGETED_ACTIONS and target is not None:
        base = f"{action} #{target}"
    else:
        base = action
    name = str(e.get("fault") or "").split("#", 1)[0]
    return base if not name or name.startswith("faults[") else f"{name} ({base})"


def timeline(run: Run, cost: Cost) -> bytes:
    """One lane per rule of each evaluation shown; a bar per execution, red when it is a
    rerun; above them a lane per fault, its window shaded across every lane (an instant,
    a dotted line), labelled: see `fault_marks`."""
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
    marks = fault_marks(history)
    fault_lanes = list(dict.fromkeys(m.label for m in marks))
    rows = [(a, r) for a in shown for r in lanes[a]]
    height = 0.22 * (len(rows) + len(fault_lanes)) + 1.8
    fig, ax = plt.subplots(figsize=(11, max(2.8, height)))
    first = len(fault_lanes)  # fault lanes on top, then the rules
    index = {row: first + i for i, row in enumerate(rows)}
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
    for m in marks:
        color = COLORS["network"] if m.network else COLORS["fault"]
        lane = fault_lanes.index(m.label)
        if m.end is None:
            ax.axvline(m.start, color=color, lw=1.0, ls=":", alpha=0.9)
            ax.plot(m.start, lane, marker="X", color="#111111", mec="white", ms=8, ls="none")
        else:
            ax.axvspan(m.start, m.end, color=color, alpha=0.12, lw=0)
            ax.barh(lane, m.end - m.start, left=m.start, height=0.6, color=color, alpha=0.8)
            if m.open_end:
                ax.text(m.start, lane, " never healed: open to the end", fontsize=6, va="center")
    ticks = [f"fault: {label}" for label in fault_lanes]
    ticks += [f"{a.rsplit('-', 1)[-1]}·{r}" for a, r in rows]
    ax.set_yticks(range(len(ticks)))
    ax.set_yticklabels(ticks, fontsize=7)
    for tick in ax.get_yticklabels()[:first]:
        tick.set_fontweight("bold")
    if first and rows:
        ax.axhline(first - 0.5, color="#444444", lw=0.6)
    ax.set_ylim(len(ticks) - 0.5, -0.5)
    ax.set_xlim(0, max(end_of_run, 1e-3) * 1.02)
    ax.xaxis.set_major_locator(MaxNLocator(12))
    ax.set_xlabel("seconds since the run started (scenario time)")
    ax.set_title(f"{run.label}: executions and faults", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    legend = [
        Patch(color=COLORS["first"], label="first execution of a rule"),
        Patch(color=COLORS["rerun"], label="rerun (paid again)"),
        Patch(color=COLORS["first"], alpha=0.4, label="faded: never finished (cut off)"),
        Patch(
            color=COLORS["fault"], alpha=0.5, label="shaded: process/service fault, fired→healed"
        ),
        Patch(
            color=COLORS["network"], alpha=0.5, label="shaded: network fault (link), fired→healed"
        ),
        Line2D(
            [],
            [],
            color=COLORS["fault"],
            ls=":",
            marker="X",
            mfc="#111111",
            label="X, dotted: an instant (a kill never healed, a cancel)",
        ),
    ]
    ax.legend(
        handles=legend, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False
    )
    if not marks:
        ax.text(0.99, 0.02, "no fault fired", transform=ax.transAxes, ha="right", fontsize=7)
    return png(fig)


def tier_lines(settings: Mapping[str, Any] | None) -> list[tuple[str, float, float]]:
    """The delay tiers a latency plot draws, from a run's recorded settings: (label, where
    in scenario seconds, the production seconds it stands for). No tiers or no scale
    recorded: none (a line at an unknown place would mislead)."""
    settings = settings or {}
    scale, tiers = settings.get("time_scale"), settings.get("tiers_ms")
    if not isinstance(scale, int | float) or scale <= 0 or not isinstance(tiers, list):
        return []
    out = []
    for n, ms in enumerate(tiers, 1):
        if isinstance(ms, int | float) and ms > 0:
            production = ms / 1000
            out.append(
                (f"tier {n}: {_seconds(production)} production", production * scale, production)
            )
    return out


def latency_cdf(
    latencies: list[RetryLatency],
    scale: float | None,
    settings: Mapping[str, Any] | None = None,
) -> bytes:
    """The CDF of retry latency per level: in scenario seconds (as the run timed it), and,
    when the scale is known, as a production estimate (only the tier waits and the agent's
    calls scaled back; fault windows and the rest as they happened), dashed. p50/p95/p99
    are marked on each scenario curve; the delay tiers (`settings`, the run's recorded
    ones) are drawn where they fall in scenario seconds."""
    return png(latency_figure(latencies, scale, settings))


def latency_figure(
    latencies: list[RetryLatency],
    scale: float | None,
    settings: Mapping[str, Any] | None = None,
) -> Figure:
    if scale is None and settings:
        scale = settings.get("time_scale")
    fig, ax = plt.subplots(figsize=(8, 4.6))
    drawn: list[float] = []
    for level, name in LEVELS.items():
        mine = [x for x in latencies if x.level == level]
        if not mine:
            continue
        xs = sorted(x.seconds for x in mine)
        ys = [(i + 1) / len(mine) for i in range(len(mine))]
        line = ax.step(xs, ys, where="post", label=f"{name}, n={len(mine)}: scenario s")
        color = line[0].get_color()
        for names, x, y in percentile_marks(xs):
            ax.plot(x, y, marker="o", color=color, ms=4, ls="none")
            ax.annotate(
                f"{names} {_seconds(x)}",
                (x, y),
                xytext=(5, -9 if y < 0.9 else -3 - 8 * (names == "p95")),
                textcoords="offset points",
                fontsize=6,
                color=color,
            )
        drawn += xs
        if scale:
            production = sorted(x.production_s(scale) for x in mine)
            ax.step(
                production,
                ys,
                where="post",
                ls="--",
                color=color,
                label=f"{name}: production estimate s",
            )
            drawn += production
    tiers = tier_lines(settings)
    for label, at, production in tiers:
        ax.axvline(at, color="#555555", lw=0.9, ls="-.", alpha=0.8, gid="tier")
        ax.text(
            at,
            0.02,
            f"{label} = {_seconds(at)} in the scenario ",
            rotation=90,
            fontsize=6,
            va="bottom",
            ha="right",
        )
        drawn.append(at)
        if scale:
            ax.axvline(production, color="#555555", lw=0.7, ls=":", alpha=0.6)
            drawn.append(production)
    if not latencies:
        ax.text(0.5, 0.5, "no rule failed: no retry to time", ha="center", va="center")
    if drawn:
        if tiers:
            ax.plot([], [], color="#555555", ls="-.", label="delay tiers, in scenario s")
            if scale:
                ax.plot([], [], color="#555555", ls=":", label="delay tiers, in production s")
        ax.legend(
            fontsize=7,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            frameon=False,
            title="solid: scenario s (x axis)\ndashed: production estimate s",
            title_fontsize=7,
        )
        _seconds_axis(ax, [x for x in drawn if x > 0])
    ax.set_xlabel(
        "seconds (s), first failure to success or permanent failure: solid, scenario time "
        "as it happened;\ndashed, production estimate (tier waits and agent calls scaled "
        "back, fault windows as they happened)",
        fontsize=8,
    )
    ax.set_ylabel("fraction of rules (cumulative)")
    ax.set_ylim(0, 1.05)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_yticks([0, 0.25, 0.5, 0.75, 0.95, 1.0])
    ax.grid(alpha=0.3)
    ax.grid(which="minor", alpha=0.1)
    ax.set_title("Retry latency, per retry level", fontsize=10)
    return fig


def percentile_marks(values: list[float]) -> list[tuple[str, float, float]]:
    """The p50, p95 and p99 marks of one curve: (names, seconds, fraction), nearest rank
    as the report's tables (`percentiles`); marks that fall on one point share a label
    (`p95=p99`), drawn at the higher fraction."""
    if not values:
        return []
    ranks = percentiles(values)
    out: list[tuple[str, float, float]] = []
    for name, y in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
        x = float(ranks[name])
        if out and out[-1][1] == x:
            out[-1] = (f"{out[-1][0]}={name}", x, y)
        else:
            out.append((name, x, y))
    return out


def _seconds_axis(ax: Any, values: list[float]) -> None:
    """A log axis with a labelled tick at 1, 2 and 5 of every decade when the values span
    more than a decade or so; a linear one otherwise. Labels in plain seconds."""
    if not values:
        return
    low, high = min(values), max(values)
    if high / low > 20:
        ax.set_xscale("log")
        ax.set_xlim(low / 1.5, high * 1.5)
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=30))
        ax.xaxis.set_minor_locator(LogLocator(base=10, subs=tuple(range(1, 10)), numticks=30))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda x, _: ""))
    else:
        ax.set_xlim(0, high * 1.1)
        ax.xaxis.set_major_locator(MaxNLocator(10))
    ax.xaxis.set_major_formatter(
        FuncFormatter(lambda x, _: f"{x * 1000:g} ms" if x < 0.1 else f"{x:g} s")
    )
    ax.tick_params(axis="x", labelsize=7)


def _seconds(s: float) -> str:
    """1.5 ms, 0.3 s, 45 s, 10 min, 2 h: what a tick or a mark says."""
    if s == 0:
        return "0"
    if s < 0.1:
        return f"{s * 1000:g} ms"
    if s < 120:
        return f"{s:.3g} s"
    if s < 7200:
        return f"{s / 60:.3g} min"
    return f"{s / 3600:.3g} h"


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


def durable_boxes(rows: list[Any]) -> bytes:
    """The durable designs side by side, a panel per measure, each design a series: what
    faults cost (tokens, USD), what never ended, how long recovery and each retry level
    took, as distributions over the runs (seeds)."""
    panels = (
        ("duplicated tokens per run", lambda r: r.duplicated_tokens),
        ("duplicated cost per run (USD)", lambda r: r.duplicated_usd),
        ("evaluations left unfinished per run", lambda r: r.unfinished),
        ("recovery (scenario s)", lambda r: r.recovery_seconds),
        ("retry latency, level 1 (production s)", lambda r: r.retry_by_level.get(1, [])),
        ("retry latency, level 2 (production s)", lambda r: r.retry_by_level.get(2, [])),
    )
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    labels = [f"{textwrap.fill(r.variant, 16)}\n({r.runs} runs)" for r in rows]
    for ax, (title, values) in zip(axes.flat, panels, strict=True):
        ax.boxplot([values(r) or [0] for r in rows], tick_labels=labels)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return png(fig)


def standby_boxes(rows: list[Any]) -> bytes:
    """A failover's protection beside its cost, the standbys side by side: the acknowledged
    writes each run lost, how long each result write waited, and the tokens paid again."""
    panels = (
        ("acknowledged writes lost per run", lambda r: r.lost_writes),
        ("result write wait (s)", lambda r: r.write_waits),
        ("duplicated tokens per run", lambda r: r.duplicated_tokens),
    )
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    labels = [f"{textwrap.fill(r.variant, 16)}\n({r.runs} runs)" for r in rows]
    for ax, (title, values) in zip(axes.flat, panels, strict=True):
        ax.boxplot([values(r) or [0] for r in rows], tick_labels=labels)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return png(fig)


def compare_boxes(rows: list[Any]) -> bytes:
    """The three designs side by side: duplicated tokens and unfinished evaluations per
    run, as distributions over the runs (seeds)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    # wrapped: "the source documents as written" beside "RabbitMQ only" would overlap
    labels = [f"{textwrap.fill(r.variant, 16)}\n({r.runs} runs)" for r in rows]
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
