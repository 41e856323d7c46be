"""Alembic 0016 (``tenant_reply_settings.repetition_penalty_scope``) up and down alone, on Postgres and on SQLite:
stored settings keep their penalty on every token (``all``), a tenant's ``reply`` survives until the downgrade
drops the column, and the settings row stays."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_migrations import _columns, _execute

from backend.db import migrate

ROWS = (
    "INSERT INTO tenants (id, name, system_prompt, created_at) VALUES ('t1', 'acme', '', '2026-01-01')",
    "INSERT INTO tenant_reply_settings (tenant_id, temperature, top_p, top_k, min_p, repetition_penalty,"
    " presence_penalty, frequency_penalty, stop, tool_choice, updated_at)"
    " VALUES ('t1', 0.0, 1.0, 0, 0.0, 1.2, 0.0, 0.0, '[]', 'auto', '2026-01-01')",
)
SCOPE = "SELECT repetition_penalty, repetition_penalty_scope FROM tenant_reply_settings"


def _scope_up_and_down(url: str) -> None:
    migrate.upgrade(url, "0015")
    for sql in ROWS:
        asyncio.run(_execute(url, sql))
    migrate.upgrade(url, "0016")
    assert asyncio.run(_execute(url, SCOPE)) == [(1.2, "all")]
    asyncio.run(_execute(url, "UPDATE tenant_reply_settings SET repetition_penalty_scope = 'reply'"))
    assert asyncio.run(_execute(url, SCOPE)) == [(1.2, "reply")]
    migrate.downgrade(url, "0015")
    assert "repetition_penalty_scope" not in asyncio.run(_columns(url, "tenant_reply_settings"))
    assert asyncio.run(_execute(url, "SELECT repetition_penalty FROM tenant_reply_settings")) == [(1.2,)]
    migrate.upgrade(url, "0016")  # and up again: the scope is back to every token
    assert asyncio.run(_execute(url, SCOPE)) == [(1.2, "all")]


@pytest.mark.postgres
def test_postgres_repetition_scope_revision_up_and_down(pg_empty_url: str) -> None:
    _scope_up_and_down(pg_empty_url)


def test_sqlite_repetition_scope_revision_up_and_down(tmp_path: Path) -> None:
    _scope_up_and_down(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")
