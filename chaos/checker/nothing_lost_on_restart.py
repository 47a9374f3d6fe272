"""`nothing_lost_on_restart`: a broker restart loses no message, and every message the
engine publishes is persistent.

RabbitMQ keeps a durable queue across a restart, but only the persistent messages in it
(delivery mode 2): a transient one is held in memory and goes with the node, even in a
durable queue. Two things are judged:
- every announcement the harness's consumer received from the engine
  (`started_received`, `completed_received`, each with the delivery mode the publisher
  set) is persistent: a transient one would not have survived a restart, whether one
  happened or not;
- each broker kill where the runner counted the messages the node held (the runner's
  `service_killed` with `messages`) is followed by a restart that finds as many
  (`service_restarted` with `messages`): nothing enters a dead node, so any fewer were
  lost. The simulator counts from its model; live, where the count could only be taken
  while clients still publish and acknowledge, nothing is counted and only the first
  part judges.
"""

from __future__ import annotations

from chaos.checker.context import Context, Outcome, as_int, of, timeline
from chaos.checker.records import Violation

RECEIVED = ("started_received", "completed_received")
PERSISTENT = 2


def check_nothing_lost_on_restart(cx: Context) -> Outcome:
    """One case per announcement received with a delivery mode, and one per counted broker
    kill and restart."""
    out: list[Violation] = []
    cases = 0
    transient: list[dict] = []
    for e in of(cx.events, *RECEIVED):
        mode = e.get("delivery_mode")
        if mode is None:
            continue  # a history from before delivery modes were recorded
        cases += 1
        if as_int(mode) != PERSISTENT:
            transient.append(e)
    by_eval: dict[str, list[dict]] = {}
    for e in transient:
        by_eval.setdefault(str(e.get("attempt_id")), []).append(e)
    for a, evs in sorted(by_eval.items()):
        kinds = sorted({str(e.get("ev")).removesuffix("_received") for e in evs})
        out.append(
            Violation(
                "nothing_lost_on_restart",
                a,
                None,
                f"evaluation.{'/'.join(kinds)} published transient (delivery mode "
                f"{evs[0].get('delivery_mode')}): a broker restart would lose it",
                timeline(evs[:4]),
            )
        )
    killed = None
    for e in of(cx.events, "service_killed", "service_restarted"):
        if e.get("service") != "broker":
            continue
        if e.get("ev") == "service_killed":
            killed = e if e.get("messages") is not None else None
            continue
        if killed is None or e.get("messages") is None:
            continue
        cases += 1
        before, after = as_int(killed.get("messages")), as_int(e.get("messages"))
        if after < before:
            out.append(
                Violation(
                    "nothing_lost_on_restart",
                    "",
                    None,
                    f"the broker held {before} message(s) when it was killed and found "
                    f"{after} on restart: {before - after} lost",
                    timeline([killed, e]),
                )
            )
        killed = None
    cx.stats["transient_messages"] = len(transient)
    return cases, out
