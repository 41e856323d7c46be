"""Async SQLAlchemy engine and session factory (Postgres via asyncpg, SQLite via aiosqlite).

A serving process names its Postgres connections ``kvchat-worker:<pid>:<random>`` (``worker_name``), so another process
starting on the same database can tell that it is not alone (``peer_workers``).
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import URL, Dialect, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from backend.db import sqlite_driver
from backend.db.idle_ping import ping_when_idle

WORKER_PREFIX = "kvchat-worker:"


def ensure_sqlite_dir(url: str) -> None:
    """SQLite cannot create the folder of its file: make it (a fresh checkout has no data dir yet)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)


SUPPORTED_DRIVERS = ("postgresql+asyncpg", "sqlite+aiosqlite")


class UnsupportedDatabaseError(ValueError):
    """``KVCHAT_DATABASE_URL`` is not a URL, or names a database kvchat does not run on."""


def check_database_url(url: str) -> URL:
    """Parse ``url`` (already normalized by the settings) and refuse anything but Postgres and SQLite."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise UnsupportedDatabaseError(f"{url!r} is not a database URL (e.g. postgresql://host/db)") from exc
    if parsed.drivername not in SUPPORTED_DRIVERS:
        raise UnsupportedDatabaseError(
            f"unsupported database {parsed.drivername!r}: use postgresql://user@host/db or sqlite:///path"
        )
    return parsed


async def ping(url: str, timeout_s: float = 10.0) -> None:
    """Connect once and run ``SELECT 1``; raises the driver's error (or ``TimeoutError``) when that fails."""
    engine = create_db_engine(url)
    try:
        async with asyncio.timeout(timeout_s), engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
    finally:
        await engine.dispose()


def worker_name(secret_tag: str = "") -> str:
    """A name for this serving process's database connections, unique among processes; ``secret_tag``
    (``backend.core.namespaces.secret_tag``) lets the other workers check that they share its secret."""
    return f"{worker_prefix(os.getpid())}{secrets.token_hex(4)}" + (f":{secret_tag}" if secret_tag else "")


def tag_of(name: str) -> str | None:
    """The secret tag in a ``worker_name`` (``kvchat-worker:<pid>:<random>:<tag>``); None for a name without one."""
    parts = name.removeprefix(WORKER_PREFIX).split(":")
    return parts[2] if len(parts) == 3 and parts[2] else None


def worker_prefix(pid: int) -> str:
    """What every connection name of the serving process ``pid`` starts with (``worker_name``)."""
    return f"{WORKER_PREFIX}{pid}:"


def create_db_engine(url: str, application_name: str | None = None, sqlite_timeout_s: float = 30.0) -> AsyncEngine:
    """An engine for ``url``; on Postgres its connections carry ``application_name`` (see ``worker_name``). On SQLite
    writes take turns in the process (``backend/db/sqlite_writer.py``); ``sqlite_timeout_s`` is SQLite's own wait
    for the file lock, for another process's writes."""
    parsed = check_database_url(url)
    if parsed.get_backend_name() == "sqlite":
        ensure_sqlite_dir(url)
        engine = create_async_engine(url, connect_args={"timeout": sqlite_timeout_s})
        event.listen(engine.sync_engine, "do_connect", _one_trip_sqlite)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    connect_args = {"server_settings": {"application_name": application_name}} if application_name else {}
    # NOTE: after a Postgres restart every pooled connection is dead: one that sat idle is tested at checkout and
    # replaced (``idle_ping.py``; a ping per checkout was ~5 round trips a turn). The pool keeps 20 (at most 30, as
    # before): at saturation a turn's tasks held more than 10 at once, and each overflow connection was made and
    # closed again, its prepared statements with it.
    engine = create_async_engine(url, pool_size=20, max_overflow=10, pool_use_lifo=True, connect_args=connect_args)
    ping_when_idle(engine.sync_engine)
    return engine


async def peer_workers(engine: AsyncEngine, own_name: str) -> int:
    """How many other serving kvchat processes are connected to this database (always 0 on SQLite: one process)."""
    if engine.dialect.name != "postgresql":
        return 0
    async with engine.connect() as conn:
        count = await conn.scalar(
            text(
                "SELECT count(DISTINCT application_name) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name LIKE :prefix AND application_name <> :own"
            ),
            {"prefix": WORKER_PREFIX + "%", "own": own_name},
        )
    return int(count or 0)


async def peer_secret_tags(engine: AsyncEngine, own_name: str) -> dict[str, str]:
    """The other serving kvchat processes connected now, by name, with their secret tags (``tag_of``); empty on
    SQLite (one process) and for workers whose names carry no tag."""
    if engine.dialect.name != "postgresql":
        return {}
    names = await live_workers(engine)
    return {name: tag for name in names if name != own_name and (tag := tag_of(name)) is not None}


async def live_workers(engine: AsyncEngine) -> set[str]:
    """The names (``worker_name``) of the serving kvchat processes connected to this database now (Postgres)."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT DISTINCT application_name FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name LIKE :prefix"
            ),
            {"prefix": WORKER_PREFIX + "%"},
        )
    return {str(name) for name in rows.scalars()}


def _one_trip_sqlite(dialect: Dialect, _record: object, cargs: list[Any], cparams: dict[str, Any]) -> object:
    # NOTE: SQLAlchemy's own connect (the URL's arguments, then its adapter), on aiosqlite connections that make one
    # trip to their thread per statement instead of four (``backend/db/sqlite_driver.py``). ``async_creator_fn`` is
    # how ``create_async_engine(async_creator=...)`` hands the adapter its connection; here it keeps the arguments.
    return dialect.loaded_dbapi.connect(*cargs, async_creator_fn=sqlite_driver.connect, **cparams)


def _sqlite_pragmas(dbapi_conn: object, _record: object) -> None:
    # NOTE: WAL lets the chat page read while a turn commits; foreign keys are off by default in SQLite.
    cursor = dbapi_conn.cursor()  # type: ignore[attr-defined]
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
