"""The pure decision core: no asyncio, no simpy, no clock, no I/O."""

from engine.core.actions import (
    AckRetry,
    Action,
    Finish,
    Park,
    PersistResult,
    PersistStatus,
    PublishPassResult,
    Recovered,
    RunRule,
    ScheduleRetry,
    SkipRules,
)
from engine.core.evaluation import Evaluation, ProtocolError
from engine.core.recovery import Recovery, Snapshot, classify
from engine.core.results import RuleResult
from engine.core.states import (
    PERMANENTLY_FAILED,
    EvaluationStatus,
    RuleState,
    failed_attempt,
    parse_status,
    status_rank,
)

__all__ = [
    "PERMANENTLY_FAILED",
    "AckRetry",
    "Action",
    "Evaluation",
    "EvaluationStatus",
    "Finish",
    "Park",
    "PersistResult",
    "PersistStatus",
    "ProtocolError",
    "PublishPassResult",
    "Recovered",
    "Recovery",
    "RuleResult",
    "RuleState",
    "RunRule",
    "ScheduleRetry",
    "SkipRules",
    "Snapshot",
    "classify",
    "failed_attempt",
    "parse_status",
    "status_rank",
]
