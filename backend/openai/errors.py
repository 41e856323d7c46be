"""Errors of the ``/v1`` API in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Mapped once, here, for the ``/v1`` routes (their router uses ``OpenAIRoute``; errors raised before routing, such as an
unknown path or an oversized body, get the same shape from ``backend/api/boundary.py``).

    condition                                   HTTP  type                    code
    missing / invalid API key                   401   invalid_request_error   invalid_api_key
    malformed body, out-of-range parameter      400   invalid_request_error   invalid_request (param named)
    undecodable body, JSON nested too deeply    400   invalid_request_error   invalid_request
    body over KVCHAT_MAX_REQUEST_BYTES          413   invalid_request_error   request_too_large
    unknown /v1 path                            404   invalid_request_error   not_found
    parameter kvchat does not support           400   invalid_request_error   unsupported_parameter
    empty prompt                                400   invalid_request_error   empty_prompt
    prompt + max_tokens over the context        400   invalid_request_error   context_length_exceeded
    unknown model                               404   invalid_request_error   model_not_found
    tenant over its quota (RateLimited)         429   invalid_request_error   rate_limited (+ Retry-After)
    engine queue full (EngineBusy)              503   server_error            busy  (+ Retry-After)
    engine stopped                              503   server_error            unavailable (+ Retry-After)
    any other engine failure                    500   server_error            engine_error
"""

from __future__ import annotations

import math
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from backend.core.errors import HTTP_STATUS_CODES, error_location, error_problem
from backend.core.tenant_quota import RateLimited
from backend.engine_client.values import (
    EmptyPromptError,
    EngineBusy,
    EngineError,
    EngineStopped,
    InvalidRequestError,
    PromptTooLongError,
)
from backend.openai.schemas import ErrorBody, ErrorResponse

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
_STOPPED_RETRY_AFTER_S = 5.0


class OpenAIError(Exception):
    """An error the ``/v1`` routes answer with; ``status`` and ``code`` are stable (tests assert them)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        *,
        error_type: str = INVALID_REQUEST,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.error_type = error_type
        self.param = param
        self.retry_after_s = retry_after_s

    @property
    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorBody(message=self.message, type=self.error_type, param=self.param, code=self.code)
        )

    @property
    def headers(self) -> dict[str, str]:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), status_code=self.status, headers=self.headers)


def unauthorized() -> OpenAIError:
    return OpenAIError(
        401, "Incorrect or missing API key: send 'Authorization: Bearer <your kvchat chat token>'.", "invalid_api_key"
    )


def unsupported(param: str, why: str) -> OpenAIError:
    return OpenAIError(400, why, "unsupported_parameter", param=param)


def from_engine_error(exc: EngineError) -> OpenAIError:
    if isinstance(exc, PromptTooLongError):
        total = exc.prompt_tokens + exc.max_tokens
        return OpenAIError(
            400,
            f"This model's maximum context length is {exc.limit} tokens. However, you requested {total} tokens "
            f"({exc.prompt_tokens} in the messages, {exc.max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.",
            "context_length_exceeded",
            param="messages",
        )
    if isinstance(exc, EmptyPromptError):
        return OpenAIError(400, str(exc), "empty_prompt", param="messages")
    if isinstance(exc, InvalidRequestError):
        return OpenAIError(400, str(exc), "invalid_request")
    if isinstance(exc, RateLimited):
        return OpenAIError(429, str(exc), "rate_limited", retry_after_s=exc.retry_after_s)
    if isinstance(exc, EngineBusy):
        return OpenAIError(503, str(exc), "busy", error_type=SERVER_ERROR, retry_after_s=exc.retry_after_s)
    if isinstance(exc, EngineStopped):
        return OpenAIError(503, str(exc), "unavailable", error_type=SERVER_ERROR, retry_after_s=_STOPPED_RETRY_AFTER_S)
    return OpenAIError(500, str(exc) or "internal engine error", "engine_error", error_type=SERVER_ERROR)


def too_long_before_tokenizing(floor: int, limit: int) -> OpenAIError:
    """A prompt whose length alone proves it cannot fit (refused without tokenizing it)."""
    return OpenAIError(
        400,
        f"This model's maximum context length is {limit} tokens. However, your messages have at least {floor} "
        "tokens. Please reduce the length of the messages.",
        "context_length_exceeded",
        param="messages",
    )


def from_validation_error(exc: RequestValidationError) -> OpenAIError:
    errors: Sequence[Any] = exc.errors()
    if not errors:
        return OpenAIError(400, "invalid request body", "invalid_request")
    first = errors[0]
    param = error_location(first.get("loc", ())) or None
    message = f"{param}: {error_problem(first)}" if param else error_problem(first)
    return OpenAIError(400, message, "invalid_request", param=param)


def from_http_exception(exc: StarletteHTTPException) -> OpenAIError:
    typ = SERVER_ERROR if exc.status_code >= 500 else INVALID_REQUEST
    code = HTTP_STATUS_CODES.get(exc.status_code, f"http_{exc.status_code}")
    return OpenAIError(exc.status_code, str(exc.detail), code, error_type=typ)


class OpenAIRoute(APIRoute):
    """A route whose errors (validation, auth, engine) are answered in OpenAI's shape instead of ``{"detail"}``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except OpenAIError as exc:
                return exc.response()
            except EngineError as exc:
                return from_engine_error(exc).response()
            except RequestValidationError as exc:
                return from_validation_error(exc).response()
            except HTTPException as exc:
                return from_http_exception(exc).response()

        return route
