"""`matches_reference`: faults cost time and tokens, never another outcome.

`CheckSpec.reference` (`chaos.reference`) holds, per evaluation, what the same
evaluation gives run without faults: the engine's core fed the fake agent's answers at
once, on the same seed, plans, agent profile and retry policy, with no shell in between.
For every evaluation not cancelled on purpose whose final state is terminal (one that is
not is `all_terminal`'s), the run must end like it: the same final status, the same sets
of completed (a result in Redis), permanently failed (that status, no result) and
skipped (neither) rules, and, when the agent does not drift, each completed rule's
verdict. With `drift` > 0 a rerun may legitimately answer another verdict, so verdicts
are left to `idempotent_results`, which holds them to the first durable write instead.
And each call the run made that the reference makes too costs the tokens the fake agent
drew for it (the draw is the call's alone, whoever makes it, however often).

No reference (a hand-built `CheckSpec`): nothing is judged, the verdict is "unknown".
"""

from __future__ import annotations

from chaos.checker.budgets import reference_calls
from chaos.checker.context import TERMINAL_STATES, Context, Outcome, listed, of, timeline
from chaos.checker.records import Violation
from chaos.reference import outcome_of

#: Differences named in one violation's message before "and N more".
_SHOWN = 6


def check_matches_reference(cx: Context) -> Outcome:
    """One case per evaluation compared with its reference; one violation per evaluation
    that differs, naming every differing field and its rules, with their events."""
    reference = cx.spec.reference
    if reference is None:
        return 0, []
    out: list[Violation] = []
    cases = 0
    for a, want in sorted(reference.evaluations.items()):
        plan, fin = cx.plans.get(a), cx.final_of(a)
        if a in cx.cancelled or plan is None or fin is None or fin.state not in TERMINAL_STATES:
            continue
        cases += 1
        got = outcome_of(plan, fin)
        diffs: list[str] = []
        rules: set[str] = set()
        if got.status != want.status:
            diffs.append(f"status {got.status}, reference {want.status}")
        for name in ("completed", "permanently_failed", "skipped"):
            have, owed = getattr(got, name), getattr(want, name)
            if have == owed:
                continue
            missing, extra = sorted(owed - have), sorted(have - owed)
            parts = [f"lacks {listed(missing)}"] if missing else []
            parts += [f"also has {listed(extra)}"] if extra else []
            diffs.append(f"{name} {' and '.join(parts)}")
            rules |= have ^ owed
        if reference.drift == 0:
            for r in sorted(got.completed & want.completed):
                if got.verdicts[r] != want.verdicts[r]:
                    diffs.append(f"verdict of {r} {got.verdicts[r]}, reference {want.verdicts[r]}")
                    rules.add(r)
        if not diffs:
            continue
        shown = "; ".join(diffs[:_SHOWN])
        if len(diffs) > _SHOWN:
            shown += f"; and {len(diffs) - _SHOWN} more"
        evs = cx.by_eval[a]
        mine = [e for e in evs if e.get("rule_id") in rules]
        out.append(
            Violation(
                "matches_reference",
                a,
                next(iter(rules)) if len(rules) == 1 else None,
                f"evaluation differs from its fault-free run: {shown}",
                timeline(
                    of(evs, "evaluation_terminal", "rules_skipped")
                    + of(mine, "result_persisted", "status_written"),
                    of(mine, "rule_started", "rule_failed") + cx.faults,
                ),
            )
        )
    calls, wrong = _calls_as_drawn(cx)
    out.extend(wrong)
    cx.stats["reference_compared"] = cases  # its bill: chaos.checker.budgets.run_figures
    cx.stats["reference_calls_compared"] = calls
    return cases + calls, out


def _calls_as_drawn(cx: Context) -> tuple[int, list[Violation]]:
    """Each call the history records (`rule_finished`, `rule_failed`) that the reference
    makes too costs the tokens the fake agent drew for it: the draw depends on the call
    alone (evaluation, rule, attempt, try), whoever makes it and however often. One
    violation per evaluation, its first calls named."""
    paid = reference_calls(cx.spec, cx.evaluations)
    if not paid:
        return 0, []
    cases = 0
    out: list[Violation] = []
    for a in sorted(cx.evaluations):
        wrong: list[tuple[dict, int]] = []
        for e in of(cx.by_eval.get(a, []), "rule_finished", "rule_failed"):
            drawn = paid.get((a, e.get("rule_id"), e.get("attempt"), e.get("try_no")))  # type: ignore[arg-type]
            if drawn is None:
                continue
            cases += 1
            if e.get("tokens") != drawn:
                wrong.append((e, drawn))
        if wrong:
            shown = [
                f"{e.get('rule_id')} attempt {e.get('attempt')} try {e.get('try_no')} "
                f"recorded {e.get('tokens')!r} token(s), drawn {drawn}"
                for e, drawn in wrong[:3]
            ]
            more = f"; and {len(wrong) - 3} more" if len(wrong) > 3 else ""
            named = {e.get("rule_id") for e, _ in wrong}
            out.append(
                Violation(
                    "matches_reference",
                    a,
                    str(wrong[0][0].get("rule_id")) if len(named) == 1 else None,
                    "a call costs what the fake agent drew for it: " + "; ".join(shown) + more,
                    timeline([e for e, _ in wrong[:6]], []),
                )
            )
    return cases, out
