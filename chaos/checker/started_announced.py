"""`started_announced`: every begin of an evaluation is announced by `evaluation.started`,
which reaches a consumer of the harness, before the begin acknowledges its delivery or
starts a rule.

The harness's consumer, bound to `evaluation.started` before the first submit (the
runner's `events_consumer_bound` with that routing key), records each delivery
(`started_received`, the body naming the worker). A worker records `evaluation_started`
once the broker confirmed its `evaluation.started`, then ACKs an execute message (`acked`)
and starts rules (`rule_started`). So, per worker process and evaluation:
- the consumer holds at least as many copies from that worker (`body.worker`) as the
  process recorded begins, and at least one if it acknowledged or started anything: a
  begin whose announcement never reached the consumer was not announced (never
  published, or published after a crash that came first);
- in the process's own order (`seq`), its first `evaluation_started` of the evaluation
  comes before its first `acked` and its first `rule_started`.
A crash between the ACK and a late publish (`after_ack`) leaves an ACK with no copy at
all: the order the engine promises is then visible in the history, live as in the
simulator.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from chaos.checker.context import Context, Outcome, event_time, of, proc_of, timeline
from chaos.checker.records import Violation

STARTED_KEY = "evaluation.started"
RECEIVED = "started_received"
BEGUN = frozenset({"evaluation_started", "acked", "rule_started"})


def check_started_announced(cx: Context) -> Outcome:
    """One case per (worker process, evaluation) that began it; judged only when the
    consumer was bound to `evaluation.started` before the first `submitted`."""
    bound = [
        e for e in of(cx.events, "events_consumer_bound") if e.get("routing_key") == STARTED_KEY
    ]
    submits = of(cx.events, "submitted")
    got = of(cx.events, RECEIVED)
    cx.stats["started_received"] = len(got)
    if not bound or (submits and event_time(bound[0]) > event_time(submits[0])):
        return 0, []
    copies: Counter[tuple[str, str]] = Counter()
    for e in got:
        body = e.get("body")
        if isinstance(body, dict):
            copies[(str(body.get("worker")), str(body.get("attempt_id")))] += 1
    out: list[Violation] = []
    cases = 0
    for a in sorted(cx.by_eval):
        by_proc: dict[tuple[str, Any], list[dict]] = defaultdict(list)
        for e in cx.by_eval[a]:
            if e.get("ev") in BEGUN:
                by_proc[proc_of(e)].append(e)
        for proc, evs in by_proc.items():
            cases += 1
            evs.sort(key=lambda e: e.get("seq") or 0)
            begins = [e for e in evs if e.get("ev") == "evaluation_started"]
            need = max(len(begins), 1)
            have = copies[(proc[0], a)]
            if have < need:
                out.append(
                    Violation(
                        "started_announced",
                        a,
                        None,
                        f"{proc[0]} began the evaluation {len(begins)} time(s)"
                        f"{_acts(evs)}, but the consumer received {have} evaluation.started "
                        "from it",
                        timeline(evs[:6], of(cx.by_eval[a], RECEIVED, "crash", "delivered")),
                    )
                )
                continue
            first = evs[0]
            if first.get("ev") != "evaluation_started":
                out.append(
                    Violation(
                        "started_announced",
                        a,
                        first.get("rule_id"),
                        f"{proc[0]} recorded {first.get('ev')} before evaluation.started was "
                        "confirmed",
                        timeline(evs[:4]),
                    )
                )
    return cases, out


def _acts(evs: list[dict]) -> str:
    acked = sum(1 for e in evs if e.get("ev") == "acked")
    rules = sum(1 for e in evs if e.get("ev") == "rule_started")
    parts = [
        f"acked {acked} delivery(ies)" if acked else "",
        f"started {rules} rule(s)" if rules else "",
    ]
    shown = " and ".join(p for p in parts if p)
    return f", {shown}" if shown else ""
