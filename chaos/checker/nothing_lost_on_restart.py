"""`nothing_lost_on_restart`: a broker restart loses no message, and every message the
engine publishes is persistent. The broker is the service that holds the work queue and
the delayed retries: RabbitMQ, or PostgreSQL itself in `pg` (`CheckSpec.brokers`).

RabbitMQ keeps a durable queue across a restart, but only the persistent messages in it
(delivery mode 2): a transient one is held in memory and goes with the node, even in a
durable queue. Two things are judged:
- every announcement the harness's consumer received from the engine
  (`started_received`, `completed_received`, `pass_received`, each with the delivery mode
  the publisher set) is persistent: a transient one would not have survived a restart, whether one
  happened or not;
- each broker kill where the runner counted the messages the node held (the runner's
  `service_killed` with `messages`) is followed by a restart that finds as many
  (`service_restarted` with `messages`): nothing enters a dead node, so any fewer were
  lost. The simulator counts from its model; live, where the count could only be taken
  while clients still publish and acknowledge, nothing is counted;
- message by message, live and in the simulator: every delayed retry that a broker kill
  found confirmed in its delay queue (`retry_published` before the kill's `fault_fired`)
  and not yet delivered (no `delivered` of it up to the `service_killed`) is delivered
  after the kill, its own copy (not the sweeper's re-publish, `reason: lost_retry`), or
  is still queued when the run ends: the runner takes what the work and delay queues
  hold once the workers have stopped (`queues_drained`, their message ids). A retry the
  runner lost on purpose (`retry_lost`, `broker.dead_letter_loss`) is not owed.
"""

from __future__ import annotations

from chaos.checker.context import Context, Outcome, as_int, event_time, of, timeline
from chaos.checker.records import Violation

RECEIVED = ("started_received", "completed_received", "pass_received")
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
        if e.get("service") not in cx.spec.brokers:
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
    kept_cases, kept_out = _retries_kept(cx)
    cx.stats["transient_messages"] = len(transient)
    return cases + kept_cases, out + kept_out


Key = tuple[str, str, int]


def _key(e: dict) -> Key:
    return (str(e.get("attempt_id")), str(e.get("rule_id")), as_int(e.get("attempt")))


def _retries_kept(cx: Context) -> Outcome:
    """One case per retry a broker kill found waiting; judged only when the run drained
    the queues at its end."""
    drained = of(cx.events, "queues_drained")
    if not drained:
        return 0, []
    left = {str(m) for m in drained[-1].get("message_ids") or ()}
    kills: list[tuple[float, dict]] = []  # (the kill's fault_fired time, its service_killed)
    fired_at: float | None = None
    runner = sorted(
        of(cx.events, "fault_fired", "service_killed"), key=lambda e: as_int(e.get("seq"))
    )
    for e in runner:
        if e.get("ev") == "fault_fired":
            fired_at = event_time(e)
        elif e.get("service") in cx.spec.brokers and fired_at is not None:
            kills.append((fired_at, e))
    if not kills:
        return 0, []
    published: dict[Key, list[dict]] = {}
    for e in of(cx.events, "retry_published"):
        published.setdefault(_key(e), []).append(e)
    own: dict[Key, list[float]] = {}  # deliveries of the retry's own copy
    for e in of(cx.events, "delivered"):
        if e.get("kind") == "retry" and e.get("reason") != "lost_retry":
            own.setdefault(_key(e), []).append(event_time(e))
    lost_on_purpose = {_key(e) for e in of(cx.events, "retry_lost")}
    out: list[Violation] = []
    cases = 0
    for t_fired, killed in kills:
        t_killed = event_time(killed)
        for key, pubs in sorted(published.items()):
            confirmed = [p for p in pubs if event_time(p) < t_fired]
            if not confirmed or key in lost_on_purpose:
                continue
            times = own.get(key, [])
            if any(t <= t_killed for t in times):
                continue  # consumed before the kill (or while it was under way)
            cases += 1
            message_id = f"{key[0]}:{key[1]}:{key[2]}"
            if any(t > t_killed for t in times) or message_id in left:
                continue
            a, r, n = key
            out.append(
                Violation(
                    "nothing_lost_on_restart",
                    a,
                    r,
                    f"the retry of {r} attempt {n}, confirmed in its delay queue before the "
                    "broker was killed, was never delivered after the restart nor left in a "
                    "queue at the end",
                    timeline(
                        [confirmed[-1], killed],
                        of(cx.by_pair[(a, r)], "delivered", "sweeper_retried", "rule_started"),
                    ),
                )
            )
    return cases, out
