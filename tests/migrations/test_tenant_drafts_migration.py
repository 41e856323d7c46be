"""Alembic 0015 (``tenants.drafts``) up and down alone, on Postgres and on SQLite: stored tenants follow the
engine's switch (``default``), a tenant's choice survives until the downgrade drops the column, and the tenant
stays."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_migrations import _columns, _execute

from backend.db import migrate

TENANT = "INSERT INTO tenants (id, name, system_prompt, created_at) VALUES ('t1', 'acme', '', '2026-01-01')"


def _drafts_up_and_down(url: str) -> None:
    migrate.upgrade(url, "0012")
    asyncio.run(_execute(url, TENANT))
    migrate.upgrade(url, "0015")
    assert asyncio.run(_execute(url, "SELECT name, drafts FROM tenants")) == [("acme", "default")]
    asyncio.run(_execute(url, "UPDATE tenants SET drafts = 'off'"))
    assert asyncio.run(_execute(url, "SELECT drafts FROM tenants")) == [("off",)]
    migrate.downgrade(url, "0012")
    assert "drafts" not in asyncio.run(_columns(url, "tenants"))
    assert asyncio.run(_execute(url, "SELECT name FROM tenants")) == [("acme",)]
    migrate.upgrade(url, "0015")  # and up again: the choice is gone, the tenant follows the switch
    assert asyncio.run(_execute(url, "SELECT drafts FROM tenants")) == [("default",)]


@pytest.mark.postgres
def test_postgres_drafts_revision_up_and_down(pg_empty_url: str) -> None:
    _drafts_up_and_down(pg_empty_url)


def test_sqlite_drafts_revision_up_and_down(tmp_path: Path) -> None:
    _drafts_up_and_down(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")
