"""SQLite's one writer, queued in the process (``backend/db/sqlite_writer.py``): concurrent write transactions go one
at a time in the order they asked, none fails with "database is locked", and reads do not wait for a writer. Through
SQLAlchemy, as the services use it."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from backend.db.engine import create_db_engine
from backend.db.sqlite_writer import WriteQueue, may_write, queue_for

pytestmark = pytest.mark.anyio

WRITERS = 40


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    # NOTE: no busy timeout: a writer that met another at the file lock would fail at once; queued, none meets one
    engine = create_db_engine(f"sqlite+aiosqlite:///{tmp_path / 'writer.db'}", sqlite_timeout_s=0.0)
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE t (id INTEGER PRIMARY KEY, writer INTEGER NOT NULL, step INTEGER)"))
    yield engine
    await engine.dispose()


def test_only_plain_reads_skip_the_queue() -> None:
    assert [may_write(s) for s in ("SELECT 1", "  select x FROM t", "(SELECT 1)", "PRAGMA foreign_keys=ON")] == [
        False,
        False,
        False,
        False,
    ]
    assert [may_write(s) for s in ("INSERT INTO t VALUES (1)", "UPDATE t SET x=1", "DELETE FROM t", "BEGIN")] == [
        True,
        True,
        True,
        True,
    ]


async def test_concurrent_write_transactions_take_turns(engine: AsyncEngine, tmp_path: Path) -> None:
    async def write(writer: int) -> None:
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO t (writer, step) VALUES (:w, 0)"), {"w": writer})
            await asyncio.sleep(0.01)  # (work between two statements of one transaction, as a service does)
            await conn.execute(text("INSERT INTO t (writer, step) VALUES (:w, 1)"), {"w": writer})

    await asyncio.gather(*(write(i) for i in range(WRITERS)))  # (none fails: none met another at the file lock)
    async with engine.connect() as conn:
        rows = [tuple(r) for r in (await conn.execute(text("SELECT writer, step FROM t ORDER BY id"))).all()]
    writers = [w for w, _ in rows[::2]]
    assert sorted(writers) == list(range(WRITERS))
    assert rows == [(w, s) for w in writers for s in (0, 1)]  # one transaction at a time
    queue = queue_for(str(tmp_path / "writer.db"))
    assert queue is not None and queue.waits > 0  # (they did meet, in the queue)


async def test_writers_get_the_lock_in_the_order_they_asked() -> None:
    queue = WriteQueue()
    order: list[int] = []

    async def writer(i: int) -> None:
        await queue.acquire()
        order.append(i)
        await asyncio.sleep(0)
        queue.release()

    await queue.acquire()
    tasks = [asyncio.create_task(writer(i)) for i in range(10)]
    await asyncio.sleep(0.01)  # (all ten are waiting)
    queue.release()
    await asyncio.gather(*tasks)
    assert order == list(range(10))
    assert queue.waits == 10


async def test_a_write_that_waits_past_its_bound_is_the_drivers_locked_error() -> None:
    queue = WriteQueue()
    await queue.acquire()
    with pytest.raises(sqlite3.OperationalError, match="database is locked"):
        await queue.acquire(timeout_s=0.05)


async def test_a_read_does_not_wait_for_a_writer(engine: AsyncEngine) -> None:
    holding, done = asyncio.Event(), asyncio.Event()

    async def writer() -> None:
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO t (writer) VALUES (1)"))
            holding.set()
            await done.wait()

    task = asyncio.create_task(writer())
    await holding.wait()
    async with engine.connect() as conn:  # another connection, while the writer's transaction is open
        count = (await conn.execute(text("SELECT count(*) FROM t"))).scalar_one()
    done.set()
    await task
    assert count == 0  # (WAL: the read sees the last commit)


async def test_a_failed_write_gives_the_lock_back(engine: AsyncEngine) -> None:
    with pytest.raises(Exception, match="no such table"):
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO missing VALUES (1)"))
    async with asyncio.timeout(5), engine.begin() as conn:  # (a lock kept would make this wait its timeout)
        await conn.execute(text("INSERT INTO t (writer) VALUES (2)"))


async def test_a_write_waits_for_another_process_off_the_loop(tmp_path: Path) -> None:
    # a write transaction runs on the loop's thread from its first write (backend/db/sqlite_driver.py), except when
    # another process holds the file's write lock: then its first write waits on the connection's thread, so the
    # loop goes on meanwhile, and it lands once the other commits
    path = tmp_path / "other.db"
    engine = create_db_engine(f"sqlite+aiosqlite:///{path}", sqlite_timeout_s=10.0)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE t (id INTEGER PRIMARY KEY, writer INTEGER NOT NULL, step INTEGER)"))
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        other.execute("INSERT INTO t (writer, step) VALUES (1, 0)")

        async def write() -> None:
            async with engine.begin() as conn:
                await conn.execute(text("INSERT INTO t (writer, step) VALUES (2, 0)"))
                await conn.execute(text("INSERT INTO t (writer, step) VALUES (2, 1)"))

        task = asyncio.create_task(write())
        ticks = 0
        for _ in range(20):  # the loop runs while the write waits
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks == 20 and not task.done()
        other.execute("COMMIT")
        other.close()
        await asyncio.wait_for(task, 10)
        async with engine.connect() as conn:
            rows = [tuple(r) for r in (await conn.execute(text("SELECT writer, step FROM t ORDER BY id"))).all()]
        assert rows == [(1, 0), (2, 0), (2, 1)]
    finally:
        await engine.dispose()
