"""The history checker: named anomalies, each proved by a short timeline of recorded events.

Theory. A run leaves two records: the *history* (one event per protocol step, appended by
every worker before the step's effect can be observed, plus the runner's submits, kills
and cancels) and the *final state* (what Redis holds at the end: results, statuses,
evaluation states, key TTLs). Each invariant is a property of these two records alone,
checked without trusting the engine's own bookkeeping (its `rerun` flags, its counters).

Each invariant is one module of this package, its docstring the property it proves
(`history_complete`, `no_completed_rerun`, `prune_only_dependents`, `retry_delays_respected`,
`dag_order`, `retry_budget`, ...); `invariants.REGISTRY` lists them in report order. What
the run should have done comes from the scenario and the plan, computed by the checker's
own code (`oracle`: delay tiers, the rules to prune, the retry budget), never by the
engine's policy or plan methods: a bug the engine and its checker shared would be
invisible.

Verdicts follow Jepsen: "pass", "fail" (at least one violation, each with its evidence), or
"unknown" when the check judged no case (each reports how many it judged: `cases`) or when
the history is incomplete and the check reads it. A scenario may require minimum case
counts (`CheckSpec.exercised`): fewer, or "unknown", fails the run like a budget. Safety
checks are judged at every moment of the history; the liveness parts (every independent
rule completed, every evaluation terminal) only on evaluations the final state calls
terminal. The package is pure: plain data in, a `CheckResult` out, no I/O (a long history
is judged on two processes, `shared`, with the same result). The one clock it reads times
each check (`CheckResult.durations_s`, for JUnit); no verdict depends on it.

Layout: `records` (the data in and out), `context` (the history indexed once, fault
windows from the runner's `fault_fired` / `fault_healed`, evidence helpers), `events` (the
history's list, answering by kind), `oracle` (the checker's own expectations), `rounds`
(executions of a rule), one module per invariant, `invariants` (the registry: one line per
invariant) and `shared` (running them, on two processes for a long history). This module
re-exports the public names and runs the checks. Explorations run the package compiled
with mypyc once it is built (`chaos.compiled`): the same source.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from chaos.checker.budgets import LATENCY_STATS, latency_stats, run_figures
from chaos.checker.context import (
    FAULT_EVENTS,
    FINISHED_STATES,
    STATE_KEY_PREFIX,
    TERMINAL_STATES,
    TIMELINE_LIMIT,
    TTL_SLACK_S,
    Context,
    Outcome,
    fault_windows,
    faults_fired,
    num,
    sort_key,
    timeline,
)
from chaos.checker.invariants import CHECKS, INVARIANTS, REGISTRY, Invariant
from chaos.checker.records import (
    BUDGETS,
    COST_BUDGETS,
    CheckResult,
    CheckSpec,
    EvaluationFinal,
    FinalState,
    RetrySettings,
    Verdict,
    Violation,
)
from chaos.checker.shared import merged_stats, run_invariants

__all__ = [
    "BUDGETS",
    "CHECKS",
    "FAULT_EVENTS",
    "FINISHED_STATES",
    "INVARIANTS",
    "REGISTRY",
    "STATE_KEY_PREFIX",
    "TERMINAL_STATES",
    "TIMELINE_LIMIT",
    "TTL_SLACK_S",
    "CheckResult",
    "CheckSpec",
    "Context",
    "EvaluationFinal",
    "FinalState",
    "Invariant",
    "Outcome",
    "RetrySettings",
    "Verdict",
    "Violation",
    "check",
    "collector_paused",
    "fault_windows",
    "faults_fired",
    "sort_key",
    "timeline",
]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for a check (and a simulated run with it), as it
    was after. Both build a graph that lives to their end (the history, its indexes; the
    simulation's generators and events); the collector would traverse it again and again
    as it grows: a quarter of a 4,000-evaluation simulated run, the checker's share
    growing with the history. What dies in a cycle meanwhile (a few per cent of what is
    allocated) waits for the first collection after. No history or verdict depends on
    when the collector runs (the golden histories)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _figures(cx: Context) -> Outcome:
    """The figures of what faults cost, worked out with the invariants (no case, no
    verdict): one definition (reports.cost), read by the summary line, the journal, the
    reports and the budgets alike."""
    spec = cx.spec
    figures = run_figures(cx.events, spec, cx.evaluations)
    cx.stats.update(figures.to_stats(spec.price_per_1k_tokens))
    return 0, []


#: `_figures` as a job of `run_invariants`, first: the longest jobs first share out best.
_FIGURES = Invariant("figures", "what faults cost", _figures)
#: The checks that take longest on a long history (`bench/sim_large.py`'s 615,000 events:
#: 2.5, 2.0 and 1.4 s of about 16), first of `run_invariants`' jobs with `_FIGURES`: two
#: processes sharing them end nearly together (taken last, the longest kept one waiting
#: a second). The order of the jobs changes no verdict, stat or violation.
_LONGEST = ("history_well_formed", "idempotent_results")
_JOBS = (
    _FIGURES,
    *(inv for name in _LONGEST for inv in REGISTRY if inv.name == name),
    *(inv for inv in REGISTRY if inv.name not in _LONGEST),
)


def check(history: list[dict], final: FinalState, spec: CheckSpec) -> CheckResult:
    """`_judged`, the collector paused."""
    with collector_paused():
        return _judged(history, final, spec)


def _judged(history: list[dict], final: FinalState, spec: CheckSpec) -> CheckResult:
    """Judge one run. Every invariant is computed (their stats feed the budgets); only
    those in `spec.invariants` get a verdict and report their violations.

    A verdict is "fail" with a violation, "unknown" when no case was judged, or when the
    history is incomplete (`history_complete` found a gap) and the invariant reads the
    history (a missing event could hide a violation or fake one: what it found is only
    counted, as `violations_unconfirmed`), and "pass" otherwise."""
    cx = Context(history, final, spec)
    ran = run_invariants(cx, _JOBS)
    merged_stats(cx.stats, ran, [inv.name for inv in REGISTRY])
    counts = {inv.name: ran[inv.name].judged for inv in REGISTRY}
    found_by = {inv.name: ran[inv.name].found for inv in REGISTRY}
    durations = {inv.name: ran[inv.name].seconds for inv in REGISTRY}
    incomplete = bool(found_by.get("history_complete"))
    if incomplete:
        cx.stats["history_incomplete"] = True

    def blind(inv: Invariant) -> bool:
        """A gap in the history can hide a violation or fake one (a missing write makes a
        later start look premature): what reads it can be neither passed nor failed."""
        return incomplete and inv.needs_history and inv.name != "history_complete"

    def verdict_of(inv: Invariant) -> Verdict:
        if blind(inv) or (counts[inv.name] <= 0 and not found_by[inv.name]):
            return "unknown"
        return "fail" if found_by[inv.name] else "pass"

    verdicts: dict[str, Verdict] = {}
    violations: list[Violation] = []
    unconfirmed = 0
    not_applicable = {n: why for n, why in spec.not_applicable.items() if n in spec.invariants}
    for inv in REGISTRY:
        if inv.name in not_applicable:  # judged nothing: neither a pass nor a case
            verdicts[inv.name] = "n/a"
        elif inv.name in spec.invariants:
            verdicts[inv.name] = verdict_of(inv)
            if blind(inv):
                unconfirmed += len(found_by[inv.name])
            else:
                violations.extend(found_by[inv.name])
    if unconfirmed:
        cx.stats["violations_unconfirmed"] = unconfirmed
    exercise_failures = []
    for name, least in spec.exercised.items():
        if name in spec.not_applicable:  # the summary line says n/a, and why
            continue
        n = counts[name]
        verdict = verdicts.get(name) or verdict_of(next(i for i in REGISTRY if i.name == name))
        if verdict == "unknown":
            why = "history incomplete" if n > 0 else "no case judged"
            exercise_failures.append(f"{name} unknown ({why}), exercised needs {least}")
        elif n < least:
            exercise_failures.append(f"{name} judged {n} case(s) < exercised {least}")
    budget_failures = []
    limits = {b: limit for b, limit in spec.budgets.items() if limit is not None}
    if limits:
        cx.stats["budgets"] = limits
    cx.stats.update(ran[_FIGURES.name].stats)
    if any(COST_BUDGETS.get(b) in LATENCY_STATS for b in limits):
        cx.stats.update(latency_stats(cx.events, spec))
    for budget, limit in sorted(spec.budgets.items()):
        stat = BUDGETS[budget]
        value = cx.stats.get(stat)
        if limit is not None and value is not None and value > limit:
            budget_failures.append(f"{stat} {num(value)} > {budget} {num(limit)}")
    judged = [name for name, v in verdicts.items() if v != "n/a"]
    timed = {name: durations[name] for name in judged}
    cases = {name: counts[name] for name in judged}
    return CheckResult(
        verdicts,
        violations,
        cx.stats,
        budget_failures,
        timed,
        cases,
        exercise_failures,
        not_applicable,
    )
