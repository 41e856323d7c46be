"""The SQLite driver under SQLAlchemy: one trip to the connection's thread per statement, and the same answers as
aiosqlite's own cursors (rows, row counts, inserted ids, RETURNING, errors, transactions)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import CursorResult, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from backend.db import sqlite_driver
from backend.db.engine import create_db_engine, create_sessionmaker

pytestmark = pytest.mark.anyio


@pytest.fixture
def trips(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the functions sent to connection threads, in order."""
    sent: list[str] = []
    run = sqlite_driver.OneTripConnection._execute

    async def counted(self: sqlite_driver.OneTripConnection, fn: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(getattr(fn, "__name__", repr(fn)))
        return await run(self, fn, *args, **kwargs)

    monkeypatch.setattr(sqlite_driver.OneTripConnection, "_execute", counted)
    return sent


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    engine = create_db_engine(f"sqlite+aiosqlite:///{tmp_path / 'driver.db'}")
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL)"))
    yield engine
    await engine.dispose()


async def test_a_statement_is_one_trip_and_a_read_only_session_ends_without_one(
    engine: AsyncEngine, trips: list[str]
) -> None:
    maker = create_sessionmaker(engine)
    async with maker() as db:
        await db.execute(text("SELECT 1"))  # (the pool's connection is open: no connect trips below)
    trips.clear()
    async with maker() as db:
        assert (await db.execute(text("SELECT 1 UNION SELECT 2"))).scalars().all() == [1, 2]
    assert trips == ["_execute"]  # aiosqlite's cursors: cursor, execute, fetchall, close, then the rollback


async def test_a_write_transaction_makes_one_trip_its_commit(engine: AsyncEngine, trips: list[str]) -> None:
    # from its first write to its commit, a transaction runs on the loop's thread (a trip would hold the writer for
    # a loop iteration); the commit (a sync to disk) and the read after it go to the connection's thread
    maker = create_sessionmaker(engine)
    async with maker() as db:
        await db.execute(text("SELECT 1"))  # (the pool's connection is open: no connect trips below)
    trips.clear()
    async with maker() as db:
        inserted = await db.execute(text("INSERT INTO t (name) VALUES ('a'), ('b')"))
        assert isinstance(inserted, CursorResult)
        assert inserted.rowcount == 2
        assert inserted.lastrowid == 2
        returned = await db.execute(text("UPDATE t SET name = name || '!' RETURNING id, name"))
        assert sorted(returned.all()) == [(1, "a!"), (2, "b!")]
        counted = await db.execute(text("SELECT count(*) FROM t"))
        assert counted.scalar() == 2
        assert trips == []
        await db.commit()
        assert trips == ["commit"]  # (its sync to disk stays off the loop)
        assert (await db.execute(text("SELECT name FROM t ORDER BY id"))).scalars().all() == ["a!", "b!"]
    assert trips == ["commit", "_execute"]  # the read after the commit: on the thread again
    async with maker() as db:
        assert (await db.execute(text("SELECT name FROM t ORDER BY id"))).scalars().all() == ["a!", "b!"]


async def test_a_rolled_back_write_is_gone_and_errors_are_the_driver_s(engine: AsyncEngine) -> None:
    maker = create_sessionmaker(engine)
    async with maker() as db:
        await db.execute(text("INSERT INTO t (name) VALUES ('kept')"))
        await db.commit()
        await db.execute(text("INSERT INTO t (name) VALUES ('dropped')"))
        await db.rollback()
        with pytest.raises(IntegrityError):
            await db.execute(text("INSERT INTO t (name) VALUES ('kept')"))
        await db.rollback()
    async with maker() as db:
        assert (await db.execute(text("SELECT name FROM t"))).scalars().all() == ["kept"]


async def test_many_rows_are_fetched_whole_or_in_parts(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("INSERT INTO t (name) VALUES (:name)"), [{"name": f"n{i}"} for i in range(50)])
    async with engine.connect() as conn:
        result = await conn.execute(text("SELECT id FROM t ORDER BY id"))
        assert result.fetchone() == (1,)
        assert [r[0] for r in result.fetchmany(3)] == [2, 3, 4]
        assert [r[0] for r in result.fetchall()] == list(range(5, 51))
