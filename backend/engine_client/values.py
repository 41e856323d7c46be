"""The engine's values and errors that cross the backend's engine interface, re-exported: the one place the backend
imports them from (``backend/engine_client/protocol.py`` says why they are plain data).

Prompts (``SegmentedPrompt`` of ``Segment``s, ``TokenizedPrompt``: ids with segment spans), ``SamplingParams`` (its
grammar a ``StructuredOutput``), the stream (``TokenDelta`` … ``RequestFinished`` with ``RequestStats``, tokens'
``TokenLogprob``s), what cache control returns, what the engine
reports, and the engine's error hierarchy (``engine/errors.py``: mapped once at the backend's boundaries).
"""

from __future__ import annotations

from engine.engine_info import EngineInfo, EngineStats
from engine.errors import (
    EmptyPromptError,
    EngineBusy,
    EngineError,
    EngineStopped,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
)
from engine.fair_share import DEFAULT_SHARE, FairShare
from engine.kv.block_meta import TokenSpan
from engine.kv.cache_control import ErasureResult, PinResult
from engine.kv.cache_stats import CacheStats
from engine.kv.kv_cache_manager import CacheFootprint, InvalidationResult
from engine.kv.tier_config import CacheSettings
from engine.kv.tiers import TierStats
from engine.outputs import FinishReason, GenerationEvent, RequestFinished, RequestStats, TokenDelta, TokenLogprob
from engine.prompt import Segment, SegmentedMessage, SegmentedPrompt, TokenizedPrompt, common_prefix
from engine.prompt_encoder import Prompt
from engine.sampling_params import MAX_LOGPROBS, GrammarKind, RepetitionScope, SamplingParams, StructuredOutput

__all__ = [
    "DEFAULT_SHARE",
    "MAX_LOGPROBS",
    "CacheFootprint",
    "CacheSettings",
    "CacheStats",
    "EmptyPromptError",
    "EngineBusy",
    "EngineError",
    "EngineInfo",
    "EngineStats",
    "EngineStopped",
    "ErasureResult",
    "FairShare",
    "FinishReason",
    "GenerationEvent",
    "GrammarKind",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "InvalidationResult",
    "PinResult",
    "Prompt",
    "PromptTooLongError",
    "RepetitionScope",
    "RequestFinished",
    "RequestStats",
    "SamplingParams",
    "Segment",
    "SegmentedMessage",
    "SegmentedPrompt",
    "StructuredOutput",
    "TierStats",
    "TokenDelta",
    "TokenLogprob",
    "TokenSpan",
    "TokenizedPrompt",
    "common_prefix",
]
