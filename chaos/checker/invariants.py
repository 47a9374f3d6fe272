"""The registry: every invariant the checker names, with its meaning and its check.

Adding an invariant is one module exposing `check_<name>(cx: Context) -> Outcome` and one
line below. The order is the report's order (journal, JUnit, summary line).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from chaos.checker.all_terminal import check_all_terminal
from chaos.checker.attempts_monotonic import check_attempts_monotonic
from chaos.checker.cancel_respected import check_cancel_respected
from chaos.checker.completed_delivered import check_completed_delivered
from chaos.checker.context import Context, Outcome
from chaos.checker.dag_order import check_dag_order
from chaos.checker.faults_fired import check_faults_fired
from chaos.checker.history_complete import check_history_complete
from chaos.checker.idempotent_results import check_idempotent_results
from chaos.checker.leases import check_leases_renewed, check_leases_respected
from chaos.checker.matches_reference import check_matches_reference
from chaos.checker.metrics_match_history import check_metrics_match_history
from chaos.checker.no_completed_rerun import check_no_completed_rerun
from chaos.checker.no_engine_error import check_no_engine_error
from chaos.checker.nothing_lost_on_restart import check_nothing_lost_on_restart
from chaos.checker.pass_results_correct import check_pass_results_correct
from chaos.checker.poison_rejected import check_poison_rejected
from chaos.checker.prefetch_respected import check_prefetch_respected
from chaos.checker.prune_only_dependents import check_prune_only_dependents
from chaos.checker.quiet_state import check_quiet_state
from chaos.checker.reruns_explained import check_reruns_explained
from chaos.checker.retries_acked import check_retries_acked
from chaos.checker.retry_budget import check_retry_budget
from chaos.checker.retry_delays_respected import check_retry_delays_respected
from chaos.checker.single_final_result import check_single_final_result
from chaos.checker.started_announced import check_started_announced
from chaos.checker.state_keys_expire import check_state_keys_expire
from chaos.checker.well_formed import check_history_well_formed
from chaos.checker.writes_fenced import check_writes_fenced


@dataclass(frozen=True)
class Invariant:
    """One named anomaly (Elle-style): its name, a one-line meaning, and the pure function
    that judges it, returning (cases judged, violations). `needs_history`: the verdict
    reads the history, so an incomplete one (a gap `history_complete` found) makes a pass
    "unknown"; False for checks of the final state alone."""

    name: str
    meaning: str
    check: Callable[[Context], Outcome]
    needs_history: bool = True


REGISTRY: tuple[Invariant, ...] = (
    Invariant(
        "history_complete",
        "every history line parses (a torn last line excepted) and no source's seq has a gap",
        check_history_complete,
        needs_history=False,
    ),
    Invariant(
        "no_completed_rerun",
        "no rule starts again after its result was durably written",
        check_no_completed_rerun,
    ),
    Invariant(
        "prune_only_dependents",
        "the rules left without a result are exactly the transitive dependents of the "
        "permanently failed ones",
        check_prune_only_dependents,
    ),
    Invariant(
        "idempotent_results",
        "what is kept and announced of a rule is its first durable write; without drift, "
        "every execution gives one verdict: the fault-free reference's",
        check_idempotent_results,
    ),
    Invariant(
        "matches_reference",
        "every evaluation not cancelled on purpose ends as it does without faults: status, "
        "completed, permanently failed and skipped rules, verdicts (without drift)",
        check_matches_reference,
    ),
    Invariant(
        "all_terminal",
        "every submitted evaluation ends completed, partial, failed or cancelled",
        check_all_terminal,
        needs_history=False,
    ),
    Invariant(
        "attempts_monotonic",
        "attempt numbers and persisted statuses never go back, and the final status agrees "
        "with the attempts started",
        check_attempts_monotonic,
    ),
    Invariant(
        "retry_delays_respected",
        "a delayed retry never starts before its tier, nor long after it without a fault",
        check_retry_delays_respected,
    ),
    Invariant(
        "single_final_result",
        "one terminal state per evaluation, and one final result published",
        check_single_final_result,
    ),
    Invariant(
        "state_keys_expire",
        "every attempt:* key in Redis carries a TTL of at most 7 days",
        check_state_keys_expire,
        needs_history=False,
    ),
    Invariant(
        "dag_order",
        "no rule starts before every dependency has a durable result",
        check_dag_order,
    ),
    Invariant(
        "retry_budget",
        "each attempt makes at most immediate_retries + 1 calls, a delayed retry follows a "
        "spent level 1, and permanently_failed follows max_attempts or a permanent error",
        check_retry_budget,
    ),
    Invariant(
        "cancel_respected",
        "after a durable cancel no rule starts and no retry fires, the evaluation stays "
        "cancelled, and only a requested cancel cancels",
        check_cancel_respected,
    ),
    Invariant(
        "pass_results_correct",
        "each pass is announced once its rules are terminal, with the final state's and the "
        "reference's outcome and rules",
        check_pass_results_correct,
    ),
    Invariant(
        "completed_delivered",
        "a consumer bound before the first submit receives evaluation.completed of every "
        "terminal evaluation, every copy the final state",
        check_completed_delivered,
    ),
    Invariant(
        "quiet_state",
        "at the end no index holds a terminal evaluation, none was re-swept, and every key "
        "the engine wrote carries a TTL",
        check_quiet_state,
    ),
    Invariant(
        "reruns_explained",
        "every repeated start of a rule attempt follows a crash, kill, stall or service "
        "fault that explains it",
        check_reruns_explained,
    ),
    Invariant(
        "no_engine_error",
        "no exception escapes the engine's code unexplained by a fault (live: the kinds no "
        "fault raises; in sim: any), and the simulator never ends a run without a verdict",
        check_no_engine_error,
    ),
    Invariant(
        "started_announced",
        "every begin of an evaluation publishes evaluation.started before its ACK and its "
        "first rule start, and a consumer bound before the first submit receives it",
        check_started_announced,
    ),
    Invariant(
        "faults_fired",
        "every fault the scenario plans fires, each failpoint at the rule and evaluation it "
        "is aimed at",
        check_faults_fired,
    ),
    Invariant(
        "retries_acked",
        "a delayed retry is ACKed by the process that ran its attempt once the attempt's "
        "outcome is durable, not held to the evaluation's end",
        check_retries_acked,
    ),
    Invariant(
        "poison_rejected",
        "every poison message is dropped on arrival with the reason its kind calls for, "
        "ACKed once, and leads to no begin, rule start or failed delivery",
        check_poison_rejected,
    ),
    Invariant(
        "prefetch_respected",
        "every worker consumes with a bounded prefetch (4 x max_evaluations at most), and "
        "no consumer of it ever holds more unsettled deliveries than that",
        check_prefetch_respected,
    ),
    Invariant(
        "nothing_lost_on_restart",
        "every message the engine publishes is persistent, and a broker restart loses none "
        "the killed node held: every retry waiting then comes back after it",
        check_nothing_lost_on_restart,
    ),
    Invariant(
        "leases_renewed",
        "a running worker renews every lease it holds before it runs out, unless a fault "
        "of that process or its Redis stopped it",
        check_leases_renewed,
    ),
    Invariant(
        "leases_respected",
        "no sweeper claims and no worker begins an evaluation before the lease its holder "
        "last renewed ran out",
        check_leases_respected,
    ),
    Invariant(
        "history_well_formed",
        "every event an engine process records is one of its documented kinds, with its "
        "fields, their types and the values the protocol allows",
        check_history_well_formed,
    ),
    Invariant(
        "metrics_match_history",
        "a worker that stops leaves Prometheus counters that say what its history says "
        "(calls, tokens, rerun tokens, reruns, retries by level, resumes, evaluations)",
        check_metrics_match_history,
    ),
    Invariant(
        "writes_fenced",
        "every write that landed carried the evaluation's current fence token",
        check_writes_fenced,
    ),
)

#: Name -> one-line meaning, in report order (what the CLI, journal and scenarios read).
INVARIANTS: dict[str, str] = {inv.name: inv.meaning for inv in REGISTRY}
#: Name -> check function.
CHECKS: dict[str, Callable[[Context], Outcome]] = {inv.name: inv.check for inv in REGISTRY}
assert len(INVARIANTS) == len(REGISTRY), "two invariants share a name"
