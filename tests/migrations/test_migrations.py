"""Alembic: an empty database upgrades to head and back to base, on Postgres and on SQLite."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import inspect
from sqlalchemy.ext.asyncio import create_async_engine

from backend.db import migrate
from backend.db.models import Base

EXPECTED_TABLES = {"tenants", "api_keys", "chat_sessions", "messages"}


async def _tables(url: str) -> set[str]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            names = await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
    finally:
        await engine.dispose()
    return names - {"alembic_version"}


def _roundtrip(url: str) -> None:
    assert asyncio.run(_tables(url)) == set()
    migrate.upgrade(url)
    assert asyncio.run(_tables(url)) == EXPECTED_TABLES
    assert set(Base.metadata.tables) == EXPECTED_TABLES
    migrate.downgrade(url, "base")
    assert asyncio.run(_tables(url)) == set()
    migrate.upgrade(url)  # and up again: downgrade left nothing behind that blocks a second upgrade
    assert asyncio.run(_tables(url)) == EXPECTED_TABLES


@pytest.mark.postgres
def test_postgres_upgrade_to_head_and_back(pg_empty_url: str) -> None:
    _roundtrip(pg_empty_url)


def test_sqlite_upgrade_to_head_and_back(tmp_path: Path) -> None:
    _roundtrip(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")
