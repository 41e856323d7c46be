"""Chat sessions and their messages in the database. Short transactions only; callers pass the DB session.

Per-session ``seq`` is allocated under a row lock on the session (``SELECT … FOR UPDATE`` on Postgres; SQLite
serialises writers anyway), and the unique constraints (session, seq) and (session, client_msg_id) are the final
guard against duplicates from another process.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from backend.core.errors import SessionNotFoundError
from backend.db.models import ChatSession, Message, MessageRole, MessageStatus, SessionStatus, utcnow


@dataclass(frozen=True, slots=True)
class TokenUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


async def create_session(db: AsyncSession, tenant_id: str, external_ref: str | None = None) -> ChatSession:
    session = ChatSession(tenant_id=tenant_id, external_ref=external_ref)
    db.add(session)
    await db.flush()
    return session


async def get_session(db: AsyncSession, tenant_id: str, session_id: str) -> ChatSession:
    session = await db.get(ChatSession, session_id)
    if session is None or session.tenant_id != tenant_id:
        raise SessionNotFoundError(f"session {session_id} not found")
    return session


async def messages_after(db: AsyncSession, session_id: str, last_seq: int = 0) -> list[Message]:
    rows = await db.execute(
        select(Message).where(Message.session_id == session_id, Message.seq > last_seq).order_by(Message.seq)
    )
    return list(rows.scalars())


async def find_by_client_msg_id(db: AsyncSession, session_id: str, client_msg_id: str) -> Message | None:
    row = await db.execute(
        select(Message).where(
            Message.session_id == session_id,
            Message.client_msg_id == client_msg_id,
            Message.role == MessageRole.USER.value,
        )
    )
    return row.scalar_one_or_none()


async def find_reply(db: AsyncSession, session_id: str, user_seq: int) -> Message | None:
    row = await db.execute(
        select(Message)
        .where(Message.session_id == session_id, Message.reply_to_seq == user_seq)
        .order_by(Message.seq.desc())
        .limit(1)
    )
    return row.scalar_one_or_none()


async def _lock_session(db: AsyncSession, session_id: str) -> ChatSession:
    # NOTE: a write first: it takes SQLite's database write lock (FOR UPDATE is a no-op there and the driver opens the
    # transaction lazily), and the row lock on Postgres, so two inserts into one session never read the same max(seq).
    await db.execute(update(ChatSession).where(ChatSession.id == session_id).values(last_active_at=utcnow()))
    row = await db.execute(select(ChatSession).where(ChatSession.id == session_id).with_for_update())
    session = row.scalar_one_or_none()
    if session is None:
        raise SessionNotFoundError(f"session {session_id} not found")
    return session


async def _next_seq(db: AsyncSession, session_id: str) -> int:
    current = await db.scalar(select(func.max(Message.seq)).where(Message.session_id == session_id))
    return int(current or 0) + 1


async def add_user_message(db: AsyncSession, session_id: str, client_msg_id: str, text: str) -> tuple[Message, bool]:
    """Insert the user's message and commit; return ``(message, duplicate)``. Idempotent on ``client_msg_id``."""
    existing = await find_by_client_msg_id(db, session_id, client_msg_id)
    if existing is not None:
        return existing, True
    session = await _lock_session(db, session_id)
    message = Message(
        session_id=session_id,
        seq=await _next_seq(db, session_id),
        role=MessageRole.USER.value,
        content=text,
        client_msg_id=client_msg_id,
        status=MessageStatus.COMPLETE.value,
    )
    db.add(message)
    session.last_active_at = utcnow()
    try:
        await db.commit()
    except IntegrityError:
        # NOTE: another process inserted the same client_msg_id first; theirs is the message.
        await db.rollback()
        existing = await find_by_client_msg_id(db, session_id, client_msg_id)
        if existing is None:
            raise
        return existing, True
    return message, False


async def add_assistant_message(
    db: AsyncSession, session_id: str, reply_to_seq: int, text: str, status: MessageStatus, usage: TokenUsage
) -> Message:
    session = await _lock_session(db, session_id)
    message = Message(
        session_id=session_id,
        seq=await _next_seq(db, session_id),
        role=MessageRole.ASSISTANT.value,
        content=text,
        status=status.value,
        reply_to_seq=reply_to_seq,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
    )
    db.add(message)
    session.last_active_at = utcnow()
    await db.commit()
    return message


async def set_status(db: AsyncSession, session_id: str, status: SessionStatus) -> None:
    values: dict[str, object] = {"status": status.value, "last_active_at": utcnow()}
    values["closed_at"] = utcnow() if status == SessionStatus.CLOSED else None
    await db.execute(update(ChatSession).where(ChatSession.id == session_id).values(**values))
    await db.commit()


async def idle_session_ids(db: AsyncSession, idle_for: timedelta, now: datetime | None = None) -> list[str]:
    cutoff = (now or utcnow()) - idle_for
    rows = await db.execute(
        select(ChatSession.id).where(
            ChatSession.status != SessionStatus.CLOSED.value, ChatSession.last_active_at < cutoff
        )
    )
    return list(rows.scalars())


async def delete_session(db: AsyncSession, tenant_id: str, session_id: str) -> None:
    await get_session(db, tenant_id, session_id)
    await db.execute(delete(Message).where(Message.session_id == session_id))
    await db.execute(delete(ChatSession).where(ChatSession.id == session_id))
    await db.commit()


async def list_sessions(
    db: AsyncSession, tenant_id: str, status: SessionStatus | None = None, limit: int = 100, offset: int = 0
) -> list[ChatSession]:
    query = select(ChatSession).where(ChatSession.tenant_id == tenant_id)
    if status is not None:
        query = query.where(ChatSession.status == status.value)
    rows = await db.execute(query.order_by(ChatSession.last_active_at.desc()).limit(limit).offset(offset))
    return list(rows.scalars())
