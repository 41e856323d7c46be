"""The engine's values as JSON, declared once: the engine's frozen dataclasses are their own schema, and pydantic
encodes and checks them (``encode``, ``decode``); the request bodies and the few other answers are the pydantic
models of ``messages.py``. ``kvchat engine-serve`` (``backend/engine_server``) writes with these and ``RemoteEngine``
(``remote.py``) reads with them, so both sides agree in one place.

A body that does not fit its type raises ``WireError``, which the client maps to a clear engine error ("garbage").

Errors travel as ``{"error": {"code", "message", "type", "retry_after_s"?}}``: ``error_body`` writes one from an
``EngineError``, ``error_from_body`` rebuilds the same class from its stable ``code``.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from backend.engine_client.values import (
    EmptyPromptError,
    EngineBusy,
    EngineError,
    EngineStopped,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    RequestStats,
)
from engine.errors import RequestAborted, RequestFailed

T = TypeVar("T")


class WireError(ValueError):
    """A JSON body that is not what the engine server writes (a wrong field, a missing one, another server)."""


_ADAPTERS: dict[Any, TypeAdapter[Any]] = {}


def _adapter(kind: Any) -> TypeAdapter[Any]:
    """One adapter per type, built once (building one compiles its validator and serializer)."""
    adapter = _ADAPTERS.get(kind)
    if adapter is None:
        adapter = _ADAPTERS[kind] = TypeAdapter(kind)
    return adapter


def _plain(value: Any) -> Any:
    # NOTE: the engine's reports hold read-only mappings (``MappingProxyType``), which pydantic does not know.
    if isinstance(value, MappingProxyType):
        return dict(value)
    raise TypeError(f"{type(value).__name__} has no JSON form")


def encode(value: Any, kind: Any = None) -> Any:
    """``value`` (of type ``kind``, else its own class) as plain JSON values."""
    kind = kind or type(value)
    return _adapter(kind).dump_python(value, mode="json", fallback=_plain, warnings=False)


def decode(kind: type[T], data: object) -> T:
    """A ``kind`` from its JSON form; ``WireError`` when the data does not fit (an engine error a value's own check
    raises, such as a bad ``SamplingParams``, goes through as it is)."""
    try:
        value: T = _adapter(kind).validate_python(data)
    except ValidationError as exc:
        name = getattr(kind, "__name__", str(kind))
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid"}
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise WireError(f"bad {name}: {where or 'value'}: {first.get('msg', 'invalid')}") from None
    return value


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
