"""`pass_results_correct`: every pass is announced (`evaluation.pass_result`, recorded as
`pass_published` with its outcome and rules) once all its rules are terminal, with the
outcome and the rules the final state says, and the fault-free reference's when present.

A rule is known terminal to the announcing process when, before the announcement, a write
of its result was recorded (`result_persisted`, won or lost: either way Redis holds one),
`permanently_failed` was written for it or for a rule it depends on, or the process loaded
it from Redis (its `recovered` event). Copies of one announcement (a crash between the
publish and the mark in Redis) must agree, and one process never announces a pass twice
(unless a resume from a checkpoint deleted results in between: the passes are announced
again, the runner's `resume_written` with rules `discarded`; or unless the process began the
evaluation again in between, its `evaluation_started`: a new owner that knows only what the
store holds, as another process would be, such as a Temporal worker whose workflow task the
server refused after it ran, and which then ran the workflow again from its history).
An evaluation that finished (not cancelled) must have announced every pass, in the history
or, when its announcer died before recording it, in its `passes` hash in Redis (judged only
where the final state holds that hash: without it a missing record proves nothing). When the
harness's consumer was bound to `evaluation.pass_result` before the first submit, every
announcement recorded reached it (`pass_received`) with the same outcome and rules.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from chaos.checker.context import (
    FINISHED_STATES,
    Context,
    Outcome,
    event_time,
    listed,
    of,
    proc_of,
    timeline,
)
from chaos.checker.expect import (
    PERMANENTLY_FAILED,
    expected_passes,
    kinds,
    pass_outcome,
    reference_of,
)
from chaos.checker.oracle import dependents_of
from chaos.checker.records import Violation

#: The events `_known_terminal` reads.
_KNOWN_KINDS = ("result_persisted", "status_written", "recovered")
PASS_KEY = "evaluation.pass_result"


def _received(cx: Context) -> dict[tuple[str, str], set[Any]] | None:
    """What the harness's consumer received of each (evaluation, pass): the (outcome,
    rules) of every copy; None when it was not bound before the first submit."""
    bound = [e for e in of(cx.events, "events_consumer_bound") if e.get("routing_key") == PASS_KEY]
    submits = of(cx.events, "submitted")
    if not bound or (submits and event_time(bound[0]) > event_time(submits[0])):
        return None
    got: dict[tuple[str, str], set[Any]] = defaultdict(set)
    for e in of(cx.events, "pass_received"):
        body = e.get("body")
        if isinstance(body, Mapping):
            key = (str(body.get("attempt_id")), str(body.get("pass_id")))
            got[key].add((str(body.get("outcome")), _frozen(body.get("rules"))))
    return got


def _known_terminal(evs: list[dict], pub: dict, plan: Any) -> set[str]:
    """The rules the announcing process could know terminal when it announced."""
    t, proc = event_time(pub), proc_of(pub)
    done: set[str] = set()
    failed: set[str] = set()
    loaded = None  # the announcing process's last `recovered` up to then
    # only the kinds read, in history order (the index's list, built once a run for every
    # announcement, not the evaluation's whole history each time)
    for e in of(evs, *_KNOWN_KINDS):
        if event_time(e) > t:
            continue
        ev = e.get("ev")
        if ev == "result_persisted":
            done.add(str(e.get("rule_id")))
        elif ev == "status_written":
            if (e.get("kept") or e.get("status")) == PERMANENTLY_FAILED:
                failed.add(str(e.get("rule_id")))
        elif ev == "recovered" and proc_of(e) == proc:
            loaded = e
    if loaded is not None:
        done |= {str(r) for r in loaded.get("loaded") or []}
        failed |= {str(r) for r in loaded.get("failed") or []}
    failed -= done
    return done | failed | set(dependents_of(plan, failed))


def check_pass_results_correct(cx: Context) -> Outcome:
    """Per evaluation and pass: announced only once its rules are known terminal; every
    copy agrees, with the plan's rules and the final state's verdicts; a finished
    evaluation announced every pass; with a reference, outcome and rules equal its own."""
    out: list[Violation] = []
    cases = duplicates = 0
    compared = 0
    unknown: list[str] = []
    received = _received(cx)
    for a in cx.evaluations:
        plan, fin = cx.plans.get(a), cx.final_of(a)
        if plan is None:
            continue
        evs = cx.by_eval[a]
        pubs = of(evs, "pass_published")
        read = getattr(fin, "passes", None)
        marked: Mapping[str, str] = read or {}
        # Every pass of a finished evaluation is owed, but a missing record proves nothing
        # unless Redis' `passes` hash was read: the announcer may have died before recording.
        finished = (
            fin is not None
            and fin.state in FINISHED_STATES
            and a not in cx.cancelled
            and read is not None
        )
        if not pubs and not marked and not finished:
            continue
        want = expected_passes(plan, fin) if fin is not None else {}
        ref_outcome = None if a in cx.cancelled else reference_of(cx.spec, a)
        ref = None if ref_outcome is None else ref_outcome.passes
        if ref is None and a not in cx.cancelled:
            unknown.append(a)
        by_pass: dict[str, list[dict]] = defaultdict(list)
        for e in pubs:
            by_pass[str(e.get("pass_id"))].append(e)
        rules_of = {p.id: list(p.rule_ids) for p in plan.passes}
        resets = [event_time(e) for e in of(evs, "resume_written") if e.get("discarded")]
        begun = [(event_time(e), proc_of(e)) for e in of(evs, "evaluation_started")]

        def flag(
            message: str,
            key: list[dict],
            pid: str | None = None,
            a: str = a,
            evs: list[dict] = evs,
            rules_of: dict[str, list[str]] = rules_of,
        ) -> None:
            context = [e for e in evs if e.get("rule_id") in rules_of.get(pid or "", ())]
            out.append(Violation("pass_results_correct", a, None, message, timeline(key, context)))

        for pid in [p.id for p in plan.passes] + sorted(set(by_pass) - set(rules_of)):
            copies = by_pass.get(pid, [])
            if pid not in rules_of:
                flag(f"announced pass {pid}, which the plan does not have", copies, pid)
                continue
            announced = bool(copies) or pid in marked
            if not announced and not finished:
                continue
            cases += 1
            outcome, rules = want.get(pid, (None, {}))
            if not announced:
                flag(
                    f"evaluation {fin.state if fin else '?'} but pass {pid} was never announced",
                    of(evs, "evaluation_terminal", "final_published", "recovered"),
                    pid,
                )
                continue
            for e in copies:
                known = _known_terminal(evs, e, plan)
                early = [r for r in rules_of[pid] if r not in known]
                if early:
                    flag(
                        f"pass {pid} announced by {e.get('src')} while {listed(early)} "
                        "had no terminal outcome it could know of",
                        [e, *[x for x in evs if x.get("rule_id") in early][-4:]],
                        pid,
                    )
            seen: dict[tuple[str, Any], dict] = {}
            for e in copies:
                key = proc_of(e)
                if key in seen:
                    first, then = event_time(seen[key]), event_time(e)
                    anew = [t for t, p in begun if p == key] + resets
                    if not any(first <= t <= then for t in anew):
                        flag(f"{e.get('src')} announced pass {pid} twice", [seen[key], e], pid)
                seen[key] = e
            duplicates += max(0, len(copies) - 1)
            shapes = {(str(e.get("outcome")), _frozen(e.get("rules"))) for e in copies}
            if received is not None and copies and not shapes <= received[(a, pid)]:
                flag(
                    f"pass {pid} announced {copies[0].get('outcome')} by "
                    f"{copies[0].get('src')}, but the consumer received "
                    + (
                        "no evaluation.pass_result of it"
                        if not received[(a, pid)]
                        else "it with other outcomes or rules"
                    ),
                    copies,
                    pid,
                )
            if len(shapes) > 1:
                flag(
                    f"copies of pass {pid} disagree: outcomes "
                    f"{listed(sorted({s[0] for s in shapes}))}",
                    copies,
                    pid,
                )
            if pid in marked and copies and marked[pid] not in {s[0] for s in shapes}:
                flag(
                    f"Redis marks pass {pid} {marked[pid]} but it was announced "
                    f"{copies[0].get('outcome')}",
                    copies,
                    pid,
                )
            got_outcome = str(copies[0].get("outcome")) if copies else str(marked[pid])
            got_rules = copies[0].get("rules") if copies else None
            if isinstance(got_rules, Mapping):
                got_rules = {str(k): str(v) for k, v in got_rules.items()}
                if set(got_rules) != set(rules_of[pid]):
                    flag(
                        f"pass {pid} announced with rules {listed(sorted(got_rules))}; the "
                        f"plan's are {listed(rules_of[pid])}",
                        copies[:2],
                        pid,
                    )
                    continue
                if got_outcome != pass_outcome(got_rules):
                    flag(
                        f"pass {pid} announced {got_outcome} with rules {_shown(got_rules)}",
                        copies[:2],
                        pid,
                    )
            if fin is not None and outcome is not None:
                if got_outcome != outcome:
                    flag(
                        f"pass {pid} announced {got_outcome}; the final state makes it "
                        f"{outcome} ({_shown(rules)})",
                        copies[:2],
                        pid,
                    )
                elif isinstance(got_rules, Mapping) and got_rules != rules:
                    wrong = sorted(r for r in rules if got_rules.get(r) != rules[r])
                    flag(
                        f"pass {pid} announced {_shown({r: got_rules[r] for r in wrong})}; "
                        f"the final state holds {_shown({r: rules[r] for r in wrong})}",
                        copies[:2],
                        pid,
                    )
            if ref is not None and pid in ref:
                compared += 1
                ref_pass = ref[pid]
                sets = kinds(got_rules) if isinstance(got_rules, Mapping) else None
                if got_outcome != ref_pass.outcome or (
                    sets is not None and sets != kinds(ref_pass.rules)
                ):
                    flag(
                        f"pass {pid} announced {got_outcome}"
                        + (f" ({_shown(got_rules)})" if isinstance(got_rules, Mapping) else "")
                        + f"; the fault-free reference announces {ref_pass.outcome} "
                        f"({_shown(ref_pass.rules)})",
                        copies[:2],
                        pid,
                    )
    cx.stats.update(
        pass_announcements=sum(len(of(cx.by_eval[a], "pass_published")) for a in cx.evaluations),
        pass_duplicates=duplicates,
        passes_compared_to_reference=compared,
    )
    if unknown:
        cx.stats.setdefault("unknown_parts", {})["pass_results_correct"] = (
            f"no reference: outcomes and rule sets of {len(unknown)} evaluation(s) not compared"
        )
    return cases, out


def _frozen(rules: Any) -> tuple[tuple[str, str], ...] | None:
    if not isinstance(rules, Mapping):
        return None
    return tuple(sorted((str(k), str(v)) for k, v in rules.items()))


def _shown(rules: Mapping[str, str]) -> str:
    return listed([f"{r}={v}" for r, v in sorted(rules.items())], 4)
