"""SQLite's one writer, queued in the process: a write transaction waits its turn on an asyncio lock, not on the file.

SQLite lets one connection write at a time. Without this, concurrent turns' write transactions met at the file lock:
the loser's ``sqlite3`` busy handler sleeps and retries (1, 2, 5, 10 ... 100 ms steps) on its connection's thread,
so a write that could have gone 1 ms after the last one went up to tens of ms later (the store step's p99 of 53 ms
in ``docs/benchmarks.md``), and past the connection's ``timeout`` it failed with "database is locked".

``WriteQueue``: a connection takes its database's writer lock before the first statement that may write (anything
but a ``SELECT`` outside a transaction) and gives it back when its transaction ends (commit, rollback, close, or a
statement that left none open). The lock is FIFO, so writers go in the order they asked; reads outside a transaction
never wait on it (WAL: they read the last commit). ``backend/db/sqlite_driver.py`` does this under SQLAlchemy, so no
service sees it; Postgres does not use it.

SQLite's own busy timeout stays for what the queue cannot see: another process on the file (a ``kvchat`` command
beside the server).

NOTE: a task that holds the lock through one connection and writes through a second would wait for itself; as the
file lock did, the wait ends (after ``WAIT_S``) with sqlite3's own "database is locked".
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import weakref

WAIT_S = 30.0  # the longest a write waits for its turn (the file lock's wait was 30 s too)
_READS = ("SELECT", "EXPLAIN", "PRAGMA")  # (a PRAGMA at connect sets this connection, and WAL that is set)


def may_write(sql: str) -> bool:
    """Whether ``sql`` may write (or begin a transaction): anything but a plain read."""
    return not sql.lstrip(" \t\r\n(").upper().startswith(_READS)


class WriteQueue:
    """One database file's writer lock, in one event loop (FIFO: ``asyncio.Lock`` wakes its waiters in order)."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self.waits = 0  # write transactions that found the lock taken (the tests, and a reader's check)

    async def acquire(self, timeout_s: float = WAIT_S) -> None:
        if self._lock.locked():
            self.waits += 1
        try:
            async with asyncio.timeout(timeout_s):
                await self._lock.acquire()
        except TimeoutError:
            raise sqlite3.OperationalError("database is locked") from None

    def release(self) -> None:
        self._lock.release()


_QUEUES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, WriteQueue]] = weakref.WeakKeyDictionary()


def queue_for(database: str) -> WriteQueue | None:
    """The write queue of ``database`` in the running loop; None for an in-memory database (each connection has its
    own: nothing to share)."""
    if database == ":memory:" or database.startswith("file::memory:"):
        return None
    if not database.startswith("file:"):
        database = os.path.realpath(database)  # (one file, however it is spelled)
    queues = _QUEUES.setdefault(asyncio.get_running_loop(), {})
    queue = queues.get(database)
    if queue is None:
        queue = queues[database] = WriteQueue()
    return queue
