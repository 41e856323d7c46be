"""What ``LLMEngine.generate`` yields: token deltas, then one final event with the request's stats."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model context
    ABORTED = "aborted"


@dataclass(frozen=True, slots=True)
class RequestStats:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache (at first admission)
    prefilled_tokens: int  # prompt tokens computed (recomputation after preemption included)
    completion_tokens: int
    ttft_s: float  # arrival → first token
    decode_tokens_per_s: float  # (completion_tokens - 1) / (finish - first token); 0 for a single token
    queue_s: float  # arrival → first scheduled
    num_preemptions: int
    # Per block type (``engine.prompt``; "untyped" for a prompt without segments): prompt tokens, and of those the
    # ones served from the prefix cache (at first admission). Each adds up to prompt_tokens / cached_tokens.
    prompt_tokens_by_type: Mapping[str, int] = field(default_factory=dict)
    cached_tokens_by_type: Mapping[str, int] = field(default_factory=dict)
    # Of cached_tokens, those found in memory and those promoted from the disk tier for this request.
    cached_tokens_by_tier: Mapping[str, int] = field(default_factory=dict)
    # Suffix drafts (engine.spec): the draft tokens this request's steps verified, and those accepted.
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The model's raw log-probability of a sampled token (before penalties, bias, grammar or temperature: vLLM's
    default), and the ``SamplingParams.logprobs`` most likely tokens at that step, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class TokenDelta:
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, with SamplingParams.logprobs


@dataclass(frozen=True, slots=True)
class RequestFinished:
    request_id: str
    finish_reason: FinishReason
    text: str  # the whole completion text (deltas concatenated)
    token_ids: tuple[int, ...]
    stats: RequestStats
    # With SamplingParams.prompt_logprobs: one entry per prompt token, log p(token p | tokens 0..p-1); None at p = 0.
    prompt_logprobs: tuple[float | None, ...] | None = None
    # With SamplingParams.logprobs: one per generated token (token_ids), in order.
    logprobs: tuple[TokenLogprob, ...] | None = None


GenerationEvent = TokenDelta | RequestFinished
