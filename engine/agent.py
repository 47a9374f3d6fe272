"""AgentService: evaluates one rule (in production an LLM call), and a seeded fake of it.

The engine only needs an agent that answers, fails transiently, or fails for good. The fake
draws all of that (latency, error kind, tokens, verdict) from a stable hash of its inputs
(seed, attemptId, ruleId, attempt, try), never from call order or a counter, so a run
replays exactly and a rerun of an attempt draws what its first execution drew. Its verdict
depends on (seed, attemptId, ruleId) only, unless the profile's `drift` lets a rerun (a
second or later execution of the same attempt and try) answer otherwise, as a real LLM may.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.core.results import RuleResult
from engine.plan import Rule
from engine.policy import MAX_SEED
from engine.validation import describe

# --- error kinds ---------------------------------------------------------------------------

#: The one table of agent error kinds: kind -> retryable. Everything else reads it.
ERROR_KINDS: dict[str, bool] = {
    "timeout": True,
    "quota": True,  # HTTP 429
    "tool_unavailable": True,
    "invalid_output": False,
}
TRANSIENT_KINDS: tuple[str, ...] = tuple(k for k, retry in ERROR_KINDS.items() if retry)
PERMANENT_KINDS: tuple[str, ...] = tuple(k for k, retry in ERROR_KINDS.items() if not retry)

#: Share of a call's drawn tokens that a failed call still costs. A timeout and an invalid
#: output were generated in full; a 429 is refused before any generation; a missing tool
#: stops the agent half way.
FAILED_CALL_TOKENS: dict[str, float] = {
    "timeout": 1.0,
    "quota": 0.0,
    "tool_unavailable": 0.5,
    "invalid_output": 1.0,
}
#: Share of a call's drawn latency that a failed call takes (a timeout waits for the cap,
#: see `FakeAgent.draw`).
FAILED_CALL_LATENCY: dict[str, float] = {
    "timeout": 1.0,
    "quota": 0.1,
    "tool_unavailable": 0.5,
    "invalid_output": 1.0,
}


class AgentError(Exception):
    """An agent call that gave no result. `retryable` comes from `ERROR_KINDS`."""

    kind: str
    retryable: bool

    def __init__(self, kind: str, message: str = "", *, tokens: int = 0) -> None:
        if kind not in ERROR_KINDS:
            raise ValueError(f"unknown agent error kind {kind!r}; known: {sorted(ERROR_KINDS)}")
        self.kind = kind
        self.retryable = ERROR_KINDS[kind]
        self.message = message
        self.tokens = tokens  # what the failed call still cost
        super().__init__(f"{kind}: {message}" if message else kind)

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.kind, self.message), {"tokens": self.tokens})


class TransientAgentError(AgentError):
    """Worth retrying: timeout, quota (429), tool unavailable."""

    def __init__(self, kind: str, message: str = "", *, tokens: int = 0) -> None:
        super().__init__(kind, message, tokens=tokens)
        if not self.retryable:
            raise ValueError(f"{kind!r} is not a transient agent error kind")


class PermanentAgentError(AgentError):
    """Not worth retrying: the same call would fail the same way (invalid output)."""

    def __init__(self, kind: str = "invalid_output", message: str = "", *, tokens: int = 0) -> None:
        super().__init__(kind, message, tokens=tokens)
        if self.retryable:
            raise ValueError(f"{kind!r} is not a permanent agent error kind")


def agent_error(kind: str, message: str = "", *, tokens: int = 0) -> AgentError:
    """The right `AgentError` subclass for `kind`."""
    if kind not in ERROR_KINDS:
        raise ValueError(f"unknown agent error kind {kind!r}; known: {sorted(ERROR_KINDS)}")
    cls = TransientAgentError if ERROR_KINDS[kind] else PermanentAgentError
    return cls(kind, message, tokens=tokens)


# --- the service ---------------------------------------------------------------------------


@runtime_checkable
class AgentService(Protocol):
    """Evaluates one rule of one submission; in production, an LLM call.

    Design constraint: the agent must be idempotent in its verdict. Evaluating the same rule
    of the same submission again (an immediate retry, a delayed retry, a rerun after a crash
    in the write window) must give the same verdict and score, because the engine may run a
    rule more than once and the checker compares every successful execution with a
    fault-free reference run. A real LLM client gets there with temperature 0, a pinned
    model and a cache keyed by (attemptId, ruleId).

    `attempt` is the level-2 attempt (1-based), `try_no` the level-1 try within it
    (1-based), `execution` how many times this attempt has been started (the engine's start
    marker: 2 and more are reruns after a crash). Failures raise `TransientAgentError`
    (retry) or `PermanentAgentError`.
    """

    async def evaluate(
        self, attempt_id: str, rule: Rule, attempt: int, try_no: int, *, execution: int = 1
    ) -> RuleResult:
        """Return the rule's result, or raise an `AgentError` subclass."""
        ...


# --- the fake agent's profile --------------------------------------------------------------


class AgentProfileError(ValueError):
    """A profile that cannot be used; one line naming the field."""


# Bounds of a profile, so that no draw overflows and every count fits the history's 64-bit
# integers (the seed's bound, MAX_SEED, is the engine's: engine.policy).
#: Mean tokens of one call.
MAX_TOKENS = 1_000_000
#: Any latency parameter: an hour per call.
MAX_LATENCY_MS = 3_600_000
#: Lognormal spread: exp(12 * sigma) stays a finite float (a draw is at most ~12 sigmas out).
MAX_SIGMA = 5
#: `fail_rules` counts.
MAX_FORCED_FAILURES = 10_000
#: `error_kinds` weights.
MAX_WEIGHT = 1e6


@dataclass(frozen=True, slots=True)
class Latency:
    """A latency distribution in ms: fixed `value_ms`, uniform [`low_ms`, `high_ms`], or
    lognormal with `median_ms` and `sigma`; any draw is clipped to `cap_ms` if set."""

    kind: Literal["fixed", "uniform", "lognormal"] = "fixed"
    value_ms: float = 0.0
    low_ms: float = 0.0
    high_ms: float = 0.0
    median_ms: float = 0.0
    sigma: float = 0.5
    cap_ms: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise AgentProfileError(
                f"latency_ms.kind: expected 'fixed', 'uniform' or 'lognormal', got {self.kind!r}"
            )
        for name in ("value_ms", "low_ms", "high_ms", "median_ms", "sigma"):
            value = getattr(self, name)
            most = MAX_SIGMA if name == "sigma" else MAX_LATENCY_MS
            if not (math.isfinite(value) and 0 <= value <= most):
                raise AgentProfileError(
                    f"latency_ms.{name}: must be a finite number within [0, {most}]"
                )
        if self.kind == "uniform" and self.high_ms < self.low_ms:
            raise AgentProfileError("latency_ms.high_ms: must be >= low_ms")
        if self.kind == "lognormal" and self.median_ms <= 0:
            raise AgentProfileError("latency_ms.median_ms: must be > 0 for a lognormal latency")
        if self.cap_ms is not None and not (
            math.isfinite(self.cap_ms) and 0 <= self.cap_ms <= MAX_LATENCY_MS
        ):
            raise AgentProfileError(
                f"latency_ms.cap_ms: must be a finite number within [0, {MAX_LATENCY_MS}]"
            )

    @classmethod
    def fixed(cls, value_ms: float, cap_ms: float | None = None) -> Latency:
        return cls("fixed", value_ms=value_ms, cap_ms=cap_ms)

    @classmethod
    def uniform(cls, low_ms: float, high_ms: float, cap_ms: float | None = None) -> Latency:
        return cls("uniform", low_ms=low_ms, high_ms=high_ms, cap_ms=cap_ms)

    @classmethod
    def lognormal(cls, median_ms: float, sigma: float, cap_ms: float | None = None) -> Latency:
        return cls("lognormal", median_ms=median_ms, sigma=sigma, cap_ms=cap_ms)

    def sample(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            value = self.value_ms
        elif self.kind == "uniform":
            value = rng.uniform(self.low_ms, self.high_ms)
        else:
            value = rng.lognormvariate(math.log(self.median_ms), self.sigma)
        if self.cap_ms is not None:
            value = min(value, self.cap_ms)
        return value

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "fixed":
            out["value_ms"] = self.value_ms
        elif self.kind == "uniform":
            out.update(low_ms=self.low_ms, high_ms=self.high_ms)
        else:
            out.update(median_ms=self.median_ms, sigma=self.sigma)
        if self.cap_ms is not None:
            out["cap_ms"] = self.cap_ms
        return out


def _equal_weights() -> dict[str, float]:
    return dict.fromkeys(TRANSIENT_KINDS, 1.0)


def _short(value: Any) -> str:
    """A value for an error line, at most ~80 characters (an int of 4,000 digits too)."""
    if isinstance(value, int) and abs(value) >= 10**30:  # repr fails past 4,300 digits
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_rate(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and 0.0 <= value <= 1.0):
        raise AgentProfileError(f"{name}: must be a number within [0, 1], got {_short(value)}")


@dataclass(frozen=True)
class AgentProfile:
    """How the fake agent behaves. Every random choice is seeded by `seed`.

    - `error_rate`: probability that a call fails transiently, with a kind drawn from the
      `error_kinds` weights (default: equal among the transient kinds; a kind left out of a
      given mapping has weight 0);
    - `permanent_error_rate`: probability that a call fails with `invalid_output`;
    - `tokens`: mean tokens per call, spread uniformly by +/- `token_spread` (a share);
    - `fail_rules`: rule id -> number of initial calls (per evaluation) that fail
      transiently whatever `error_rate` says, counted from (attempt, try) as a fault-free run
      makes them (`FakeAgent.immediate_retries` + 1 tries per attempt), so a rerun after a
      crash fails exactly where the first execution did;
    - `always_fail_rules`: rules whose every call fails transiently;
    - `pass_rate`: share of "pass" verdicts; of the others, a `review_share` are
      "needs_review" and the rest "fail";
    - `drift`: probability that a rerun (execution 2 or more of the same attempt and try)
      draws its verdict afresh, as a real LLM may answer differently the second time. It
      changes verdicts (and scores) only, never errors, latency or tokens, so statuses and
      rule sets stay those of a fault-free run; 0 (the default): every call of a rule agrees.
    """

    seed: int = 0
    latency_ms: Latency = field(default_factory=Latency)
    error_rate: float = 0.0
    error_kinds: dict[str, float] = field(default_factory=_equal_weights)
    permanent_error_rate: float = 0.0
    tokens: int = 1200
    token_spread: float = 0.25
    fail_rules: dict[str, int] = field(default_factory=dict)
    always_fail_rules: frozenset[str] = frozenset()
    pass_rate: float = 0.7
    review_share: float = 0.25
    drift: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise AgentProfileError(f"seed: must be an integer, got {self.seed!r}")
        if not isinstance(self.latency_ms, Latency):
            raise AgentProfileError("latency_ms: must be a Latency")
        for name in (
            "error_rate",
            "permanent_error_rate",
            "token_spread",
            "pass_rate",
            "review_share",
            "drift",
        ):
            _check_rate(name, getattr(self, name))
        if self.error_rate + self.permanent_error_rate > 1.0:
            raise AgentProfileError(
                "permanent_error_rate: error_rate + permanent_error_rate must be <= 1"
            )
        if not isinstance(self.tokens, int) or not 0 <= self.tokens <= MAX_TOKENS:
            raise AgentProfileError(
                f"tokens: must be an integer within [0, {MAX_TOKENS}], got {_short(self.tokens)}"
            )
        for kind, weight in self.error_kinds.items():
            if kind not in TRANSIENT_KINDS:
                raise AgentProfileError(
                    f"error_kinds.{_short(kind)}: not a transient error kind; "
                    f"expected one of {', '.join(TRANSIENT_KINDS)}"
                )
            if not (math.isfinite(weight) and 0 <= weight <= MAX_WEIGHT):
                raise AgentProfileError(
                    f"error_kinds.{kind}: weight must be within [0, {MAX_WEIGHT:.0f}]"
                )
        if sum(self.error_kinds.values()) <= 0:
            raise AgentProfileError("error_kinds: at least one weight must be > 0")
        for rule_id, count in self.fail_rules.items():
            if not isinstance(count, int) or not 0 <= count <= MAX_FORCED_FAILURES:
                raise AgentProfileError(
                    f"fail_rules.{_short(rule_id)}: must be an integer within "
                    f"[0, {MAX_FORCED_FAILURES}]"
                )
        if not isinstance(self.always_fail_rules, frozenset):
            object.__setattr__(self, "always_fail_rules", frozenset(self.always_fail_rules))

    @classmethod
    def from_dict(cls, data: Any) -> AgentProfile:
        """Build a profile from a decoded YAML/JSON mapping.

        `latency_ms` is a number (fixed) or a mapping like `{kind: uniform, low_ms: 10,
        high_ms: 50}`; `always_fail_rules` a list. Bad input raises `AgentProfileError`
        (a `ValueError`) with one line naming the field.
        """
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise AgentProfileError("agent profile: expected a mapping")
        try:
            spec = _ProfileSpec.model_validate(dict(data))
        except ValidationError as exc:
            raise AgentProfileError(describe(exc, dict(data))) from None
        values = spec.model_dump(exclude_unset=True)
        try:
            if "latency_ms" in values:
                values["latency_ms"] = _latency_from(values["latency_ms"])
            if "always_fail_rules" in values:
                values["always_fail_rules"] = frozenset(values["always_fail_rules"])
            return cls(**values)
        except OverflowError:  # an integer too large for a float
            raise AgentProfileError("agent profile: a number is too large") from None

    def to_dict(self) -> dict[str, Any]:
        """The profile as `from_dict` reads it (for recording a run's configuration)."""
        return {
            "seed": self.seed,
            "latency_ms": self.latency_ms.to_dict(),
            "error_rate": self.error_rate,
            "error_kinds": dict(self.error_kinds),
            "permanent_error_rate": self.permanent_error_rate,
            "tokens": self.tokens,
            "token_spread": self.token_spread,
            "fail_rules": dict(self.fail_rules),
            "always_fail_rules": sorted(self.always_fail_rules),
            "pass_rate": self.pass_rate,
            "review_share": self.review_share,
            "drift": self.drift,
        }


_Ms = Annotated[float, Field(ge=0, le=MAX_LATENCY_MS, allow_inf_nan=False)]


class _LatencySpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    kind: Literal["fixed", "uniform", "lognormal"] = "fixed"
    value_ms: _Ms = 0.0
    low_ms: _Ms = 0.0
    high_ms: _Ms = 0.0
    median_ms: _Ms = 0.0
    sigma: float = Field(default=0.5, ge=0, le=MAX_SIGMA, allow_inf_nan=False)
    cap_ms: _Ms | None = None


class _ProfileSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    latency_ms: Any = 0.0  # checked by `_latency_from`, which knows its two shapes
    error_rate: float = 0.0
    error_kinds: dict[str, float] = {}
    permanent_error_rate: float = 0.0
    tokens: int = Field(default=1200, ge=0, le=MAX_TOKENS)
    token_spread: float = 0.25
    fail_rules: dict[str, Annotated[int, Field(ge=0, le=MAX_FORCED_FAILURES)]] = {}
    always_fail_rules: list[str] = []
    pass_rate: float = 0.7
    review_share: float = 0.25
    drift: float = 0.0


def _latency_from(raw: Any) -> Latency:
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        if not (isinstance(raw, float) or 0 <= raw <= MAX_LATENCY_MS):  # float() may overflow
            raise AgentProfileError(
                f"latency_ms: must be a finite number within [0, {MAX_LATENCY_MS}]"
            )
        return Latency.fixed(float(raw))
    if not isinstance(raw, Mapping):
        raise AgentProfileError(
            "latency_ms: expected a number of ms or a mapping with 'kind' "
            "(fixed, uniform or lognormal)"
        )
    try:
        spec = _LatencySpec.model_validate(dict(raw))
    except ValidationError as exc:
        raise AgentProfileError(describe(exc, dict(raw), prefix="latency_ms")) from None
    return Latency(**spec.model_dump())


# --- the fake agent ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Draw:
    """Everything one fake call does: how long it takes, what it costs, how it ends.

    Exactly one of `error` (an `ERROR_KINDS` key) and `result` is set.
    """

    latency_ms: float
    error: str | None
    result: RuleResult | None
    tokens: int


def _stable_digest(*parts: object) -> bytes:
    # repr of a tuple of str and int is unambiguous and the same in every process
    return _digest(repr(parts))


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=64).digest()


def _uniform(digest: bytes, i: int) -> float:
    """The `i`th uniform of a digest (of eight), as `_HashStream` reads it."""
    return (int.from_bytes(digest[8 * i : 8 * i + 8], "big") >> 11) * (2.0**-53)


class _HashStream(random.Random):
    """Uniforms read straight from a 64-byte digest (eight of them), then from a seeded
    Mersenne Twister: building a `random.Random` per call costs more than the hash.
    `start` skips the uniforms a caller read itself (`_uniform`)."""

    def __init__(self, digest: bytes, start: int = 0) -> None:  # no seeding: that's the cost
        self._digest = digest
        self._next = start
        self._fallback: random.Random | None = None

    def random(self) -> float:
        i = self._next
        if i < 8:
            self._next = i + 1
            return _uniform(self._digest, i)
        if self._fallback is None:
            self._fallback = random.Random(int.from_bytes(self._digest, "big"))
        return self._fallback.random()


class FakeAgent:
    """A deterministic `AgentService` driven by an `AgentProfile`.

    `draw` is pure and is what the simulator calls; `evaluate` is the live runtime's async
    entry point: it draws, sleeps the drawn latency scaled by `time_scale`, then returns the
    result or raises the error.

    `immediate_retries` is the engine's level-1 count (engine.policy.RetryPolicy): with it
    the agent numbers a call from (attempt, try) alone, for `fail_rules`.

    `nondeterministic=True` is a deliberately broken mutant: the verdict then also depends
    on a salt and on (attempt, try_no, execution), so reruns disagree and the idempotence
    check has something to catch. The salt is process-random unless `salt` is given (pass
    one to replay a mutant run).
    """

    def __init__(
        self,
        profile: AgentProfile,
        time_scale: float = 1.0,
        *,
        nondeterministic: bool = False,
        salt: int | None = None,
        immediate_retries: int = 2,
    ) -> None:
        if not (math.isfinite(time_scale) and time_scale >= 0):
            raise ValueError("time_scale must be a finite number >= 0")
        if not isinstance(immediate_retries, int) or immediate_retries < 0:
            raise ValueError("immediate_retries must be an integer >= 0")
        self.profile = profile
        self.time_scale = time_scale
        self.nondeterministic = nondeterministic
        self.salt = int.from_bytes(os.urandom(8), "big") if salt is None else salt
        self.immediate_retries = immediate_retries
        self._calls: dict[tuple[str, str], int] = {}  # for `call_count` only, never a draw

    # -- pure --------------------------------------------------------------------------------

    def call_number(self, attempt: int, try_no: int) -> int:
        """0-based number of the call (attempt, try_no) in a fault-free run of one rule:
        every earlier attempt used all its tries (an attempt ends early only by succeeding
        or failing for good, and then no call follows)."""
        return (attempt - 1) * (self.immediate_retries + 1) + (try_no - 1)

    def draw(
        self, attempt_id: str, rule_id: str, attempt: int, try_no: int, execution: int = 1
    ) -> Draw:
        """The outcome of one call, from a stable hash of its inputs and nothing else.

        Latency, tokens and the error are drawn from (seed, attempt_id, rule_id, attempt,
        try_no), `fail_rules` decides by `call_number(attempt, try_no)`; the verdict and
        score from (seed, attempt_id, rule_id) only, so every successful call of a rule
        agrees, except that with `drift` a rerun (`execution` >= 2: the same attempt and
        try started again) may redraw them from (attempt, try_no, execution) too. An
        `execution` below 1 counts as 1. A timeout takes `latency_ms.cap_ms` when a cap is
        set (the client gave up there).
        """
        p = self.profile
        # `_stable_digest("call", seed, attempt_id, rule_id, attempt, try_no)`, its repr
        # written out (a tuple's repr is its items' reprs): the draw a rule costs, halved.
        call = f"('call', {p.seed!r}, {attempt_id!r}, {rule_id!r}, {attempt!r}, {try_no!r})"
        digest = _digest(call)
        # Fixed draw order, whatever branch is taken, so one knob does not reshuffle the rest.
        u_err, u_kind, u_tok = _uniform(digest, 0), _uniform(digest, 1), _uniform(digest, 2)
        lat = p.latency_ms
        if lat.kind == "fixed":  # draws nothing
            latency = lat.value_ms if lat.cap_ms is None else min(lat.value_ms, lat.cap_ms)
        else:  # last: some distributions use a variable count
            latency = lat.sample(_HashStream(digest, start=3))
        spread = p.tokens * p.token_spread
        tokens = max(0, round(p.tokens - spread + 2 * spread * u_tok))

        forced = rule_id in p.always_fail_rules or self.call_number(
            attempt, try_no
        ) < p.fail_rules.get(rule_id, 0)
        error: str | None = None
        if forced or u_err < p.error_rate:
            error = self._transient_kind(u_kind)
        elif u_err < p.error_rate + p.permanent_error_rate:
            error = PERMANENT_KINDS[0]
        if error is not None:
            if error == "timeout" and p.latency_ms.cap_ms is not None:
                latency = p.latency_ms.cap_ms
            else:
                latency *= FAILED_CALL_LATENCY[error]
            return Draw(latency, error, None, round(tokens * FAILED_CALL_TOKENS[error]))
        return Draw(
            latency,
            None,
            self._result(attempt_id, rule_id, attempt, try_no, execution, tokens),
            tokens,
        )

    def _transient_kind(self, u: float) -> str:
        weights = self.profile.error_kinds
        total = sum(weights.get(k, 0.0) for k in TRANSIENT_KINDS)
        acc = 0.0
        chosen = TRANSIENT_KINDS[0]
        for kind in TRANSIENT_KINDS:
            w = weights.get(kind, 0.0)
            if w <= 0:
                continue
            chosen = kind
            acc += w / total
            if u < acc:
                break
        return chosen

    def _result(
        self, attempt_id: str, rule_id: str, attempt: int, try_no: int, execution: int, tokens: int
    ) -> RuleResult:
        p = self.profile
        key = ("verdict", p.seed, attempt_id, rule_id)
        if self.nondeterministic:
            digest = _stable_digest(*key, self.salt, attempt, try_no, execution)
        elif self.drifts(attempt_id, rule_id, attempt, try_no, execution):
            digest = _stable_digest(*key, attempt, try_no, execution)
        else:  # `_stable_digest(*key)`, written out as in `draw`
            digest = _digest(f"('verdict', {p.seed!r}, {attempt_id!r}, {rule_id!r})")
        u = _uniform(digest, 0)
        if u < p.pass_rate:
            verdict = "pass"
        elif u < p.pass_rate + (1.0 - p.pass_rate) * p.review_share:
            verdict = "needs_review"
        else:
            verdict = "fail"
        score = round(1.0 - u, 4)
        return RuleResult(
            rule_id=rule_id,
            verdict=verdict,
            score=score,
            tokens=tokens,
            attempt=attempt,
            rationale=f"fake agent: {verdict} ({score})",
        )

    def drifts(
        self, attempt_id: str, rule_id: str, attempt: int, try_no: int, execution: int
    ) -> bool:
        """Whether this rerun draws its verdict afresh (probability `drift`; never for a
        first execution). A redrawn verdict may still equal the first one."""
        if execution <= 1 or self.profile.drift <= 0.0:
            return False
        key = ("drift", self.profile.seed, attempt_id, rule_id, attempt, try_no, execution)
        return _HashStream(_stable_digest(*key)).random() < self.profile.drift

    # -- live --------------------------------------------------------------------------------

    def call_count(self, attempt_id: str, rule_id: str) -> int:
        """Calls of this rule this agent has made (in this process)."""
        return self._calls.get((attempt_id, rule_id), 0)

    async def evaluate(
        self, attempt_id: str, rule: Rule, attempt: int, try_no: int, *, execution: int = 1
    ) -> RuleResult:
        """Draw, sleep the latency, then return the result or raise the error.

        The draw is `draw(attempt_id, rule.id, attempt, try_no, execution)`: nothing of this
        process (call order, a counter) enters it, so a worker started after a crash draws
        what the crashed one drew. `call_count` only counts, for tests and messages.
        """
        key = (attempt_id, rule.id)
        call_index = self._calls.get(key, 0)
        self._calls[key] = call_index + 1
        d = self.draw(attempt_id, rule.id, attempt, try_no, execution)
        delay = d.latency_ms * self.time_scale / 1000.0
        if delay > 0:
            await asyncio.sleep(delay)
        if d.error is not None:
            raise agent_error(
                d.error, f"fake agent, rule {rule.id}, call {call_index}", tokens=d.tokens
            )
        assert d.result is not None
        return d.result
