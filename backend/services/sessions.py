"""Chat sessions and their messages in the database. Short transactions only; callers pass the DB session.

Per-session ``seq`` is allocated under a row lock on the session (``SELECT … FOR UPDATE`` on Postgres; SQLite
serialises writers anyway), and the unique constraints (session, seq) and (session, client_msg_id) are the final
guard against duplicates from another process.

A user message the bot is to answer is stored ``awaiting_reply``; its reply's transaction sets it back to
``complete``. So a message still awaiting when no process runs its turn was cut off (a crash, a lost database), and
``settle_interrupted`` gives it its one reply: an empty ``incomplete`` marker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from backend.core.errors import SessionNotFoundError
from backend.db.models import ChatSession, Message, utcnow
from backend.domain import MessageRole, MessageStatus, SessionStatus


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


async def lock_session(db: AsyncSession, tenant_id: str, session_id: str) -> ChatSession:
    """The tenant's session, locked for this transaction (its last activity set); ``SessionNotFoundError`` when the
    tenant has no such session. ``add_user_message(locked=...)`` then stores into it."""
    session = await _lock_session(db, session_id)
    if session.tenant_id != tenant_id:
        raise SessionNotFoundError(f"session {session_id} not found")
    return session


async def lock_any(db: AsyncSession, session_id: str) -> ChatSession:
    """The session, whoever its tenant, locked for this transaction (the server's own steps: a hand-off)."""
    return await _lock_session(db, session_id)


async def next_seq(db: AsyncSession, session_id: str) -> int:
    """The seq of the session's next message; only under the session's lock (``lock_session``)."""
    return await _next_seq(db, session_id)


async def _lock_session(db: AsyncSession, session_id: str) -> ChatSession:
    # NOTE: a write first: it takes SQLite's database write lock (FOR UPDATE is a no-op there and the driver opens the
    # transaction lazily), and the row lock on Postgres, so two inserts into one session never read the same max(seq).
    # RETURNING reads the row in the same statement (one round trip, not an update then a select).
    row = await db.execute(
        update(ChatSession)
        .where(ChatSession.id == session_id)
        .values(last_active_at=utcnow())
        .returning(ChatSession)
        .execution_options(populate_existing=True)
    )
    session = row.scalar_one_or_none()
    if session is None:
        raise SessionNotFoundError(f"session {session_id} not found")
    return session


async def _next_seq(db: AsyncSession, session_id: str) -> int:
    current = await db.scalar(select(func.max(Message.seq)).where(Message.session_id == session_id))
    return int(current or 0) + 1


async def add_user_message(
    db: AsyncSession,
    session_id: str,
    client_msg_id: str,
    text: str,
    awaiting_reply: bool = False,
    locked: ChatSession | None = None,
) -> tuple[Message, bool]:
    """Insert the user's message and commit; return ``(message, duplicate)``. Idempotent on ``client_msg_id``.

    ``awaiting_reply``: the bot will answer it (the message is stored ``awaiting_reply`` until its reply is).
    ``locked``: the session, locked in this transaction already (``lock_session``).
    """
    existing = await find_by_client_msg_id(db, session_id, client_msg_id)
    if existing is not None:
        return existing, True
    if locked is None:
        await _lock_session(db, session_id)  # (its update is the session's last activity)
    message = user_message(session_id, await _next_seq(db, session_id), client_msg_id, text, awaiting_reply)
    stage_user_message(db, message, awaiting_reply)
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


def user_message(session_id: str, seq: int, client_msg_id: str, text: str, awaiting_reply: bool) -> Message:
    """A user message to be stored as ``seq`` (``stage_user_message``), owed a reply or not."""
    status = _status(awaiting_reply).value
    role = MessageRole.USER.value
    return Message(session_id=session_id, seq=seq, role=role, content=text, client_msg_id=client_msg_id, status=status)


def stage_user_message(db: AsyncSession, message: Message, awaiting_reply: bool) -> None:
    """Add ``message`` to the transaction (its seq read under the session's lock), owed a reply or not as the lock
    found the session; the caller commits."""
    if message.status != (status := _status(awaiting_reply).value):
        message.status = status
    db.add(message)


def _status(awaiting_reply: bool) -> MessageStatus:
    return MessageStatus.AWAITING_REPLY if awaiting_reply else MessageStatus.COMPLETE


async def await_reply(db: AsyncSession, message: Message) -> None:
    """Mark a stored user message as owed a reply again (a retry restarts a turn that produced none)."""
    if message.status != MessageStatus.AWAITING_REPLY.value:
        await db.execute(
            update(Message).where(Message.id == message.id).values(status=MessageStatus.AWAITING_REPLY.value)
        )
        await db.commit()
        message.status = MessageStatus.AWAITING_REPLY.value


async def add_assistant_message(
    db: AsyncSession,
    session_id: str,
    reply_to_seq: int,
    text: str,
    status: MessageStatus,
    usage: TokenUsage,
    commit_delay_s: float = 0.0,
    tool_exchange: str | None = None,
) -> Message:
    """Store a reply and, in the same transaction, settle the user message it answers (no longer awaiting).
    ``tool_exchange``: the tools it called (``backend/services/tool_exchange.py``, as JSON).

    A user message has at most one reply: when one is already stored (a retried commit that had landed, a marker
    a restart wrote), that one is returned and nothing is added. ``commit_delay_s`` is a test hook: it holds the
    transaction open before the commit (crash tests widen that window with it).
    """

    def reply_at(seq: int) -> Message:
        return Message(
            session_id=session_id,
            seq=seq,
            role=MessageRole.ASSISTANT.value,
            content=text,
            status=status.value,
            reply_to_seq=reply_to_seq,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            tool_exchange=tool_exchange,
        )

    try:
        return await _add_reply(db, session_id, reply_to_seq, reply_at, commit_delay_s, reads_first=True)
    except IntegrityError:
        await db.rollback()  # a message landed between the reads and the lock: its seq was taken
    return await _add_reply(db, session_id, reply_to_seq, reply_at, commit_delay_s, reads_first=False)


async def _add_reply(
    db: AsyncSession,
    session_id: str,
    reply_to_seq: int,
    reply_at: Callable[[int], Message],
    commit_delay_s: float,
    *,
    reads_first: bool,
) -> Message:
    # NOTE: ``reads_first``: the reads go before the session's lock, which on SQLite is the database's one writer
    # (backend/db/sqlite_writer.py: every trip made while holding it holds every other turn's writes). A message
    # stored after the reads takes the seq read here (``uq_messages_session_seq``), so the insert fails and the
    # caller runs this again with the reads under the lock; a reply stored meanwhile for the same message does too.
    if not reads_first:
        await _lock_session(db, session_id)  # (its update is the session's last activity)
    existing = await find_reply(db, session_id, reply_to_seq)
    if existing is not None:
        db.expunge(existing)  # NOTE: kept readable: a rollback expires what the session holds
        await db.rollback()
        return existing
    seq = await _next_seq(db, session_id)
    if reads_first:
        await _lock_session(db, session_id)
    message = reply_at(seq)
    db.add(message)
    await db.execute(
        update(Message)
        .where(
            Message.session_id == session_id,
            Message.seq == reply_to_seq,
            Message.status == MessageStatus.AWAITING_REPLY.value,
        )
        .values(status=MessageStatus.COMPLETE.value)
        .execution_options(synchronize_session=False)  # (the customer's message is not held in this session)
    )
    if commit_delay_s:
        await db.flush()
        await asyncio.sleep(commit_delay_s)
    await db.commit()
    return message


async def awaiting_replies(db: AsyncSession) -> list[Message]:
    """User messages still owed a reply, oldest first (on start: the turns a crash cut off)."""
    rows = await db.execute(
        select(Message)
        .where(Message.role == MessageRole.USER.value, Message.status == MessageStatus.AWAITING_REPLY.value)
        .order_by(Message.session_id, Message.seq)
    )
    return list(rows.scalars())


async def settle_interrupted(db: AsyncSession, session_id: str, user_seq: int) -> Message | None:
    """Give a cut-off turn its one reply, an empty ``incomplete`` marker; ``None`` when it was settled meanwhile."""
    await _lock_session(db, session_id)
    status = await db.scalar(
        select(Message.status).where(
            Message.session_id == session_id, Message.seq == user_seq, Message.role == MessageRole.USER.value
        )
    )
    if status != MessageStatus.AWAITING_REPLY.value:
        await db.rollback()  # NOTE: another process answered or marked it first (checked under the session lock)
        return None
    return await add_assistant_message(db, session_id, user_seq, "", MessageStatus.INCOMPLETE, TokenUsage())


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
