"""Logging: plain text for a terminal, or one JSON object a line (``KVCHAT_LOG_FORMAT=json``) for a log pipeline.

Every record carries the ids of what it is about, when there is one: ``request_id`` (an HTTP request or a websocket
connection) and ``session_id`` (a chat session). They live in context variables, set where the work starts
(``RequestIdMiddleware``, the websocket handler), so tasks spawned from there inherit them.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Literal

from starlette.types import ASGIApp, Message, Receive, Scope, Send

LogFormat = Literal["text", "json"]

request_id: ContextVar[str | None] = ContextVar("kvchat_request_id", default=None)
session_id: ContextVar[str | None] = ContextVar("kvchat_session_id", default=None)

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Requests that come every few seconds by design: health probes, the metrics scraper and the dashboard's polls. Their
# access-log lines are kept at debug (``KVCHAT_LOG_LEVEL=debug`` shows them), so the console keeps what happened.
QUIET_PATHS = frozenset({"/livez", "/readyz", "/metrics", "/admin/stats", "/admin/sessions/summary"})
# NOTE: a client-sent X-Request-ID is kept only when it is short and plain, so it cannot forge log lines.
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


class ContextFilter(logging.Filter):
    """Copies the current request and session ids onto each record (as ``request_id`` / ``session_id``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        record.session_id = session_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """``{"time", "level", "logger", "message", "request_id"?, "session_id"?, "exception"?}`` per line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("request_id", "session_id"):
            value = getattr(record, key, None)
            if value:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class QuietPollsFilter(logging.Filter):
    """On uvicorn's access logger: a request for one of ``QUIET_PATHS`` becomes a debug record, dropped unless the
    logger is at debug. uvicorn's access records carry ``(client, method, path with query, http version, status)``."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str)):
            return True
        if args[2].partition("?")[0] not in QUIET_PATHS:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


class AlembicChatterFilter(logging.Filter):
    """Drops alembic's two lines about its own machinery ("Context impl SQLiteImpl.", "Will assume non-transactional
    DDL."), which every migration run prints and which tell an operator nothing; the migrations themselves stay."""

    _CHATTER = ("Context impl ", "Will assume ")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self._CHATTER)


def configure(level: str = "info", fmt: LogFormat = "text") -> None:
    """Set up the root logger once for the process (uvicorn's loggers propagate to it)."""
    handler = logging.StreamHandler()
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers[:] = []
        uvicorn_logger.propagate = True
    access = logging.getLogger("uvicorn.access")
    access.filters[:] = [f for f in access.filters if not isinstance(f, QuietPollsFilter)]
    access.addFilter(QuietPollsFilter())
    migration = logging.getLogger("alembic.runtime.migration")
    migration.filters[:] = [f for f in migration.filters if not isinstance(f, AlembicChatterFilter)]
    migration.addFilter(AlembicChatterFilter())


class RequestIdMiddleware:
    """Gives every HTTP request and websocket an id (the client's ``X-Request-ID`` when plain, else a new one),
    sets it for the logs, and returns it in the ``X-Request-ID`` response header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        rid = _client_request_id(scope) or secrets.token_hex(8)
        token = request_id.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id.reset(token)


def _client_request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if _CLIENT_REQUEST_ID.fullmatch(text) else None
    return None
