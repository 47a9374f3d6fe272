"""`quiet_state`: when the run ends, the engine is quiet about every evaluation it finished.

- No index holds a terminal evaluation (`FinalState.indexes`: the running index, the
  retries index, by their names without the run's namespace). The one exception: a
  terminal evaluation whose `evaluation.completed` is not out yet stays in the running
  index, so that the sweeper finishes announcing it.
- No terminal evaluation is re-swept: no `sweeper_resumed` / `sweeper_retried` after it was
  terminal and announced (its first `final_published`, the runner's winning
  `cancel_written`, or Redis' `final_published` flag at the end).
- Every key the engine wrote carries a TTL (`FinalState.key_ttls`: the `attempt:*` keys and
  the engine's own `engine:*` keys; `TTL` -1 is none, -2 a key gone meanwhile).
- No living worker still holds a terminal, announced evaluation in memory when the run's
  deadline passes (`deadline_passed`: the run could not settle because of it): it has
  nothing left to do there but renew a lease on what is over.
- No lease is left on a terminal, announced evaluation (its `owner` key, read by the runner
  the moment the run settled, `leases_at_settle`, and among the keys at the end): the
  process that announces it, or that drops it as over, gives the lease back.
  Only a holder that died or was frozen (a kill, a crash, a pause) leaves one, to expire.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from chaos.checker.context import (
    TERMINAL_STATES,
    Context,
    Outcome,
    event_time,
    listed,
    of,
    timeline,
)
from chaos.checker.records import Violation

#: The engine's index keys (without the namespace) and what their members name.
RUNNING_INDEX = "engine:running"
RETRIES_INDEX = "engine:retries"
SWEPT = ("sweeper_resumed", "sweeper_retried")
#: Events whose step writes an index (the running one or the retries one).
INDEX_WRITERS = (
    "evaluation_started",
    "parked",
    "status_written",
    "result_persisted",
    "final_published",
    *SWEPT,
)


def member_attempt(member: str) -> str:
    """The attemptId an index member names (`attempt` or `attempt\\x1frule`)."""
    return member.partition("\x1f")[0]


def announced_at(evs: list[dict]) -> float | None:
    """When the evaluation was first terminal and announced (None: not recorded)."""
    marks = of(evs, "final_published") + [
        e for e in of(evs, "cancel_written") if e.get("state") == "cancelled"
    ]
    return min((event_time(e) for e in marks), default=None)


def claim_start(e: Mapping[str, Any]) -> float:
    """The earliest moment a sweeper's claim can have happened: it is recorded once the
    re-publish is out, so a claim recorded after an announcement may still have judged the
    evaluation before it was terminal; only one that began after it re-swept it."""
    start = e.get("claimed_from_ms")
    return start / 1000.0 if isinstance(start, int | float) else event_time(e)


def check_quiet_state(cx: Context) -> Outcome:
    """Cases: each terminal evaluation (indexes read and sweeps looked at) and each key
    whose TTL was read."""
    out: list[Violation] = []
    cases = 0
    indexes = getattr(cx.final, "indexes", None)
    held: dict[str, list[str]] = defaultdict(list)  # attempt -> "index member"
    for key, members in (indexes or {}).items():
        for member in members:
            held[member_attempt(str(member))].append(f"{key} {member!r}")
    excused = 0
    settle_leases = _leases_at_settle(cx.events)
    held_at_deadline = _held_at_deadline(cx.events)
    for a in cx.evaluations:
        fin = cx.final_of(a)
        if fin is None or fin.state not in TERMINAL_STATES:
            continue
        evs = cx.by_eval[a]
        t_quiet = announced_at(evs)
        published = t_quiet is not None or bool(getattr(fin, "published", False))
        cases += 1
        where = held.get(a, [])
        if indexes is not None and where:
            stuck = [w for w in where if not w.startswith(RUNNING_INDEX + " ") or published]
            excused += len(where) - len(stuck)
            if stuck:
                out.append(
                    Violation(
                        "quiet_state",
                        a,
                        None,
                        f"evaluation {fin.state}"
                        + (", announced," if published else "")
                        + f" but still held by {listed(stuck, 3)} when the run ended",
                        timeline(
                            of(evs, "evaluation_terminal", "final_published", "cancel_written")
                            + of(evs, *SWEPT, "terminal_dropped")[-4:],
                            of(evs, "parked", "status_written", "sweeper_retried"),
                        ),
                    )
                )
        leased = a in settle_leases or f"attempt:{a}:owner" in cx.final.key_ttls
        if published and a in held_at_deadline:
            out.append(
                Violation(
                    "quiet_state",
                    a,
                    None,
                    f"evaluation {fin.state} and announced, but still held in memory by a "
                    f"living worker (pid {listed([str(p) for p in held_at_deadline[a]])}) when "
                    "the run's deadline passed",
                    timeline(
                        of(evs, "evaluation_started", "final_published", "cancel_written")[-6:],
                        of(evs, "cancel_seen", "evaluation_abandoned")[-4:],
                    ),
                )
            )
        if published and leased and not _holder_stopped(cx, evs):
            out.append(
                Violation(
                    "quiet_state",
                    a,
                    None,
                    f"evaluation {fin.state} and announced, but its lease is still held when "
                    "the run ended, though no holder of it died or was paused",
                    timeline(
                        of(evs, "evaluation_started", "final_published", "terminal_dropped")[-6:]
                    ),
                )
            )
        if t_quiet is None:
            continue
        late = [e for e in of(evs, *SWEPT) if claim_start(e) > t_quiet]
        if late:
            first = late[0]
            out.append(
                Violation(
                    "quiet_state",
                    a,
                    first.get("rule_id"),
                    f"evaluation {fin.state} and announced, yet re-swept {len(late)} time(s), "
                    f"first by {first.get('src')} {event_time(first) - t_quiet:.3f} s after",
                    timeline(
                        of(evs, "final_published", "cancel_written")[:2] + late[:4],
                        of(evs, "terminal_dropped", "delivered"),
                    ),
                )
            )
    bad: dict[str, list[str]] = defaultdict(list)
    keys = 0
    for key, ttl in sorted(cx.final.key_ttls.items()):
        if ttl == -2:
            continue
        keys += 1
        if ttl == -1:
            owner = _owner(key)
            bad[owner].append(key)
    for owner, names in sorted(bad.items()):
        # the evidence: the evaluation's last writes, or those that last wrote an index
        evs = cx.by_eval.get(owner) or of(cx.events, *INDEX_WRITERS)
        out.append(
            Violation(
                "quiet_state",
                owner,
                None,
                f"{len(names)} key(s) the engine wrote carry no TTL and would live forever: "
                f"{listed(names, 3)}",
                timeline(evs[-4:]),
            )
        )
    cx.stats.update(
        quiet_keys_checked=keys,
        index_members=sum(len(m) for m in (indexes or {}).values()),
        index_members_excused=excused,
    )
    if indexes is None:
        cx.stats.setdefault("unknown_parts", {})["quiet_state"] = "the indexes were not read"
    return cases + keys, out


def _leases_at_settle(events: list[dict]) -> dict[str, Any]:
    """The leases the runner found the moment every evaluation was terminal and announced
    and no living worker held one (`leases_at_settle`): read then, not when the run ends,
    since by then a short lease left behind may have expired."""
    for e in of(events, "leases_at_settle"):
        held = e.get("held")
        if isinstance(held, dict):
            return held
    return {}


def _held_at_deadline(events: list[dict]) -> dict[str, list[Any]]:
    """The evaluations living workers still held in memory when the run's deadline passed
    before it settled (`deadline_passed`), and by which pids."""
    for e in of(events, "deadline_passed"):
        held = e.get("held")
        if isinstance(held, dict):
            return {str(a): list(p) if isinstance(p, list) else [p] for a, p in held.items()}
    return {}


#: What stops a holder without giving its leases back: they expire instead.
_STOPPED = frozenset({"crash", "worker_killed", "worker_paused", "failpoint_fired"})


def _holder_stopped(cx: Context, evs: list[dict]) -> bool:
    """Whether a process that began the evaluation died or was frozen at some point."""
    pids = {e.get("pid") for e in of(evs, "evaluation_started")}
    return any(
        e.get("pid") in pids and (e.get("ev") != "failpoint_fired" or e.get("stall_ms"))
        for e in of(cx.events, *_STOPPED)
    )


def _owner(key: str) -> str:
    """The evaluation an `attempt:*` key belongs to; the key itself for the engine's own."""
    if not key.startswith("attempt:"):
        return key
    body = key[len("attempt:") :]
    if ":rule:" in body:
        return body.split(":rule:", 1)[0]
    return body.rsplit(":", 1)[0] if ":" in body else body
