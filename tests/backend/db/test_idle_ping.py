"""Pre-ping only after idle, on a real Postgres: a connection back from a moment ago is handed out without a round
trip; one that sat idle is pinged, and replaced when its server process is gone."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from backend.db import idle_ping
from backend.db.engine import create_db_engine

pytestmark = pytest.mark.anyio


@pytest.fixture
async def one_connection(pg_empty_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(pg_empty_url, pool_size=1, max_overflow=0)
    yield engine
    await engine.dispose()


def count_pings(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    pings: list[int] = []
    do_ping = engine.dialect.do_ping

    def counted(dbapi_connection: Any) -> bool:
        pings.append(1)
        return do_ping(dbapi_connection)

    monkeypatch.setattr(engine.dialect, "do_ping", counted)
    return pings


async def backend_pid(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int(await conn.scalar(text("SELECT pg_backend_pid()")))


async def terminate(url: str, pid: int) -> None:
    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SELECT pg_terminate_backend($1)", pid)
    finally:
        await conn.close()


async def test_a_connection_back_a_moment_ago_is_not_pinged(
    one_connection: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    idle_ping.ping_when_idle(one_connection.sync_engine, idle_s=60.0)
    pings = count_pings(one_connection, monkeypatch)
    pids = {await backend_pid(one_connection) for _ in range(5)}
    assert len(pids) == 1  # the same pooled connection every time
    assert pings == []


async def test_an_idle_connection_is_pinged_and_a_dead_one_replaced(
    one_connection: AsyncEngine, pg_empty_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    idle_ping.ping_when_idle(one_connection.sync_engine, idle_s=0.0)  # (every reuse counts as idle)
    pings = count_pings(one_connection, monkeypatch)
    first = await backend_pid(one_connection)
    assert await backend_pid(one_connection) == first
    assert len(pings) == 1
    await terminate(pg_empty_url, first)
    assert await backend_pid(one_connection) != first  # the ping failed: a new connection, not a failed statement
    assert len(pings) == 2


async def test_the_serving_engine_pings_only_idle_connections(
    pg_empty_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(idle_ping, "IDLE_PING_S", 0.0)
    engine = create_db_engine(pg_empty_url)
    try:
        assert not engine.pool._pre_ping  # type: ignore[attr-defined]  # (not one ping per checkout)
        pings = count_pings(engine, monkeypatch)
        first = await backend_pid(engine)
        await terminate(pg_empty_url, first)
        assert await backend_pid(engine) != first
        assert pings
    finally:
        await engine.dispose()
