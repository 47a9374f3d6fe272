"""`poison_rejected`: every poison message the runner published is dropped on arrival, once.

The runner's `publish_poison` fault records each message it puts on the work queue
(`poison_published`: its kind, the attempt id it names or null, `chaos.poison`). For each:
- a worker rejects it (`message_rejected`) with the reason its kind calls for: `malformed`
  for a message of the wrong shape (its `detail` naming the field at fault:
  `chaos.poison.DETAILS`), the unknown type itself, `no plan`, or the plan's own error
  line;
- nothing else happens to the evaluation it names: no begin, no rule start, no failed
  delivery (a failed delivery goes back to the queue, and a poison fails again at every
  delivery, for ever);
- it is rejected once: a second rejection is a redelivery, owed to the first rejecting
  process dying or to a fault on its broker or on it before the second (a poison ACKed
  when it is dropped never comes back). The messages that name no attempt id are judged
  together, by count.
A poison the run never saw rejected is a violation: the runner waits for each rejection
before it stops the workers (until the deadline). And the other way round, in every run:
no message the engine published itself is rejected, as malformed (a publisher and a
consumer that disagree on the shape of a message) or for any reason but `no plan` (an
unknown type, a plan that does not parse); each delivery taken is a case.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from chaos.checker.context import Context, Outcome, event_time, of, proc_of, timeline
from chaos.checker.records import Violation
from chaos.checker.touching import BROKER
from chaos.poison import DETAILS, expected_reason

NAME = "poison_rejected"
#: The one rejection a message of the engine's own may meet: its evaluation's plan is gone
#: (a Redis that lost it, a state expired).
NO_PLAN = "no plan"
#: What a poison message must never lead to.
_NEVER = ("evaluation_started", "rule_started", "delivery_failed", "acked")


def _repeat_owed(first: dict, second: dict, died: dict[Any, list[dict]], faults: list) -> bool:
    """Whether `second` rejection may be a redelivery of what `first` rejected: its process
    died between the two, or a fault on it or on its broker was open between them."""
    proc, t0, t1 = proc_of(first), event_time(first), event_time(second)
    pid = proc[1]
    for d in (*died.get(proc, ()), *died.get(pid, ())):
        if t0 <= event_time(d) <= t1:
            return True
    return any(w.start <= t1 and w.end >= t0 and w.touches(pid, (BROKER,)) for w in faults)


def _repeats(rejections: list[dict], died: dict, faults: list, allowed: int) -> list[dict]:
    """The rejections past the first `allowed` that no death or fault before them owes."""
    unowed: list[dict] = []
    for i, e in enumerate(rejections):
        if i >= allowed and not any(_repeat_owed(p, e, died, faults) for p in rejections[:i]):
            unowed.append(e)
    return unowed


def check_poison_rejected(cx: Context) -> Outcome:
    """One case per poison message published, and one per delivery the engine took."""
    published = of(cx.events, "poison_published")
    poisoned = {p.get("attempt_id") for p in published}
    rejected = sorted(of(cx.events, "message_rejected"), key=event_time)
    named: dict[str, list[dict]] = defaultdict(list)
    nameless: list[dict] = []
    for e in rejected:
        a = e.get("attempt_id")
        if isinstance(a, str):
            named[a].append(e)
        elif e.get("reason") == "malformed":
            nameless.append(e)
    died, faults = cx.deaths(), cx.touches()
    out: list[Violation] = []
    anonymous = [p for p in published if p.get("attempt_id") is None]
    for e in rejected:
        a = e.get("attempt_id")
        reason = e.get("reason")
        if isinstance(a, str) and a not in poisoned and reason != NO_PLAN:
            why = f"malformed: {e.get('detail')}" if reason == "malformed" else repr(reason)
            out.append(
                Violation(
                    NAME,
                    a,
                    None,
                    f"{proc_of(e)[0]} rejected a message of the engine's own as {why}",
                    timeline([e, *of(cx.by_eval.get(a, []), "delivered")[:3]]),
                )
            )
    for pub in published:
        a, kind = pub.get("attempt_id"), str(pub.get("kind"))
        if a is None:
            continue
        mine = named.get(a, [])
        if not mine:
            out.append(Violation(NAME, a, None, f"poison {kind} never rejected", timeline([pub])))
            continue
        want, detail = expected_reason(kind, a), DETAILS.get(kind)
        for e in mine:
            got, said = e.get("reason"), e.get("detail")
            if not str(got).startswith(want):
                out.append(
                    Violation(
                        NAME,
                        a,
                        None,
                        f"poison {kind} rejected as {got!r}; expected {want!r}",
                        timeline([pub, e]),
                    )
                )
            elif detail is not None and not str(said).startswith(detail):
                out.append(
                    Violation(
                        NAME,
                        a,
                        None,
                        f"poison {kind} rejected with detail {said!r}; expected one that "
                        f"starts {detail!r}",
                        timeline([pub, e]),
                    )
                )
        again = _repeats(mine, died, faults, 1)
        if again:  # one violation a poison, however often it came round
            out.append(
                Violation(
                    NAME,
                    a,
                    None,
                    f"poison {kind} rejected again by {proc_of(again[0])[0]} ({len(again)} "
                    "time(s)): it was not ACKed when dropped (no death or fault of the "
                    "process that dropped it first)",
                    timeline([pub, *mine[:4]]),
                )
            )
        acted = [e for e in cx.by_eval.get(a, []) if e.get("ev") in _NEVER]
        if acted:
            out.append(
                Violation(
                    NAME,
                    a,
                    None,
                    f"poison {kind} led to {acted[0].get('ev')}: it must be dropped on arrival",
                    timeline([pub, *acted[:4]]),
                )
            )
    if anonymous or nameless:
        said = [str(e.get("detail")) for e in nameless]
        for pub in anonymous:  # each nameless poison's detail, among theirs
            detail = DETAILS[str(pub.get("kind"))]
            match = next((i for i, d in enumerate(said) if d.startswith(detail)), None)
            if match is None:
                out.append(
                    Violation(
                        NAME,
                        "",
                        None,
                        f"poison {pub.get('kind')} (naming no evaluation): no malformed "
                        f"rejection naming none says {detail!r}",
                        timeline([pub, *nameless[:5]]),
                    )
                )
            else:
                del said[match]
        if len(nameless) < len(anonymous):
            out.append(
                Violation(
                    NAME,
                    "",
                    None,
                    f"{len(anonymous)} poison message(s) naming no evaluation published, "
                    f"{len(nameless)} malformed message(s) naming none rejected",
                    timeline(anonymous + nameless),
                )
            )
        again = _repeats(nameless, died, faults, len(anonymous))
        if again:
            out.append(
                Violation(
                    NAME,
                    "",
                    None,
                    f"a malformed message naming no evaluation rejected again by "
                    f"{proc_of(again[0])[0]}: more rejections ({len(nameless)}) than such "
                    f"poison messages ({len(anonymous)}), with no death or fault to owe them",
                    timeline(nameless[:6]),
                )
            )
    cx.stats["poison_published"] = len(published)
    cx.stats["poison_rejections"] = len(rejected)
    return len(published) + len(of(cx.events, "delivered")), out
