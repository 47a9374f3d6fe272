"""`idempotent_results`: what the engine keeps and announces of a rule is what its first
durable write said, and without drift every execution says the same, the reference's.

Per (attemptId, ruleId), W = the first durable write (the first `result_persisted` with
`won: true`, recorded once `SET NX` answered). Always: the final Redis result carries W's
(verdict, score), every losing write saw W's verdict (`kept_verdict`), and every
announcement carries W's verdict: the winning `evaluation_terminal` (the verdicts of
`evaluation.completed`) and each `pass_published` (the rules of `evaluation.pass_result`).
An engine whose later write overwrites the first (last-write-wins) breaks this as soon as a
late execution answers otherwise.

Without drift (the agent profile's `drift` is 0, or no profile): every successful call
(`rule_finished`), every write and the final result also carry one (verdict, score), and
with a reference (`CheckSpec.reference`, the same evaluations run without faults) it is
the reference's. With drift a rerun may answer otherwise, as a real LLM does: executions
may disagree and the reference's verdict is not owed, so only W binds.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from chaos.checker.context import (
    Context,
    Outcome,
    of,
    timeline,
)
from chaos.checker.records import Violation
from engine.core.results import RuleResult

#: `int | float` as a tuple: built once, not at every call (the union is an expression)
_NUMBER = (int, float)


def _key(verdict: Any, score: Any) -> tuple[str, float | None]:
    s = round(float(score), 6) if isinstance(score, _NUMBER) else None
    return (str(verdict), s)


def _show(value: tuple[str, float | None]) -> str:
    return value[0] if value[1] is None else f"{value[0]} ({value[1]:g})"


def _announced(cx: Context) -> dict[tuple[str, str], list[tuple[str, dict]]]:
    """(attemptId, ruleId) -> each verdict an announcement gave it, with its event: the
    winning `evaluation_terminal` (what `evaluation.completed` carries) and every
    `pass_published` (what `evaluation.pass_result` carries)."""
    out: dict[tuple[str, str], list[tuple[str, dict]]] = defaultdict(list)
    for a, evs in cx.by_eval.items():
        for e in of(evs, "evaluation_terminal", "pass_published"):
            if e.get("ev") == "evaluation_terminal" and e.get("won") is not True:
                continue
            field = e.get("verdicts") if e.get("ev") == "evaluation_terminal" else e.get("rules")
            if isinstance(field, dict):
                for r, verdict in field.items():
                    out[(a, str(r))].append((str(verdict), e))
    return out


def _first_write_binds(
    a: str,
    r: str,
    first: dict,
    cx: Context,
    announced: list[tuple[str, dict]],
    writes: list[dict],
    final: RuleResult | None,
) -> Violation | None:
    """What Redis keeps (`final`), what losing writes saw (`writes`: the pair's
    `result_persisted`) and what was announced of (a, r) against W = `first`, the first
    durable write."""
    want = _key(first.get("verdict"), first.get("score"))
    wrong: list[str] = []
    key: list[dict] = [first]
    if final is not None and _key(final.verdict, final.score) != want:
        wrong.append(f"Redis keeps {_show(_key(final.verdict, final.score))}")
        key += [e for e in writes if e is not first and e.get("won") is True]
    for e in writes:
        if e.get("kept_verdict") is not None and str(e["kept_verdict"]) != want[0]:
            wrong.append(f"a losing write saw {e['kept_verdict']}")
            key.append(e)
    for verdict, e in announced:
        if verdict != want[0]:
            what = (
                "evaluation.completed"
                if e.get("ev") == "evaluation_terminal"
                else (f"pass {e.get('pass_id')}")
            )
            wrong.append(f"{what} announced {verdict}")
            key.append(e)
    if not wrong:
        return None
    return Violation(
        "idempotent_results",
        a,
        r,
        f"the first durable write of {r} was {_show(want)} (by {first.get('src')}), but "
        + "; ".join(wrong),
        timeline(key, of(cx.by_pair.get((a, r), []), "rule_started", "rule_finished")),
    )


def check_idempotent_results(cx: Context) -> Outcome:
    """Per (attemptId, ruleId) with an execution, a write, a result or an announcement:
    the first durable write binds what is kept and announced; without drift, every
    execution agrees, and with a reference equals it (see the module's docstring)."""
    out: list[Violation] = []
    drift = cx.spec.agent.drift if cx.spec.agent is not None else 0.0
    reference = cx.spec.reference
    announced = _announced(cx)
    pairs = set(cx.by_pair) | set(announced)
    for a, fin in cx.final.evaluations.items():
        pairs |= {(a, r) for r in fin.results}
    judged = 0
    for a, r in sorted(pairs):
        # one pass over the pair's events: its writes, and its executions' and writes'
        # answers in order (every seed asks this of every pair)
        persisted: list[dict] = []
        answers: list[dict] = []
        first = None
        for e in cx.by_pair.get((a, r), ()):
            ev = e.get("ev")
            if ev == "result_persisted":
                persisted.append(e)
                answers.append(e)
                if first is None and e.get("won") is True:
                    first = e
            elif ev == "rule_finished":
                answers.append(e)
        final = None
        if first is not None:
            judged += 1
            final = cx.result_of(a, r)
            announcements = announced.get((a, r), [])
            broken = _first_write_binds(a, r, first, cx, announcements, persisted, final)
            if broken is not None:
                out.append(broken)
                continue
        if drift > 0:
            continue  # a rerun may answer otherwise: only the first durable write binds
        seen: list[tuple[tuple[str, float | None], dict | None]] = [
            (_key(e.get("verdict"), e.get("score")), e) for e in answers
        ]
        if first is None:
            final = cx.result_of(a, r)
        if final is not None:
            seen.append((_key(final.verdict, final.score), None))
        kept = [e for e in persisted if e.get("kept_verdict") is not None]
        if not seen:
            continue
        judged += first is None
        values = {v for v, _ in seen}
        verdicts = {v[0] for v in values} | {str(e["kept_verdict"]) for e in kept}
        if len(values) > 1 or len(verdicts) > 1:
            counts: dict[tuple[str, float | None], int] = defaultdict(int)
            for v, said in seen:
                if said is not None:
                    counts[v] += 1
            # a missing score (None) sorts before any number
            order = sorted(
                counts.items(), key=lambda vn: (vn[0][0], vn[0][1] is not None, vn[0][1] or 0)
            )
            shown = ", ".join(f"{_show(v)} x{n}" for v, n in order)
            if final is not None:
                shown += f"; final result {_show(_key(final.verdict, final.score))}"
            out.append(
                Violation(
                    "idempotent_results",
                    a,
                    r,
                    f"executions of {r} disagree: {shown}",
                    timeline([e for _, e in seen if e is not None] + kept),
                )
            )
            continue
        expected = reference.of(a) if reference is not None else None
        if expected is not None and r in expected.verdicts:
            want = (expected.verdicts[r], expected.scores.get(r))
            (got,) = values
            if got != want:
                where = "final result" if final is not None else "every execution"
                out.append(
                    Violation(
                        "idempotent_results",
                        a,
                        r,
                        f"{where} of {r} is {_show(got)}; the fault-free reference is "
                        f"{_show(want)}",
                        timeline([e for _, e in seen if e is not None]),
                    )
                )
    return judged, out
