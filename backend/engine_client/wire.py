"""The engine's values as JSON: what ``kvchat engine-serve`` (``backend/engine_server``) writes and ``RemoteEngine``
(``remote.py``) reads, so both sides agree in one place.

Encoding is generic (``to_json``: dataclasses, mappings, tuples, enums). Decoding is per type, because the values are
frozen dataclasses with nested ones (``EngineStats``) and typed fields (``FinishReason``, ``GrammarKind``); a field
missing or of the wrong kind raises ``WireError``, which the client maps to a clear engine error ("garbage").

Errors travel as ``{"error": {"code", "message", "type", "retry_after_s"?}}``: ``error_body`` writes one from an
``EngineError``, ``error_from_body`` rebuilds the same class from its stable ``code``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from backend.engine_client.values import (
    CacheFootprint,
    CacheSettings,
    CacheStats,
    EmptyPromptError,
    EngineBusy,
    EngineError,
    EngineInfo,
    EngineStats,
    EngineStopped,
    ErasureResult,
    FinishReason,
    InvalidationResult,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PinResult,
    PromptTooLongError,
    RequestStats,
    SamplingParams,
    StructuredOutput,
    TierStats,
)
from engine.errors import RequestAborted, RequestFailed
from engine.kv.block_meta import TokenSpan
from engine.kv.cache_stats import InvalidationCounts
from engine.kv.kv_cache_manager import KVCacheUsage
from engine.outputs import TokenLogprob
from engine.sampling_params import GrammarKind

T = TypeVar("T")


class WireError(ValueError):
    """A JSON body that is not what the engine server writes (a wrong field, a missing one, another server)."""


def to_json(value: Any) -> Any:
    """Dataclasses, mappings, tuples and enums as plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    return value


def flat(cls: Callable[..., T], data: object) -> T:
    """A dataclass of plain fields from its JSON object (``WireError`` when it does not fit)."""
    if not isinstance(data, dict):
        raise WireError(f"expected an object for {getattr(cls, '__name__', cls)}, got {type(data).__name__}")
    try:
        return cls(**data)
    except (TypeError, ValueError, EngineError) as exc:
        raise WireError(f"bad {getattr(cls, '__name__', cls)}: {exc}") from None


def _mapping(data: object, value: Callable[[Any], Any] = lambda v: v) -> Mapping[str, Any]:
    if not isinstance(data, dict):
        raise WireError(f"expected an object, got {type(data).__name__}")
    return MappingProxyType({str(k): value(v) for k, v in data.items()})


def _field(data: object, name: str) -> Any:
    if not isinstance(data, dict) or name not in data:
        raise WireError(f"missing field {name!r}")
    return data[name]


# ---------------------------------------------------------------------------------------------- requests


def sampling_to_json(params: SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = to_json(params)
    return out


def sampling_from_json(data: object) -> SamplingParams:
    """``SamplingParams`` from ``sampling_to_json``'s object (its own checks run: ``InvalidSamplingParamsError``)."""
    if not isinstance(data, dict):
        raise InvalidRequestError("kvchat.sampling must be an object")
    fields = dict(data)
    tuples = ("stop_token_ids", "stop")
    for name in tuples:
        if name in fields and isinstance(fields[name], list):
            fields[name] = tuple(fields[name])
    if isinstance(fields.get("logit_bias"), list):
        fields["logit_bias"] = tuple(_pair(p) for p in fields["logit_bias"])
    structured = fields.get("structured")
    if isinstance(structured, dict):
        try:
            fields["structured"] = StructuredOutput(
                GrammarKind(str(structured.get("kind"))), structured.get("spec", "")
            )
        except ValueError as exc:
            raise InvalidSamplingParamsError(f"structured output: {exc}") from None
    try:
        return SamplingParams(**fields)
    except TypeError as exc:
        raise InvalidRequestError(f"kvchat.sampling: {exc}") from None


def _pair(item: object) -> tuple[int, float]:
    if not isinstance(item, list) or len(item) != 2:
        raise InvalidSamplingParamsError("logit_bias entries must be [token_id, bias] pairs")
    return int(item[0]), float(item[1])


def spans_to_json(spans: tuple[TokenSpan, ...]) -> list[list[Any]]:
    return [[s.start, s.end, s.block_type, s.block_id, s.parent_id] for s in spans]


def spans_from_json(data: object) -> tuple[TokenSpan, ...]:
    """Segment spans (``[start, end, block_type, block_id, parent_id]`` rows); ``InvalidRequestError`` if malformed."""
    if not isinstance(data, list):
        raise InvalidRequestError("kvchat.spans must be a list of [start, end, block_type, block_id, parent_id]")
    try:
        return tuple(TokenSpan(*row) for row in data)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"kvchat.spans: {exc}") from None


# ---------------------------------------------------------------------------------------------- the stream


def logprobs_from_json(data: object) -> tuple[TokenLogprob, ...]:
    if not isinstance(data, list):
        raise WireError("logprobs must be a list")
    try:
        return tuple(
            TokenLogprob(int(d["token_id"]), float(d["logprob"]), tuple((int(t), float(p)) for t, p in d["top"]))
            for d in data
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"bad logprobs: {exc}") from None


def request_stats_from_json(data: object) -> RequestStats:
    if not isinstance(data, dict):
        raise WireError("stats must be an object")
    fields = dict(data)
    for name in ("prompt_tokens_by_type", "cached_tokens_by_type", "cached_tokens_by_tier"):
        fields[name] = _mapping(fields.get(name, {}), int)
    return flat(RequestStats, fields)


def finish_reason_from_json(data: object) -> FinishReason:
    try:
        return FinishReason(str(data))
    except ValueError:
        raise WireError(f"unknown finish reason {data!r}") from None


def usage_of(stats: RequestStats) -> dict[str, Any]:
    """OpenAI's ``usage``, with the cached prompt tokens (and, beyond OpenAI, those by tier)."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": stats.cached_tokens,
            "cached_tokens_by_tier": dict(stats.cached_tokens_by_tier),
        },
    }


# ---------------------------------------------------------------------------------------------- engine reports


def info_from_json(data: object) -> EngineInfo:
    return flat(EngineInfo, data)


def stats_from_json(data: object) -> EngineStats:
    fields = dict(_mapping(data))
    cache = dict(_mapping(_field(fields, "cache")))
    for name in ("query_tokens_by_type", "hit_tokens_by_type", "cached_blocks_by_type"):
        cache[name] = _mapping(_field(cache, name), int)
    cache["invalidations"] = _mapping(_field(cache, "invalidations"), lambda v: flat(InvalidationCounts, v))
    fields["cache"] = flat(CacheStats, cache)
    fields["kv"] = flat(KVCacheUsage, _field(fields, "kv"))
    fields["tiers"] = flat(TierStats, _field(fields, "tiers"))
    return flat(EngineStats, fields)


def settings_from_json(data: object) -> CacheSettings:
    fields = dict(_mapping(data))
    if "type_weights" in fields:
        fields["type_weights"] = _mapping(fields["type_weights"], float)
    return flat(CacheSettings, fields)


def invalidation_from_json(data: object) -> InvalidationResult:
    return flat(InvalidationResult, data)


def erasure_from_json(data: object) -> ErasureResult:
    return flat(ErasureResult, data)


def pin_from_json(data: object) -> PinResult:
    return flat(PinResult, data)


def footprint_from_json(data: object) -> CacheFootprint:
    return flat(CacheFootprint, data)


# ---------------------------------------------------------------------------------------------- errors

_ERRORS: dict[str, type[EngineError]] = {
    cls.code: cls
    for cls in (
        EngineError,
        InvalidRequestError,
        InvalidSamplingParamsError,
        EngineStopped,
        RequestAborted,
        RequestFailed,
    )
}


def error_body(exc: EngineError) -> dict[str, Any]:
    """The one-line JSON error an engine server answers with (``code`` is the engine error's stable code)."""
    error: dict[str, Any] = {"code": exc.code, "message": str(exc), "type": type(exc).__name__}
    if isinstance(exc, EngineBusy):
        error["retry_after_s"] = exc.retry_after_s
    if isinstance(exc, PromptTooLongError):
        error["prompt_tokens"], error["max_tokens"], error["limit"] = exc.prompt_tokens, exc.max_tokens, exc.limit
    return {"error": error}


def error_from_body(data: object, fallback: str) -> EngineError:
    """The engine error a server's error body names (``fallback`` says what failed when the body is not one)."""
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("code"), str):
        return RequestFailed(fallback)
    code, message = error["code"], str(error.get("message", fallback))
    try:
        if code == EngineBusy.code:
            return EngineBusy(message.split("; retry after")[0], float(error.get("retry_after_s", 1.0)))
        if code == PromptTooLongError.code:
            too_long = PromptTooLongError(int(error["prompt_tokens"]), int(error["max_tokens"]), int(error["limit"]))
            too_long.args = (message,)  # (the server's words: they name the bound, context or KV pool)
            return too_long
        if code == EmptyPromptError.code:
            return EmptyPromptError()
    except (KeyError, TypeError, ValueError):
        return RequestFailed(f"{fallback}: {message}")
    return _ERRORS.get(code, RequestFailed)(message)
