"""The engine's history vocabulary: every event a worker records, its fields, their types
and, where the protocol fixes them, their values.

Written out here by hand, not read from `engine.core`: the history is a contract between
the engine and whoever reads it (this checker, a dashboard, a post-mortem), and a check
that read the names from the engine would follow a misspelt one. `history_well_formed`
judges every event of a worker or sweeper against this table; the reference page
`docs/reference/history.md` is generated from it.

A field spec is a tuple of accepted types (`None` for a null), a frozenset of accepted
values, or a compiled pattern a string must match whole. A field whose name ends in `?`
may be absent. Every event also carries `t`, `src`, `pid`, `seq` and `ev`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from engine.agent import ERROR_KINDS
from engine.failpoints import FAILPOINTS

Spec = tuple[Any, ...] | frozenset[Any] | re.Pattern[str]

STR: Spec = (str,)
INT: Spec = (int,)
NUM: Spec = (int, float)
BOOL: Spec = (bool,)
DICT: Spec = (dict,)
LIST: Spec = (list,)
OPT_STR: Spec = (str, None)
OPT_INT: Spec = (int, None)

#: What a delivery carries (`execute`: a submit or a resume; `retry`: a delayed retry).
WORK_KINDS: Spec = frozenset({"execute", "retry"})
#: Why an evaluation was begun: a delivery's kind, or `resume` for a stale retry's.
BEGIN_KINDS: Spec = frozenset({"execute", "retry", "resume"})
EVALUATION_STATUSES: Spec = frozenset({"completed", "partial", "failed", "cancelled"})
#: A rule's persisted status: `failed_attempt_N` after a failed attempt N, then for good.
RULE_STATUS: Spec = re.compile(r"failed_attempt_[1-9][0-9]*|permanently_failed")
VERDICTS: Spec = frozenset({"pass", "fail", "needs_review"})
OPT_VERDICT: Spec = frozenset({"pass", "fail", "needs_review", None})
ERRORS: Spec = frozenset(ERROR_KINDS)
PASS_OUTCOMES: Spec = frozenset({"complete", "partial"})
#: A renewal's answer: lost (another holder, or none), held, forgotten by Redis.
RENEWAL: Spec = frozenset({0, 1, 2})
SLOTS: Spec = frozenset({"evaluation", "rule", "lock"})
WRITES: Spec = frozenset({"result", "status", "final", "park", "pass"})
FENCE: Spec = re.compile(r"[0-9]+:.+")
#: Why an evaluation was dropped: a stop, a lost lease, a failed delivery, a task's
#: exception (its type and message), another copy's result write.
ABANDONED: Spec = re.compile(
    r"worker stopping|lease lost|delivery failed|[A-Z]\w*: .*"
    r"|\S+: another write of its result came first",
    re.S,
)
#: Where a submit or a resume came from (`delivered.reason`); None on a retry.
REASONS: Spec = frozenset({"submit", "lost_retry", "stale_heartbeat", "resume", None})

_ID = {"attempt_id": STR}
_RULE = {**_ID, "rule_id": STR, "attempt": INT}
#: A write the fence let through (`write_refused` is the one it did not).
_WRITE = {"fence": FENCE, "landed": frozenset({True}), "sent_ms": INT}
#: What the live driver adds to the events whose lateness the checker weighs.
_LAG = {"loop_lag_ms?": NUM}

EVENTS: dict[str, dict[str, Spec]] = {
    # --- a delivery, from its arrival to its settlement
    "delivered": {
        **_ID,
        "kind": WORK_KINDS,
        "rule_id": OPT_STR,
        "attempt": OPT_INT,
        "redelivered": BOOL,
        "reason": REASONS,
        "published_ms": INT,
        "delay_ms": OPT_INT,
        **_LAG,
    },
    "message_rejected": {"attempt_id?": STR, "reason": STR, "detail?": STR},
    "delivery_failed": {**_ID, "error": STR},
    "duplicate_dropped": {**_ID, "kind": WORK_KINDS},
    "terminal_dropped": {**_ID, "kind": WORK_KINDS},
    "stale_retry_dropped": _RULE,
    "forwarded": {**_ID, "to": STR, **_LAG},
    "forward_failed": {**_ID, "to": STR},
    "acked": _ID,
    "prefetch_window": {"in_flight": INT, "queue": STR, "prefetch": INT, "max_evaluations": INT},
    "slot_wait": {
        **_ID,
        "slot": SLOTS,
        "kind?": WORK_KINDS,
        "held?": LIST,
        "setting_up?": LIST,
        "slots?": INT,
        "rule_id?": STR,
        "attempt?": INT,
        "running?": DICT,
    },
    "slot_granted": {**_ID, "slot": SLOTS, "rule_id?": STR, "attempt?": INT, **_LAG},
    # --- an evaluation held
    "evaluation_started": {
        **_ID,
        "plan": STR,
        "resumed": BOOL,
        "kind": BEGIN_KINDS,
        "reason": REASONS,
        "fence": FENCE,
        "lease_ms": INT,
    },
    "recovered": {**_ID, "loaded": LIST, "retrying": DICT, "failed": LIST, "fresh": LIST},
    "evaluation_reinstated": {**_ID, "plan_restored": BOOL},
    "lease_renewed": {
        **_ID,
        "fence": FENCE,
        "held": RENEWAL,
        "sent_ms": INT,
        "lease_ms": INT,
        "expires_ms": OPT_INT,
    },
    "parking": {**_ID, "sent_ms": INT},
    "parked": {**_ID, "waiting": DICT, **_WRITE},
    "cancel_received": {**_ID, "held": BOOL},
    "cancel_seen": {**_ID, "state": EVALUATION_STATUSES},
    "evaluation_abandoned": {**_ID, "reason": ABANDONED},
    # --- a rule's attempts
    "rule_started": {**_RULE, "try_no": INT, "rerun": BOOL, "execution": INT, **_LAG},
    "start_marked": {**_RULE, "write_ms": NUM},
    "rule_finished": {**_RULE, "try_no": INT, "verdict": VERDICTS, "score": NUM, "tokens": INT},
    "rule_failed": {
        **_RULE,
        "try_no": INT,
        "kind": ERRORS,
        "retryable": BOOL,
        "tokens": INT,
    },
    "result_persisted": {
        **_RULE,
        "verdict": VERDICTS,
        "score": NUM,
        "won": BOOL,
        "kept_verdict": OPT_VERDICT,
        **_WRITE,
    },
    "status_written": {
        **_ID,
        "rule_id": STR,
        "status": RULE_STATUS,
        "kept": (None, RULE_STATUS),
        "error": ERRORS,
        "due_ms": OPT_INT,
        **_WRITE,
    },
    "write_refused": {
        **_ID,
        "rule_id": OPT_STR,
        "write": WRITES,
        **_WRITE,
        "landed": frozenset({False}),
    },
    "retry_published": {**_RULE, "tier": INT, "bucket": INT, "delay_ms": INT, "sent_ms?": INT},
    "retry_not_scheduled": {**_RULE, "state": EVALUATION_STATUSES},
    "retry_acked": _RULE,
    "retry_requeued": _RULE,
    "rules_skipped": {**_ID, "rule_ids": LIST, "because_of": STR},
    # --- an evaluation's end
    "pass_published": {**_ID, "pass_id": STR, "outcome": PASS_OUTCOMES, "rules": DICT, **_WRITE},
    "evaluation_terminal": {
        **_ID,
        "status": EVALUATION_STATUSES,
        "won": BOOL,
        "decided": EVALUATION_STATUSES,
        "verdicts": DICT,
        **_WRITE,
    },
    "results_restored": {**_ID, "rule_ids": LIST, "status": EVALUATION_STATUSES},
    "final_state_restored": {**_ID, "rule_ids": LIST, "status": EVALUATION_STATUSES},
    "passes_restored": {**_ID, "pass_ids": LIST},
    "final_published": {**_ID, "status": EVALUATION_STATUSES, "sent_ms": INT},
    # --- the sweeper
    "sweeper_resumed": {**_ID, "claimed_from_ms": INT},
    "sweeper_retried": {**_RULE, "claimed_from_ms": INT},
    # --- the process
    "worker_started": {"sweeper": BOOL},
    "worker_stopping": {},
    "worker_stopped": {"metrics": DICT},
    "failpoint_fired": {
        "failpoint": frozenset(FAILPOINTS),
        "action": STR,
        "stall_ms": INT,
        "rule": OPT_STR,
        "attempt_id": OPT_STR,
        "until?": STR,
    },
    # a stall with `until` is over: its event came, or its longest elapsed
    "failpoint_released": {
        "failpoint": frozenset(FAILPOINTS),
        "rule": OPT_STR,
        "attempt_id": OPT_STR,
        "came": BOOL,
    },
    "crash": {"failpoint": frozenset(FAILPOINTS), "rule": OPT_STR, "attempt_id": OPT_STR},
    "engine_error": {"error": STR, "during": STR, "traceback": STR, "attempt_id?": STR},
}

#: The bodies of the engine's `evaluation.*` events, as the runner's consumer receives them
#: (`started_received`, `completed_received`, `pass_received`), and the message id each
#: must carry after `{attempt_id}:` (with the body's fields filled in): a consumer dedupes
#: on it.
MESSAGES: dict[str, tuple[str, dict[str, Spec]]] = {
    "started_received": (
        "started",
        {"attempt_id": STR, "plan": STR, "resumed": BOOL, "worker": STR},
    ),
    "completed_received": (
        "completed",
        {"attempt_id": STR, "status": EVALUATION_STATUSES, "verdicts": DICT},
    ),
    "pass_received": (
        "pass:{pass_id}",
        {"attempt_id": STR, "pass_id": STR, "outcome": PASS_OUTCOMES, "rules": DICT},
    ),
}


def _retryable_as_its_kind(e: dict) -> str | None:
    kind = e.get("kind")
    if kind in ERROR_KINDS and e.get("retryable") is not ERROR_KINDS[kind]:
        retryable = ERROR_KINDS[kind]
        return f"`retryable` {e.get('retryable')!r} for a {kind} error, which is {retryable}"
    return None


def _expiry_as_its_answer(e: dict) -> str | None:
    held, expires = e.get("held"), e.get("expires_ms")
    if (held == 0) != (expires is None):
        return f"`held` {held!r} and `expires_ms` {expires!r} (a lease runs out only if held)"
    return None


#: Why each kind of work message was published: a retry by its owner (no reason) or by
#: the sweeper that found it lost; an execute by a submit, by the sweeper's resume, or by
#: a resume from a checkpoint that was asked for (`engine.submit --resume`).
REASONS_OF = {"retry": (None, "lost_retry"), "execute": ("submit", "stale_heartbeat", "resume")}


def _retry_or_execute(e: dict) -> str | None:
    """A retry names its rule, attempt and delay; an execute names none of them; each
    carries a reason of its own kind."""
    kind = e.get("kind")
    retry = kind == "retry"
    named = [k for k in ("rule_id", "attempt", "delay_ms") if (e.get(k) is None) is retry]
    if named:
        return f"kind {kind!r} and `{'`, `'.join(named)}` " + ("missing" if retry else "given")
    if e.get("reason") not in REASONS_OF.get(str(kind), ()):
        return f"kind {kind!r} with reason {e.get('reason')!r}"
    return None


def _a_delayed_retry(e: dict) -> str | None:
    """A start marker's write is measured for a delayed retry's first start only."""
    attempt, wrote = e.get("attempt"), e.get("write_ms")
    if isinstance(attempt, int) and attempt < 2:
        return f"attempt {attempt}: only a delayed retry (attempt 2 or later) is measured"
    if isinstance(wrote, int | float) and wrote <= 0:
        return f"`write_ms` {wrote!r}: a write to Redis takes time"
    return None


def _rerun_as_counted(e: dict) -> str | None:
    """A first try is a rerun exactly when an earlier execution of its attempt started
    (the start marker counts them); a level-1 retry is never one."""
    execution, try_no = e.get("execution"), e.get("try_no")
    if not isinstance(execution, int) or not isinstance(try_no, int):
        return None  # the fields' own types are judged apart
    if execution < 1:
        return f"`execution` {execution} below 1"
    if e.get("rerun") is not (try_no == 1 and execution > 1):
        return f"`rerun` {e.get('rerun')!r} for try {try_no} of execution {execution}"
    return None


#: What holds between the fields of one event, each a sentence when it does not.
AGREES: dict[str, Callable[[dict], str | None]] = {
    "rule_started": _rerun_as_counted,
    "start_marked": _a_delayed_retry,
    "rule_failed": _retryable_as_its_kind,
    "lease_renewed": _expiry_as_its_answer,
    "delivered": _retry_or_execute,
}

#: Every event's own fields, written by the history itself.
COMMON = ("t", "src", "pid", "seq", "ev")


def fits(value: Any, spec: Spec) -> bool:
    """Whether `value` is what `spec` accepts (an int is a number, a bool never is)."""
    if isinstance(spec, re.Pattern):
        return type(value) is str and spec.fullmatch(value) is not None
    if isinstance(spec, frozenset):  # of the same type too: True is not 1, nor 1.0 1
        try:
            return value in spec and any(type(x) is type(value) for x in spec)
        except TypeError:  # unhashable: a list or a dict where a name belongs
            return False
    for t in spec:
        if t is None:
            if value is None:
                return True
        elif isinstance(t, re.Pattern | frozenset):
            if fits(value, t):
                return True
        elif t is float:
            if type(value) is float:
                return True
        elif type(value) is t:
            return True
    return False


def describe(spec: Spec) -> str:
    """A spec as a reader writes it: `str`, `int or null`, `one of a, b`."""
    if isinstance(spec, re.Pattern):
        return f"matching `{spec.pattern}`" if spec.pattern else "a string"
    if isinstance(spec, frozenset):
        return "one of " + ", ".join(
            "null" if v is None else str(v) for v in sorted(spec, key=lambda v: (v is None, str(v)))
        )
    return " or ".join(
        "null" if t is None else t.__name__ if isinstance(t, type) else describe(t) for t in spec
    )


def _well_formed(
    spec: dict[str, Spec], agrees: Callable[[dict], str | None] | None
) -> Callable[[dict], bool]:
    """One kind's check, compiled once from its specs: a function of straight-line tests,
    one a field, each answering as `fits` does (the checker asks it of every event a
    run records, and a loop of a call a field cost three times as much)."""
    required = frozenset(n for n in spec if not n.endswith("?"))
    allowed = frozenset(n.rstrip("?") for n in spec) | frozenset(COMMON)
    names: dict[str, Any] = {"required": required, "allowed": allowed, "agrees": agrees}
    lines = [
        "def ok(e):",
        "    keys = e.keys()",
        "    if not (required <= keys and keys <= allowed):",
        "        return False",
    ]
    for i, (name, field) in enumerate(spec.items()):
        key = name.rstrip("?")
        value = f"e[{key!r}]"
        if isinstance(field, tuple) and all(t is None or isinstance(t, type) for t in field):
            names[f"types{i}"] = frozenset(type(None) if t is None else t for t in field)
            test = f"type({value}) not in types{i}"
        elif isinstance(field, frozenset):  # of the same type too, as `fits` has it
            names[f"kinds{i}"] = frozenset(type(x) for x in field)
            names[f"values{i}"] = field
            test = f"type({value}) not in kinds{i} or {value} not in values{i}"
        elif isinstance(field, re.Pattern):
            names[f"pattern{i}"] = field
            test = f"type({value}) is not str or pattern{i}.fullmatch({value}) is None"
        else:
            names[f"field{i}"] = field
            test = f"not fits({value}, field{i})"
        guard = "" if key in required else f"{key!r} in e and ("
        lines += [f"    if {guard}{test}{')' if guard else ''}:", "        return False"]
    lines.append("    return agrees is None or agrees(e) is None")
    names["fits"] = fits
    exec("\n".join(lines), names)  # the specs above, this module's own
    ok: Callable[[dict], bool] = names["ok"]
    return ok


#: Per kind, whether an event is well formed (True: `problems` would find nothing): the
#: common case, judged without building a sentence or a list.
WELL_FORMED: dict[str, Callable[[dict], bool]] = {
    ev: _well_formed(spec, AGREES.get(ev)) for ev, spec in EVENTS.items()
}
