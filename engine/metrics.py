"""Prometheus metrics of one worker, named after the second seed's `*_retries_total`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.retries = Counter(
            "engine_retries_total",
            "Retries by level (1 immediate, 2 delayed, 3 permanent)",
            ["level"],
            registry=r,
        )
        self.resumes = Counter(
            "engine_resume_total", "Evaluations resumed from Redis state", ["reason"], registry=r
        )
        self.reruns = Counter(
            "engine_reruns_total",
            "Rule attempts started again after a crash lost them",
            registry=r,
        )
        self.calls = Counter(
            "engine_agent_calls_total", "Agent calls by outcome", ["outcome"], registry=r
        )
        self.tokens = Counter("engine_tokens_total", "Tokens spent on agent calls", registry=r)
        self.rerun_tokens = Counter(
            "engine_rerun_tokens_total", "Tokens spent on reruns (duplicated cost)", registry=r
        )
        self.loaded = Counter(
            "engine_rules_loaded_total", "Rule results loaded from Redis, not rerun", registry=r
        )
        self.evaluations = Counter(
            "engine_evaluations_total", "Evaluations finished, by status", ["status"], registry=r
        )
        self.running = Gauge("engine_evaluations_running", "Evaluations in memory", registry=r)
        self._counters: dict[tuple[str, tuple[tuple[str, str], ...]], Counter] = {}

    def counter(self, metric: str, labels: tuple[tuple[str, str], ...] = ()) -> Counter:
        """The counter `metric` (its child for `labels`), looked up once: `labels()`
        validates and takes a lock on every call, and a rule moves a few counters."""
        key = (metric, labels)
        found = self._counters.get(key)
        if found is None:
            found = getattr(self, metric)
            if labels:
                found = found.labels(**dict(labels))
            self._counters[key] = found
        return found

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
