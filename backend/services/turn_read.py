"""What a chat turn reads of the database, in one round trip on Postgres (issue 43: "the context is read once, with
the reply settings, in one round trip").

The session with its tenant and the tenant's context settings, the session's messages, topic history and blocks,
the tenant's rules' version, its reply settings and tools: seven statements in turn before, each a trip to the
server and a statement's worth of the event loop's time. On Postgres they are now one ``SELECT`` of subqueries, each
table's rows as an array of its row type; asyncpg decodes those as records whose fields carry the columns' own
types, and the rows become ORM objects as a query would have loaded them (detached: the caller only reads them).

Other databases (SQLite: in process, no trip to save) read the same rows one statement at a time; the two ways give
the same ``TurnRows`` (``tests/backend/services/test_turn_read.py`` checks it on Postgres).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import make_transient_to_detached

from backend.core.errors import SessionNotFoundError
from backend.db.models import (
    Base,
    ChatSession,
    Message,
    SemanticBlock,
    Tenant,
    TenantContextSettings,
    TenantReplySettings,
    TenantTool,
    TopicHistory,
)
from backend.services import context_store, reply_settings, tenant_tools
from backend.services import sessions as store

Row = TypeVar("Row", bound=Base)


@dataclass(frozen=True, slots=True)
class TurnRows:
    """A turn's rows. ``blocks``: each block with its message's seq and text, in the prompt's order; ``reply`` and
    ``tools``: read only when asked for (``with_reply``)."""

    session: ChatSession
    tenant: Tenant
    context_settings: TenantContextSettings | None
    messages: list[Message]
    history: list[TopicHistory]
    blocks: list[tuple[SemanticBlock, int, str]]
    rules_version: tuple[int, datetime | None]
    reply: TenantReplySettings | None = None
    tools: tuple[TenantTool, ...] = ()


# NOTE: the scalar subqueries are evaluated once each; ``array_agg(x ORDER BY …)`` of a table's alias is an array of
# its row type. The block's message seq and text come from the messages read beside it, by id.
_ONE_TRIP = text(
    """
SELECT
  (SELECT s FROM chat_sessions s WHERE s.id = :sid AND s.tenant_id = :tid) AS session,
  (SELECT t FROM tenants t WHERE t.id = :tid) AS tenant,
  (SELECT c FROM tenant_context_settings c WHERE c.tenant_id = :tid) AS context_settings,
  (SELECT array_agg(m ORDER BY m.seq) FROM messages m WHERE m.session_id = :sid) AS messages,
  (SELECT array_agg(h ORDER BY h.message_seq, h.id) FROM topic_history h WHERE h.session_id = :sid) AS history,
  (SELECT array_agg(b ORDER BY bm.seq, b.block_index)
     FROM semantic_blocks b JOIN messages bm ON bm.id = b.message_id WHERE b.session_id = :sid) AS blocks,
  (SELECT count(*) FROM splitter_rules r WHERE r.tenant_id IS NULL OR r.tenant_id = :tid) AS rules_count,
  (SELECT max(r.updated_at) FROM splitter_rules r WHERE r.tenant_id IS NULL OR r.tenant_id = :tid) AS rules_latest,
  CASE WHEN :with_reply THEN (SELECT rs FROM tenant_reply_settings rs WHERE rs.tenant_id = :tid) END AS reply,
  CASE WHEN :with_reply THEN
    (SELECT array_agg(tt ORDER BY tt.name) FROM tenant_tools tt WHERE tt.tenant_id = :tid) END AS tools
"""
)


async def read(db: AsyncSession, tenant_id: str, session_id: str, *, with_reply: bool = True) -> TurnRows:
    """The turn's rows (``SessionNotFoundError`` when the session is not the tenant's): one round trip on Postgres."""
    if db.get_bind().dialect.name == "postgresql":
        return await _one_trip(db, tenant_id, session_id, with_reply)
    return await _statement_by_statement(db, tenant_id, session_id, with_reply)


async def _one_trip(db: AsyncSession, tenant_id: str, session_id: str, with_reply: bool) -> TurnRows:
    found = (await db.execute(_ONE_TRIP, {"sid": session_id, "tid": tenant_id, "with_reply": with_reply})).one()
    if found.session is None or found.tenant is None:
        raise SessionNotFoundError(f"session {session_id} not found")
    messages = [_orm(Message, r) for r in found.messages or ()]
    by_id = {m.id: m for m in messages}
    blocks = [_orm(SemanticBlock, r) for r in found.blocks or ()]
    return TurnRows(
        _orm(ChatSession, found.session),
        _orm(Tenant, found.tenant),
        None if found.context_settings is None else _orm(TenantContextSettings, found.context_settings),
        messages,
        [_orm(TopicHistory, r) for r in found.history or ()],
        [(b, by_id[b.message_id].seq, by_id[b.message_id].content) for b in blocks],
        (int(found.rules_count), found.rules_latest),
        None if found.reply is None else _orm(TenantReplySettings, found.reply),
        tuple(_orm(TenantTool, r) for r in found.tools or ()),
    )


async def _statement_by_statement(db: AsyncSession, tenant_id: str, session_id: str, with_reply: bool) -> TurnRows:
    session, tenant, settings = await context_store.session_and_tenant(db, tenant_id, session_id)
    return TurnRows(
        session,
        tenant,
        settings,
        await store.messages_after(db, session_id, 0),
        await context_store.topic_history(db, session_id),
        await context_store.block_rows(db, session_id),
        await context_store.rules_version(db, tenant_id),
        await reply_settings.row(db, tenant_id) if with_reply else None,
        tuple(await tenant_tools.list_tools(db, tenant_id)) if with_reply else (),
    )


def _orm(model: type[Row], record: Mapping[str, Any]) -> Row:
    """An ORM object of ``model`` from a row of its table, as if a query had loaded it and its session had closed
    (every column loaded, no pending change). Columns the model does not map are left out."""
    row = model(**{key: record[key] for key in _columns(model)})
    make_transient_to_detached(row)
    return row


@functools.cache
def _columns(model: type[Base]) -> tuple[str, ...]:
    return tuple(attr.key for attr in model.__mapper__.column_attrs)
