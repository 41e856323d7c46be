"""Per-request sampling parameters (validated once, at the engine's edge)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidSamplingParamsError

GREEDY_BELOW = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes a sampled request reproducible regardless of what else is in the batch.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    # vLLM's ``prompt_logprobs`` (for scoring text, not chatting): ``RequestFinished.prompt_logprobs`` holds, for each
    # prompt position p >= 1, log p(token p | tokens 0..p-1). Such a request takes no prefix-cache hit.
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        # NOTE: below 1e-5 sampling is argmax in all but name (a logit gap of 1e-3 leaves the runner-up e**-100).
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        def bad(msg: str) -> InvalidSamplingParamsError:
            return InvalidSamplingParamsError(msg)

        for name in ("max_tokens", "top_k", "seed", "min_tokens"):
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
        if len(self.stop) > 16:
            raise bad(f"at most 16 stop strings are allowed, got {len(self.stop)}")


def _finite(value: object) -> bool:
    """A real, finite number (bool excluded: ``True`` is not a temperature)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
