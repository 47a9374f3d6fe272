"""RuleResult: what a finished rule leaves behind in Redis."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


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
        return json.dumps(
            {
                "attempt": self.attempt,
                "rationale": self.rationale,
                "rule_id": self.rule_id,
                "score": self.score,
                "tokens": self.tokens,
                "verdict": self.verdict,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> RuleResult:
        data: dict[str, Any] = json.loads(raw)
        return cls(**data)
