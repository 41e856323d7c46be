"""The engine server's errors and their one shape: ``{"error": {"code", "message", "type"}}`` (one line of JSON).

    condition                                   status  code
    an InvalidRequestError (too long, empty...) 400     its code (prompt_too_long, empty_prompt, ...)
    a body that does not parse or validate      400     invalid_request
    missing or wrong engine secret              401     unauthorized
    unknown path / method                       404/405 not_found / method_not_allowed
    EngineBusy                                  503     busy (with Retry-After)
    EngineStopped                               503     engine_stopped
    any other EngineError                       500     its code
    an unexpected exception                     500     internal_error (logged once, with its traceback)

``backend/engine_client/wire.py`` writes the engine errors' bodies, and the remote client rebuilds the same classes
from their codes, so the chat layer maps a remote engine's error exactly as an in-process one's.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from backend.engine_client.values import EngineBusy, EngineError, EngineStopped, InvalidRequestError
from backend.engine_client.wire import error_body

log = logging.getLogger("kvchat.engine_server")


class Unauthorized(Exception):
    """The request lacks the engine secret."""


def status_of(exc: EngineError) -> int:
    if isinstance(exc, InvalidRequestError):
        return 400
    if isinstance(exc, EngineBusy | EngineStopped):
        return 503
    return 500


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"code": code, "message": " ".join(message.split()), "type": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def install(app: FastAPI) -> None:
    """Map every error to the one JSON shape."""

    @app.exception_handler(EngineError)
    async def engine_error(_: Request, exc: EngineError) -> JSONResponse:
        headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))} if isinstance(exc, EngineBusy) else None
        return JSONResponse(error_body(exc), status_code=status_of(exc), headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid body"}
        if first.get("type") == "json_invalid":
            return error_response(400, "invalid_request", "the body is not valid JSON")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(400, "invalid_request", f"{where or 'body'}: {first.get('msg', 'invalid')}")

    @app.exception_handler(Unauthorized)
    async def unauthorized(_: Request, exc: Unauthorized) -> JSONResponse:
        return error_response(401, "unauthorized", str(exc), {"WWW-Authenticate": "Bearer"})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, f"http_{exc.status_code}")
        return error_response(exc.status_code, code, str(exc.detail))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, "internal_error", f"internal error ({type(exc).__name__}; see the server log)")
