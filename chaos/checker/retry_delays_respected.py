"""`retry_delays_respected`: attempt k >= 2 of a rule starts no earlier than its tier after
the write of `failed_attempt_{k-1}` (the retry message is published after that write and
the queue TTL starts at the broker, so the measured wait over-estimates the broker's), and
no later than its tier with jitter, unless the history proves why it started later.

There is no slack. A retry may start later than its tier only by what the history shows:
- waiting for a free slot while every slot was busy: the shell records `slot_wait` when
  a due rule finds every rule slot of its evaluation taken (with the rules running), or
  a delivery finds every evaluation slot of its worker taken (with the evaluations held),
  and `slot_granted` when it gets one. The checker verifies the claim: each rule named
  running had started in that process and not finished when the wait began, one of them
  ended before the grant, and there were as many as the evaluation's slots; each
  evaluation named held had begun in that process (one named `setting_up`, its slot taken
  and its begin under way, had been delivered there), and no other process held the
  evaluation from before the delivery to the wait (its lease was there to be looked up:
  the delivery should have been passed on at once). The waits are reported as latency
  (`retry_slot_wait_s`);
- the resumed evaluation's begin and recovery, when its delivery found it out of memory
  (parked, or its owner gone): from the delivery (or its evaluation slot) to the
  `evaluation_started` and `recovered` of that copy (behind Sentinel with `wait_replicas`
  each write waits for the replica), and the same set-up from the delivery to its wait
  for an evaluation slot (the plan and the lease's holder read from the store first: a
  round trip each, on a busy PostgreSQL tens of milliseconds);
- the delivery's own latency, as its events measure it: the broker's hold past the
  message's due time (its publisher's stamp plus its delay, against the first delivery),
  then the forward from the process that first received it to the one that started it,
  less any wait there for an evaluation slot of an evaluation another process held all
  along (the retry should have been passed on at once: that wait is unexplained);
- a fault window (from the runner's own `fault_fired` / `fault_healed` records) open
  during the wait, or the sweeper's lost-retry path.
What is left, the worker's processing from the delivery to the start, must fit within
`delay_tolerance_s` (the timer granularity, the same tolerance an early start gets); live,
each event's own recorded event-loop lag (`loop_lag_ms`, measured by the worker) is added
to it. Anything else is a violation.

Where the design's retries come out in the order they fall due (a queue per delay,
claims by due time), a retry delivered behind one due later than it is the broker's
doing, and a violation; a workflow engine's timers (`temporal`) are each their own.

The tier is the checker's own (`oracle.delay_bounds`, from the scenario's `tiers_ms`,
`jitter` and `time_scale`), never the engine's: a retry published to the wrong tier, or
with a delay its tier does not allow, is a violation even when it then arrives on time
for the delay it was given. Zero retries judged is "unknown".
"""

from __future__ import annotations

from collections import deque
from typing import Any

from chaos.checker.context import (
    Context,
    Outcome,
    as_int,
    event_time,
    num,
    of,
    proc_of,
    sort_key,
    timeline,
)
from chaos.checker.holding import Proc, Session
from chaos.checker.oracle import DelayBounds, delay_bounds, retry_delay_ms
from chaos.checker.records import RetrySettings, Violation

NAME = "retry_delays_respected"


def _published_problem(
    pub: dict, bounds: DelayBounds, settings: RetrySettings, time_scale: float
) -> str | None:
    """What is wrong with the `retry_published` record itself, if anything: its tier, a
    delay outside [tier, tier * (1 + jitter)] (scaled, in ms), a jitter bucket its tier does
    not have, or a delay other than the one its tier and bucket give."""
    tier = pub.get("tier")
    if isinstance(tier, int) and not isinstance(tier, bool) and tier != bounds.tier:
        return (
            f"published to tier {tier}, but failed_attempt_{bounds.failed} goes to tier "
            f"{bounds.tier} ({num(bounds.tier_ms)} ms)"
        )
    delay = pub.get("delay_ms")
    if not isinstance(delay, int | float) or isinstance(delay, bool):
        return None
    low_ms, high_ms = bounds.low_s * 1000.0, bounds.high_s * 1000.0
    if not low_ms <= delay <= high_ms:
        side = "below" if delay < low_ms else "above"
        return (
            f"published with a {num(float(delay))} ms delay, {side} tier {bounds.tier}'s "
            f"[{num(round(low_ms, 3))}, {num(round(high_ms, 3))}] ms "
            f"({num(bounds.tier_ms)} ms x {num(time_scale)}, jitter included)"
        )
    bucket = pub.get("bucket")
    if bucket is None:  # not recorded (`history_well_formed` says so): the range only
        return None
    expected = retry_delay_ms(settings, time_scale, bounds.failed, bucket)
    if expected is None:
        buckets = 1 if settings.jitter == 0.0 else settings.jitter_buckets
        return (
            f"published to jitter bucket {bucket!r}, but tier {bounds.tier} has buckets "
            f"0 to {buckets - 1} (jitter {num(settings.jitter)}, "
            f"jitter_buckets {settings.jitter_buckets})"
        )
    if delay != expected:
        return (
            f"published with a {num(float(delay))} ms delay, but bucket {bucket} of tier "
            f"{bounds.tier} is {expected} ms ({num(bounds.tier_ms)} ms x {num(time_scale)}, "
            f"jitter {num(settings.jitter)} over {settings.jitter_buckets} buckets)"
        )
    return None


def _held_until(
    evs: list[dict], src: Any, rule_id: str, attempt: int, t0: float, t1: float
) -> bool:
    """Whether (rule_id, attempt) held a slot in process `src` over [t0, t1]: started there
    by t1 (the core counts a rule running from its decision, its start marker's write
    comes before `rule_started`), and not finished there before t0 (a level-1 retry
    keeps the slot)."""
    started = finished = False
    for e in evs:
        if e.get("src") != src or e.get("rule_id") != rule_id or e.get("attempt") != attempt:
            continue
        ev, t = e.get("ev"), event_time(e)
        if ev == "rule_started" and t <= t1:
            started = True
        elif ev == "rule_finished" and t < t0:
            finished = True
    return started and not finished


def _rule_wait(cx: Context, evs: list[dict], wait: dict, granted: dict) -> str | None:
    """Why a rule's `slot_wait` is not proven (None: it is)."""
    src, tw, tg = wait.get("src"), event_time(wait), event_time(granted)
    running = wait.get("running")
    if not isinstance(running, dict):
        return "its slot_wait names no running rules"
    slots = cx.spec.max_parallel or as_int(wait.get("slots"), 0)
    if len(running) < max(slots, 1):
        return f"{len(running)} rule(s) running, {slots} slot(s)"
    for rule, attempt in running.items():
        if not _held_until(evs, src, str(rule), as_int(attempt, 1), tw, tg):
            return f"{rule} attempt {attempt}, named running, was not running then"
    ended = any(
        e.get("src") == src
        and e.get("rule_id") in running
        and e.get("ev") in ("rule_finished", "rule_failed")
        and tw <= event_time(e) <= tg
        for e in evs
    )
    return None if ended else "no running rule ended before its slot was granted"


#: What an evaluation does while it holds its lock: carrying out an input's actions.
_AT_WORK = frozenset(
    {
        "result_persisted",
        "status_written",
        "retry_published",
        "rule_started",
        "pass_published",
        "rules_skipped",
        "recovered",
        "retry_acked",
    }
)


def _lock_wait(evs: list[dict], wait: dict, granted: dict) -> str | None:
    """Why a due retry's wait for its evaluation's lock (another input's actions being
    carried out, one input at a time) is not proven (None: it is): that process recorded
    none of the evaluation's work meanwhile."""
    src, tw, tg = wait.get("src"), event_time(wait), event_time(granted)
    busy = any(
        e.get("src") == src and e.get("ev") in _AT_WORK and tw <= event_time(e) <= tg for e in evs
    )
    return None if busy else "the evaluation did nothing meanwhile"


def _evaluation_wait(
    cx: Context, wait: dict, delivered: dict | None, held_by: list[Session]
) -> str | None:
    """Why an evaluation's `slot_wait` is not proven (None: it is). A delivery for an
    evaluation another process held all along, from before it arrived (so its lease was
    in Redis when the shell looked it up) to the wait, should have been passed on to that
    process at once (`may_be_held_elsewhere`), not held for a slot."""
    src, tw = wait.get("src"), event_time(wait)
    held = wait.get("held")
    setting_up = wait.get("setting_up") or []
    if not isinstance(held, list) or not isinstance(setting_up, list) or not (held or setting_up):
        return "its slot_wait names no evaluation held"
    for h in setting_up:  # its slot taken, its begin under way: delivered there before
        taken = any(
            e.get("src") == src and event_time(e) <= tw
            for e in of(cx.by_eval.get(str(h), []), "delivered")
        )
        if not taken:
            return f"{h}, named being set up, was not delivered to that process"
    for h in held:
        begun = any(
            e.get("src") == src and event_time(e) <= tw
            for e in of(cx.by_eval.get(str(h), []), "evaluation_started")
        )
        if not begun:
            return f"{h}, named held, was not begun in that process"
    if delivered is not None:
        holder = _holder_all_along(held_by, proc_of(wait), event_time(delivered), tw)
        if holder is not None:
            return (
                f"{holder.proc[0]} held the evaluation from before the delivery to the wait: "
                "it should have been passed on"
            )
    return None


def _holder_all_along(held_by: list[Session], proc: Proc, t0: float, t1: float) -> Session | None:
    """Another process's session open over all of [t0, t1] (begun before t0: its lease was
    written before it recorded `evaluation_started`)."""
    return next((s for s in held_by if s.proc != proc and s.t0 < t0 and s.t1 > t1), None)


def _needless_in_transit(
    evs: list[dict],
    start: dict,
    t_first: float,
    t_arrived: float,
    held_by: list[Session],
) -> tuple[float, list[dict], list[str]]:
    """Evaluation slot waits, in the processes a retry went through before the one that
    started it, for an evaluation another process held all along: not the delivery's own
    latency but a message that should have been passed on at once (seconds, the waits and
    their grants, what each was)."""
    seconds = 0.0
    key: list[dict] = []
    why: list[str] = []
    last_delivery: dict[Any, dict] = {}
    open_waits: dict[Any, dict] = {}
    for e in evs:
        t, src, ev = event_time(e), e.get("src"), e.get("ev")
        if t < t_first or t > t_arrived or src == start.get("src"):
            continue
        if ev == "delivered":
            last_delivery[src] = e
        elif ev == "slot_wait" and e.get("slot") == "evaluation":
            open_waits[src] = e
        elif ev == "slot_granted" and e.get("slot") == "evaluation" and src in open_waits:
            wait = open_waits.pop(src)
            delivered = last_delivery.get(src)
            if delivered is None:
                continue
            holder = _holder_all_along(
                held_by, proc_of(wait), event_time(delivered), event_time(wait)
            )
            if holder is not None:
                seconds += t - event_time(wait)
                key += [wait, e]
                why.append(
                    f"{1000 * (t - event_time(wait)):.1f} ms waiting for an evaluation slot in "
                    f"{src} while {holder.proc[0]} held the evaluation (not passed on)"
                )
    return seconds, key, why


def _waits(
    cx: Context, a: str, r: str, k: int, start: dict, arrived: dict, held_by: list[Session]
) -> tuple[float, float, float, list[dict], list[str]]:
    """Proven waits of attempt k's start in its process since `t_from` (its delivery
    there): (slot and lock waits, begin and recovery, its start marker's write as the
    worker measured it, their events, why a claimed wait is not proven)."""
    src, ts, t_from = start.get("src"), event_time(start), event_time(arrived)
    evs = cx.by_eval.get(a, [])
    mine = [e for e in evs if e.get("src") == src and t_from <= event_time(e) <= ts]
    slot_s = begin_s = marker_s = 0.0
    key: list[dict] = []
    unproven: list[str] = []
    begin_from = t_from
    open_waits: dict[str, dict] = {}
    for e in mine:
        ev = e.get("ev")
        if ev == "slot_wait":
            if e.get("slot") == "evaluation" and event_time(e) > begin_from:
                # the delivery's set-up before it waits for a slot (its plan and whether
                # another worker holds it, read from the store), as a begin's own set-up
                begin_s += event_time(e) - begin_from
                begin_from = event_time(e)
                key.append(e)
            if e.get("slot") == "evaluation" or (e.get("rule_id") == r and e.get("attempt") == k):
                open_waits[str(e.get("slot"))] = e
        elif ev == "start_marked" and e.get("rule_id") == r and e.get("attempt") == k:
            wrote = e.get("write_ms")
            if isinstance(wrote, int | float) and not isinstance(wrote, bool) and wrote > 0:
                marker_s += min(float(wrote) / 1000.0, event_time(e) - t_from)
                key.append(e)
        elif ev == "slot_granted":
            slot = str(e.get("slot"))
            if slot not in open_waits or (
                slot != "evaluation" and (e.get("rule_id"), e.get("attempt")) != (r, k)
            ):
                continue
            wait = open_waits.pop(slot)
            if slot == "rule":
                why = _rule_wait(cx, evs, wait, e)
            elif slot == "lock":
                why = _lock_wait(evs, wait, e)
            else:
                why = _evaluation_wait(cx, wait, arrived, held_by)
            if slot == "evaluation":  # the begin counts from the slot, proven or not
                begin_from = event_time(e)
            if why is None:
                slot_s += event_time(e) - event_time(wait)
                key += [wait, e]
            else:
                article = "an" if slot[0] in "aeiou" else "a"
                unproven.append(f"{article} {slot} slot wait not proven ({why})")
        elif ev in ("evaluation_started", "recovered") and event_time(e) > begin_from:
            begin_s += event_time(e) - begin_from
            begin_from = event_time(e)
            key.append(e)
    return slot_s, begin_s, marker_s, key, unproven


def _lag_s(*events: dict | None) -> float:
    """The event-loop lag the live worker recorded with the events of a retry's path, from
    its first delivery to its start (`engine.runtime.drive.LoopLag`; none in the
    simulator, whose processes have none): how much later than due its loop ran things."""
    lag = 0.0
    for e in events:
        if e is not None:
            value = e.get("loop_lag_ms")
            if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
                lag += float(value) / 1000.0
    return lag


def _due_s(delivery: dict) -> float | None:
    """When the broker owed a retry message: its publisher's stamp plus its delay (the
    queue's TTL counts from the broker's receipt, never earlier), in run seconds."""
    published, delay = delivery.get("published_ms"), delivery.get("delay_ms")
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in (published, delay)):
        return None
    return (float(published) + float(delay)) / 1000.0  # type: ignore[arg-type]


def _due(e: dict) -> float:
    return _due_s(e) or 0.0


def _held_behind(cx: Context, tol: float) -> list[Violation]:
    """Retries the broker held behind a later one: a retry message delivered only after
    one due later than it was delivered, though it was in the broker and due well before
    (by more than the tolerance and the recorded loop lags). With one queue per delay and
    a queue-level TTL, messages come out in the order they fall due; a per-message TTL
    expires only at the queue's head, so a short delay waits behind a long one. The
    delivery's own latency is allowed, and so is the publish's: a message is in the
    broker by its `retry_published` at the latest (recorded once the publish returned,
    confirmed), and its delay counts from the broker's receipt (a queue's TTL; on `pg`
    the visible time is the commit's clock plus the delay), so it may be due as late as
    that answer plus its delay (on `pg` a publish waits for its group commit, tens of
    milliseconds on a busy database); an inversion of the order the messages were surely
    due in is not. Two deliveries to two processes within the tolerance of each other (the
    timer granularity) have no order (at one instant, out of a busy broker's backlog, the
    history lists them by source name); one process's own deliveries come in the order its
    connection carried them."""
    firsts: dict[tuple[Any, Any, Any], dict] = {}
    for e in of(cx.events, "delivered"):
        if e.get("kind") == "retry" and _due_s(e) is not None:
            firsts.setdefault((e.get("attempt_id"), e.get("rule_id"), e.get("attempt")), e)
    # each publish of each retry: when it was answered, and the latest it can be due (the
    # broker's clock starts at its receipt, at the latest that answer)
    answers: dict[tuple[Any, Any, Any], list[tuple[float, float]]] = {}
    for e in of(cx.events, "retry_published"):
        key = (e.get("attempt_id"), e.get("rule_id"), e.get("attempt"))
        delay = e.get("delay_ms")
        numeric = isinstance(delay, int | float) and not isinstance(delay, bool)
        wait_s = float(delay) / 1000.0 if numeric and delay > 0 else 0.0  # type: ignore[arg-type,operator]
        answers.setdefault(key, []).append((event_time(e), event_time(e) + wait_s))
    out: list[Violation] = []
    before: dict | None = None  # the message due last of those delivered before this one
    recent: deque[dict] = deque()  # delivered within the tolerance before it
    mine: dict[Any, dict] = {}  # per process, the message due last it was delivered
    for key, e in sorted(firsts.items(), key=lambda kv: sort_key(kv[1])):
        due = _due_s(e)
        assert due is not None
        while recent and event_time(e) - event_time(recent[0]) > tol:
            x = recent.popleft()
            if before is None or _due(x) > _due(before):
                before = x
        recent.append(e)
        proc = proc_of(e)
        latest = max((x for x in (before, mine.get(proc)) if x is not None), key=_due, default=None)
        if mine.get(proc) is None or due > _due(mine[proc]):
            mine[proc] = e
        if latest is not None:
            ahead = _due_s(latest)
            assert ahead is not None
            gap = ahead - due
            # due by the broker's clock: at the latest, the last publish answered before
            # the delivery (the sweeper's, when it re-published a lost one) plus its delay
            sent = [latest_due for t, latest_due in answers.get(key, ()) if t <= event_time(e)]
            there = max([due, *sent])
            if ahead - there > tol + _lag_s(e, latest) and not cx.fault_between(due, event_time(e)):
                out.append(
                    Violation(
                        NAME,
                        str(e.get("attempt_id")),
                        str(e.get("rule_id")),
                        f"retry of {e.get('rule_id')} attempt {e.get('attempt')} was "
                        f"delivered {event_time(e) - due:.3f} s after it was due, behind a "
                        f"retry due {gap:.3f} s later than it ({latest.get('attempt_id')} "
                        f"{latest.get('rule_id')} attempt {latest.get('attempt')}): the "
                        "broker held it behind a later one",
                        timeline([latest, e]),
                    )
                )
    return out


def check_retry_delays_respected(cx: Context) -> Outcome:
    """For the first `rule_started` of each attempt k >= 2 of a rule: base = the latest
    `status_written` of `failed_attempt_{k-1}` before it (else the `retry_published` of
    attempt k; neither: not judged, counted in `retries_unchecked`). With [low, high] the
    tier's bounds and tol = `delay_tolerance_s`: a start earlier than low - tol is a
    violation; later than high + tol is one unless a fault window overlaps the wait
    (`late_retries_excused`), the sweeper re-published it (`late_retries_swept`), or the
    proven delays cover all but tol of the lateness (`late_retries_explained`): its
    delivery's own (the broker's hold past the message's due time, then its way to the
    process that started it, less any slot wait on the way for an evaluation another
    process held all along: `_needless_in_transit`) and the waits in that process since
    its delivery there (slots, a resume's begin and recovery, its start marker's write);
    a `retry_published` with another tier, a bucket its tier has not, or a delay other
    than its tier and bucket give is one."""
    spec = cx.spec
    settings = RetrySettings.of(spec.policy)
    tol = spec.delay_tolerance_s
    out: list[Violation] = []
    latencies: list[float] = []
    lateness: list[float] = []
    slot_waits: list[float] = []
    resumes: list[float] = []
    unexplained: list[float] = []  # lateness past the tier that no proven wait covers
    delivery_latencies: list[float] = []
    excused = swept_late = unchecked = explained = 0
    for (a, r), evs in sorted(cx.by_pair.items()):
        firsts: dict[int, dict] = {}
        for e in of(evs, "rule_started"):
            k = as_int(e.get("attempt"), 1)
            if k >= 2 and k not in firsts:
                firsts[k] = e
        for k, start in sorted(firsts.items()):
            ts = event_time(start)
            before = [e for e in evs if event_time(e) <= ts]
            status = next(
                (
                    e
                    for e in of(before, "status_written")[::-1]
                    if e.get("status") == f"failed_attempt_{k - 1}"
                ),
                None,
            )
            pub = next(
                (e for e in of(before, "retry_published")[::-1] if e.get("attempt") == k),
                None,
            )
            base = status or pub
            if base is None:
                unchecked += 1
                continue
            bounds = delay_bounds(spec.policy, spec.time_scale, k - 1)
            key = [x for x in (status, pub, start) if x is not None]
            deliveries = [
                e
                for e in of(before, "delivered", "sweeper_retried")
                if e.get("attempt") == k and event_time(e) >= event_time(base)
            ]

            context = deliveries + cx.faults

            def flag(msg: str, a: str = a, r: str = r, k: list = key, c: list = context) -> None:
                out.append(Violation(NAME, a, r, msg, timeline(k, c)))

            problem = _published_problem(pub, bounds, settings, spec.time_scale) if pub else None
            if problem:
                flag(f"retry of {r} attempt {k} {problem}")
            latency = ts - event_time(base)
            latencies.append(latency)
            lateness.append(latency - bounds.high_s)
            tier_text = (
                f"tier {bounds.tier} ({num(bounds.tier_ms)} ms x {num(spec.time_scale)} = "
                f"{num(round(bounds.tier_ms * spec.time_scale / 1000.0, 6))} s"
            )
            # its delivery in the process that started it: the waits there are proven
            here = [e for e in deliveries if e.get("src") == start.get("src")]
            arrived = here[-1] if here else None
            # the delivery's own latency: the broker's hold past the message's own due
            # time (the publisher's stamp plus its delay), then any forward to the owner
            first = next((e for e in deliveries if e.get("ev") == "delivered"), None)
            carried = 0.0
            needless_key: list[dict] = []
            needless_why: list[str] = []
            if first is not None and arrived is not None:
                due = _due_s(first)
                hold = event_time(first) - due if due is not None else 0.0
                carried = max(hold, 0.0) + max(event_time(arrived) - event_time(first), 0.0)
                delivery_latencies.append(round(max(hold, 0.0), 6))
                if arrived is not first:
                    needless, needless_key, needless_why = _needless_in_transit(
                        cx.by_eval.get(a, []),
                        start,
                        event_time(first),
                        event_time(arrived),
                        cx.sessions(a),
                    )
                    carried -= needless
            waited = resumed = marked = 0.0
            waits_key: list[dict] = list(needless_key)
            unproven: list[str] = list(needless_why)
            if arrived is not None:
                waited, resumed, marked, waits_key, unproven = _waits(
                    cx, a, r, k, start, arrived, cx.sessions(a)
                )
                slot_waits.append(round(waited, 6))
                if resumed:
                    resumes.append(round(resumed, 6))
            if latency < bounds.low_s - tol:
                flag(
                    f"{r} attempt {k} started {latency * 1000:.1f} ms after "
                    f"failed_attempt_{k - 1}, before its {tier_text})"
                )
                continue
            allowed = tol + _lag_s(*deliveries, *waits_key, start)
            late = latency - bounds.high_s
            swept = any(
                e.get("reason") == "lost_retry" or e.get("ev") == "sweeper_retried"
                for e in deliveries
            )
            faulted = cx.fault_between(event_time(base), ts)
            if not (faulted or swept):
                unexplained.append(late - carried - waited - resumed - marked)
            if late <= allowed:
                continue
            if faulted:
                excused += 1
            elif swept:
                swept_late += 1
            elif late - carried - waited - resumed - marked <= allowed:
                explained += 1
            else:
                left = late - carried - waited - resumed - marked
                shown = [f"{1000 * left:.1f} ms unexplained"]
                if carried:
                    shown.append(f"{1000 * carried:.1f} ms delivering it")
                if waited:
                    shown.append(f"{1000 * waited:.1f} ms waiting for a slot")
                if resumed:
                    shown.append(f"{1000 * resumed:.1f} ms resuming the evaluation")
                if marked:
                    shown.append(f"{1000 * marked:.1f} ms writing its start marker")
                if arrived is None:
                    shown.append("no delivery of it recorded in the process that started it")
                shown += unproven
                context.extend(waits_key)
                flag(
                    f"{r} attempt {k} started {latency:.3f} s after failed_attempt_"
                    f"{k - 1}: {late:.3f} s past its {tier_text}, "
                    f"{num(round(bounds.high_s, 6))} s with jitter), with no fault open: "
                    + "; ".join(shown)
                    + f" (tolerance {1000 * allowed:.1f} ms)"
                )
    if spec.retries_in_due_order:  # else no queue to hold one behind another
        out.extend(_held_behind(cx, tol))
    cx.stats.update(
        retries_checked=len(latencies),
        retries_unchecked=unchecked,
        retry_latency_s=[round(x, 6) for x in latencies],
        retry_latency_max_s=round(max(latencies), 6) if latencies else 0.0,
        retry_lateness_max_s=round(max(lateness), 6) if lateness else 0.0,
        retry_slot_wait_s=slot_waits,
        retry_slot_wait_max_s=max(slot_waits) if slot_waits else 0.0,
        retry_resume_s=resumes,
        retry_delivery_latency_max_s=max(delivery_latencies) if delivery_latencies else 0.0,
        retry_unexplained_max_s=round(max(unexplained), 6) if unexplained else 0.0,
        late_retries_excused=excused,
        late_retries_swept=swept_late,
        late_retries_explained=explained,
    )
    return len(latencies), out
