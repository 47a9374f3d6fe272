"""`completed_delivered`: a consumer of the harness, bound to the events exchange before the
first submit (the runner's `events_consumer_bound`), receives at least one
`evaluation.completed` (`completed_received`) per terminal evaluation, and every copy
carries the same body: the final state's status and verdicts (and, when the fault-free
reference finished the evaluation and the agent does not drift, the reference's status and
verdicts), under the stable message id `{attemptId}:completed`.

The expected verdicts are the core's: every rule of the plan, with its result's verdict,
else `permanently_failed`, else `skipped`. A cancelled evaluation is announced by the
canceller with whatever verdicts it had: those must agree with the final results.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chaos.checker.context import (
    FINISHED_STATES,
    TERMINAL_STATES,
    Context,
    Outcome,
    event_time,
    listed,
    of,
    timeline,
)
from chaos.checker.expect import final_verdicts, reference_of
from chaos.checker.records import Violation

BOUND = "events_consumer_bound"
RECEIVED = "completed_received"


def check_completed_delivered(cx: Context) -> Outcome:
    """One case per terminal evaluation, judged only when the consumer was bound before the
    first `submitted`; a violation per evaluation with no copy, with copies that differ,
    or whose body is not the final state (or the reference)."""
    out: list[Violation] = []
    bound = of(cx.events, BOUND)
    submits = of(cx.events, "submitted")
    if not bound or (submits and event_time(bound[0]) > event_time(submits[0])):
        cx.stats["completed_received"] = len(of(cx.events, RECEIVED))
        return 0, out
    cases = copies_total = 0
    for a in cx.evaluations:
        fin = cx.final_of(a)
        evs = cx.by_eval[a]
        got = of(evs, RECEIVED)
        copies_total += len(got)
        state = fin.state if fin else None
        if state not in TERMINAL_STATES:
            if got:
                cases += 1
                out.append(
                    Violation(
                        "completed_delivered",
                        a,
                        None,
                        f"evaluation.completed received {len(got)} time(s), but Redis ends "
                        f"with {state or 'no state'}",
                        timeline(got[:3], of(evs, "evaluation_terminal", "final_published")),
                    )
                )
            continue
        cases += 1

        def flag(message: str, key: list[dict], a: str = a) -> None:
            context = of(cx.by_eval[a], "evaluation_terminal", "final_published", "cancel_written")
            out.append(Violation("completed_delivered", a, None, message, timeline(key, context)))

        if not got:
            announced = of(evs, "final_published", "cancel_written")
            flag(
                f"evaluation {state}, but evaluation.completed never reached the consumer "
                + ("(it was published)" if announced else "(it was never published)"),
                announced or of(evs, "evaluation_terminal"),
            )
            continue
        by_body: dict[Any, dict] = {}  # each body once (frozen), with its last copy
        for e in got:
            by_body[_frozen(e.get("body"))] = e
        bodies = by_body.keys()
        if len(bodies) > 1:
            flag(f"{len(got)} copies of evaluation.completed carry {len(bodies)} bodies", got)
        ids = sorted({str(e.get("message_id")) for e in got})
        if ids != [f"{a}:completed"]:
            flag(f"evaluation.completed arrived with message id(s) {listed(ids)}", got[:3])
        for e in by_body.values():
            problem = _judge(cx, a, state, e.get("body"), fin)
            if problem:
                flag(problem, [e])
    cx.stats["completed_received"] = copies_total
    return cases, out


def _judge(cx: Context, a: str, state: str, body: Any, fin: Any) -> str | None:
    """What is wrong with one body, or None."""
    if not isinstance(body, Mapping):
        return f"evaluation.completed body is not an object: {body!r}"
    if body.get("attempt_id") != a:
        return f"evaluation.completed of {a} names attempt {body.get('attempt_id')!r}"
    if body.get("status") != state:
        return f"evaluation.completed says {body.get('status')}, Redis ends with {state}"
    verdicts = body.get("verdicts")
    if not isinstance(verdicts, Mapping):
        return "evaluation.completed carries no verdicts"
    verdicts = {str(r): str(v) for r, v in verdicts.items()}
    plan = cx.plans.get(a)
    if plan is None:
        return None
    want = final_verdicts(plan, fin)
    if state in FINISHED_STATES:
        if verdicts != want:
            wrong = sorted(set(want) | set(verdicts), key=str)
            wrong = [r for r in wrong if verdicts.get(r) != want.get(r)]
            return (
                f"evaluation.completed verdicts {_shown(verdicts, wrong)} differ from the "
                f"final state's {_shown(want, wrong)}"
            )
        ref = reference_of(cx.spec, a)
        if ref is not None:
            if ref.status != state:
                return f"evaluation ends {state}; the fault-free reference ends {ref.status}"
            drift = getattr(getattr(cx.spec, "reference", None), "drift", 0.0) or 0.0
            ref_verdicts = dict(ref.verdicts)
            mine = {r: v for r, v in verdicts.items() if r in ref_verdicts}
            if not drift and (mine != ref_verdicts or set(ref.completed) - set(mine)):
                wrong = sorted(r for r in ref_verdicts if verdicts.get(r) != ref_verdicts[r])
                return (
                    f"evaluation.completed verdicts {_shown(verdicts, wrong)} differ from the "
                    f"fault-free reference's {_shown(ref_verdicts, wrong)}"
                )
        return None
    results = fin.results if fin is not None else {}
    wrong = [r for r, v in verdicts.items() if r in results and want.get(r) != v]
    if wrong:
        return (
            f"evaluation.completed of the cancelled evaluation says {_shown(verdicts, wrong)}; "
            f"Redis holds {_shown(want, wrong)}"
        )
    return None


def _frozen(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


def _shown(values: Mapping[str, str], keys: list[str]) -> str:
    return listed([f"{k}={values.get(k, '-')}" for k in keys], 4)
