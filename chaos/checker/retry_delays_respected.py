"""`retry_delays_respected`: attempt k >= 2 of a rule starts no earlier than its tier after
the write of `failed_attempt_{k-1}` (the retry message is published after that write and
the queue TTL starts at the broker, so the measured wait over-estimates the broker's), and
no later than its tier with jitter plus the slack, unless a fault window (from the runner's
own `fault_fired` / `fault_healed` records) was open during the wait or the retry came
back through the sweeper's lost-retry path.

The tier is the checker's own (`oracle.delay_bounds`, from the scenario's `tiers_ms`,
`jitter` and `time_scale`), never the engine's: a retry published to the wrong tier, or
with a delay its tier does not allow, is a violation even when it then arrives on time
for the delay it was given. Zero retries judged is "unknown".
"""

from __future__ import annotations

from chaos.checker.context import (
    Context,
    Outcome,
    as_int,
    event_time,
    num,
    of,
    timeline,
)
from chaos.checker.oracle import DelayBounds, delay_bounds
from chaos.checker.records import Violation

NAME = "retry_delays_respected"


def _published_problem(pub: dict, bounds: DelayBounds, time_scale: float) -> str | None:
    """What is wrong with the `retry_published` record itself, if anything: its tier, or
    a delay outside [tier, tier * (1 + jitter)] (scaled, in ms)."""
    tier = pub.get("tier")
    if isinstance(tier, int) and not isinstance(tier, bool) and tier != bounds.tier:
        return (
            f"published to tier {tier}, but failed_attempt_{bounds.failed} goes to tier "
            f"{bounds.tier} ({num(bounds.tier_ms)} ms)"
        )
    delay = pub.get("delay_ms")
    if isinstance(delay, int | float) and not isinstance(delay, bool):
        low_ms, high_ms = bounds.low_s * 1000.0, bounds.high_s * 1000.0
        if not low_ms <= delay <= high_ms:
            side = "below" if delay < low_ms else "above"
            return (
                f"published with a {num(float(delay))} ms delay, {side} tier {bounds.tier}'s "
                f"[{num(round(low_ms, 3))}, {num(round(high_ms, 3))}] ms "
                f"({num(bounds.tier_ms)} ms x {num(time_scale)}, jitter included)"
            )
    return None


def check_retry_delays_respected(cx: Context) -> Outcome:
    """For the first `rule_started` of each attempt k >= 2 of a rule: base = the latest
    `status_written` of `failed_attempt_{k-1}` before it (else the `retry_published` of
    attempt k; neither: not judged, counted in `retries_unchecked`). With [low, high] the
    tier's bounds: a start earlier than low - `delay_tolerance_s` is a violation; later
    than high + slack (`retry_slack_ms` x `time_scale`) is one unless a fault window
    overlaps the wait (`late_retries_excused`) or the sweeper re-published it
    (`late_retries_swept`); a `retry_published` with another tier or delay is one."""
    spec = cx.spec
    slack_s = spec.retry_slack_s
    out: list[Violation] = []
    latencies: list[float] = []
    lateness: list[float] = []
    excused = swept_late = unchecked = 0
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
                    for e in reversed(of(before, "status_written"))
                    if e.get("status") == f"failed_attempt_{k - 1}"
                ),
                None,
            )
            pub = next(
                (e for e in reversed(of(before, "retry_published")) if e.get("attempt") == k),
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

            problem = _published_problem(pub, bounds, spec.time_scale) if pub else None
            if problem:
                flag(f"retry of {r} attempt {k} {problem}")
            latency = ts - event_time(base)
            latencies.append(latency)
            lateness.append(latency - bounds.high_s)
            tier_text = (
                f"tier {bounds.tier} ({num(bounds.tier_ms)} ms x {num(spec.time_scale)} = "
                f"{num(round(bounds.tier_ms * spec.time_scale / 1000.0, 6))} s"
            )
            if latency < bounds.low_s - spec.delay_tolerance_s:
                flag(
                    f"{r} attempt {k} started {latency * 1000:.1f} ms after "
                    f"failed_attempt_{k - 1}, before its {tier_text})"
                )
            elif latency > bounds.high_s + slack_s:
                swept = any(
                    e.get("reason") == "lost_retry" or e.get("ev") == "sweeper_retried"
                    for e in deliveries
                )
                if cx.fault_between(event_time(base), ts):
                    excused += 1
                elif swept:
                    swept_late += 1
                else:
                    flag(
                        f"{r} attempt {k} started {latency:.3f} s after failed_attempt_"
                        f"{k - 1}: {latency - bounds.high_s:.3f} s past its {tier_text}, "
                        f"{num(round(bounds.high_s, 6))} s with jitter; slack "
                        f"{num(round(slack_s, 6))} s), with no fault open"
                    )
    cx.stats.update(
        retries_checked=len(latencies),
        retries_unchecked=unchecked,
        retry_latency_s=[round(x, 6) for x in latencies],
        retry_latency_max_s=round(max(latencies), 6) if latencies else 0.0,
        retry_lateness_max_s=round(max(lateness), 6) if lateness else 0.0,
        late_retries_excused=excused,
        late_retries_swept=swept_late,
    )
    return len(latencies), out
