"""`leases_renewed` and `leases_respected`: the lease machinery, judged on its own records.

Fenced writes run an owner's lease on as a side effect, so a heartbeat that stops, beats
too slowly or renews nothing hides behind a busy owner; these checks read the heartbeat's
own records (`lease_renewed`: the token, the store's answer, when it was sent and the
lease it asked for) and never count a write as a renewal.

- `leases_renewed` (liveness): while a running process holds an evaluation (a session,
  `chaos.checker.holding`), it renews the lease before it can run out: from the begin,
  and from each renewal's reply, the next renewal is sent within the lease. A gap is
  excused only by a fault that touched that process or its Redis (its pause, a freeze or
  stall, a fault on its own link to Redis, Redis down or paused), plus the scenario's
  `fault_recovery_s`. And a renewal the store answered `held` extended the lease to a
  whole lease after it was sent at least, by the store's own clock (`expires_ms`, its
  PEXPIRETIME once renewed; the store and the worker share the host's clock, which both
  read in whole milliseconds).
- `leases_respected` (safety): nobody takes a lease before it ran out. A sweeper claims
  an evaluation only once the stamp of its latest renewal is older than the lease (a
  renewal answered before the claim was sent stamped the index when it was sent, at the
  latest), and another worker begins an evaluation only once the lease of the latest
  renewal the holder got answered `held` has run out, unless the holder let it go first
  (abandoned, parked, announced, or another final state kept), or a resume from a
  checkpoint took it away (the runner's `resume_requested` / `resume_written`: the store
  clears the owner and moves the fence, so a renewal it answered held, sent before the
  resume's answer, was applied before the resume, whenever its answer was recorded). A
  Redis fault in between (a restart or failover may roll keys back) excuses it. Only the
  holders before the begin are looked at: those whose token is older than the begin's (the
  store numbers its tokens in the order it gives them; a begin recorded late, after a
  publish that waited out a broker outage, was still applied before a later holder's
  begin).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from chaos.checker.context import Context, Outcome, event_time, of, proc_of, timeline
from chaos.checker.holding import Session
from chaos.checker.records import Violation
from chaos.checker.touching import STORE, Touch, touching

#: `lease_renewed`'s `held`: lost to another worker; 1 still ours, 2 ours again.
LOST = 0
#: Events of the holder that give its lease back (or lose it) before it runs out.
_LET_GO = frozenset(
    {"evaluation_abandoned", "parked", "final_published", "delivery_failed", "terminal_dropped"}
)
#: Clock resolution: the store stamps and the sweeper compares in whole milliseconds.
_MS = 0.001


def _sent(e: dict) -> float:
    value = e.get("sent_ms")
    return float(value) / 1000 if isinstance(value, int | float) else event_time(e)


def _lease(e: dict) -> float | None:
    value = e.get("lease_ms")
    return float(value) / 1000 if isinstance(value, int | float) and value > 0 else None


def _worker_of(token: Any) -> str | None:
    return token.partition(":")[2] if isinstance(token, str) and ":" in token else None


def _redis_fault(windows: list[Touch], t0: float, t1: float, slack: float) -> Touch | None:
    """A fault of the store itself (not of one process's link) open at some moment of
    [t0, t1]."""
    for w in windows:
        if w.start > t1:
            break
        if w.end + slack >= t0 and w.pids is None and w.service in (None, STORE):
            return w
    return None


def check_leases_renewed(cx: Context) -> Outcome:
    """One case per interval judged (begin to first renewal, renewal to renewal, last
    renewal to the session's end); a violation per interval longer than the lease that no
    fault of that process or its Redis explains."""
    renewals = of(cx.events, "lease_renewed")
    begun = of(cx.events, "evaluation_started")
    leases = [x for x in map(_lease, [*renewals, *begun]) if x is not None]
    if not leases:  # a history from before leases were recorded: nothing to judge by
        return 0, []
    lease = min(leases)
    slack = float(getattr(cx.spec, "fault_recovery_s", 0.0) or 0.0)
    windows = cx.touches()
    end_of_run = event_time(cx.events[-1]) if cx.events else 0.0  # in time order
    cases = 0
    out: list[Violation] = []
    for a in cx.evaluations:
        evs = cx.by_eval.get(a, [])
        mine: dict[Any, list[dict]] = defaultdict(list)
        for e in of(evs, "lease_renewed"):
            mine[proc_of(e)].append(e)
        for s in cx.sessions(a):
            pid = s.proc[1]
            t_end = min(s.t1, end_of_run)
            held_from, last = s.t0, s.started  # the lease runs out by held_from + lease
            # `sent_ms` is in whole milliseconds: a renewal sent in the begin's millisecond
            # reads up to one earlier than the session's start
            beats = [e for e in mine.get(s.proc, []) if s.t0 - _MS <= _sent(e) <= t_end]
            gaps: list[tuple[float, float, dict, dict | None]] = []
            for e in beats:
                gaps.append((held_from, _sent(e), last, e))
                if e.get("held") == LOST:
                    break
                held_from, last = event_time(e), e
            else:
                gaps.append((held_from, t_end, last, s.end))
            for t0, t1, before, after in gaps:
                cases += 1
                if t1 - t0 <= lease + _MS:
                    continue
                if touching(windows, pid, t0, t1, slack, (STORE,)) is not None:
                    continue
                late = t1 - t0 - lease
                what = (
                    "its next renewal was sent"
                    if after is not None and after.get("ev") == "lease_renewed"
                    else "it still held the evaluation"
                )
                out.append(
                    Violation(
                        "leases_renewed",
                        a,
                        None,
                        f"{s.proc[0]} held {a} without renewing its lease for {t1 - t0:.3f} s "
                        f"(the lease is {lease:.3f} s): {what} {late:.3f} s after it ran out, "
                        f"with no pause, stall or Redis fault of that process in between",
                        timeline([x for x in (before, after) if x is not None], evs),
                    )
                )
    for e in renewals:
        expires, sent, asked = e.get("expires_ms"), e.get("sent_ms"), e.get("lease_ms")
        if e.get("held") == LOST or not (
            isinstance(expires, int) and isinstance(sent, int) and isinstance(asked, int)
        ):
            continue
        cases += 1
        short = sent + asked - expires  # the renewal landed after it was sent: never > 0
        if short <= 1:
            continue
        a = str(e.get("attempt_id"))
        out.append(
            Violation(
                "leases_renewed",
                a,
                None,
                f"{e.get('src')}'s renewal of {a} was answered held, but the store says the "
                f"lease runs out {short} ms before the {asked} ms it asked for, counted from "
                f"when it was sent",
                timeline([e], cx.by_eval.get(a, [])),
            )
        )
    cx.stats["renewals"] = len(renewals)
    return cases, out


@dataclass(frozen=True)
class _Mark:
    """A moment a holder's lease and stamp ran on: a renewal answered held, or a begin.
    `sent`: when it was sent at the latest bound we have (the renewal's `sent_ms`, the
    delivery before the begin); `reply`: when its answer was recorded (it was applied
    before); `lease`: the lease it asked for (run seconds)."""

    proc: Any
    sent: float
    reply: float
    lease: float
    fence: Any
    event: dict


def _marks(evs: list[dict], held: list[Session]) -> list[_Mark]:
    out = [
        _Mark(proc_of(e), _sent(e), event_time(e), lease, e.get("fence"), e)
        for e in of(evs, "lease_renewed")
        if e.get("held") != LOST and (lease := _lease(e)) is not None
    ]
    for s in held:
        lease = _lease(s.started)
        if lease is not None:
            out.append(_Mark(s.proc, s.begun_after, s.t0, lease, s.started.get("fence"), s.started))
    return out


def _fence_number(token: Any) -> int | None:
    """n of a token `n:worker`: the store gives them in order (None: no token)."""
    head = str(token).partition(":")[0] if token else ""
    return int(head) if head.isdigit() else None


def _resumes(evs: list[dict]) -> list[tuple[float, dict]]:
    """The resumes of an evaluation that were done: when each was asked for, and its answer
    (`resume_written`; the store applied it in between)."""
    out: list[tuple[float, dict]] = []
    asked: float | None = None
    for e in of(evs, "resume_requested", "resume_written"):
        if e.get("ev") == "resume_requested":
            asked = event_time(e)
        elif asked is not None and e.get("resume") is not None:
            out.append((asked, e))
    return out


def _before_resume(mark: Any, done: float) -> bool:
    """Whether `mark` was applied before a resume answered at `done`: answered by then, or a
    renewal sent by then and answered held (its answer may be recorded later), which the
    store applied before the resume, since the resume moves the fence and refuses it
    after."""
    if mark.reply <= done:
        return True
    e = mark.event
    return e.get("ev") == "lease_renewed" and e.get("held") != LOST and mark.sent <= done


def check_leases_respected(cx: Context) -> Outcome:
    """One case per sweeper claim and per begin; a violation per one that took a lease
    before the renewal or begin of another holder could have run out."""
    if not of(cx.events, "lease_renewed") and not any(
        _lease(e) for e in of(cx.events, "evaluation_started")
    ):
        return 0, []  # a history from before leases were recorded
    slack = float(getattr(cx.spec, "fault_recovery_s", 0.0) or 0.0)
    windows = cx.touches()
    cases = 0
    out: list[Violation] = []
    for a in cx.evaluations:
        evs = cx.by_eval.get(a, [])
        marks = _marks(evs, cx.sessions(a))
        if not marks:
            continue
        # A renewal or a begin stamps the running index only while the state is not
        # terminal: only those answered before the first terminal write was sent count.
        over = [
            _sent(e) for e in of(evs, "evaluation_terminal", "cancel_requested", "cancel_written")
        ]
        first_over = min(over, default=float("inf"))
        for claim in of(evs, "sweeper_resumed"):
            t = event_time(claim)
            sent_from = claim.get("claimed_from_ms")
            t_from = float(sent_from) / 1000 if isinstance(sent_from, int | float) else t
            stamped = [m for m in marks if m.reply < min(t_from, first_over)]
            cases += 1  # judged: with no stamp known, nothing it could have taken early
            if not stamped:
                continue
            last = max(stamped, key=lambda m: m.sent)
            due = last.sent + last.lease
            if t + _MS >= due or _redis_fault(windows, last.sent, t, slack) is not None:
                continue
            out.append(
                Violation(
                    "leases_respected",
                    a,
                    None,
                    f"{claim.get('src')}'s sweeper claimed {a} {due - t:.3f} s before the "
                    f"stamp {last.proc[0]} left ({last.event.get('ev')}) went stale",
                    timeline([last.event, claim], evs),
                )
            )
        # Looked up by bisection, not scanned per begin: a broken engine that begins an
        # evaluation at every redelivery has thousands of them.
        by_sent = sorted(enumerate(marks), key=lambda im: (im[1].sent, -im[0]))
        sent_keys = [m.sent for _, m in by_sent]
        # A holder lets go when it sends its release (a park's, the final `done`'s): the
        # event, recorded at the reply, carries when (`sent_ms`); the others are recorded
        # before their release is sent.
        # A park sent whose reply its process never recorded (it died first: the last event
        # it left of the evaluation) may have landed, and let go, from when it was sent.
        last_of = {proc_of(e): i for i, e in enumerate(evs)}
        let_go_at: dict[Any, list[float]] = defaultdict(list)
        for i, e in enumerate(evs):
            ev = e.get("ev")
            if (
                ev in _LET_GO
                or (ev == "evaluation_terminal" and e.get("won") is False)
                or (ev == "parking" and last_of[proc_of(e)] == i)
            ):
                let_go_at[proc_of(e)].append(_sent(e))
        for times in let_go_at.values():
            times.sort()
        revoked = [(asked, event_time(done)) for asked, done in _resumes(evs)]
        for s in cx.sessions(a):
            begin, t, proc = s.started, s.t0, s.proc
            if begin.get("fence") is None:
                continue
            cases += 1  # judged: with no other holder before it, nothing taken early
            me = _worker_of(begin.get("fence"))
            mine = _fence_number(begin.get("fence"))
            # The latest stamp of another holder: its renewal answered held was applied
            # before this begin (it would have been refused after it); its begin, only if
            # answered before this one was sent. Either was sent by `t`. Of equal stamps,
            # the first recorded.
            other: _Mark | None = None
            for i in range(bisect_right(sent_keys, t) - 1, -1, -1):
                m = by_sent[i][1]
                if (
                    m.proc != proc
                    and m.event is not begin
                    and (me is None or _worker_of(m.fence) != me)
                    and (mine is None or (_fence_number(m.fence) or 0) < mine)
                    and (
                        m.sent <= t
                        if m.event.get("ev") == "lease_renewed"
                        else m.reply < s.begun_after
                    )
                ):
                    other = m
                    break
            if other is None:
                continue
            due = other.sent + other.lease
            if t + _MS >= due or _redis_fault(windows, other.sent, t, slack) is not None:
                continue
            gone = let_go_at.get(other.proc, [])
            if bisect_right(gone, t) > bisect_left(gone, other.sent):
                continue
            if any(asked <= t and _before_resume(other, done) for asked, done in revoked):
                continue  # the resume took the lease: applied after the mark, before t
            out.append(
                Violation(
                    "leases_respected",
                    a,
                    None,
                    f"{begin.get('src')} began {a} {due - t:.3f} s before the lease "
                    f"{other.proc[0]} took ({other.event.get('ev')}) ran out, "
                    f"{other.proc[0]} still holding it",
                    timeline([other.event, begin], evs),
                )
            )
    return cases, out
