"""A turn's reads in one round trip on Postgres give the rows that reading them one statement at a time gives (the
way SQLite reads them), on a real Postgres: every column of every row, in the same order."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import event, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from backend.core.errors import SessionNotFoundError
from backend.db.engine import create_db_engine, create_sessionmaker
from backend.db.models import (
    Base,
    ChatSession,
    Message,
    SemanticBlock,
    SplitterRule,
    Tenant,
    TenantContextSettings,
    TenantReplySettings,
    TenantTool,
    TopicHistory,
)
from backend.services import turn_read
from backend.services.turn_read import TurnRows

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


def _columns(row: Base | None) -> dict[str, Any] | None:
    if row is None:
        return None
    return {attr.key: getattr(row, attr.key) for attr in type(row).__mapper__.column_attrs}


def _as_dicts(rows: TurnRows) -> dict[str, Any]:
    return {
        "session": _columns(rows.session),
        "tenant": _columns(rows.tenant),
        "context_settings": _columns(rows.context_settings),
        "messages": [_columns(m) for m in rows.messages],
        "history": [_columns(h) for h in rows.history],
        "blocks": [(_columns(b), seq, text) for b, seq, text in rows.blocks],
        "rules_version": rows.rules_version,
        "reply": _columns(rows.reply),
        "tools": [_columns(t) for t in rows.tools],
    }


async def _session_with_history(db: AsyncSession, *, settings: bool) -> tuple[str, str]:
    tenant = Tenant(id="t-shop", name="Shop", system_prompt="You help.", policy_text="Refunds in 30 days.")
    session = ChatSession(id="s-1", tenant_id=tenant.id, topic_epoch=1, semantic_temperature=0.4, pinned_context="VIP")
    db.add_all([tenant, Tenant(id="t-other", name="Other")])
    await db.flush()  # (no relationships are mapped: the unit of work does not order the tables' inserts)
    db.add(session)
    await db.flush()
    texts = ["Where is my parcel?", "It is on its way.", "And the kettle broke.", "A person will call you."]
    roles = ["user", "assistant", "user", "agent"]
    messages = [
        Message(
            session_id=session.id, seq=seq, role=role, content=content, client_msg_id=f"c{seq}" if seq % 2 else None
        )
        for seq, (role, content) in enumerate(zip(roles, texts, strict=True), start=1)
    ]
    messages[1].reply_to_seq, messages[1].tool_exchange = 1, '{"calls": []}'
    db.add_all(messages)
    await db.flush()
    first = SemanticBlock(
        session_id=session.id, message_id=messages[2].id, block_index=0, block_type="issue", char_start=0,
        char_end=11, token_count=4, content_hash="h0", topic_epoch=1,
    )  # fmt: skip
    db.add(first)
    await db.flush()
    db.add_all(
        [
            SemanticBlock(
                session_id=session.id, message_id=messages[2].id, block_index=1, block_type="statement",
                char_start=12, char_end=21, token_count=3, content_hash="h1", topic_epoch=1, parent_id=first.id,
            ),
            SemanticBlock(
                session_id=session.id, message_id=messages[0].id, block_index=0, block_type="question",
                char_start=0, char_end=19, token_count=6, content_hash="h2", topic_epoch=0,
            ),
            TopicHistory(session_id=session.id, message_seq=1, similarity=None, temperature=0.0, shift=False,
                         topic_epoch=0, sections='["Late parcels"]'),
            TopicHistory(session_id=session.id, message_seq=3, similarity=0.2, temperature=0.4, shift=True,
                         topic_epoch=1),
            SplitterRule(tenant_id=None, name="global", pattern="x", block_type="issue", priority=1),
            SplitterRule(tenant_id=tenant.id, name="own", pattern="y", block_type="issue", priority=2),
            SplitterRule(tenant_id="t-other", name="not ours", pattern="z", block_type="issue", priority=3),
        ]
    )  # fmt: skip
    if settings:
        db.add_all(
            [
                TenantContextSettings(tenant_id=tenant.id, history_policy="full", similarity_backend="tfidf",
                                      shift_threshold=0.3, start_temperature=0.1, shift_temperature=0.9,
                                      min_block_length=12),
                TenantReplySettings(tenant_id=tenant.id, temperature=0.7, top_p=0.9, top_k=40, min_p=0.0,
                                    repetition_penalty=1.1, presence_penalty=0.0, frequency_penalty=0.0,
                                    stop='["END"]', tool_choice="auto"),
                TenantTool(tenant_id=tenant.id, name="track", parameters="{}", url="https://example.com/t"),
                TenantTool(tenant_id=tenant.id, name="refund", parameters="{}", url="https://example.com/r",
                           enabled=False, secret_header="X-Key", secret_value="s"),
                TenantTool(tenant_id="t-other", name="theirs", parameters="{}", url="https://example.com/o"),
            ]
        )  # fmt: skip
    await db.commit()
    return tenant.id, session.id


@pytest.mark.parametrize("settings", [True, False], ids=["with settings and tools", "defaults"])
async def test_one_round_trip_reads_what_one_statement_at_a_time_reads(pg_url: str, settings: bool) -> None:
    db_engine = create_db_engine(pg_url)
    statements: list[str] = []
    event.listen(db_engine.sync_engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    try:
        maker = create_sessionmaker(db_engine)
        async with maker() as db:
            tenant_id, session_id = await _session_with_history(db, settings=settings)
        for with_reply in (True, False):
            statements.clear()
            async with maker() as db:
                one = await turn_read._one_trip(db, tenant_id, session_id, with_reply)
            assert len(statements) == 1
            async with maker() as db:
                each = await turn_read._statement_by_statement(db, tenant_id, session_id, with_reply)
            assert _as_dicts(one) == _as_dicts(each)
        assert [m.seq for m in one.messages] == [1, 2, 3, 4]
        assert [(seq, text) for _, seq, text in one.blocks] == [
            (1, "Where is my parcel?"),
            (3, "And the kettle broke."),
            (3, "And the kettle broke."),
        ]
        async with maker() as db:
            seeded = await db.scalar(select(func.count()).where(SplitterRule.tenant_id.is_(None)))
        assert one.rules_version[0] == seeded + 1  # the global rules and the tenant's own, not the other tenant's
        async with maker() as db:
            assert len((await turn_read.read(db, tenant_id, session_id)).tools) == (2 if settings else 0)
    finally:
        await db_engine.dispose()


async def test_another_tenants_session_is_not_found(pg_url: str) -> None:
    db_engine = create_db_engine(pg_url)
    try:
        maker = create_sessionmaker(db_engine)
        async with maker() as db:
            _, session_id = await _session_with_history(db, settings=False)
        async with maker() as db:
            with pytest.raises(SessionNotFoundError):
                await turn_read.read(db, "t-other", session_id)
            with pytest.raises(SessionNotFoundError):
                await turn_read.read(db, "t-shop", "no-such-session")
    finally:
        await db_engine.dispose()
