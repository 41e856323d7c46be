"""Per-request sampling parameters (validated once, at the engine's edge).

Plain, immutable data (numbers, strings, tuples, one enum), so a request can travel to a remote engine as JSON. The
meanings are vLLM's: penalties and ``logit_bias`` change the logits before the choice (greedy rows included);
``min_p``, ``top_k`` and ``top_p`` filter sampled rows after the temperature; ``logprobs`` reports the model's raw
log-probabilities; ``structured`` constrains the reply to a grammar. ``n`` choices of one request are ``n`` requests:
``choices(n)`` gives their parameters.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass, field

from engine.errors import InvalidSamplingParamsError

GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound
MIN_REPETITION_PENALTY = 0.01  # below it a logit divided by the penalty overflows
MAX_LOGIT_BIAS = 1024  # entries; each bias in [-100, 100] (OpenAI's range)
MAX_GRAMMAR_CHARS = 1 << 20


class GrammarKind(enum.StrEnum):
    """What ``StructuredOutput.spec`` holds."""

    JSON_OBJECT = "json_object"  # any JSON object; spec is ""
    JSON_SCHEMA = "json_schema"  # spec: a JSON schema, as JSON text
    LARK = "lark"  # spec: a grammar in llguidance's Lark dialect (may embed ``%json {...}`` schemas)


class RepetitionScope(enum.StrEnum):
    """Which tokens ``SamplingParams.repetition_penalty`` applies to."""

    ALL = "all"  # every token seen, the prompt's and the reply's: vLLM's semantics
    # NOTE: the reply's own tokens only. A loop is a reply repeating itself; the prompt's words (a handbook, a
    # customer's order number, earlier replies) stay free to be quoted, and so to be proposed by suffix drafts.
    REPLY = "reply"


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A grammar the reply must follow; the sampler masks every token that would leave it."""

    kind: GrammarKind
    spec: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GrammarKind):
            raise InvalidSamplingParamsError(f"structured output kind must be a GrammarKind, got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_GRAMMAR_CHARS:
            raise InvalidSamplingParamsError(f"structured output spec must be a string of at most {MAX_GRAMMAR_CHARS}")
        if self.kind is GrammarKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.spec)
            except ValueError as exc:
                raise InvalidSamplingParamsError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise InvalidSamplingParamsError("a JSON schema must be an object (or a boolean)")
        elif self.kind is GrammarKind.LARK and not self.spec.strip():
            raise InvalidSamplingParamsError("a Lark grammar must not be empty")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k == 0``, ``top_p == 1``, ``min_p == 0`` disable those filters.
    ``seed`` makes a sampled request reproducible regardless of what else is in the batch.
    ``repetition_penalty`` (1 = off) divides positive logits and multiplies negative ones of every token seen in the
    prompt or the reply (``repetition_penalty_scope`` ALL), or in the reply only (REPLY); ``presence_penalty`` /
    ``frequency_penalty`` (0 = off) subtract, per token of the reply so far, a constant / its count. ``logit_bias``
    adds a bias to chosen token ids. ``logprobs``: None for none, else the sampled token's log-probability plus the
    ``logprobs`` most likely ones.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    repetition_penalty: float = 1.0
    repetition_penalty_scope: RepetitionScope = RepetitionScope.ALL
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    logprobs: int | None = None
    structured: StructuredOutput | None = None
    # vLLM's ``prompt_logprobs`` (for scoring text, not chatting): ``RequestFinished.prompt_logprobs`` holds, for each
    # prompt position p >= 1, log p(token p | tokens 0..p-1). Such a request takes no prefix-cache hit.
    prompt_logprobs: bool = False
    # Suffix drafts (engine.spec), verified exactly: True drafts where the cost model says they pay, False asks for
    # plain one-token steps, None follows the engine's switch (``EngineConfig.drafts``). The backend sets it from the
    # tenant's setting and a /v1 request's own field.
    drafts: bool | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        # NOTE: below 1e-5 sampling is argmax in all but name (a logit gap of 1e-3 leaves the runner-up e**-100).
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def changes_logits(self) -> bool:
        """Whether anything but the final choice touches this request's logits (the sampler's slow path)."""
        return self.has_penalties or bool(self.logit_bias) or self.structured is not None

    def choices(self, n: int) -> list[SamplingParams]:
        """The parameters of ``n`` choices of this request: choice ``i`` is seeded ``seed + i`` (vLLM's rule), so
        choice 0 equals the request alone; unseeded choices draw independently."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidSamplingParamsError(f"n must be an integer >= 1, got {n!r}")
        if self.seed is None:
            return [self] * n
        return [dataclasses.replace(self, seed=(self.seed + i) % 2**64) for i in range(n)]

    def validate(self) -> None:
        def bad(msg: str) -> InvalidSamplingParamsError:
            return InvalidSamplingParamsError(msg)

        for name in ("max_tokens", "top_k", "seed", "min_tokens", "logprobs"):
            if isinstance(getattr(self, name), bool):  # NOTE: bool is an int subclass; True is not a token count
                raise bad(f"{name} must be an integer, got {getattr(self, name)!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        # NOTE: every finite value in these ranges is safe for the sampler (engine/sampler.py keeps the most likely
        # token whatever top_p is, and scales logits that were shifted to a maximum of 0); NaN and inf are refused.
        if not _finite(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise bad(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            raise bad(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.min_tokens, int) or not (0 <= self.min_tokens <= self.max_tokens):
            raise bad(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative integers")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise bad("stop strings must be non-empty strings")
        if not isinstance(self.prompt_logprobs, bool):
            raise bad(f"prompt_logprobs must be a boolean, got {self.prompt_logprobs!r}")
        if self.drafts is not None and not isinstance(self.drafts, bool):
            raise bad(f"drafts must be a boolean or null, got {self.drafts!r}")
        if len(self.stop) > 16:
            raise bad(f"at most 16 stop strings are allowed, got {len(self.stop)}")
        self._validate_logit_changes()

    def _validate_logit_changes(self) -> None:
        def bad(msg: str) -> InvalidSamplingParamsError:
            return InvalidSamplingParamsError(msg)

        # NOTE: vLLM takes any positive repetition penalty; below 0.01 a logit divided by it overflows to inf, so the
        # floor is 0.01 (the two OpenAI penalties are in [-2, 2], as in vLLM).
        if not _finite(self.repetition_penalty) or not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 100.0:
            raise bad(f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty!r}")
        if not isinstance(self.repetition_penalty_scope, RepetitionScope):
            scopes = ", ".join(repr(s.value) for s in RepetitionScope)
            raise bad(f"repetition_penalty_scope must be one of {scopes}, got {self.repetition_penalty_scope!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2.0 <= value <= 2.0:
                raise bad(f"{name} must be in [-2, 2], got {value!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        seen: set[int] = set()
        for entry in self.logit_bias:
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise bad("logit_bias must be (token id, bias) pairs")
            token, bias = entry
            if isinstance(token, bool) or not isinstance(token, int) or token < 0 or token in seen:
                raise bad(f"logit_bias token ids must be distinct integers >= 0, got {token!r}")
            if not _finite(bias) or not -100.0 <= bias <= 100.0:
                raise bad(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
            seen.add(token)
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise bad(f"structured must be a StructuredOutput, got {self.structured!r}")
            if self.ignore_eos:
                # NOTE: a finished grammar allows only EOS; ignoring it would leave nothing to sample.
                raise bad("ignore_eos cannot be combined with structured output")


def _finite(value: object) -> bool:
    """A real, finite number (bool excluded: ``True`` is not a temperature)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
