"""Errors raised by the backend's services, mapped once at each boundary (websocket frames, HTTP statuses).

    BackendError                   code               HTTP   websocket
    ├── SessionNotFoundError       session_not_found  404    close 4404 (on hello) / error frame
    └── SessionClosedError         session_closed     409    error frame

Authentication failures are answered at the boundary itself (401 / close 4401). Engine errors (``engine.errors``)
are mapped by ``engine_error_code`` below: busy → ``busy`` (websocket error frame with ``retry_after_ms``; HTTP 503 +
Retry-After), prompt too long → ``prompt_too_long``, invalid params → ``invalid_request``, engine stopped →
``unavailable``. The OpenAI-compatible API maps them to OpenAI's error shape in ``backend/openai/errors.py``.
"""

from __future__ import annotations

from engine.errors import EngineBusy, EngineError, EngineStopped, InvalidRequestError, PromptTooLongError


class BackendError(Exception):
    code = "internal_error"
    status = 500


class SessionNotFoundError(BackendError):
    code = "session_not_found"
    status = 404


class SessionClosedError(BackendError):
    code = "session_closed"
    status = 409


def engine_error_code(exc: EngineError) -> str:
    if isinstance(exc, EngineBusy):
        return "busy"
    if isinstance(exc, PromptTooLongError):
        return "prompt_too_long"
    if isinstance(exc, InvalidRequestError):
        return "invalid_request"
    if isinstance(exc, EngineStopped):
        return "unavailable"
    return "engine_error"
