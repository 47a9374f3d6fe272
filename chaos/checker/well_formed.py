"""`history_well_formed`: every event an engine process recorded speaks the vocabulary of
`chaos.checker.vocabulary`: a known kind, each of its fields present (unless optional),
none unknown, each of the type and, where the protocol fixes them, the values it must have.

The other invariants read the history by these names: an event recorded under another
name, or a field under another key, would leave them judging nothing where they should
judge something. The runner's own events are the harness's, not the engine's, and are
not judged here, except the bodies and message ids of the `evaluation.*` events the
engine published, as the runner's consumer received them.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from chaos.checker.context import Context, Outcome, timeline
from chaos.checker.history_complete import UNREADABLE
from chaos.checker.records import Violation
from chaos.checker.vocabulary import AGREES, COMMON, EVENTS, MESSAGES, describe, fits

NAME = "history_well_formed"
#: The events shown one by one for each kind of problem; the rest are counted in one.
MAX_SHOWN = 3
RUNNER = "runner"


def problems(e: dict) -> list[tuple[str, str]]:
    """What is wrong with one event: (a short key to group by, the sentence)."""
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
    agrees = AGREES.get(ev)
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


def check_history_well_formed(cx: Context) -> Outcome:
    """One case per event of an engine process; a violation per kind of problem found
    (the first `MAX_SHOWN` events with it, each with its neighbours, then one that counts
    the rest)."""
    cases = 0
    seen: Counter[str] = Counter()
    out: list[Violation] = []
    for e in cx.events:
        if e.get("ev") in MESSAGES:  # the runner's, of a message the engine published
            found, who = message_problems(e), "the runner received"
        elif e.get("src") == RUNNER or e.get("ev") == UNREADABLE:
            continue
        else:
            found, who = problems(e), f"{e.get('src')} recorded"
        cases += 1
        for key, text in found:
            seen[key] += 1
            if seen[key] <= MAX_SHOWN:
                out.append(
                    Violation(
                        NAME,
                        str(e.get("attempt_id") or ""),
                        str(e.get("rule_id")) if e.get("rule_id") else None,
                        f"{who} {text}",
                        timeline([e], []),
                    )
                )
    for key, n in sorted(seen.items()):
        if n > MAX_SHOWN:
            out.append(Violation(NAME, "", None, f"and {n - MAX_SHOWN} more: {key}", []))
    return cases, out
