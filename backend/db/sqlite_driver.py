"""The SQLite driver under SQLAlchemy: aiosqlite, with one trip to the connection's thread per statement.

aiosqlite runs each connection on its own thread, and every call is a trip there and back (a queue put, a thread
wake-up, a ``call_soon_threadsafe`` and a loop wake-up). SQLAlchemy's adapter makes four trips per statement: open a
cursor, execute, fetch all rows, close the cursor; and a session that only read still ends with a rollback trip.

NOTE: measured on a 2-core EPYC, idle: 0.63 ms a statement with four trips, each about 0.15 ms; in a chat turn under
load (the engine stepping, 100 sockets) about 1 ms, and a turn runs some 20 statements before its prompt reaches the
engine. So ``OneTripConnection`` runs a statement and fetches its rows in one trip (SQLAlchemy fetches them all at
once anyway), closes its cursor without one, and skips the commit or rollback trip when no transaction is open
(``sqlite3`` would do nothing there).

Its write transactions take turns on the database's ``WriteQueue`` (``backend/db/sqlite_writer.py``) instead of
meeting at SQLite's file lock.
"""

from __future__ import annotations

import sqlite3
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import aiosqlite

from backend.db.sqlite_writer import WriteQueue, may_write, queue_for

_Description = tuple[tuple[Any, ...], ...] | None


class BufferedCursor:
    """A cursor as SQLAlchemy's aiosqlite adapter uses one, with each statement's rows fetched on the way back."""

    def __init__(self, connection: OneTripConnection) -> None:
        self._connection = connection
        self._rows: deque[Any] = deque()
        self.description: _Description = None
        self.rowcount = -1
        self.lastrowid: int | None = None
        self.arraysize = 1

    async def __aenter__(self) -> BufferedCursor:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def execute(self, sql: str, parameters: Sequence[Any] | dict[str, Any] | None = None) -> BufferedCursor:
        result = await self._connection.statement(_execute, sql, () if parameters is None else parameters)
        self._rows = deque(result[0])
        self.description, self.rowcount, self.lastrowid = result[1:]
        return self

    async def executemany(self, sql: str, parameters: Iterable[Sequence[Any]]) -> BufferedCursor:
        self._rows = deque()
        self.description, self.rowcount, self.lastrowid = await self._connection.statement(
            _execute_many, sql, parameters
        )
        return self

    async def fetchone(self) -> Any:
        return self._rows.popleft() if self._rows else None

    async def fetchmany(self, size: int | None = None) -> list[Any]:
        count = min(len(self._rows), self.arraysize if size is None else size)
        return [self._rows.popleft() for _ in range(count)]

    async def fetchall(self) -> list[Any]:
        rows = list(self._rows)
        self._rows.clear()
        return rows

    async def close(self) -> None:
        self._rows.clear()


class OneTripConnection(aiosqlite.Connection):
    """An aiosqlite connection whose cursors make one trip per statement (``BufferedCursor``), and whose write
    transactions queue in the process (``backend/db/sqlite_writer.py``)."""

    def __init__(self, connector: Any, database: str) -> None:
        super().__init__(connector, iter_chunk_size=64)
        self._database = database
        self._writer: WriteQueue | None = None  # the queue whose lock this connection holds, while it writes

    def cursor(self) -> BufferedCursor:  # type: ignore[override]
        return BufferedCursor(self)

    async def run(self, fn: Any, *args: Any) -> Any:
        """``fn(sqlite3_connection, *args)`` on the connection's thread."""
        return await self._execute(fn, self._conn, *args)

    async def statement(self, fn: Any, sql: str, parameters: Any) -> Any:
        """``run`` for one statement: one that may write waits for the writer lock first (unless held already)."""
        if self._writer is None and may_write(sql):
            queue = queue_for(self._database)
            if queue is not None:
                await queue.acquire()
                self._writer = queue
        try:
            return await self.run(fn, sql, parameters)
        finally:
            self._release_unless_writing()

    async def commit(self) -> None:
        try:
            if self._open_transaction():
                await super().commit()
        finally:
            self._release_unless_writing()

    async def rollback(self) -> None:
        try:
            if self._open_transaction():
                await super().rollback()
        finally:
            self._release_unless_writing()

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            self._release_unless_writing()

    def _release_unless_writing(self) -> None:
        connection = self._connection
        if self._writer is not None and (connection is None or not connection.in_transaction):
            self._writer.release()
            self._writer = None

    def _open_transaction(self) -> bool:
        # NOTE: read from the loop's thread: the connection is made with check_same_thread=False (SQLAlchemy's
        # default for a file), and nothing else runs on it meanwhile (the adapter awaits each statement in turn).
        # A closed connection answers True, so the call goes through and raises as aiosqlite's own would.
        connection = self._connection
        return connection is None or connection.in_transaction


def connect(database: str, **kwargs: Any) -> OneTripConnection:
    """Like ``aiosqlite.connect``: await the result for an open connection (its thread a daemon, as SQLAlchemy's)."""
    connection = OneTripConnection(lambda: sqlite3.connect(database, **kwargs), database)
    connection._thread.daemon = True
    return connection


def _execute(conn: sqlite3.Connection, sql: str, parameters: Any) -> tuple[list[Any], _Description, int, int | None]:
    cursor = conn.cursor()
    try:
        cursor.execute(sql, parameters)
        rows = cursor.fetchall() if cursor.description else []
        return rows, cursor.description, cursor.rowcount, cursor.lastrowid
    finally:
        cursor.close()


def _execute_many(conn: sqlite3.Connection, sql: str, parameters: Any) -> tuple[_Description, int, int | None]:
    cursor = conn.cursor()
    try:
        cursor.executemany(sql, parameters)
        return cursor.description, cursor.rowcount, cursor.lastrowid
    finally:
        cursor.close()
