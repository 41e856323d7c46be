"""The HTTP boundary: every error leaves in a stable JSON shape, and no body can stall the event loop.

Two shapes, chosen by path:

    /v1/...        OpenAI's  {"error": {"message", "type", "param", "code"}}   (backend/openai/errors.py)
    anything else  kvchat's  {"detail": <message>, "code": <stable code>}

    condition                               status  code
    /v1/chat/completions past the engine's  503     busy          (with Retry-After; before any other work)
      capacity (max_num_seqs + max_waiting)
    body over KVCHAT_MAX_REQUEST_BYTES      413     request_too_large
    /v1/chat/completions body larger than   413     request_too_large (from Content-Length, unread;
      any usable request (body_bound.py)                              backend/openai/body_bound.py)
    JSON nested deeper than MAX_JSON_DEPTH  400     invalid_request
    undecodable or invalid body / params    400/422 invalid_request   (/v1: 400; elsewhere FastAPI's 422)
    unknown path                            404     not_found
    method not allowed                      405     method_not_allowed
    a BackendError (backend/core/errors.py) its status    its code (e.g. 404 session_not_found; 503 starting,
                                                          with Retry-After, until the start is done)
    a ContextError (backend/context/errors)  422 (503)  its code (e.g. invalid_rule)
    an EngineError outside /v1 (an admin    503     unavailable (an engine that does not answer a control call
      call's control call to the engine)                within its deadline: backend/engine_client/control.py),
                                            503     busy; 500 engine_error (backend/core/errors.py engine_error_code)
    any other HTTPException                 its own http_<status>
    an unexpected exception                 500     internal_error    (logged once, with its traceback)

``BodyGuard`` is raw ASGI middleware: it refuses an oversized body from its ``Content-Length`` before reading a byte,
stops reading a chunked one at the cap, and checks JSON nesting before any parser recurses into it. ``AdmissionGuard``,
outside it, counts completion requests from their first byte to their last (``backend/core/admission.py``) and
refuses one past the engine's capacity at once: before its body is parsed or its key looked up, so a burst of 400 is
refused in memory while the admitted ones run (a refusal can therefore come before a bad key's 401); the admitted ones
start a few at a time, so the refusals do not wait behind their start either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backend.api.state import AppState
from backend.context.errors import ContextError
from backend.core.admission import RETRY_AFTER_S
from backend.core.errors import (
    HTTP_STATUS_CODES,
    BackendError,
    StartingError,
    engine_error_code,
    error_location,
    error_problem,
)
from backend.core.limits import MAX_JSON_DEPTH, json_too_deep
from backend.engine_client.values import EngineBusy, EngineError
from backend.openai.errors import (
    SERVER_ERROR,
    OpenAIError,
    from_engine_error,
    from_http_exception,
    from_validation_error,
)

# NOTE: bodies up to this size are checked for nesting on the loop (microseconds); larger ones in a thread.
_INLINE_CHECK_BYTES = 64 * 1024
_DRAIN_FACTOR = 16  # an oversized body is read and dropped up to 16x the cap, so its client can read the 413


def is_openai_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def error_response(
    path: str, status: int, message: str, code: str | None = None, param: str | None = None
) -> JSONResponse:
    """The error in the shape the path's clients expect."""
    code = code or HTTP_STATUS_CODES.get(status, f"http_{status}")
    if is_openai_path(path):
        kind = SERVER_ERROR if status >= 500 else "invalid_request_error"
        return OpenAIError(status, message, code, error_type=kind, param=param).response()
    return JSONResponse({"detail": message, "code": code}, status_code=status)


@dataclass(frozen=True, slots=True)
class TooLarge:
    """A body past its cap. ``ended``: its last byte has been read already, so there is nothing left to drain."""

    ended: bool


class BodyGuard:
    """Caps request bodies at ``max_bytes`` (413) and refuses JSON nested deeper than ``MAX_JSON_DEPTH`` (400)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        cap = min(self.max_bytes, scope.get(BODY_CAP_KEY) or self.max_bytes)
        body = TooLarge(ended=False) if _declared_over(scope, cap) else await self._read(receive, cap)
        if isinstance(body, TooLarge):
            await self._too_large(path, scope, receive, send, cap, drain=not body.ended)
            return
        if await _too_deep(body):
            response = error_response(path, 400, f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels")
            await response(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive, cap: int) -> bytes | TooLarge:
        """The whole body, or ``TooLarge`` as soon as it passes ``cap`` (saying whether that was its last message)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # http.disconnect: the app sees an empty body and the client is gone anyway
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                return TooLarge(ended=not message.get("more_body", False))
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    async def _too_large(self, path: str, scope: Scope, receive: Receive, send: Send, cap: int, *, drain: bool) -> None:
        # NOTE: the rest of the body is read and dropped (up to a bound) before answering: a client still sending
        # when the server closes gets a reset instead of the 413. Past the bound the connection is simply closed.
        # A /v1 body over the usable bound (cap < max_bytes) is drained to that bound only: it can never be used,
        # and draining 16x would let each such request make the server read ~27 MB for nothing.
        # Not when the message that passed the cap was the body's last (``drain`` False): the server has no more to
        # give, and one more receive() waits for the client's disconnect while the client waits for this 413.
        if drain:
            await _discard(receive, (1 if cap < self.max_bytes else _DRAIN_FACTOR) * cap)
        if cap < self.max_bytes:
            message = f"the request body is larger than {cap} bytes, more than any prompt the model accepts can take"
        else:
            message = f"the request body is larger than {cap} bytes (KVCHAT_MAX_REQUEST_BYTES)"
        response = error_response(path, 413, message)
        response.headers["Connection"] = "close"
        await response(scope, receive, send)


async def _discard(receive: Receive, limit: int) -> None:
    seen = 0
    while seen <= limit:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        seen += len(message.get("body", b""))


def _declared_over(scope: Scope, max_bytes: int) -> bool:
    """The ``Content-Length`` already says the body is too large (nothing is read then)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return value.isdigit() and int(value) > max_bytes
    return False


async def _too_deep(body: bytes) -> bool:
    if len(body) <= _INLINE_CHECK_BYTES:
        return json_too_deep(body)
    return await asyncio.to_thread(json_too_deep, body)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: wait for the disconnect, as the server would

    return replay


class AdmissionGuard:
    """Counts ``POST /v1/chat/completions`` requests while they run; one past the engine's capacity is a 503 ``busy``
    with ``Retry-After`` before anything else is done for it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state: AppState | None = getattr(scope["app"].state, "kvchat", None) if scope["type"] == "http" else None
        if state is None or scope["method"] != "POST" or scope["path"] != COMPLETIONS_PATH:
            await self.app(scope, receive, send)
            return
        cap = scope[BODY_CAP_KEY] = state.admission.max_body_bytes
        if cap is not None and _declared_over(scope, cap):
            await self.app(scope, receive, send)  # (the body guard refuses it from its Content-Length, unread)
            return
        if not state.admission.try_enter():
            await _discard(receive, _DRAIN_FACTOR * MAX_REFUSED_BODY_BYTES)
            busy = EngineBusy(f"{state.admission.admitted} requests are already in flight", RETRY_AFTER_S)
            await from_engine_error(busy).response()(scope, receive, send)
            return
        try:
            # NOTE: admitted requests start a few at a time (backend/core/admission.py), so the refusals of a burst
            # are not queued behind the admitted ones' parsing and authentication on the loop.
            async with state.admission.start_slot():
                await self.app(scope, receive, send)
        finally:
            state.admission.leave()
            state.heap.closed()


COMPLETIONS_PATH = "/v1/chat/completions"
BODY_CAP_KEY = "kvchat.max_body_bytes"  # a lower cap than KVCHAT_MAX_REQUEST_BYTES for this request (AdmissionGuard)
MAX_REFUSED_BODY_BYTES = 1024 * 1024  # a refused request's body is read and dropped up to 16x this


def install(app: FastAPI, max_request_bytes: int) -> None:
    """Add the body guard, the admission guard outside it, and the exception handlers that give every error its
    stable shape, and document those errors in the OpenAPI schema as they are sent (clients generated from it, and
    schemathesis, rely on that)."""
    app.add_middleware(BodyGuard, max_bytes=max_request_bytes)
    app.add_middleware(AdmissionGuard)
    _document_errors(app)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(BackendError, _backend_error)
    app.add_exception_handler(ContextError, _context_error)
    app.add_exception_handler(EngineError, _engine_error)
    app.add_exception_handler(Exception, _unexpected)


async def _http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    path = request.url.path
    if is_openai_path(path):
        response = from_http_exception(exc).response()
    else:
        code = getattr(exc, "code", None) or HTTP_STATUS_CODES.get(exc.status_code, f"http_{exc.status_code}")
        response = JSONResponse({"detail": str(exc.detail), "code": code}, status_code=exc.status_code)
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


async def _backend_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, BackendError)
    response = error_response(request.url.path, exc.status, str(exc), exc.code)
    if isinstance(exc, StartingError):
        response.headers["Retry-After"] = str(exc.retry_after_s)
    return response


# NOTE: the context layer's errors carry a code but no HTTP status (that layer knows nothing of HTTP).
_CONTEXT_STATUS = {"backend_unavailable": 503}


async def _context_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ContextError)
    return error_response(request.url.path, _CONTEXT_STATUS.get(exc.code, 422), str(exc), exc.code)


# NOTE: the engine's errors carry no HTTP status either; a control call that missed its deadline is "unavailable".
_ENGINE_STATUS = {"unavailable": 503, "busy": 503, "rate_limited": 429, "invalid_request": 422}


async def _engine_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, EngineError)
    if is_openai_path(request.url.path):
        return from_engine_error(exc).response()
    code = engine_error_code(exc)
    return error_response(request.url.path, _ENGINE_STATUS.get(code, 500), str(exc), code)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    if is_openai_path(request.url.path):
        return from_validation_error(exc).response()
    return JSONResponse({"detail": describe_errors(exc.errors()), "code": "invalid_request"}, status_code=422)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # NOTE: not logged here: Starlette re-raises it after this response, and the server logs it once.
    return error_response(request.url.path, 500, "internal server error", "internal_error")


def describe_errors(errors: Sequence[Any]) -> str:
    """``"<where>: <problem>"`` for the first validation error, never echoing the offending input."""
    if not errors:
        return "invalid request"
    first = errors[0]
    loc = error_location(first.get("loc", ()))
    return f"{loc}: {error_problem(first)}" if loc else error_problem(first)


# The error body of every route outside /v1 (FastAPI's default 422 schema, a list of pydantic errors, is not sent).
ERROR_DETAIL_SCHEMA: dict[str, Any] = {
    "title": "ErrorDetail",
    "type": "object",
    "properties": {"detail": {"type": "string", "title": "Detail"}, "code": {"type": "string", "title": "Code"}},
    "required": ["detail", "code"],
}
_KVCHAT_ERRORS = {
    "400": "undecodable body, or JSON nested too deeply",
    "401": "no valid key",
    "404": "not found",
    "413": "request body too large",
    "422": "invalid request",
}
_OPENAI_ERRORS = {"400": "invalid request", "401": "no valid key", "404": "not found", "413": "request too large"}


def _document_errors(app: FastAPI) -> None:
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _with_errors(build())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _with_errors(schema: dict[str, Any]) -> dict[str, Any]:
    """Every operation documents the errors the boundary can send, in the shape its path uses."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["HTTPValidationError"] = ERROR_DETAIL_SCHEMA
    components.pop("ValidationError", None)
    for path, item in schema.get("paths", {}).items():
        for operation in item.values():
            responses = operation.setdefault("responses", {})
            if is_openai_path(path):
                responses.pop("422", None)  # /v1 answers validation errors with a 400 in OpenAI's shape
                ref, errors = "#/components/schemas/ErrorResponse", _OPENAI_ERRORS
            else:
                ref, errors = "#/components/schemas/HTTPValidationError", _KVCHAT_ERRORS
            for status, description in errors.items():
                if status == "401" and "security" not in operation:
                    continue
                if status in ("400", "413") and "requestBody" not in operation and not is_openai_path(path):
                    continue
                responses.setdefault(status, {"description": description})
            for status, entry in responses.items():
                if status[0] in "45":  # every error a route declares has the path's shape
                    entry["content"] = {"application/json": {"schema": {"$ref": ref}}}
    return schema
