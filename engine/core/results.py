"""RuleResult: what a finished rule leaves behind in Redis."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _string
from typing import Any

# One encoder for every result: `json.dumps` with separators builds a new one a call, and
# a rule's result is encoded twice (its write, and the final state's check).
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode
_float = float.__repr__


@dataclass(frozen=True, slots=True)
class RuleResult:
    rule_id: str
    verdict: str  # "pass" | "fail" | "needs_review"
    score: float
    tokens: int
    attempt: int = 1
    rationale: str = ""
    # `to_json`'s text, kept: a rule's result is encoded for its write and again for the
    # final state's check (about 10k instructions an encoding). Not part of the value.
    _json: str | None = field(default=None, init=False, repr=False, compare=False)

    def same_verdict(self, other: RuleResult) -> bool:
        """Idempotence is about the verdict, not about who paid for it or when."""
        return (self.rule_id, self.verdict, self.score) == (
            other.rule_id,
            other.verdict,
            other.score,
        )

    def to_json(self) -> str:
        """Compact JSON, keys sorted, encoded once (kept for the next call)."""
        text = self._json
        if text is None:
            text = self._encode()
            object.__setattr__(self, "_json", text)
        return text

    def _encode(self) -> str:
        """The usual types are written out by hand, with the pieces `json` itself uses (a
        third of its cost); anything else goes through `json`, so the text is `json`'s in
        every case."""
        attempt, tokens, score = self.attempt, self.tokens, self.score
        rule_id, verdict, rationale = self.rule_id, self.verdict, self.rationale
        if (
            type(attempt) is int
            and type(tokens) is int
            and type(score) is float
            and math.isfinite(score)
            and type(rule_id) is str
            and type(verdict) is str
            and type(rationale) is str
        ):
            return (
                f'{{"attempt":{attempt},"rationale":{_string(rationale)},'
                f'"rule_id":{_string(rule_id)},"score":{_float(score)},'
                f'"tokens":{tokens},"verdict":{_string(verdict)}}}'
            )
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
