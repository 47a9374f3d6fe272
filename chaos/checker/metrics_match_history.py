"""`metrics_match_history`: a worker's Prometheus counters say what its history says.

A worker that stops leaves its counters in its `worker_stopped` (`Metrics.totals`, the
names a scrape shows). Each is held to the events that process recorded: a dashboard
built on the counters must tell the story the checker proves. A killed worker's counters
die with it and are not judged. The engine moves each counter with its event, with no
wait between the two, so a graceful stop cannot come between them.

    engine_agent_calls_total{outcome}   rule_finished ("ok"), rule_failed (its kind)
    engine_tokens_total                 the tokens of both
    engine_rerun_tokens_total           ... of the calls of executions started as reruns
    engine_reruns_total                 rule_started with rerun
    engine_retries_total{level}         1: rule_started with try_no > 1; 2: status_written
                                        failed_attempt_N; 3: status_written permanently_failed
    engine_resume_total{reason}         evaluation_started resumed (its reason, else kind)
    engine_rules_loaded_total           the rules of every `recovered`'s loaded
    engine_evaluations_total{status}    evaluation_terminal that won, by status
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from chaos.checker.context import Context, Outcome, as_int, proc_of, timeline
from chaos.checker.records import Violation

NAME = "metrics_match_history"


def _label(name: str, key: str, value: Any) -> str:
    return f'{name}{{{key}="{value}"}}'


def expected_totals(events: list[dict]) -> Counter[str]:
    """The counters one process's events call for, as `Metrics.totals` names them."""
    out: Counter[str] = Counter()
    rerun: dict[tuple[Any, Any, Any], bool] = {}  # (attempt_id, rule, attempt): started as one
    for e in events:
        ev = e.get("ev")
        if ev == "rule_started":
            if as_int(e.get("try_no"), 1) > 1:
                out[_label("engine_retries_total", "level", 1)] += 1
            else:
                rerun[e.get("attempt_id"), e.get("rule_id"), e.get("attempt")] = (
                    e.get("rerun") is True
                )
            if e.get("rerun") is True:
                out["engine_reruns_total"] += 1
        elif ev in ("rule_finished", "rule_failed"):
            tokens = as_int(e.get("tokens"))
            outcome = "ok" if ev == "rule_finished" else e.get("kind")
            out[_label("engine_agent_calls_total", "outcome", outcome)] += 1
            out["engine_tokens_total"] += tokens
            first_try = as_int(e.get("try_no"), 1) == 1
            if first_try and rerun.get((e.get("attempt_id"), e.get("rule_id"), e.get("attempt"))):
                out["engine_rerun_tokens_total"] += tokens
        elif ev == "status_written":
            level = 3 if e.get("status") == "permanently_failed" else 2
            out[_label("engine_retries_total", "level", level)] += 1
        elif ev == "evaluation_started" and e.get("resumed") is True:
            out[_label("engine_resume_total", "reason", e.get("reason") or e.get("kind"))] += 1
        elif ev == "recovered":
            loaded = e.get("loaded")
            out["engine_rules_loaded_total"] += len(loaded) if isinstance(loaded, list) else 0
        elif ev == "evaluation_terminal" and e.get("won") is True:
            out[_label("engine_evaluations_total", "status", e.get("status"))] += 1
    return +out  # the zero counts dropped, as `totals` drops them


def check_metrics_match_history(cx: Context) -> Outcome:
    """One case per counter of each worker that stopped (those it moved and those its
    history calls for); a violation per counter that disagrees."""
    by_proc: dict[Any, list[dict]] = defaultdict(list)
    for e in cx.events:
        by_proc[proc_of(e)].append(e)
    cases = 0
    out: list[Violation] = []
    for proc, evs in by_proc.items():
        stops = [e for e in evs if e.get("ev") == "worker_stopped"]
        if not stops or not isinstance(stops[-1].get("metrics"), dict):
            continue
        stopped = stops[-1]
        said = {k: v for k, v in stopped["metrics"].items() if v}
        want = expected_totals(evs)
        for name in sorted(set(said) | set(want)):
            cases += 1
            if said.get(name, 0) == want.get(name, 0):
                continue
            out.append(
                Violation(
                    NAME,
                    "",
                    None,
                    f"{proc[0]} stopped with {name} {said.get(name, 0):g}, but its history "
                    f"calls for {want.get(name, 0):g}",
                    timeline([stopped], []),
                )
            )
    return cases, out
