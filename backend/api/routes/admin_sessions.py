"""Admin: search, inspect, close and delete chat sessions; export transcripts (JSON or plain text); a session's detail
(blocks, temperature history, invalidations, cache footprint); the sessions list with their footprints (what the
dashboard reads per refresh); flush a session's cache.

Each route is one call into ``backend/services/session_admin.py``; a session of another tenant is a 404, like one
that does not exist.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from backend.api.deps import AdminDep, DbDep, StateDep, audit_note, audited
from backend.chat.protocol import MessageOut
from backend.chat.service import message_out
from backend.context.blocks import Block
from backend.core.limits import ExternalRef, QueryOffset, SafeText, SessionId
from backend.db.models import ChatSession, InvalidationEvent, TopicHistory
from backend.domain import SessionStatus
from backend.engine_client.replica_report import ReplicaOutcome, ReplicaReport, report_of
from backend.engine_client.values import InvalidationResult
from backend.services import audit, cache_admin, context_store, session_admin
from backend.services.session_admin import SessionDetail, SessionQuery, SessionSummary

router = APIRouter(prefix="/admin/sessions", tags=["admin: sessions"])

SessionIdPath = Annotated[SessionId, Path(description="the session's id")]


class SessionOut(BaseModel):
    id: str
    external_ref: str | None
    status: str
    context_version: int
    semantic_temperature: float | None
    topic_epoch: int
    created_at: datetime
    last_active_at: datetime
    closed_at: datetime | None

    @classmethod
    def of(cls, s: ChatSession) -> SessionOut:
        return cls(
            id=s.id,
            external_ref=s.external_ref,
            status=s.status,
            context_version=s.context_version,
            semantic_temperature=s.semantic_temperature,
            topic_epoch=s.topic_epoch,
            created_at=s.created_at,
            last_active_at=s.last_active_at,
            closed_at=s.closed_at,
        )


class Transcript(BaseModel):
    session: SessionOut
    messages: list[MessageOut]


class StatusChange(BaseModel):
    status: SessionStatus


class PinnedContextIn(BaseModel):
    pinned_context: Annotated[SafeText, Field(max_length=8000)]


class ReplicaOut(BaseModel):
    """What one engine replica did with the action (engine replicas only: docs/scale-out.md)."""

    replica: str = Field(description="the replica's URL")
    outcome: ReplicaOutcome = Field(
        description="done; cache_reset (its whole prefix cache was reset instead: every session on it lost its "
        "cached prefixes); unsupported (it has no such action, e.g. vLLM: nothing was done there); failed (it could "
        "not be reached or answered an error: what it did is unknown)"
    )
    detail: str

    @classmethod
    def all_of(cls, report: ReplicaReport) -> list[ReplicaOut]:
        return [cls(replica=r.replica, outcome=r.outcome, detail=r.detail) for r in report.results]


class ReplicaActionOut(BaseModel):
    complete: bool = Field(
        description="false: some replica did not do it (listed in replicas; the answer is then a 207)"
    )
    replicas: list[ReplicaOut] = Field(description="each engine replica's outcome; empty with the in-process engine")


class ErasureOut(ReplicaActionOut):
    """What a session's erasure removed from the engine's cache, by tier, and on which replicas it was not done."""

    memory_blocks: int = Field(description="blocks freed from memory (or when the reply holding them ends)")
    disk_blocks: int = Field(description="blocks removed from the disk tier")


class FlushOut(ReplicaActionOut):
    blocks_freed: int  # cached blocks freed now
    tokens_freed: int

    @classmethod
    def of(cls, r: InvalidationResult) -> FlushOut:
        report = report_of(r)
        return cls(
            blocks_freed=r.blocks_freed,
            tokens_freed=r.tokens_freed,
            complete=report.complete,
            replicas=ReplicaOut.all_of(report),
        )


class PinnedContextOut(ReplicaActionOut):
    session: SessionOut
    pinned_context: str
    blocks_freed: int  # cached blocks freed because they depended on the old pinned context
    tokens_freed: int
    deferred: int  # blocks a reply in flight holds: freed when it ends


PARTIAL: dict[int | str, dict[str, Any]] = {
    207: {"description": "done in part: some engine replica did not do it (the body's replicas say which)"}
}


def answer_partial(request: Request, response: Response, report: ReplicaReport, detail: str) -> None:
    """An action some replica did not do answers 207, and its audit row is ``incomplete`` with ``detail``."""
    if report.complete:
        audit_note(request, detail)
        return
    response.status_code = 207
    audit_note(request, detail, audit.INCOMPLETE)


class BlockRef(BaseModel):
    seq: int  # the message's seq
    index: int  # the block's index in that message


class BlockOut(BaseModel):
    index: int
    type: str
    start: int  # character span in the message's content
    end: int
    parent: BlockRef | None  # the block it refers back to ("step 2 of that")

    @classmethod
    def of(cls, b: Block) -> BlockOut:
        parent = None if b.parent is None else BlockRef(seq=b.parent.seq, index=b.parent.index)
        return cls(index=b.key.index, type=b.type.value, start=b.start, end=b.end, parent=parent)


class DetailedMessage(MessageOut):
    blocks: list[BlockOut]


class TemperaturePoint(BaseModel):
    seq: int  # the customer message that moved the topic
    similarity: float | None  # None for the session's first message
    temperature: float
    shift: bool
    epoch: int
    section: list[str] = Field(description="the handbook sections the topic's prompt held after this message")

    @classmethod
    def of(cls, t: TopicHistory) -> TemperaturePoint:
        return cls(
            seq=t.message_seq,
            similarity=t.similarity,
            temperature=t.temperature,
            shift=t.shift,
            epoch=t.topic_epoch,
            section=list(context_store.section_titles(t)),
        )


class InvalidationOut(BaseModel):
    reason: str
    actor: str
    blocks_freed: int
    tokens_freed: int
    at: datetime

    @classmethod
    def of(cls, e: InvalidationEvent) -> InvalidationOut:
        return cls(
            reason=e.reason, actor=e.actor, blocks_freed=e.blocks_freed, tokens_freed=e.tokens_freed, at=e.created_at
        )


class FootprintOut(BaseModel):
    blocks: int
    tokens: int


class SessionSummaryOut(SessionOut):
    cache_footprint: FootprintOut | None = Field(description="blocks cached now; null for a closed session")

    @classmethod
    def of_summary(cls, s: SessionSummary) -> SessionSummaryOut:
        f = s.footprint
        footprint = None if f is None else FootprintOut(blocks=f.blocks, tokens=f.tokens)
        return cls(**SessionOut.of(s.session).model_dump(), cache_footprint=footprint)


class SessionDetailOut(BaseModel):
    session: SessionOut
    pinned_context: str
    messages: list[DetailedMessage]
    temperature_history: list[TemperaturePoint]
    invalidation_events: list[InvalidationOut]
    cache_footprint: FootprintOut
    section: list[str] = Field(description="the handbook sections of the session's current topic")

    @classmethod
    def of(cls, d: SessionDetail) -> SessionDetailOut:
        messages = [
            DetailedMessage(**message_out(m).model_dump(), blocks=[BlockOut.of(b) for b in d.blocks.get(m.seq, [])])
            for m in d.messages
        ]
        return cls(
            session=SessionOut.of(d.session),
            pinned_context=d.session.pinned_context,
            messages=messages,
            temperature_history=[TemperaturePoint.of(t) for t in d.topics],
            invalidation_events=[InvalidationOut.of(e) for e in d.invalidations],
            cache_footprint=FootprintOut(blocks=d.footprint.blocks, tokens=d.footprint.tokens),
            section=list(context_store.section_titles(d.topics[-1])) if d.topics else [],
        )


def session_query(
    status_filter: Annotated[SessionStatus | None, Query(alias="status")] = None,
    external_ref: Annotated[ExternalRef | None, Query(description="the customer's reference, exact")] = None,
    created_after: Annotated[datetime | None, Query()] = None,
    created_before: Annotated[datetime | None, Query()] = None,
    min_temperature: Annotated[float | None, Query(ge=0, le=1)] = None,
    max_temperature: Annotated[float | None, Query(ge=0, le=1)] = None,
    topic_epoch: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[QueryOffset, Query()] = 0,
) -> SessionQuery:
    """The sessions list's filters and page, from the query string."""
    return SessionQuery(
        status_filter,
        external_ref,
        created_after,
        created_before,
        min_temperature,
        max_temperature,
        topic_epoch,
        limit,
        offset,
    )


SessionQueryDep = Annotated[SessionQuery, Depends(session_query)]


@router.get("", response_model=list[SessionOut])
async def list_sessions(tenant: AdminDep, db: DbDep, query: SessionQueryDep) -> list[SessionOut]:
    """The tenant's sessions, most recently active first, filtered and paged."""
    return [SessionOut.of(s) for s in await session_admin.search_sessions(db, tenant.id, query)]


# NOTE: declared before "/{session_id}", which would take "summary" for a session id.
@router.get("/summary", response_model=list[SessionSummaryOut])
async def sessions_summary(
    tenant: AdminDep, db: DbDep, state: StateDep, query: SessionQueryDep
) -> list[SessionSummaryOut]:
    """The sessions list with each open session's cache footprint: one call per dashboard refresh."""
    summaries = await session_admin.summaries(db, state.engine, tenant.id, query)
    return [SessionSummaryOut.of_summary(s) for s in summaries]


@router.get("/{session_id}", response_model=SessionOut)
async def get_session(session_id: SessionIdPath, tenant: AdminDep, db: DbDep) -> SessionOut:
    return SessionOut.of(await session_admin.get_session(db, tenant.id, session_id))


@router.get("/{session_id}/detail", response_model=SessionDetailOut)
async def session_detail(session_id: SessionIdPath, tenant: AdminDep, db: DbDep, state: StateDep) -> SessionDetailOut:
    """Messages with their semantic blocks, the temperature history, invalidation events and the cache footprint."""
    return SessionDetailOut.of(await session_admin.detail(db, state.engine, tenant.id, session_id))


@router.post("/{session_id}/flush", response_model=FlushOut, dependencies=[audited("session.flush")], responses=PARTIAL)
async def flush_session(
    session_id: SessionIdPath, tenant: AdminDep, db: DbDep, state: StateDep, request: Request, response: Response
) -> FlushOut:
    """Free the session's cached KV blocks (what other sessions share stays); the session stays open."""
    freed = await cache_admin.flush_session(db, state.engine, state.namespaces, tenant, session_id)
    answer_partial(request, response, report_of(freed), cache_admin.describe_flush(freed, "the session"))
    return FlushOut.of(freed)


@router.post("/{session_id}/status", response_model=SessionOut, dependencies=[audited("session.status")])
async def change_status(
    session_id: SessionIdPath, body: StatusChange, tenant: AdminDep, db: DbDep, state: StateDep
) -> SessionOut:
    """Set a session's status (e.g. ``resolved``, ``closed``); closing releases the session's engine cache."""
    return SessionOut.of(await session_admin.set_status(db, state.chat, tenant.id, session_id, body.status))


@router.put(
    "/{session_id}/context",
    response_model=PinnedContextOut,
    dependencies=[audited("session.context")],
    responses=PARTIAL,
)
async def set_pinned_context(
    session_id: SessionIdPath,
    body: PinnedContextIn,
    tenant: AdminDep,
    db: DbDep,
    state: StateDep,
    request: Request,
    response: Response,
) -> PinnedContextOut:
    """Replace the session's pinned context (customer facts); the cached context that depended on it is freed."""
    edit = await session_admin.set_pinned_context(db, state.chat, tenant.id, session_id, body.pinned_context)
    freed, report = edit.freed, report_of(edit.freed)
    answer_partial(request, response, report, cache_admin.describe_flush(freed, "the session's context"))
    return PinnedContextOut(
        session=SessionOut.of(edit.session),
        pinned_context=edit.session.pinned_context,
        blocks_freed=freed.blocks_freed,
        tokens_freed=freed.tokens_freed,
        deferred=freed.deferred,
        complete=report.complete,
        replicas=ReplicaOut.all_of(report),
    )


@router.delete("/{session_id}", response_model=ErasureOut, dependencies=[audited("session.delete")], responses=PARTIAL)
async def delete_session(
    session_id: SessionIdPath, tenant: AdminDep, db: DbDep, state: StateDep, request: Request, response: Response
) -> ErasureOut:
    """Erase the session: its messages, blocks and history, and its cached KV on every tier (memory and disk) of
    every engine replica. A 207 names the replicas where its KV may remain (the rows are gone all the same)."""
    erased = await session_admin.delete_session(db, state.chat, state.engine, tenant, session_id)
    report = report_of(erased)
    answer_partial(request, response, report, cache_admin.describe_erasure(erased))
    return ErasureOut(
        memory_blocks=erased.memory_blocks,
        disk_blocks=erased.disk_blocks,
        complete=report.complete,
        replicas=ReplicaOut.all_of(report),
    )


@router.get("/{session_id}/transcript", response_model=None)
async def transcript(
    session_id: SessionIdPath,
    tenant: AdminDep,
    db: DbDep,
    fmt: Annotated[Literal["json", "text"], Query(alias="format")] = "json",
) -> Transcript | PlainTextResponse:
    """The whole conversation, as JSON or as plain text."""
    t = await session_admin.transcript(db, tenant.id, session_id)
    if fmt == "text":
        return PlainTextResponse(t.as_text())
    return Transcript(session=SessionOut.of(t.session), messages=[message_out(m) for m in t.messages])
