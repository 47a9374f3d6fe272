"""`cancel_respected`: once a cancel is durable, no rule starts and no retry fires for that
evaluation, a cancelled evaluation stays cancelled, and only a requested cancel cancels.

The cancel instant `Tc` is the runner's `cancel_written` (recorded once `EngineClient.cancel`
returned: the `cancelled` state, `evaluation.completed` and the control broadcast are all
out), or a worker's `cancel_received` or `cancel_seen` if earlier (both follow the write).
A process is judged by what it could know, session by session (`holding`):

- a session whose `begin` ran after `Tc` (its delivery came later) read a cancelled
  evaluation and must not exist: the evaluation was revived;
- a session open at `Tc` may still start rules and publish retries it had decided on
  before the cancel's turn came: allowed (counted as `cancel_inflight_starts`) when the
  session hears of it (`cancel_received` while holding the evaluation, or `cancel_seen`:
  the cancelled state read from Redis) and ends as the core decided on hearing it (its
  `evaluation_terminal` `decided` cancelled: a core that acts after a cancel reached it
  can only have decided so), or when its process is killed before the broadcast reaches
  it; a session that never hears of the cancel yet goes on, or hears of it and finishes
  the evaluation anyway, is a violation;
- the sweeper re-publishing a retry after `Tc` is a retry fired for a cancelled evaluation.

An act is timed when the process did it: a retry when it was sent (`sent_ms`; recorded at
the broker's confirm, which a slowed link may hold back past `Tc`), the others when
recorded (a status write's landing: the store ordered it before the cancel or refused it).
"""

from __future__ import annotations

from collections.abc import Sequence

from chaos.checker.context import (
    Context,
    Outcome,
    event_time,
    of,
    proc_of,
    timeline,
)
from chaos.checker.holding import Session, session_at
from chaos.checker.records import Violation

CANCELLED = "cancelled"
#: What a process does that a cancel forbids: start a rule, schedule a retry.
_ACTS = ("rule_started", "retry_published", "status_written")


def _is_act(e: dict) -> bool:
    if e.get("ev") == "status_written":  # failed_attempt_N: a retry decided and scheduled
        return str(e.get("status", "")).startswith("failed_attempt_") and not e.get("kept")
    return e.get("ev") in ("rule_started", "retry_published")


def cancel_instant(evs: list[dict]) -> tuple[float | None, list[dict]]:
    """When the cancel was durable (None: no winning cancel recorded), with its events."""
    written = [e for e in of(evs, "cancel_written") if e.get("state") == CANCELLED]
    marks = written[:1] + of(evs, "cancel_received")[:1] + of(evs, "cancel_seen")[:1]
    if not marks:
        return None, []
    first = min(marks, key=event_time)
    return event_time(first), of(evs, "cancel_requested")[:1] + marks


def check_cancel_respected(cx: Context) -> Outcome:
    """Per evaluation: a `cancelled` state (final, won, or published) only where a cancel was
    requested; after `Tc` no revival, no act of a process that could know, no retry fired
    by the sweeper; and the final state of a cancelled evaluation stays `cancelled`."""
    out: list[Violation] = []
    cases = inflight = unknown = 0
    for a in cx.evaluations:
        evs = cx.by_eval[a]
        fin = cx.final_of(a)
        state = fin.state if fin else None
        if fin is None and not evs:
            continue
        cases += 1

        def flag(message: str, key: list[dict], context: Sequence[dict] = (), a: str = a) -> None:
            out.append(Violation("cancel_respected", a, None, message, timeline(key, context)))

        if a not in cx.cancelled:
            marks = [
                e
                for e in of(evs, "evaluation_terminal", "final_published", "completed_received")
                if _status(e) == CANCELLED
            ]
            if state == CANCELLED or marks:
                flag(
                    f"evaluation ends {state or 'with no state'}"
                    + (f" and was announced cancelled ({len(marks)} record(s))" if marks else "")
                    + ", although no cancel was requested",
                    marks or evs[-3:],
                )
            continue
        tc, cancel_evs = cancel_instant(evs)
        if tc is None:
            lost = [e for e in of(evs, "cancel_written") if e.get("state") != CANCELLED]
            if not lost and state == CANCELLED:
                unknown += 1  # cancelled, but when is not recorded: nothing to time it by
            continue
        if state != CANCELLED:
            flag(
                f"cancelled at {tc:.3f}, but Redis ends with {state or 'no state'}: the "
                "cancelled evaluation did not stay cancelled",
                cancel_evs + of(evs, "evaluation_terminal", "evaluation_started")[-3:],
            )
        for e in of(evs, "evaluation_terminal"):
            if e.get("won") is True and e.get("status") != CANCELLED and event_time(e) > tc:
                flag(
                    f"{e.get('src')} won terminal state {e.get('status')} after the cancel",
                    [*cancel_evs, e],
                )
        held = cx.sessions(a)
        revived: list[Session] = [s for s in held if s.begun_after > tc]
        for revival in revived:
            acts = [e for e in revival.events if _is_act(e)]
            flag(
                f"{revival.proc[0]} resumed the evaluation after the cancel was durable "
                f"(delivery {revival.begun_after - tc:.3f} s after it)"
                + (f" and started {len(acts)} rule(s) or retries" if acts else ""),
                cancel_evs
                + [x for x in (revival.delivered, revival.started) if x is not None]
                + acts[:4],
            )
        silent: dict[int, tuple[Session, list[dict]]] = {}
        for e in evs:
            if not _is_act(e) or _acted(e) <= tc:
                continue
            proc = proc_of(e)
            s = session_at(held, proc, _acted(e))
            if s is None:
                flag(
                    f"{proc[0]} {_what(e)} after the cancel, holding no session of the evaluation",
                    [*cancel_evs, e],
                    evs,
                )
                continue
            if s in revived:
                continue  # reported with its session
            told = any(_told(x) for x in s.events)
            decided = s.end.get("decided") if s.end is not None else None
            if told and decided in (None, CANCELLED):
                inflight += 1  # decided before the cancel's turn came: in flight
                continue
            if not told and s.end is not None and s.end.get("ev") in ("crash", "worker_killed"):
                inflight += 1  # killed before the broadcast could reach it
                continue
            silent.setdefault(id(s), (s, []))[1].append(e)
        for s, acts in silent.values():
            ended = s.end.get("ev") if s.end is not None else "the end of the run"
            heard = [x for x in s.events if _told(x)]
            if heard and s.end is not None and s.end.get("decided") not in (None, CANCELLED):
                why = (
                    f"heard of it ({heard[0].get('ev')}) and still finished "
                    f"the evaluation as {s.end.get('decided')}"
                )
            else:
                why = (
                    f"never heard of it while holding the evaluation (its hold ended with {ended})"
                )
            flag(
                f"{s.proc[0]} {_what(acts[0])} {len(acts)} time(s) after the cancel was "
                f"durable, and {why}",
                cancel_evs + acts[:6] + heard[:1] + ([s.end] if s.end is not None else []),
                of(evs, "cancel_received"),
            )
        for e in of(evs, "sweeper_retried"):
            if event_time(e) > tc:
                flag(
                    f"the sweeper of {e.get('src')} re-published a retry of {e.get('rule_id')} "
                    f"{event_time(e) - tc:.3f} s after the cancel",
                    [*cancel_evs, e],
                )
    cx.stats.update(cancel_inflight_starts=inflight, cancels_untimed=unknown)
    return cases, out


def _acted(e: dict) -> float:
    """When the process did `e`: a publish when it was sent, anything else when recorded."""
    sent = e.get("sent_ms")
    if e.get("ev") == "retry_published" and isinstance(sent, int) and not isinstance(sent, bool):
        return sent / 1000
    return event_time(e)


def _told(e: dict) -> bool:
    """The process learnt of the cancel while holding the evaluation: the broadcast
    (`cancel_received`) or the cancelled state read from Redis (`cancel_seen`)."""
    ev = e.get("ev")
    return (ev == "cancel_received" and e.get("held") is True) or ev == "cancel_seen"


def _status(e: dict) -> object:
    body = e.get("body")
    return body.get("status") if isinstance(body, dict) else e.get("status")


def _what(e: dict) -> str:
    ev = e.get("ev")
    if ev == "rule_started":
        return f"started {e.get('rule_id')} (attempt {e.get('attempt')})"
    if ev == "retry_published":
        return f"published a retry of {e.get('rule_id')} (attempt {e.get('attempt')})"
    return f"wrote {e.get('status')} for {e.get('rule_id')}"
