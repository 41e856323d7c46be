"""What a tenant's admin does to its chat sessions: search them (with their cache footprints: the dashboard's
summary), read a transcript or the whole detail (blocks, temperature history, invalidations, cache footprint), change
a status, delete one.

Every function takes the admin's tenant id and only ever reaches that tenant's sessions (another tenant's session is
``SessionNotFoundError``, the same answer as a session that does not exist). What reaches a live session (its status
announced to its sockets, its reply in flight stopped, its engine cache) goes through the chat service, which the
caller passes in as a ``LiveChat``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from backend.context.blocks import Block
from backend.db.models import ChatSession, InvalidationEvent, Message, Tenant, TopicHistory
from backend.domain import InvalidationReason, ReplicaErase, SessionStatus
from backend.engine_client import control
from backend.engine_client.protocol import EngineClient
from backend.engine_client.values import CacheFootprint, ErasureResult, InvalidationResult
from backend.services import cache_admin, context_store
from backend.services import sessions as store
from backend.services.context_service import ContextService


class LiveChat(Protocol):
    """What the admin asks of the chat service (``backend.chat.service.ChatService`` is the one) for a live session.

    NOTE: a protocol, so the services layer does not import the chat layer above it (``lint-imports``).
    """

    @property
    def context(self) -> ContextService: ...

    @property
    def block_size(self) -> int: ...

    async def set_status(
        self, session_id: str, status: SessionStatus, reason: InvalidationReason = ..., actor: str = ...
    ) -> None: ...

    def cancel(self, session_id: str, client_msg_id: str | None) -> bool: ...

    async def erase_cache(self, session_id: str, namespace: str) -> ErasureResult: ...


@dataclass(frozen=True, slots=True)
class SessionQuery:
    """Filters of the sessions list; None means "any"."""

    status: SessionStatus | None = None
    external_ref: str | None = None  # exact match
    created_after: datetime | None = None
    created_before: datetime | None = None
    min_temperature: float | None = None
    max_temperature: float | None = None
    topic_epoch: int | None = None
    limit: int = 100
    offset: int = 0


@dataclass(frozen=True, slots=True)
class SessionTranscript:
    session: ChatSession
    messages: list[Message]

    def as_text(self) -> str:
        s = self.session
        lines = [f"Session {s.id} ({s.status}), started {s.created_at.isoformat()}", ""]
        for m in self.messages:
            note = "" if m.status == "complete" else f" [{m.status}]"
            lines.append(f"[{m.seq}] {m.created_at.isoformat()} {m.role}{note}: {m.content}")
        return "\n".join(lines) + "\n"


async def search_sessions(db: AsyncSession, tenant_id: str, q: SessionQuery) -> list[ChatSession]:
    """The tenant's sessions matching ``q``, most recently active first."""
    query = select(ChatSession).where(ChatSession.tenant_id == tenant_id)
    if q.status is not None:
        query = query.where(ChatSession.status == q.status.value)
    if q.external_ref is not None:
        query = query.where(ChatSession.external_ref == q.external_ref)
    if q.created_after is not None:
        query = query.where(ChatSession.created_at >= q.created_after)
    if q.created_before is not None:
        query = query.where(ChatSession.created_at < q.created_before)
    if q.min_temperature is not None:
        query = query.where(ChatSession.semantic_temperature >= q.min_temperature)
    if q.max_temperature is not None:
        query = query.where(ChatSession.semantic_temperature <= q.max_temperature)
    if q.topic_epoch is not None:
        query = query.where(ChatSession.topic_epoch == q.topic_epoch)
    query = query.order_by(ChatSession.last_active_at.desc(), ChatSession.id).limit(q.limit).offset(q.offset)
    return list((await db.execute(query)).scalars())


@dataclass(frozen=True, slots=True)
class SessionSummary:
    session: ChatSession
    footprint: CacheFootprint | None  # its blocks cached right now; None for a closed one (its cache was released)


async def summaries(db: AsyncSession, engine: EngineClient, tenant_id: str, q: SessionQuery) -> list[SessionSummary]:
    """The sessions matching ``q``, each with its cache footprint: what the dashboard reads per refresh, in one call
    (the footprints asked for together: with a remote engine, each is a round trip)."""
    found = await search_sessions(db, tenant_id, q)
    live = [s for s in found if s.status != SessionStatus.CLOSED.value]
    footprints = await asyncio.gather(*(control.session_footprint(engine, s.id) for s in live))
    by_id = {s.id: f for s, f in zip(live, footprints, strict=True)}
    return [SessionSummary(s, by_id.get(s.id)) for s in found]


async def get_session(db: AsyncSession, tenant_id: str, session_id: str) -> ChatSession:
    return await store.get_session(db, tenant_id, session_id)


async def transcript(db: AsyncSession, tenant_id: str, session_id: str) -> SessionTranscript:
    session = await store.get_session(db, tenant_id, session_id)
    return SessionTranscript(session, await store.messages_after(db, session_id, 0))


@dataclass(frozen=True, slots=True)
class SessionDetail:
    session: ChatSession
    messages: list[Message]
    blocks: dict[int, list[Block]]  # message seq → its semantic blocks, in order
    topics: list[TopicHistory]  # the temperature history, by message seq
    invalidations: list[InvalidationEvent]  # oldest first
    footprint: CacheFootprint  # the session's recorded chain blocks cached right now


async def detail(db: AsyncSession, engine: EngineClient, tenant_id: str, session_id: str) -> SessionDetail:
    session = await store.get_session(db, tenant_id, session_id)
    blocks: dict[int, list[Block]] = {}
    for block in await context_store.load_blocks(db, session_id):
        blocks.setdefault(block.key.seq, []).append(block)
    events = await db.execute(
        select(InvalidationEvent)
        .where(InvalidationEvent.session_id == session_id)
        .order_by(InvalidationEvent.created_at, InvalidationEvent.id)
    )
    return SessionDetail(
        session,
        await store.messages_after(db, session_id, 0),
        blocks,
        await context_store.topic_history(db, session_id),
        list(events.scalars()),
        await control.session_footprint(engine, session_id),
    )


async def set_status(
    db: AsyncSession, chat: LiveChat, tenant_id: str, session_id: str, status: SessionStatus
) -> ChatSession:
    """Set the status (closing also releases the session's engine cache); returns the session as stored now."""
    session = await store.get_session(db, tenant_id, session_id)
    await chat.set_status(session_id, status, actor="admin")
    await db.refresh(session)
    return session


async def delete_session(
    db: AsyncSession, chat: LiveChat, engine: EngineClient, tenant: Tenant, session_id: str
) -> ErasureResult:
    """Erase the session: stop its reply in flight, delete its rows (messages cascade), remove its cached KV from
    every tier of the engine (an ``invalidation_events`` row, without the session, keeps the count). On an engine
    replica without a per-session erase (vLLM), the tenant's ``replica_erase`` resets that replica's whole prefix
    cache or leaves the gap in the result's replica report (``cache_admin.erase_coarsely``); the rows go either way."""
    tenant_id = tenant.id
    await store.get_session(db, tenant_id, session_id)
    namespace = await chat.context.namespace_of(db, tenant_id)
    chat.cancel(session_id, None)
    await store.delete_session(db, tenant_id, session_id)
    erased = await chat.erase_cache(session_id, namespace)
    erased = await cache_admin.erase_coarsely(engine, ReplicaErase(tenant.replica_erase), erased)
    await cache_admin.record_erasure(db, tenant_id, erased, chat.block_size)
    return erased


@dataclass(frozen=True, slots=True)
class PinnedContextEdit:
    session: ChatSession  # as stored now (``context_version`` bumped)
    freed: InvalidationResult  # the session's cached blocks that depended on the old pinned context


async def set_pinned_context(
    db: AsyncSession, chat: LiveChat, tenant_id: str, session_id: str, text: str, actor: str = "admin"
) -> PinnedContextEdit:
    """Replace the session's pinned context, bump ``context_version``, free the cached blocks depending on it."""
    session = await store.get_session(db, tenant_id, session_id)
    await db.execute(
        update(ChatSession)
        .where(ChatSession.id == session_id)
        .values(pinned_context=text, context_version=ChatSession.context_version + 1)
    )
    await db.commit()
    await db.refresh(session)
    freed = await chat.context.pinned_context_edited(tenant_id, session_id, actor)
    return PinnedContextEdit(session, freed)
