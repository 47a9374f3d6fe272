"""Prometheus metrics of one worker, named after the second seed's `*_retries_total`.

The counters and the gauge are plain numbers, moved by `count` and `running.set` and read
by collectors when Prometheus scrapes: a `prometheus_client.Counter` validates and takes a
lock on every increment, and a rule moves two or three of them. A scrape shows them exactly
as `Counter`s and a `Gauge` would (the `_total` and `_created` samples, children in the
order they first moved). The scrape runs in the server's thread; the event loop's thread is
the only writer, so a scrape reads each number whole, at worst one increment old. The
registry is made when first asked for: the simulator makes a worker at every process start
and never scrapes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

Labels = tuple[tuple[str, str], ...]

#: name -> (exposed name, help, label names): the worker's counters, in exposition order.
COUNTERS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "retries": (
        "engine_retries",
        "Retries by level (1 immediate, 2 delayed, 3 permanent)",
        ("level",),
    ),
    "resumes": ("engine_resume", "Evaluations resumed from Redis state", ("reason",)),
    "reruns": ("engine_reruns", "Rule attempts started again after a crash lost them", ()),
    "calls": ("engine_agent_calls", "Agent calls by outcome", ("outcome",)),
    "tokens": ("engine_tokens", "Tokens spent on agent calls", ()),
    "rerun_tokens": (
        "engine_rerun_tokens",
        "Tokens spent on executions started again (reruns), whatever they drew",
        (),
    ),
    "loaded": ("engine_rules_loaded", "Rule results loaded from Redis, not rerun", ()),
    "evaluations": ("engine_evaluations", "Evaluations finished, by status", ("status",)),
}


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        now = time.time()
        # (metric, labels) -> [value, created]; the unlabelled ones exist from the start.
        self._counts: dict[tuple[str, Labels], list[float]] = {
            (name, ()): [0.0, now] for name, (_, _, labels) in COUNTERS.items() if not labels
        }
        self.running = GaugeValue()
        self._registry: CollectorRegistry | None = None
        if registry is not None:
            self._register(registry)

    @property
    def registry(self) -> CollectorRegistry:
        """The registry a scrape reads, made on first use."""
        if self._registry is None:
            return self._register(CollectorRegistry())
        return self._registry

    def _register(self, registry: CollectorRegistry) -> CollectorRegistry:
        registry.register(_Counters(self._counts))
        registry.register(
            _Gauge("engine_evaluations_running", "Evaluations in memory", self.running)
        )
        self._registry = registry
        return registry

    def count(self, metric: str, labels: Labels = (), amount: float = 1) -> None:
        """Move the counter `metric` (its child for `labels`) by `amount` (>= 0)."""
        found = self._counts.get((metric, labels))
        if found is None:
            found = self._first(metric, labels)
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        found[0] += amount

    def _first(self, metric: str, labels: Labels) -> list[float]:
        """A labelled counter's child, made when it first moves (as `Counter.labels`)."""
        if metric not in COUNTERS:
            raise AttributeError(f"no counter {metric!r}; known: {sorted(COUNTERS)}")
        names = COUNTERS[metric][2]
        if tuple(k for k, _ in labels) != names:
            raise ValueError(f"counter {metric!r} takes the labels {names}, got {labels}")
        found = self._counts[(metric, labels)] = [0.0, time.time()]
        return found

    def value(self, metric: str, labels: Labels = ()) -> float:
        """A counter's value now (0 for a child that never moved)."""
        found = self._counts.get((metric, labels))
        return 0.0 if found is None else found[0]

    def totals(self) -> dict[str, float]:
        """Every counter that moved, as a scrape names it (`engine_tokens_total`,
        `engine_agent_calls_total{outcome="ok"}`): what a stopping worker leaves in its
        history, for the checker to hold against the events it recorded."""
        out = {}
        for (metric, labels), (value, _) in self._counts.items():
            if value:
                name = COUNTERS[metric][0] + "_total"
                if labels:
                    name += "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"
                out[name] = value
        return out

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)


class GaugeValue:
    """A gauge's number, set by the event loop and read at a scrape (as `Gauge.set`)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)


class _Gauge:
    """The collector that shows a `GaugeValue` as a Prometheus gauge."""

    def __init__(self, name: str, doc: str, gauge: GaugeValue) -> None:
        self._name, self._doc, self._gauge = name, doc, gauge

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(self._name, self._doc)]

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self._name, self._doc, value=self._gauge.value)


class _Counters:
    """The collector that shows `Metrics`' numbers as Prometheus counters."""

    def __init__(self, counts: dict[tuple[str, Labels], list[float]]) -> None:
        self._counts = counts

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(name, doc, labels=ls) for name, doc, ls in COUNTERS.values()]

    def collect(self) -> Iterator[Metric]:
        children: dict[str, list[tuple[Labels, float, float]]] = {m: [] for m in COUNTERS}
        for (metric, labels), (value, created) in list(self._counts.items()):
            children[metric].append((labels, value, created))
        for metric, (name, doc, names) in COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=names)
            for labels, value, created in children[metric]:
                family.add_metric([v for _, v in labels], value, created=created)
            yield family
