"""Clients' mistakes in the log: one line each at most, never a traceback, and rate limited.

A client that sends a text frame of invalid UTF-8 is closed by uvicorn with 1007, which is right; uvicorn also logs
it with ``logger.exception``, a five-line traceback per frame, so any client could flood the log (issue 28). The
same holds for the lines each refused socket writes. ``ClientErrorFilter`` sits on uvicorn's logger: it turns a
client protocol error into one line without its traceback, drops the per-socket "connection open/closed" lines, and
lets each kind of line through at most once per ``window_s``, saying how many it held back. ``RateLimitedLog`` does
the same for our own per-connection refusals.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

WINDOW_S = 10.0

# uvicorn's messages for a client's protocol error (its exception is the client's, not ours) -> our one line.
CLIENT_ERRORS = {
    "Invalid UTF-8 sequence received from client.": "a client sent a text frame that is not UTF-8 (closed 1007)",
    "Invalid HTTP request received.": "a client sent an invalid HTTP request",
}
# Lines uvicorn writes for every websocket; the access line ("WebSocket /ws/chat" [accepted]) already names each.
_PER_SOCKET = frozenset({"connection open", "connection closed"})


class RateLimiter:
    """Lets each key through at most once per ``window_s``; counts what it held back meanwhile. Thread safe."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    @property
    def window_s(self) -> float:
        return self._window_s

    def allow(self, key: str) -> int | None:
        """None when ``key`` must stay quiet; else how many were held back since the last one let through."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._window_s:
                self._held[key] = self._held.get(key, 0) + 1
                return None
            self._last[key] = now
            return self._held.pop(key, 0)


class ClientErrorFilter(logging.Filter):
    """On uvicorn's error logger: client protocol errors as one rate-limited line, per-socket lines dropped."""

    def __init__(self, limiter: RateLimiter | None = None) -> None:
        super().__init__()
        self._limiter = limiter or RateLimiter()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in _PER_SOCKET:
            return False
        line = CLIENT_ERRORS.get(message)
        if line is None:
            return True
        held = self._limiter.allow(message)
        if held is None:
            return False
        record.msg = line if not held else f"{line} (and {held} more in the last {self._limiter.window_s:.0f} s)"
        record.args = None
        record.exc_info = None
        record.exc_text = None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


class RateLimitedLog:
    """One line per kind of event, at most once per ``window_s``, with the count of those held back."""

    def __init__(self, logger: logging.Logger, limiter: RateLimiter | None = None) -> None:
        self._logger = logger
        self._limiter = limiter or RateLimiter()

    def info(self, kind: str, line: str) -> None:
        held = self._limiter.allow(kind)
        if held is not None:
            self._logger.info("%s%s", line, f" (and {held} more like it)" if held else "")


def install(logger_name: str = "uvicorn.error") -> None:
    """Put ``ClientErrorFilter`` on uvicorn's error logger, once per process."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, ClientErrorFilter) for f in logger.filters):
        logger.addFilter(ClientErrorFilter())
