"""Admin: list, inspect, close, delete chat sessions; export transcripts (JSON or plain text)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Response, status
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from backend.api.deps import AdminDep, DbDep, StateDep
from backend.chat.protocol import MessageOut
from backend.chat.service import message_out
from backend.core.limits import QueryOffset, SessionId
from backend.db.models import ChatSession, SessionStatus
from backend.services import sessions as store

router = APIRouter(prefix="/admin/sessions", tags=["admin: sessions"])

SessionIdPath = Annotated[SessionId, Path(description="the session's id")]


class SessionOut(BaseModel):
    id: str
    external_ref: str | None
    status: str
    context_version: int
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
            created_at=s.created_at,
            last_active_at=s.last_active_at,
            closed_at=s.closed_at,
        )


class Transcript(BaseModel):
    session: SessionOut
    messages: list[MessageOut]


class StatusChange(BaseModel):
    status: SessionStatus


async def _session(db: DbDep, tenant_id: str, session_id: str) -> ChatSession:
    return await store.get_session(db, tenant_id, session_id)  # SessionNotFoundError: a 404 (api/boundary.py)


@router.get("", response_model=list[SessionOut])
async def list_sessions(
    tenant: AdminDep,
    db: DbDep,
    status_filter: Annotated[SessionStatus | None, Query(alias="status")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[QueryOffset, Query()] = 0,
) -> list[SessionOut]:
    return [SessionOut.of(s) for s in await store.list_sessions(db, tenant.id, status_filter, limit, offset)]


@router.get("/{session_id}", response_model=SessionOut)
async def get_session(session_id: SessionIdPath, tenant: AdminDep, db: DbDep) -> SessionOut:
    return SessionOut.of(await _session(db, tenant.id, session_id))


@router.post("/{session_id}/status", response_model=SessionOut)
async def change_status(
    session_id: SessionIdPath, body: StatusChange, tenant: AdminDep, db: DbDep, state: StateDep
) -> SessionOut:
    """Set a session's status (e.g. ``resolved``, ``closed``); closing releases the session's engine cache."""
    session = await _session(db, tenant.id, session_id)
    await state.chat.set_status(session_id, body.status)
    await db.refresh(session)
    return SessionOut.of(session)


@router.delete("/{session_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_session(session_id: SessionIdPath, tenant: AdminDep, db: DbDep, state: StateDep) -> Response:
    await _session(db, tenant.id, session_id)
    state.chat.cancel(session_id, None)
    await store.delete_session(db, tenant.id, session_id)
    state.chat.release_cache(session_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/{session_id}/transcript", response_model=None)
async def transcript(
    session_id: SessionIdPath,
    tenant: AdminDep,
    db: DbDep,
    fmt: Annotated[Literal["json", "text"], Query(alias="format")] = "json",
) -> Transcript | PlainTextResponse:
    session = await _session(db, tenant.id, session_id)
    messages = [message_out(m) for m in await store.messages_after(db, session_id, 0)]
    if fmt == "json":
        return Transcript(session=SessionOut.of(session), messages=messages)
    lines = [f"Session {session.id} ({session.status}), started {session.created_at.isoformat()}", ""]
    for m in messages:
        note = "" if m.status == "complete" else f" [{m.status}]"
        lines.append(f"[{m.seq}] {m.created_at.isoformat()} {m.role}{note}: {m.content}")
    return PlainTextResponse("\n".join(lines) + "\n")
