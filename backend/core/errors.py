"""Errors raised by the backend's services, mapped once at each boundary (websocket frames, HTTP statuses).

    BackendError                   code            HTTP   websocket
    ├── UnauthorizedError          unauthorized    401    close 4401
    ├── SessionNotFoundError       session_not_found 404  close 4404 (on hello) / error frame
    ├── SessionClosedError         session_closed  409    error frame
    ├── InvalidInputError          invalid_request 400    error frame
    └── RateLimitedError           rate_limited    429    error frame (with retry_after_ms)

Engine errors (``engine.errors``) are mapped by ``engine_error_code`` below: busy → ``busy`` (HTTP 503 + Retry-After),
prompt too long / invalid params → ``invalid_request`` (400), engine stopped → ``unavailable`` (503).
"""

from __future__ import annotations

from engine.errors import EngineBusy, EngineError, EngineStopped, InvalidRequestError, PromptTooLongError


class BackendError(Exception):
    code = "internal_error"
    status = 500


class UnauthorizedError(BackendError):
    code = "unauthorized"
    status = 401


class SessionNotFoundError(BackendError):
    code = "session_not_found"
    status = 404


class SessionClosedError(BackendError):
    code = "session_closed"
    status = 409


class InvalidInputError(BackendError):
    code = "invalid_request"
    status = 400


class RateLimitedError(BackendError):
    code = "rate_limited"
    status = 429

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


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
