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
meeting at SQLite's file lock, and run on the loop's thread without a trip from their first write to their commit:
the writer is held while SQLite works and for the commit's trip (its sync to disk stays off the loop), not while
the loop gets round to each next statement (``_inline``).
Reads outside a write transaction stay on the connection's thread.
"""

from __future__ import annotations

import sqlite3
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import aiosqlite

from backend.db.sqlite_writer import WriteQueue, may_write, queue_for

# NOTE: set by ``reads_inline``: this task's reads are short ones by key (a chat turn's), run on the loop's thread
READS_INLINE: ContextVar[bool] = ContextVar("kvchat_sqlite_reads_inline", default=False)

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

    def __init__(self, connector: Any, database: str, busy_s: float) -> None:
        super().__init__(connector, iter_chunk_size=64)
        self._database = database
        self._busy_ms = round(busy_s * 1000)  # sqlite3's ``timeout``: how long a write waits for another process
        self._writer: WriteQueue | None = None  # the queue whose lock this connection holds, while it writes

    def cursor(self) -> BufferedCursor:  # type: ignore[override]
        return BufferedCursor(self)

    async def run(self, fn: Any, *args: Any) -> Any:
        """``fn(sqlite3_connection, *args)`` on the connection's thread."""
        return await self._execute(fn, self._conn, *args)

    async def statement(self, fn: Any, sql: str, parameters: Any) -> Any:
        """``run`` for one statement. One that may write waits for the writer lock first (unless held already); a
        write transaction's statements then run at once, on the loop's thread (``_first_write``, ``_inline``), as do
        the reads of a ``reads_inline`` task; everything else, and every commit, on the connection's thread."""
        if self._writer is None and may_write(sql):
            queue = queue_for(self._database)
            if queue is not None:
                await queue.acquire()
                self._writer = queue
                try:
                    return _first_write(self._conn, self._busy_ms, fn, sql, parameters)
                except _Busy:
                    pass  # another process holds the file's write lock: wait for it on the connection's thread
                finally:
                    self._release_unless_writing()
        elif self._inline() or (READS_INLINE.get() and self._connection is not None):
            try:
                return fn(self._conn, sql, parameters)
            finally:
                self._release_unless_writing()
        try:
            return await self.run(fn, sql, parameters)
        finally:
            self._release_unless_writing()

    async def commit(self) -> None:
        # NOTE: on the connection's thread even in a write transaction: a commit syncs the WAL to disk (ms), which
        # would stall the loop (measured: 16 % of the loop's time under 100 sockets when run there).
        try:
            if self._open_transaction():
                await super().commit()
        finally:
            self._release_unless_writing()

    async def rollback(self) -> None:
        try:
            if self._inline():
                self._conn.rollback()
            elif self._open_transaction():
                await super().rollback()
        finally:
            self._release_unless_writing()

    def _inline(self) -> bool:
        """Whether to run the next statement at once, on the loop's thread: while this connection holds the writer
        in an open transaction, after its first write.

        NOTE: a trip to the connection's thread comes back after the loop's other ready callbacks; on a busy loop
        that is several ms, and a transaction holding the writer held every other turn's writes for each of its
        trips (measured under 100 sockets: 5 write transactions a turn, 4-5 trips each, ~5 ms a trip; the writer
        was busy ~75 % of the time and each write waited ~250 ms for it). Once the first write took SQLite's file
        lock, the transaction's statements meet no lock (WAL: readers never block the writer) and are short (rows
        by key), so they run here, in tens of µs each; only the commit makes a trip."""
        connection = self._connection
        return self._writer is not None and connection is not None and connection.in_transaction

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


@contextmanager
def reads_inline() -> Iterator[None]:
    """Within it (and in the tasks started within it), reads run at once on the loop's thread, as write transactions
    do: for a chat turn's reads, a few rows by key each. Under load a trip to the connection's thread took ~80 ms
    (the loop's queue, and the GIL shared with the engine's step and the CPU workers), so a turn's 7 reads before
    its prompt took ~0.5 s and kept a pooled connection all that time; run here they take ~10 ms. Not for a read
    that may scan a table (an export, the admin's lists): it would stall every socket meanwhile."""
    token = READS_INLINE.set(True)
    try:
        yield
    finally:
        READS_INLINE.reset(token)


def connect(database: str, **kwargs: Any) -> OneTripConnection:
    """Like ``aiosqlite.connect``: await the result for an open connection (its thread a daemon, as SQLAlchemy's)."""
    connection = OneTripConnection(lambda: sqlite3.connect(database, **kwargs), database, kwargs.get("timeout", 5.0))
    connection._thread.daemon = True
    return connection


class _Busy(Exception):
    """The file's write lock is another process's (``_first_write``)."""


def _first_write(conn: sqlite3.Connection, busy_ms: int, fn: Any, sql: str, parameters: Any) -> Any:
    """``fn`` at once, on the calling thread, if SQLite's file lock is free: a transaction's first write takes it.
    Raises ``_Busy`` when another process holds it (nothing was written; the caller waits on the connection's
    thread instead). NOTE: the wait is off for this statement alone; a deferred transaction's first write fails with
    SQLITE_BUSY before it changes anything, and the transaction stays open to try again."""
    conn.execute("PRAGMA busy_timeout = 0")
    try:
        return fn(conn, sql, parameters)
    except sqlite3.OperationalError as exc:
        if exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY:
            raise _Busy from exc
        raise
    finally:
        conn.execute(f"PRAGMA busy_timeout = {busy_ms}")


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
