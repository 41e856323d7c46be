"""JSON logs carry the request and session ids; every response says its request id."""

from __future__ import annotations

import io
import json
import logging

import httpx
import pytest
from fastapi import FastAPI

from backend.core import logs

pytestmark = pytest.mark.anyio


def _capture(fmt: logs.LogFormat) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(logs.ContextFilter())
    handler.setFormatter(logs.JsonFormatter() if fmt == "json" else logging.Formatter("%(message)s"))
    logger = logging.getLogger(f"kvchat.test.{fmt}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, stream


def test_json_lines_carry_the_ids_in_context() -> None:
    logger, stream = _capture("json")
    logger.info("outside any request")
    rid, sid = logs.request_id.set("req-1"), logs.session_id.set("sess-1")
    try:
        logger.warning("turn %s failed", "m1")
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("with a traceback")
    finally:
        logs.request_id.reset(rid)
        logs.session_id.reset(sid)
    first, second, third = (json.loads(line) for line in stream.getvalue().splitlines())
    assert set(first) == {"time", "level", "logger", "message"}
    assert (second["level"], second["message"], second["request_id"], second["session_id"]) == (
        "warning",
        "turn m1 failed",
        "req-1",
        "sess-1",
    )
    assert third["exception"].startswith("Traceback") and "ValueError: boom" in third["exception"]


def _app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(logs.RequestIdMiddleware)

    @app.get("/id")
    async def current() -> dict[str, str | None]:
        return {"request_id": logs.request_id.get()}

    return app


@pytest.mark.parametrize(
    ("sent", "kept"),
    [(None, False), ("abc-123", True), ("bad id; forged=1", False), ("x" * 65, False)],
)
async def test_request_id_is_the_clients_when_plain_and_is_echoed(sent: str | None, kept: bool) -> None:
    transport = httpx.ASGITransport(app=_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        headers = {"X-Request-ID": sent} if sent is not None else {}
        resp = await client.get("/id", headers=headers)
    seen = resp.json()["request_id"]
    assert resp.headers["x-request-id"] == seen
    if kept:
        assert seen == sent
    else:
        assert seen != sent and len(seen) == 16


def _access_record(path: str) -> logging.LogRecord:
    return logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("1.2.3.4:5", "GET", path, "1.1", 200),
        None,
    )


@pytest.mark.parametrize(
    "path", ["/livez", "/readyz", "/metrics", "/admin/stats?window_s=60", "/admin/sessions/summary"]
)
def test_probes_and_polls_are_kept_at_debug(path: str) -> None:
    record = _access_record(path)
    access = logging.getLogger("uvicorn.access")
    before = access.level
    try:
        access.setLevel(logging.INFO)
        assert logs.QuietPollsFilter().filter(record) is False
        assert (record.levelno, record.levelname) == (logging.DEBUG, "DEBUG")
        access.setLevel(logging.DEBUG)
        assert logs.QuietPollsFilter().filter(_access_record(path)) is True
    finally:
        access.setLevel(before)


@pytest.mark.parametrize("path", ["/admin/sessions", "/livez/extra", "/v1/chat/completions", "/admin/stats/other"])
def test_other_requests_stay_at_info(path: str) -> None:
    record = _access_record(path)
    assert logs.QuietPollsFilter().filter(record) is True
    assert record.levelno == logging.INFO


@pytest.mark.parametrize(
    ("message", "kept"),
    [
        ("Context impl SQLiteImpl.", False),
        ("Will assume non-transactional DDL.", False),
        ("Running upgrade 0001 -> 0002, context layer", True),
    ],
)
def test_alembics_own_machinery_is_left_out(message: str, kept: bool) -> None:
    record = logging.LogRecord("alembic.runtime.migration", logging.INFO, __file__, 1, message, None, None)
    assert logs.AlembicChatterFilter().filter(record) is kept
