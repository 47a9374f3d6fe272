"""RuleResult: what a finished rule leaves behind in Redis."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# One encoder for every result: `json.dumps` with separators builds a new one a call, and
# a rule's result is encoded twice (its write, and the final state's check).
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


@dataclass(frozen=True, slots=True)
class RuleResult:
    rule_id: str
    verdict: str  # "pass" | "fail" | "needs_review"
    score: float
    tokens: int
    attempt: int = 1
    rationale: str = ""

    def same_verdict(self, other: RuleResult) -> bool:
        """Idempotence is about the verdict, not about who paid for it or when."""
        return (self.rule_id, self.verdict, self.score) == (
            other.rule_id,
            other.verdict,
            other.score,
        )

    def to_json(self) -> str:
        return _ENCODE(
            {
                "attempt": self.attempt,
                "rationale": self.rationale,
                "rule_id": self.rule_id,
                "score": self.score,
                "tokens": self.tokens,
                "verdict": self.verdict,
            }
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> RuleResult:
        data: dict[str, Any] = json.loads(raw)
        return cls(**data)
