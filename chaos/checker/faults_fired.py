"""`faults_fired`: every fault the scenario plans fires, where it was aimed.

A scenario that arms `rule_after_write` for rule `docs_quality` of evaluation 0, or that
kills the broker once the first retry is published, says what it tests. If that fault
never fires, the run proved nothing about it, whatever else passed: the engine may have
stopped reaching the site, or stopped telling the site which rule and evaluation it is at
(a failpoint aimed at a rule then never matches), or the event a fault waits for never
came. Each planned fault is a case: a runner fault with no `fault_fired` of its label, a
failpoint with no `crash` or `failpoint_fired` of its name, its rule (when it names one)
and its evaluation (when it names one), is a violation. And one case more, in every run
where an engine process recorded anything: nothing fired that the scenario did not plan
(a fault of another label, a failpoint it does not arm). An explored variant draws its
hits and times anew, so whether each fires there is chance, not a promise: `chaos sim`
leaves this check out of its variants.
"""

from __future__ import annotations

from chaos.checker.context import Context, Outcome, of
from chaos.checker.records import Violation

NAME = "faults_fired"


def check_faults_fired(cx: Context) -> Outcome:
    """One case per runner fault firing planned and per failpoint armed."""
    out: list[Violation] = []
    labels = {e.get("fault") for e in of(cx.events, "fault_fired")}
    armed = {name for name, _, _ in cx.spec.failpoints}
    unplanned = [
        e
        for e in of(cx.events, "fault_fired", "crash", "failpoint_fired")
        if (
            e.get("fault") not in cx.spec.faults_planned
            if e.get("ev") == "fault_fired"
            else e.get("failpoint") not in armed
        )
    ]
    if unplanned:
        out.append(
            Violation(
                NAME,
                "",
                None,
                f"{len(unplanned)} fault(s) fired that the scenario does not plan",
                unplanned[:6],
            )
        )
    for label in cx.spec.faults_planned:
        if label not in labels:
            out.append(
                Violation(NAME, "", None, f"fault {label} never fired: the run did not exercise it")
            )
    fired = of(cx.events, "crash", "failpoint_fired")
    for name, rule, attempt_id in cx.spec.failpoints:
        if any(
            e.get("failpoint") == name
            and (rule is None or e.get("rule") == rule)
            and (attempt_id is None or e.get("attempt_id") == attempt_id)
            for e in fired
        ):
            continue
        aimed = "".join(
            f", {k} {v}" for k, v in (("rule", rule), ("evaluation", attempt_id)) if v is not None
        )
        near = [e for e in fired if e.get("failpoint") == name][:4]
        out.append(
            Violation(
                NAME,
                attempt_id or "",
                rule,
                f"failpoint {name} armed{aimed} never fired there: the run did not exercise it"
                + (f" ({len(near)} firing(s) elsewhere)" if near else ""),
                near,
            )
        )
    ran = any(e.get("src") != "runner" for e in cx.events)  # an engine process recorded
    return len(cx.spec.faults_planned) + len(cx.spec.failpoints) + int(ran), out
