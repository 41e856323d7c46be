"""Alembic: an empty database upgrades to head and back to base, on Postgres and on SQLite; 0002, 0004-0010, 0013,
0014, 0011 and 0012 up and down alone. At head the global splitter rules equal ``DEFAULT_RULES`` (when the defaults
change, write a migration)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.ext.asyncio import create_async_engine

from backend.context.blocks import BlockType
from backend.context.rules import DEFAULT_RULES, Rule, compile_rule
from backend.db import migrate
from backend.db.models import Base

TABLES_0001 = {"tenants", "api_keys", "chat_sessions", "messages"}
TABLES_0002 = {"splitter_rules", "semantic_blocks", "topic_history", "invalidation_events", "tenant_context_settings"}
TABLES_0004 = {"admin_audit"}
TABLES_0008 = {"tenant_reply_settings", "tenant_tools"}
TABLES_0010 = {"handbook_sections"}
TABLES_0011 = {"tenant_fair_share"}
TABLES_0012 = {"agents", "handoffs", "agent_notes", "tenant_handoff_settings"}
EXPECTED_TABLES = TABLES_0001 | TABLES_0002 | TABLES_0004 | TABLES_0008 | TABLES_0010 | TABLES_0011 | TABLES_0012
SESSION_COLUMNS_0002 = {"semantic_temperature", "topic_epoch"}


async def _tables(url: str) -> set[str]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            names = await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
    finally:
        await engine.dispose()
    return names - {"alembic_version"}


async def _session_columns(url: str) -> set[str]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            columns = await conn.run_sync(lambda c: inspect(c).get_columns("chat_sessions"))
    finally:
        await engine.dispose()
    return {c["name"] for c in columns}


async def _execute(url: str, sql: str) -> list[tuple[object, ...]]:
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            result = await conn.execute(text(sql))
            return [tuple(row) for row in result] if result.returns_rows else []
    finally:
        await engine.dispose()


GLOBAL_RULES = "SELECT name, pattern, block_type, priority, language FROM splitter_rules WHERE tenant_id IS NULL"


def _roundtrip(url: str) -> None:
    assert asyncio.run(_tables(url)) == set()
    migrate.upgrade(url)
    assert asyncio.run(_tables(url)) == EXPECTED_TABLES
    defaults = sorted((r.name, r.pattern, r.block_type.value, r.priority, r.language) for r in DEFAULT_RULES)
    assert sorted(asyncio.run(_execute(url, GLOBAL_RULES))) == defaults
    assert set(Base.metadata.tables) == EXPECTED_TABLES
    migrate.downgrade(url, "base")
    assert asyncio.run(_tables(url)) == set()
    migrate.upgrade(url)  # and up again: downgrade left nothing behind that blocks a second upgrade
    assert asyncio.run(_tables(url)) == EXPECTED_TABLES


def _context_layer_up_and_down(url: str) -> None:
    """0001 → 0002 with a session already stored, back to 0001, and up again."""
    migrate.upgrade(url, "0001")
    asyncio.run(
        _execute(
            url,
            "INSERT INTO tenants (id, name, system_prompt, created_at) VALUES ('t1', 'acme', '', '2026-01-01')",
        )
    )
    asyncio.run(
        _execute(
            url,
            "INSERT INTO chat_sessions (id, tenant_id, status, context_version, created_at, last_active_at) "
            "VALUES ('s1', 't1', 'bot_active', 0, '2026-01-01', '2026-01-01')",
        )
    )
    migrate.upgrade(url, "0002")
    assert asyncio.run(_tables(url)) == TABLES_0001 | TABLES_0002
    assert asyncio.run(_session_columns(url)) >= SESSION_COLUMNS_0002
    assert asyncio.run(_execute(url, "SELECT topic_epoch, semantic_temperature FROM chat_sessions")) == [(0, None)]
    seeded = asyncio.run(
        _execute(url, "SELECT name, pattern, block_type, priority, language, tenant_id FROM splitter_rules ORDER BY id")
    )
    # The frozen seed: 18 global rules, each still a default of the same type, priority and language.
    defaults = {r.name: (r.block_type.value, r.priority, r.language, None) for r in DEFAULT_RULES}
    assert len(seeded) == 18
    assert all(defaults[name] == tuple(rest) for name, _, *rest in seeded)
    migrate.downgrade(url, "0001")
    assert asyncio.run(_tables(url)) == TABLES_0001
    assert not SESSION_COLUMNS_0002 & asyncio.run(_session_columns(url))
    assert asyncio.run(_execute(url, "SELECT id FROM chat_sessions")) == [("s1",)]  # the session survived both ways
    migrate.upgrade(url, "0002")
    assert asyncio.run(_tables(url)) == TABLES_0001 | TABLES_0002


def _admin_audit_up_and_down(url: str) -> None:
    """0003 → 0004 with a tenant stored, an audit row written, back to 0003 (the table goes, the tenant stays), up."""
    migrate.upgrade(url, "0003")
    asyncio.run(
        _execute(
            url,
            "INSERT INTO tenants (id, name, system_prompt, created_at) VALUES ('t1', 'acme', '', '2026-01-01')",
        )
    )
    migrate.upgrade(url, "0004")
    assert asyncio.run(_tables(url)) == TABLES_0001 | TABLES_0002 | TABLES_0004
    asyncio.run(
        _execute(
            url,
            "INSERT INTO admin_audit (tenant_id, actor, action, target, result, at) "
            "VALUES ('t1', 'kvc_admin_ab', 'session.flush', 's1', 'ok', '2026-01-01')",
        )
    )
    assert asyncio.run(_execute(url, "SELECT id, actor, action, target, result FROM admin_audit")) == [
        (1, "kvc_admin_ab", "session.flush", "s1", "ok")
    ]
    migrate.downgrade(url, "0003")
    assert asyncio.run(_tables(url)) == TABLES_0001 | TABLES_0002
    assert asyncio.run(_execute(url, "SELECT id FROM tenants")) == [("t1",)]
    migrate.upgrade(url, "0004")
    assert asyncio.run(_tables(url)) == TABLES_0001 | TABLES_0002 | TABLES_0004
    assert asyncio.run(_execute(url, "SELECT count(*) FROM admin_audit")) == [(0,)]


def _tenant_cache_up_and_down(url: str) -> None:
    """0004 → 0005 with a tenant and an audit row stored: the tenant gets the defaults (no policy text, private scope,
    no pin); an operator row (no tenant) can be written; back to 0004 the operator rows go and the rest stays."""
    migrate.upgrade(url, "0004")
    asyncio.run(
        _execute(
            url,
            "INSERT INTO tenants (id, name, system_prompt, created_at) VALUES ('t1', 'acme', 'Be kind.', '2026-01-01')",
        )
    )
    audit = "INSERT INTO admin_audit (tenant_id, actor, action, target, result, at) VALUES "
    asyncio.run(_execute(url, audit + "('t1', 'kvc_admin_ab', 'session.flush', 's1', 'ok', '2026-01-01')"))
    migrate.upgrade(url, "0005")
    assert asyncio.run(_execute(url, "SELECT system_prompt, policy_text, cache_scope, pin_prefix FROM tenants")) == [
        ("Be kind.", "", "private", False)
    ]
    asyncio.run(_execute(url, audit + "(NULL, 'operator', 'cache.settings', NULL, 'ok', '2026-01-02')"))
    asyncio.run(_execute(url, "UPDATE admin_audit SET detail = 'memory_ttl_s=30.0' WHERE actor = 'operator'"))
    assert asyncio.run(_execute(url, "SELECT tenant_id, action, detail FROM admin_audit ORDER BY id")) == [
        ("t1", "session.flush", None),
        (None, "cache.settings", "memory_ttl_s=30.0"),
    ]
    migrate.downgrade(url, "0004")
    assert asyncio.run(_execute(url, "SELECT tenant_id, action FROM admin_audit")) == [("t1", "session.flush")]
    assert asyncio.run(_execute(url, "SELECT id, system_prompt FROM tenants")) == [("t1", "Be kind.")]
    migrate.upgrade(url, "0005")
    assert asyncio.run(_execute(url, "SELECT policy_text, cache_scope FROM tenants")) == [("", "private")]


def _rules_in_re2_up_and_down(url: str) -> None:
    """0005 → 0006 rewrites the seeded rules that RE2 refuses (lookarounds) and leaves an operator's edit of a global
    rule and a tenant's own rule as they were; back to 0005 the seeded patterns return exactly."""
    migrate.upgrade(url, "0005")
    tenant = "INSERT INTO tenants (id, name, system_prompt, created_at) VALUES ('t1', 'acme', '', '2026-01-01')"
    asyncio.run(_execute(url, tenant))
    asyncio.run(_execute(url, "UPDATE splitter_rules SET pattern = 'ord(?=er)' WHERE name = 'order_number'"))
    asyncio.run(
        _execute(
            url,
            "INSERT INTO splitter_rules (tenant_id, name, pattern, block_type, priority, language, enabled, updated_at)"
            " VALUES ('t1', 'phone', '(?<!x)y', 'identifier', 1, 'any', true, '2026-01-01')",
        )
    )
    before = sorted(asyncio.run(_execute(url, GLOBAL_RULES)))
    migrate.upgrade(url, "0006")
    after = {name: pattern for name, pattern, *_ in asyncio.run(_execute(url, GLOBAL_RULES))}
    changed = {name for name, pattern, *_ in before if after[name] != pattern}
    assert changed == {"account_or_ticket", "email", "phone", "step_numbered"}  # order_number: the operator's
    assert after["order_number"] == "ord(?=er)"
    for name, pattern in after.items():
        if name != "order_number":
            compile_rule(Rule(name, pattern, BlockType.CONTEXT, 0))  # RE2 accepts every seeded pattern now
    own = "SELECT pattern FROM splitter_rules WHERE tenant_id = 't1'"
    assert asyncio.run(_execute(url, own)) == [("(?<!x)y",)]
    migrate.downgrade(url, "0005")
    assert sorted(asyncio.run(_execute(url, GLOBAL_RULES))) == before
    assert asyncio.run(_execute(url, own)) == [("(?<!x)y",)]


def _dialogue_act_rules_up_and_down(url: str) -> None:
    """0006 → 0007 adds the greeting and hand-off rules; back to 0006 they go, and blocks and tenant rules of the
    new types become ``context`` (0006's code cannot read them)."""
    migrate.upgrade(url, "0006")
    before = sorted(asyncio.run(_execute(url, GLOBAL_RULES)))
    migrate.upgrade(url, "0007")
    added = sorted(set(asyncio.run(_execute(url, GLOBAL_RULES))) - set(before))
    assert [(name, kind, priority) for name, _, kind, priority, _ in added] == [
        ("greeting", "greeting", 55),
        ("handoff_request", "handoff", 58),
    ]
    for sql in (
        "INSERT INTO tenants (id, name, system_prompt, created_at) VALUES ('t1', 'acme', '', '2026-01-01')",
        "INSERT INTO chat_sessions (id, tenant_id, status, context_version, created_at, last_active_at, topic_epoch)"
        " VALUES ('s1', 't1', 'bot_active', 0, '2026-01-01', '2026-01-01', 0)",
        "INSERT INTO messages (id, session_id, seq, role, content, status, prompt_tokens, completion_tokens,"
        " cached_tokens, created_at) VALUES (1, 's1', 1, 'user', 'Hi! 转人工', 'complete', 0, 0, 0, '2026-01-01')",
        "INSERT INTO semantic_blocks (session_id, message_id, block_index, block_type, char_start, char_end,"
        " token_count, content_hash, topic_epoch) VALUES ('s1', 1, 0, 'greeting', 0, 3, 1, 'h0', 0),"
        " ('s1', 1, 1, 'handoff', 4, 7, 3, 'h1', 0)",
        "INSERT INTO splitter_rules (tenant_id, name, pattern, block_type, priority, language, enabled, updated_at)"
        " VALUES ('t1', 'agent', '人工', 'handoff', 1, 'zh', true, '2026-01-01')",
    ):
        asyncio.run(_execute(url, sql))
    migrate.downgrade(url, "0006")
    assert sorted(asyncio.run(_execute(url, GLOBAL_RULES))) == before
    blocks = "SELECT block_index, block_type FROM semantic_blocks ORDER BY block_index"
    assert asyncio.run(_execute(url, blocks)) == [(0, "context"), (1, "context")]
    own = "SELECT name, block_type FROM splitter_rules WHERE tenant_id = 't1'"
    assert asyncio.run(_execute(url, own)) == [("agent", "context")]


def _reply_settings_and_tools_up_and_down(url: str) -> None:
    """0007 → 0008 adds the two tables; a tenant's settings and tools are stored; back to 0007 both tables go (and a
    tenant deleted at 0008 takes its rows with it)."""
    migrate.upgrade(url, "0007")
    migrate.upgrade(url, "0008")
    assert asyncio.run(_tables(url)) >= TABLES_0008
    for sql in (
        "INSERT INTO tenants (id, name, system_prompt, created_at) VALUES ('t1', 'acme', '', '2026-01-01')",
        "INSERT INTO tenant_reply_settings (tenant_id, temperature, top_p, top_k, min_p, repetition_penalty,"
        " presence_penalty, frequency_penalty, stop, tool_choice, updated_at)"
        " VALUES ('t1', 0.7, 0.9, 0, 0.0, 1.1, 0.0, 0.0, '[\"END\"]', 'auto', '2026-01-01')",
        "INSERT INTO tenant_tools (tenant_id, name, description, parameters, url, secret_header, secret_value,"
        " timeout_s, enabled, created_at, updated_at) VALUES ('t1', 'lookup', '', '{}', 'http://x', 'X-Key', 's',"
        " 5.0, true, '2026-01-01', '2026-01-01')",
    ):
        asyncio.run(_execute(url, sql))
    assert asyncio.run(_execute(url, "SELECT name, url FROM tenant_tools")) == [("lookup", "http://x")]
    migrate.downgrade(url, "0007")
    assert asyncio.run(_tables(url)) & TABLES_0008 == set()
    migrate.upgrade(url, "0008")
    assert asyncio.run(_execute(url, "SELECT count(*) FROM tenant_tools")) == [(0,)]


async def _message_columns(url: str) -> set[str]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            columns = await conn.run_sync(lambda c: inspect(c).get_columns("messages"))
    finally:
        await engine.dispose()
    return {c["name"] for c in columns}


def _tool_exchange_up_and_down(url: str) -> None:
    """0008 → 0009 adds ``messages.tool_exchange`` (empty on the stored messages); back to 0008 it goes, the messages
    stay."""
    migrate.upgrade(url, "0008")
    for sql in (
        "INSERT INTO tenants (id, name, system_prompt, created_at) VALUES ('t1', 'acme', '', '2026-01-01')",
        "INSERT INTO chat_sessions (id, tenant_id, status, context_version, created_at, last_active_at, topic_epoch)"
        " VALUES ('s1', 't1', 'bot_active', 0, '2026-01-01', '2026-01-01', 0)",
        "INSERT INTO messages (id, session_id, seq, role, content, status, prompt_tokens, completion_tokens,"
        " cached_tokens, created_at) VALUES (1, 's1', 1, 'assistant', 'Shipped.', 'complete', 0, 0, 0, '2026-01-01')",
    ):
        asyncio.run(_execute(url, sql))
    migrate.upgrade(url, "0009")
    assert "tool_exchange" in asyncio.run(_message_columns(url))
    assert asyncio.run(_execute(url, "SELECT content, tool_exchange FROM messages")) == [("Shipped.", None)]
    asyncio.run(_execute(url, 'UPDATE messages SET tool_exchange = \'{"steps": [], "answer_from": 0}\''))
    migrate.downgrade(url, "0008")
    assert "tool_exchange" not in asyncio.run(_message_columns(url))
    assert asyncio.run(_execute(url, "SELECT content FROM messages")) == [("Shipped.",)]


@pytest.mark.postgres
def test_postgres_tool_exchange_revision_up_and_down(pg_empty_url: str) -> None:
    _tool_exchange_up_and_down(pg_empty_url)


def test_sqlite_tool_exchange_revision_up_and_down(tmp_path: Path) -> None:
    _tool_exchange_up_and_down(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")


def _v1_contact_guard_up_and_down(url: str) -> None:
    """0013 → 0014 adds ``tenants.v1_contact_guard``, off for the stored tenants; back to 0013 it goes, they stay."""
    migrate.upgrade(url, "0013")
    insert = "INSERT INTO tenants (id, name, system_prompt, created_at) VALUES ('t1', 'acme', '', '2026-01-01')"
    asyncio.run(_execute(url, insert))
    migrate.upgrade(url, "0014")
    assert asyncio.run(_execute(url, "SELECT name, v1_contact_guard FROM tenants")) == [("acme", False)]
    asyncio.run(_execute(url, "UPDATE tenants SET v1_contact_guard = true"))
    assert asyncio.run(_execute(url, "SELECT v1_contact_guard FROM tenants")) == [(True,)]
    migrate.downgrade(url, "0013")
    assert asyncio.run(_execute(url, "SELECT name FROM tenants")) == [("acme",)]
    migrate.upgrade(url, "0014")
    assert asyncio.run(_execute(url, "SELECT v1_contact_guard FROM tenants")) == [(False,)]


@pytest.mark.postgres
def test_postgres_v1_contact_guard_revision_up_and_down(pg_empty_url: str) -> None:
    _v1_contact_guard_up_and_down(pg_empty_url)


def test_sqlite_v1_contact_guard_revision_up_and_down(tmp_path: Path) -> None:
    _v1_contact_guard_up_and_down(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")


def _fair_share_up_and_down(url: str) -> None:
    """0014 → 0011 adds ``tenant_fair_share`` (a tenant's weight and quotas); back to 0014 it goes, the tenant stays."""
    migrate.upgrade(url, "0014")
    asyncio.run(
        _execute(
            url, "INSERT INTO tenants (id, name, system_prompt, created_at) VALUES ('t1', 'acme', '', '2026-01-01')"
        )
    )
    migrate.upgrade(url, "0011")
    asyncio.run(
        _execute(
            url,
            "INSERT INTO tenant_fair_share (tenant_id, weight, tokens_per_minute, max_concurrent, updated_at)"
            " VALUES ('t1', 2.0, 6000, NULL, '2026-01-01')",
        )
    )
    rows = asyncio.run(
        _execute(url, "SELECT tenant_id, weight, tokens_per_minute, max_concurrent FROM tenant_fair_share")
    )
    assert rows == [("t1", 2.0, 6000, None)]
    migrate.downgrade(url, "0014")
    assert "tenant_fair_share" not in asyncio.run(_tables(url))
    assert asyncio.run(_execute(url, "SELECT name FROM tenants")) == [("acme",)]


@pytest.mark.postgres
def test_postgres_fair_share_revision_up_and_down(pg_empty_url: str) -> None:
    _fair_share_up_and_down(pg_empty_url)


def test_sqlite_fair_share_revision_up_and_down(tmp_path: Path) -> None:
    _fair_share_up_and_down(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")


@pytest.mark.postgres
def test_postgres_upgrade_to_head_and_back(pg_empty_url: str) -> None:
    _roundtrip(pg_empty_url)


def test_sqlite_upgrade_to_head_and_back(tmp_path: Path) -> None:
    _roundtrip(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")


@pytest.mark.postgres
def test_postgres_context_layer_revision_up_and_down(pg_empty_url: str) -> None:
    _context_layer_up_and_down(pg_empty_url)


def test_sqlite_context_layer_revision_up_and_down(tmp_path: Path) -> None:
    _context_layer_up_and_down(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")


@pytest.mark.postgres
def test_postgres_admin_audit_revision_up_and_down(pg_empty_url: str) -> None:
    _admin_audit_up_and_down(pg_empty_url)


def test_sqlite_admin_audit_revision_up_and_down(tmp_path: Path) -> None:
    _admin_audit_up_and_down(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")


@pytest.mark.postgres
def test_postgres_tenant_cache_revision_up_and_down(pg_empty_url: str) -> None:
    _tenant_cache_up_and_down(pg_empty_url)


def test_sqlite_tenant_cache_revision_up_and_down(tmp_path: Path) -> None:
    _tenant_cache_up_and_down(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")


@pytest.mark.postgres
def test_postgres_rules_in_re2_revision_up_and_down(pg_empty_url: str) -> None:
    _rules_in_re2_up_and_down(pg_empty_url)


def test_sqlite_rules_in_re2_revision_up_and_down(tmp_path: Path) -> None:
    _rules_in_re2_up_and_down(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")


@pytest.mark.postgres
def test_postgres_dialogue_act_rules_revision_up_and_down(pg_empty_url: str) -> None:
    _dialogue_act_rules_up_and_down(pg_empty_url)


def test_sqlite_dialogue_act_rules_revision_up_and_down(tmp_path: Path) -> None:
    _dialogue_act_rules_up_and_down(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")


@pytest.mark.postgres
def test_postgres_reply_settings_and_tools_revision_up_and_down(pg_empty_url: str) -> None:
    _reply_settings_and_tools_up_and_down(pg_empty_url)


def test_sqlite_reply_settings_and_tools_revision_up_and_down(tmp_path: Path) -> None:
    _reply_settings_and_tools_up_and_down(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")


def _replica_erase_up_and_down(url: str) -> None:
    """0010 → 0013 adds ``tenants.replica_erase``, ``report`` on the stored tenants; back to 0010 it goes, the tenants
    stay."""
    migrate.upgrade(url, "0010")
    asyncio.run(
        _execute(
            url, "INSERT INTO tenants (id, name, system_prompt, created_at) VALUES ('t1', 'acme', '', '2026-01-01')"
        )
    )
    migrate.upgrade(url, "0013")
    assert asyncio.run(_execute(url, "SELECT name, replica_erase FROM tenants")) == [("acme", "report")]
    asyncio.run(_execute(url, "UPDATE tenants SET replica_erase = 'reset_cache'"))
    migrate.downgrade(url, "0010")
    assert asyncio.run(_execute(url, "SELECT name FROM tenants")) == [("acme",)]
    assert "replica_erase" not in asyncio.run(_tenant_columns(url))


def _handbook_up_and_down(url: str) -> None:
    """0009 → 0010 adds ``handbook_sections``, ``tenants.handbook_version`` (0 on the stored tenants) and
    ``topic_history.sections``; back to 0009 they go, the tenants stay."""
    migrate.upgrade(url, "0009")
    asyncio.run(
        _execute(
            url, "INSERT INTO tenants (id, name, system_prompt, created_at) VALUES ('t1', 'acme', '', '2026-01-01')"
        )
    )
    migrate.upgrade(url, "0010")
    assert asyncio.run(_execute(url, "SELECT name, handbook_version FROM tenants")) == [("acme", 0)]
    asyncio.run(
        _execute(
            url,
            "INSERT INTO handbook_sections (tenant_id, position, title, text, content_hash, version) "
            "VALUES ('t1', 0, 'Returns', 'Within 30 days.', 'h', 1)",
        )
    )
    assert asyncio.run(_execute(url, "SELECT title, examples FROM handbook_sections")) == [("Returns", "[]")]
    migrate.downgrade(url, "0009")
    assert asyncio.run(_execute(url, "SELECT name FROM tenants")) == [("acme",)]
    assert "handbook_version" not in asyncio.run(_tenant_columns(url))
    assert "handbook_sections" not in asyncio.run(_tables(url))


def test_postgres_handbook_revision_up_and_down(pg_empty_url: str) -> None:
    _handbook_up_and_down(pg_empty_url)


def test_sqlite_handbook_revision_up_and_down(tmp_path: Path) -> None:
    _handbook_up_and_down(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")


async def _tenant_columns(url: str) -> set[str]:
    return await _columns(url, "tenants")


async def _columns(url: str, table: str) -> set[str]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            columns = await conn.run_sync(lambda c: inspect(c).get_columns(table))
    finally:
        await engine.dispose()
    return {c["name"] for c in columns}


@pytest.mark.postgres
def test_postgres_replica_erase_revision_up_and_down(pg_empty_url: str) -> None:
    _replica_erase_up_and_down(pg_empty_url)


def test_sqlite_replica_erase_revision_up_and_down(tmp_path: Path) -> None:
    _replica_erase_up_and_down(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")


def _human_agents_up_and_down(url: str) -> None:
    """0011 → 0012 adds the agents' tables and ``agent_id`` columns; back to 0011 an agent's key is left revoked and
    their message stays (role ``agent``)."""
    migrate.upgrade(url, "0011")
    for sql in (
        "INSERT INTO tenants (id, name, system_prompt, created_at) VALUES ('t1', 'acme', '', '2026-01-01')",
        "INSERT INTO chat_sessions (id, tenant_id, status, context_version, created_at, last_active_at, topic_epoch)"
        " VALUES ('s1', 't1', 'bot_active', 0, '2026-01-01', '2026-01-01', 0)",
    ):
        asyncio.run(_execute(url, sql))
    migrate.upgrade(url, "0012")
    assert asyncio.run(_tables(url)) >= TABLES_0012
    assert "agent_id" in asyncio.run(_columns(url, "api_keys"))
    for sql in (
        "INSERT INTO agents (id, tenant_id, name, created_at) VALUES ('a1', 't1', 'Dana', '2026-01-01')",
        "INSERT INTO api_keys (id, tenant_id, kind, key_hash, prefix, created_at, agent_id)"
        " VALUES ('k1', 't1', 'agent', 'h1', 'kvc_agent_x', '2026-01-01', 'a1')",
        "INSERT INTO messages (id, session_id, seq, role, content, status, prompt_tokens, completion_tokens,"
        " cached_tokens, created_at, agent_id) VALUES (1, 's1', 1, 'agent', 'Hi, Dana here.', 'complete', 0, 0, 0,"
        " '2026-01-01', 'a1')",
        "INSERT INTO handoffs (tenant_id, session_id, reason, requested_at) VALUES ('t1', 's1', 'customer_asked',"
        " '2026-01-01')",
    ):
        asyncio.run(_execute(url, sql))
    migrate.downgrade(url, "0011")
    assert not asyncio.run(_tables(url)) & TABLES_0012
    assert "agent_id" not in asyncio.run(_columns(url, "messages"))
    assert asyncio.run(_execute(url, "SELECT role, content FROM messages")) == [("agent", "Hi, Dana here.")]
    revoked = asyncio.run(_execute(url, "SELECT id FROM api_keys WHERE revoked_at IS NOT NULL"))
    assert revoked == [("k1",)]


@pytest.mark.postgres
def test_postgres_human_agents_revision_up_and_down(pg_empty_url: str) -> None:
    _human_agents_up_and_down(pg_empty_url)


def test_sqlite_human_agents_revision_up_and_down(tmp_path: Path) -> None:
    _human_agents_up_and_down(f"sqlite+aiosqlite:///{tmp_path / 'm.db'}")
