"""`dag_order`: no rule starts before every one of its dependencies has a durable result.

For each rule with dependencies (the plan's `depends_on`, read as data), each of its
`rule_started` must follow, for every dependency d, a proof that d's result was durable:
d's first `result_persisted` (recorded once `SET NX` answered: with `won: true` the write
landed, with `won: false` a result was already there), or a
`recovered` of the evaluation listing d among the results it loaded from Redis (a worker
that resumed the evaluation read it there; the process that wrote it may have died before
recording its write). A start without that proof ran on an answer that could still vanish,
or on none at all.
"""

from __future__ import annotations

from chaos.checker.context import Context, Outcome, listed, of, sort_key, timeline
from chaos.checker.records import Violation

NAME = "dag_order"


def _durable_at(cx: Context, a: str, dep: str) -> dict | None:
    """The earliest proof that `dep`'s result was durable in evaluation `a` (in history
    order: time, then source and sequence, so a process's own steps keep their order even
    at one simulated instant)."""
    # won or not: a losing write found a result already there (a retried SET NX whose first
    # try landed before the connection dropped finds its own)
    proofs = of(cx.by_pair.get((a, dep), []), "result_persisted")
    proofs += [e for e in of(cx.by_eval.get(a, []), "recovered") if dep in (e.get("loaded") or ())]
    if not proofs:
        return None
    return min(proofs, key=sort_key)


def check_dag_order(cx: Context) -> Outcome:
    """One case per (evaluation, rule) that started and has dependencies in the plan; a
    violation per such rule whose first start precedes a dependency's durable result (the
    timeline: the start, the dependency's events, the proof if it came later)."""
    out: list[Violation] = []
    cases = 0
    proofs: dict[tuple[str, str], dict | None] = {}  # (a, dep): `_durable_at`, asked once

    def durable_at(a: str, dep: str) -> dict | None:
        key = (a, dep)
        if key not in proofs:
            proofs[key] = _durable_at(cx, a, dep)
        return proofs[key]

    for (a, r), evs in sorted(cx.by_pair.items()):
        plan = cx.plans.get(a)
        rule = plan.rules.get(r) if plan is not None else None
        deps = tuple(rule.depends_on) if rule is not None else ()
        starts = of(evs, "rule_started")
        if not deps or not starts:
            continue
        cases += 1
        first = starts[0]
        early: list[str] = []
        key: list[dict] = [first]
        for dep in deps:
            proof = durable_at(a, dep)
            if proof is not None and sort_key(proof) < sort_key(first):
                continue
            early.append(dep)
            dep_evs = cx.by_pair.get((a, dep), [])
            key += of(dep_evs, "rule_started", "rule_finished", "rule_failed")[-3:]
            if proof is not None:
                key.append(proof)
        if early:
            when = "before" if all(durable_at(a, d) for d in early) else "without"
            out.append(
                Violation(
                    NAME,
                    a,
                    r,
                    f"{r} started {when} a durable result of its dependenc"
                    f"{'y' if len(early) == 1 else 'ies'} {listed(early)}",
                    timeline(key, of(cx.by_eval.get(a, []), "recovered", "delivered")),
                )
            )
    return cases, out
