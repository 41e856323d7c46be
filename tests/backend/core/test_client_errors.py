"""Clients' mistakes in the log: uvicorn's invalid-UTF-8 traceback becomes one line, rate limited; per-socket lines
are dropped; our own refusals are rate limited per kind."""

from __future__ import annotations

import logging
import sys

import pytest

from backend.core.client_errors import ClientErrorFilter, RateLimitedLog, RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _record(message: str, *, with_traceback: bool = False) -> logging.LogRecord:
    exc_info = None
    if with_traceback:
        try:
            b"\xff".decode()
        except UnicodeDecodeError:
            exc_info = sys.exc_info()
    return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, message, None, exc_info)


def test_a_client_protocol_error_is_one_line_without_traceback_at_most_every_window() -> None:
    clock = Clock()
    kept = ClientErrorFilter(RateLimiter(10.0, clock))
    first = _record("Invalid UTF-8 sequence received from client.", with_traceback=True)
    assert kept.filter(first) is True
    assert (first.getMessage(), first.exc_info, first.levelname) == (
        "a client sent a text frame that is not UTF-8 (closed 1007)",
        None,
        "WARNING",
    )
    assert logging.Formatter().format(first).count("\n") == 0  # one line: no traceback
    held = [kept.filter(_record("Invalid UTF-8 sequence received from client.")) for _ in range(3)]
    assert held == [False, False, False]
    clock.now += 10.0
    later = _record("Invalid UTF-8 sequence received from client.", with_traceback=True)
    assert kept.filter(later) is True
    assert (
        later.getMessage() == "a client sent a text frame that is not UTF-8 (closed 1007) (and 3 more in the last 10 s)"
    )


def test_per_socket_lines_are_dropped_and_other_lines_kept_as_they_are() -> None:
    kept = ClientErrorFilter()
    assert kept.filter(_record("connection open")) is False
    assert kept.filter(_record("connection closed")) is False
    other = _record("Exception in ASGI application\n", with_traceback=True)
    assert kept.filter(other) is True and other.exc_info is not None  # a server bug keeps its traceback


def test_refusals_are_rate_limited_per_kind(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = RateLimitedLog(logging.getLogger("kvchat.test.refusals"), RateLimiter(10.0, clock))
    with caplog.at_level(logging.INFO, logger="kvchat.test.refusals"):
        for _ in range(5):
            log.info("tenant cap", "refused a socket with 1013: tenant cap")
        log.info("client cap", "refused a socket with 1013: client cap")
        clock.now += 10.0
        log.info("tenant cap", "refused a socket with 1013: tenant cap")
    assert [r.getMessage() for r in caplog.records] == [
        "refused a socket with 1013: tenant cap",
        "refused a socket with 1013: client cap",
        "refused a socket with 1013: tenant cap (and 4 more like it)",
    ]
