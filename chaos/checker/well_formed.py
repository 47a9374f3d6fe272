"""`history_well_formed`: every event an engine process recorded speaks the vocabulary of
`chaos.checker.vocabulary`: a known kind, each of its fields present (unless optional),
none unknown, each of the type and, where the protocol fixes them, the values it must have;
each start's `execution` is the count its start marker keeps (`_executions_counted`), a
delayed retry's first start follows the write of its start marker (`_markers_accounted`;
where the design writes one: a workflow engine's server counts the executions itself), a
write is sent within its session (`_sent_in_session`) and each restore is recorded on its
side of the final write (`_restores_in_order`).

The other invariants read the history by these names: an event recorded under another
name, or a field under another key, would leave them judging nothing where they should
judge something. The runner's own events are the harness's, not the engine's, and are
not judged here, except the bodies and message ids of the `evaluation.*` events the
engine published, as the runner's consumer received them.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from chaos.checker.context import Context, Outcome, as_int, event_time, num, timeline
from chaos.checker.history_complete import UNREADABLE
from chaos.checker.records import Violation
from chaos.checker.touching import STORE, role
from chaos.checker.vocabulary import (
    AGREES,
    COMMON,
    EVENTS,
    MESSAGES,
    WELL_FORMED,
    describe,
    fits,
)

NAME = "history_well_formed"
#: The events shown one by one for each kind of problem; the rest are counted in one.
MAX_SHOWN = 3
RUNNER = "runner"


def problems(e: dict) -> list[tuple[str, str]]:
    """What is wrong with one event: (a short key to group by, the sentence)."""
    ev = e.get("ev")
    if type(ev) is str and (ok := WELL_FORMED.get(ev)) is not None and ok(e):
        return []
    return each_problem(e)


def each_problem(e: dict) -> list[tuple[str, str]]:
    """`problems`, field by field, with no quick answer first."""
    ev = e.get("ev")
    spec = EVENTS.get(ev) if isinstance(ev, str) else None
    if spec is None:
        return [(f"unknown {ev!r}", f"an event of unknown kind {ev!r}")]
    out: list[tuple[str, str]] = []
    for name, field in spec.items():
        key, optional = name.rstrip("?"), name.endswith("?")
        if key not in e:
            if not optional:
                out.append((f"{ev}.{key} missing", f"`{ev}` without its field `{key}`"))
        elif not fits(e[key], field):
            out.append(
                (
                    f"{ev}.{key} wrong",
                    f"`{ev}`'s `{key}` is {e[key]!r}, expected {describe(field)}",
                )
            )
    agrees = AGREES.get(ev)  # type: ignore[arg-type]
    wrong = agrees(e) if agrees is not None and not out else None
    if wrong is not None:
        out.append((f"{ev} disagrees", f"`{ev}` with {wrong}"))
    known = {n.rstrip("?") for n in spec}
    for key in e:
        if key not in known and key not in COMMON:
            out.append((f"{ev}.{key} unknown", f"`{ev}` with a field `{key}` it does not have"))
    return out


def message_problems(e: dict) -> list[tuple[str, str]]:
    """What is wrong with the body or the message id of an event the engine published, as
    the runner received it."""
    ev = str(e.get("ev"))
    suffix, spec = MESSAGES[ev]
    body = e.get("body")
    if not isinstance(body, dict):
        return [(f"{ev} body", f"`{ev}` whose body is {body!r}, not an object")]
    out: list[tuple[str, str]] = []
    for key, field in spec.items():
        if key not in body:
            out.append((f"{ev}.body.{key} missing", f"`{ev}` whose body has no `{key}`"))
        elif not fits(body[key], field):
            out.append(
                (
                    f"{ev}.body.{key} wrong",
                    f"`{ev}` whose body's `{key}` is {body[key]!r}, expected {describe(field)}",
                )
            )
    for key in body:
        if key not in spec:
            out.append((f"{ev}.body.{key} unknown", f"`{ev}` whose body has a field `{key}`"))
    want = f"{body.get('attempt_id')}:{suffix.format_map(defaultdict(str, body))}"
    if e.get("message_id") != want:
        out.append(
            (
                f"{ev}.message_id",
                f"`{ev}` with message id {e.get('message_id')!r}, expected {want!r}",
            )
        )
    return out


#: Runner events after which Redis may have forgotten acknowledged writes (a restart that
#: lost some, a failover to a replica that had not got them all).
_FORGETTING = ("service_restarted", "redis_failover")


def _executions_counted(events: list[dict]) -> list[tuple[dict, str, str]]:
    """Each start's `execution` is the start marker's count: the first tries of an attempt,
    in any process, are told executions no two alike (each marker counted one more; in
    whatever order the processes record them), since Redis last may have lost writes; a
    level-1 retry carries the execution of the first try it retries, in its process.
    (event, key, sentence) for each that does not."""
    out: list[tuple[dict, str, str]] = []
    told: dict[tuple, set[int]] = defaultdict(set)  # (attempt_id, rule_id, attempt) -> executions
    current: dict[tuple, int] = {}  # (process, attempt_id, rule_id, attempt) -> execution
    for e in events:
        ev = e.get("ev")
        if ev in _FORGETTING and (ev == "redis_failover" or role(str(e.get("service"))) == STORE):
            told.clear()
            continue
        if ev != "rule_started":
            continue
        execution, try_no = e.get("execution"), e.get("try_no")
        if not isinstance(execution, int) or not isinstance(try_no, int):
            continue  # the fields' own types are judged apart
        key = (e.get("attempt_id"), e.get("rule_id"), e.get("attempt"))
        mine = (e.get("src"), e.get("pid"), *key)
        if try_no == 1:
            if execution in told[key]:
                out.append(
                    (
                        e,
                        "rule_started uncounted",
                        f"`rule_started` of execution {execution}, told to an earlier start of "
                        f"its attempt too ({len(told[key])} before it; each start marker "
                        "counts one more)",
                    )
                )
            told[key].add(execution)
            current[mine] = execution
        elif mine in current and execution != current[mine]:
            out.append(
                (
                    e,
                    "rule_started execution",
                    f"`rule_started` try {try_no} of execution {execution}, but its first try "
                    f"in that process was execution {current[mine]}",
                )
            )
    return out


#: How fast the history's wall clock (`t`, `time.time`) may run apart from the monotonic
#: clock a `write_ms` is measured by: the most adjtime(3) slews it, 0.5 ms a second.
CLOCK_SLEW = 500e-6
#: What rounding may add: a `write_ms` is rounded to the microsecond, and each `t` is a
#: double of Unix seconds, 2**-22 s apart today (two of them in a difference).
ROUNDING_MS = 0.0005 + 2 * 2**-22 * 1000
#: Events of a process between a delayed retry's first start and the write that carried
#: its start marker: the marker rode on a result's write or on another rule's marker.
_CARRIERS = frozenset({"result_persisted", "rule_started"})


def _markers_accounted(events: list[dict]) -> list[tuple[dict, str, str]]:
    """A delayed retry's first start is preceded, in its process, by the write of its start
    marker: its own `start_marked` (followed by that first try; its `write_ms` no longer than
    the time since the retry's delivery there), or a result's write or another rule's
    marker that carried it. (event, key, sentence) for each that is not."""
    out: list[tuple[dict, str, str]] = []
    mine: dict[tuple, list[dict]] = defaultdict(list)  # (process, attempt_id) -> its events
    for e in events:
        if e.get("src") == RUNNER or not e.get("attempt_id"):
            continue
        evs = mine[e.get("src"), e.get("pid"), e.get("attempt_id")]
        ev = e.get("ev")
        if ev == "rule_started" and e.get("try_no") == 1 and as_int(e.get("attempt"), 1) >= 2:
            found = _marker_of(evs, e)
            if found is not None:
                out.append((e, "rule_started unmarked", found))
        elif ev == "start_marked":
            delivered = next(
                (
                    x
                    for x in evs
                    if x.get("ev") == "delivered"
                    and (x.get("rule_id"), x.get("attempt")) == (e.get("rule_id"), e.get("attempt"))
                ),
                None,
            )
            wrote = e.get("write_ms")
            if delivered is not None and isinstance(wrote, int | float):
                since_ms = 1000.0 * (event_time(e) - event_time(delivered))
                if wrote > since_ms * (1 + CLOCK_SLEW) + ROUNDING_MS:
                    out.append(
                        (
                            e,
                            "start_marked too long",
                            f"`start_marked` of a {num(float(wrote))} ms write, sent after "
                            f"the retry's delivery {since_ms:.3f} ms before",
                        )
                    )
        elif ev == "rule_started" and evs and evs[-1].get("ev") == "start_marked":
            marked = evs[-1]
            same = (marked.get("rule_id"), marked.get("attempt")) == (
                e.get("rule_id"),
                e.get("attempt"),
            )
            if not same or e.get("try_no") != 1:
                out.append(
                    (
                        marked,
                        "start_marked unused",
                        f"`start_marked` of {marked.get('rule_id')} attempt "
                        f"{marked.get('attempt')}, followed by try {e.get('try_no')} of "
                        f"{e.get('rule_id')} attempt {e.get('attempt')}",
                    )
                )
        evs.append(e)
    return out


def _marker_of(evs: list[dict], start: dict) -> str | None:
    """Why the write of `start`'s marker is not found before it (None: it is): since the
    process last began the evaluation or started this attempt, and after the retry's first
    delivery there. A duplicate delivery or another rule's status may be recorded in
    between (the controller and the evaluation's other tasks record as they go): only the
    first delivery counts, even one that came before the evaluation was begun again (a
    parked evaluation is resumed by its retry's delivery, and a redelivered copy may be
    recorded between the marker's write and the start)."""
    key = (start.get("rule_id"), start.get("attempt"))
    region: list[dict] = []
    begun = -1  # where the evaluation was last begun, counted from the region's end
    for i in range(len(evs) - 1, -1, -1):  # (not `reversed`: mypyc cannot compile it here)
        x = evs[i]
        ev = x.get("ev")
        if ev == "rule_started" and (x.get("rule_id"), x.get("attempt")) == key:
            break
        if ev == "evaluation_started" and begun < 0:
            begun = len(region)
        region.append(x)
    region.reverse()
    after = -1 if begun < 0 else len(region) - 1 - begun
    delivered = next(
        (
            i
            for i, x in enumerate(region)
            if x.get("ev") == "delivered" and (x.get("rule_id"), x.get("attempt")) == key
        ),
        -1,
    )
    for x in region[max(after, delivered) + 1 :]:
        own = (x.get("rule_id"), x.get("attempt")) == key
        if (x.get("ev") == "start_marked" and own) or (x.get("ev") in _CARRIERS and not own):
            return None
    return (
        f"`rule_started` of delayed retry attempt {start.get('attempt')} with no write of its "
        "start marker before it (its own `start_marked`, a result's, another rule's marker)"
    )


#: Writes and publishes recorded with when they were sent (`sent_ms`, the process's clock
#: in whole ms).
_SENT = frozenset(
    {
        "result_persisted",
        "retry_published",
        "status_written",
        "evaluation_terminal",
        "write_refused",
        "parking",
        "parked",
        "pass_published",
        "final_published",
    }
)


def _sent_in_session(events: list[dict]) -> list[tuple[dict, str, str]]:
    """A write is sent within its session: not after it was recorded (at the reply), not
    before the process began the evaluation (its latest `evaluation_started`, else its first
    delivery of it); within a millisecond, `sent_ms`'s resolution."""
    out: list[tuple[dict, str, str]] = []
    since: dict[tuple, float] = {}  # (process, attempt_id) -> its session's start
    for e in events:
        ev, a = e.get("ev"), e.get("attempt_id")
        if e.get("src") == RUNNER or not a:
            continue
        mine = (e.get("src"), e.get("pid"), a)
        if ev == "evaluation_started" or (ev == "delivered" and mine not in since):
            since[mine] = event_time(e)
            continue
        sent = e.get("sent_ms")
        if ev not in _SENT or not isinstance(sent, int) or isinstance(sent, bool):
            continue
        t, began = event_time(e), since.get(mine)
        if sent > 1000.0 * t + 1:
            out.append((e, f"{ev} sent later", f"`{ev}` sent at {sent} ms, after it was recorded"))
        elif began is not None and sent < 1000.0 * began - 1:
            out.append(
                (
                    e,
                    f"{ev} sent earlier",
                    f"`{ev}` sent at {sent} ms, {1000.0 * began - sent:.0f} ms before its "
                    "process began the evaluation",
                )
            )
    return out


def _restores_in_order(events: list[dict]) -> list[tuple[dict, str, str]]:
    """`results_restored` comes from the final write (what it wrote back, before the
    process's `evaluation_terminal`); `final_state_restored` from the announcement's check
    that the final state is still there (after it)."""
    out: list[tuple[dict, str, str]] = []
    ended: dict[tuple, bool] = {}  # (process, attempt_id) -> its evaluation_terminal seen
    for e in events:
        ev, a = e.get("ev"), e.get("attempt_id")
        if e.get("src") == RUNNER or not a:
            continue
        mine = (e.get("src"), e.get("pid"), a)
        if ev == "evaluation_started":
            ended[mine] = False
        elif ev == "evaluation_terminal":
            ended[mine] = True
        elif ev == "results_restored":
            if ended.get(mine):
                out.append((e, ev, "`results_restored` after its process's evaluation_terminal"))
            elif not e.get("rule_ids"):
                out.append((e, ev, "`results_restored` with nothing restored"))
        elif ev == "final_state_restored" and not ended.get(mine):
            out.append((e, ev, "`final_state_restored` before its process's evaluation_terminal"))
    return out


def check_history_well_formed(cx: Context) -> Outcome:
    """One case per event of an engine process; a violation per kind of problem found
    (the first `MAX_SHOWN` events with it, each with its neighbours, then one that counts
    the rest)."""
    cases = 0
    found: list[tuple[dict, str, str]] = []  # (event, a key to group by, the sentence)
    for e in cx.events:
        if e.get("ev") in MESSAGES:  # the runner's, of a message the engine published
            mine, who = message_problems(e), "the runner received"
        elif e.get("src") == RUNNER or e.get("ev") == UNREADABLE:
            continue
        else:
            mine, who = problems(e), None
        cases += 1
        if mine:  # the sentence built only for a problem: nearly every event has none
            said = who or f"{e.get('src')} recorded"
            found += [(e, key, f"{said} {text}") for key, text in mine]
    across = [_executions_counted, _markers_accounted, _sent_in_session, _restores_in_order]
    if not cx.spec.start_markers:  # the server counts the executions: no marker to write
        across.remove(_markers_accounted)
    found += [
        (e, key, f"{e.get('src')} recorded {text}")
        for rule in across
        for e, key, text in rule(cx.events)
    ]
    seen: Counter[str] = Counter()
    out: list[Violation] = []
    for e, key, text in found:
        seen[key] += 1
        if seen[key] <= MAX_SHOWN:
            out.append(
                Violation(
                    NAME,
                    str(e.get("attempt_id") or ""),
                    str(e.get("rule_id")) if e.get("rule_id") else None,
                    text,
                    timeline([e], []),
                )
            )
    for key, n in sorted(seen.items()):
        if n > MAX_SHOWN:
            out.append(Violation(NAME, "", None, f"and {n - MAX_SHOWN} more: {key}", []))
    return cases, out
