"""The inbox in the database: hand-offs of sessions to people, claims, agents' replies and private notes.

A session asks for a person (``request``): it gets one open ``handoffs`` row and the status ``agent_requested``. An
agent claims it (``agent_active``, one holder at a time: a second claim is ``ClaimedByOtherError`` naming the
holder), may release it (back to waiting, ahead of later requests: its ``requested_at`` stays), transfer it to
another agent, hand it back to the bot (``bot_active``) or resolve it (``resolved``). Every change runs under the
session's row lock (``sessions.lock_session``), so two agents racing for one session are ordered by the database,
across server processes.

An agent's reply is a message of role ``agent`` with the agent's id, stored only when the agent holds the session:
otherwise ``NotClaimedError`` (409), a closed session ``SessionClosedError`` (409), another tenant's session
``SessionNotFoundError`` (404), and nothing is stored. The text is stored as sent: it is plain text to every reader
(the customer's page renders text, never HTML) and an ordinary assistant turn in the bot's next prompt.

These functions commit; the chat layer (``backend/chat/agent_desk.py``) announces what they changed.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from backend.core.errors import SessionClosedError
from backend.db.models import AgentNote, ChatSession, Handoff, Message, utcnow
from backend.domain import HandoffOutcome, HandoffReason, MessageRole, MessageStatus, SessionStatus
from backend.services import sessions as store
from backend.services.agents import Actor, get_agent
from backend.services.inbox_errors import ClaimedByOtherError, NotClaimedError, NotWaitingError

EXPECTED_WAIT_SAMPLE = 20  # the tenant's latest first claims the expected wait is the median of
EXPECTED_WAIT_WINDOW = timedelta(days=1)  # ... within this long


@dataclass(frozen=True, slots=True)
class QueueEntry:
    """A session in the inbox: who holds it (None: waiting), since when it waits, and what it is about."""

    session_id: str
    status: SessionStatus
    reason: HandoffReason
    requested_at: datetime
    waited_s: float
    holder: str | None
    holder_name: str | None
    last_customer_message: str | None
    topic_epoch: int
    temperature: float | None


@dataclass(frozen=True, slots=True)
class QueuePlace:
    """Where a waiting session stands: 1 = next; the expected wait from the tenant's recent first claims."""

    position: int
    expected_wait_s: float | None


@dataclass(frozen=True, slots=True)
class HandoffChange:
    """A hand-off after a change: the session, who holds it now (None: waiting or ended), and its status."""

    session_id: str
    tenant_id: str
    status: SessionStatus
    holder: str | None
    holder_name: str | None
    reason: HandoffReason
    previous_holder_name: str | None = None
    first_wait_s: float | None = None  # set by the hand-off's first claim: how long the customer waited


@dataclass(frozen=True, slots=True)
class StoredReply:
    """An agent's stored reply; ``first_reply_s`` when it is the hand-off's first: the time since the request."""

    message: Message
    first_reply_s: float | None


async def request(db: AsyncSession, session_id: str, reason: HandoffReason) -> HandoffChange | None:
    """The session asks for a person: open a hand-off (the session is ``agent_requested``). None when one is open
    already (asking twice keeps the first place in the queue)."""
    session = await store.lock_any(db, session_id)
    if await _open_handoff(db, session_id) is not None:
        await db.rollback()
        return None
    db.add(Handoff(tenant_id=session.tenant_id, session_id=session_id, reason=reason.value, requested_at=utcnow()))
    session.status = SessionStatus.AGENT_REQUESTED.value
    await db.commit()
    return HandoffChange(session_id, session.tenant_id, SessionStatus.AGENT_REQUESTED, None, None, reason)


async def queue(db: AsyncSession, tenant_id: str, now: datetime | None = None) -> list[QueueEntry]:
    """The tenant's open hand-offs, oldest request first: the waiting ones and the held ones."""
    now = now or utcnow()
    rows = await db.execute(
        select(Handoff, ChatSession)
        .join(ChatSession, ChatSession.id == Handoff.session_id)
        .where(Handoff.tenant_id == tenant_id, Handoff.ended_at.is_(None))
        .order_by(Handoff.requested_at, Handoff.id)
    )
    pairs = [(row[0], row[1]) for row in rows]
    last = await _last_customer_messages(db, [s.id for _, s in pairs])
    return [
        QueueEntry(
            session_id=s.id,
            status=SessionStatus(s.status),
            reason=HandoffReason(h.reason),
            requested_at=h.requested_at,
            waited_s=max(0.0, (now - _aware(h.requested_at)).total_seconds()),
            holder=h.holder,
            holder_name=h.holder_name,
            last_customer_message=last.get(s.id),
            topic_epoch=s.topic_epoch,
            temperature=s.semantic_temperature,
        )
        for h, s in pairs
    ]


async def place(db: AsyncSession, tenant_id: str, session_id: str) -> QueuePlace | None:
    """Where the session waits (None: it does not wait: held, or no hand-off open)."""
    waiting = await db.execute(
        select(Handoff.session_id)
        .where(Handoff.tenant_id == tenant_id, Handoff.ended_at.is_(None), Handoff.holder.is_(None))
        .order_by(Handoff.requested_at, Handoff.id)
    )
    ids = list(waiting.scalars())
    if session_id not in ids:
        return None
    return QueuePlace(ids.index(session_id) + 1, await expected_wait_s(db, tenant_id))


async def waiting_sessions(db: AsyncSession, tenant_id: str) -> list[str]:
    """The tenant's sessions waiting for a person, oldest request first."""
    rows = await db.execute(
        select(Handoff.session_id)
        .where(Handoff.tenant_id == tenant_id, Handoff.ended_at.is_(None), Handoff.holder.is_(None))
        .order_by(Handoff.requested_at, Handoff.id)
    )
    return list(rows.scalars())


async def expected_wait_s(db: AsyncSession, tenant_id: str, now: datetime | None = None) -> float | None:
    """The median wait for a first claim over the tenant's latest ``EXPECTED_WAIT_SAMPLE`` claims of the last day;
    None without any.

    NOTE: the median, not the mean: one session that waited overnight must not promise every customer an hour.
    """
    since = (now or utcnow()) - EXPECTED_WAIT_WINDOW
    rows = await db.execute(
        select(Handoff.requested_at, Handoff.first_claimed_at)
        .where(
            Handoff.tenant_id == tenant_id,
            Handoff.first_claimed_at.is_not(None),
            Handoff.first_claimed_at >= since,
        )
        .order_by(Handoff.first_claimed_at.desc())
        .limit(EXPECTED_WAIT_SAMPLE)
    )
    waits = [(_aware(c) - _aware(r)).total_seconds() for r, c in rows if c is not None]
    return statistics.median(waits) if waits else None


@dataclass(frozen=True, slots=True)
class InboxStats:
    """The dashboard's view of the inbox: the queue now, and the hand-offs of the last ``window``."""

    queue: list[QueueEntry]
    expected_wait_s: float | None
    handoffs: int  # requested within the window
    first_reply_p50_s: float | None  # request → a person's first reply, of those answered within the window
    first_reply_p95_s: float | None


async def stats(db: AsyncSession, tenant_id: str, window: timedelta = EXPECTED_WAIT_WINDOW) -> InboxStats:
    now = utcnow()
    since = now - window
    requested = await db.scalar(
        select(func.count()).where(Handoff.tenant_id == tenant_id, Handoff.requested_at >= since)
    )
    rows = await db.execute(
        select(Handoff.requested_at, Handoff.first_reply_at).where(
            Handoff.tenant_id == tenant_id, Handoff.first_reply_at.is_not(None), Handoff.first_reply_at >= since
        )
    )
    replies = sorted((_aware(r) - _aware(q)).total_seconds() for q, r in rows if r is not None)
    return InboxStats(
        queue=await queue(db, tenant_id, now),
        expected_wait_s=await expected_wait_s(db, tenant_id, now),
        handoffs=int(requested or 0),
        first_reply_p50_s=_quantile(replies, 0.50),
        first_reply_p95_s=_quantile(replies, 0.95),
    )


def _quantile(ordered: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None without samples."""
    if not ordered:
        return None
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


async def claim(db: AsyncSession, actor: Actor, session_id: str) -> HandoffChange:
    """Take the session: ``ClaimedByOtherError`` when someone else holds it, ``NotWaitingError`` when no person is
    asked for. Claiming a session one holds already is not an error (a retry)."""
    session, handoff = await _locked(db, actor, session_id)
    if handoff is None:
        raise NotWaitingError("this session is not waiting for a person")
    if handoff.holder is not None and handoff.holder != actor.ref:
        raise ClaimedByOtherError(handoff.holder_name or "another agent")
    previous, first = handoff.holder_name, handoff.first_claimed_at is None
    _hold(handoff, actor.ref, actor.name)
    session.status = SessionStatus.AGENT_ACTIVE.value
    await db.commit()
    change = _change(session, handoff, previous)
    if first and handoff.first_claimed_at is not None:
        waited = (_aware(handoff.first_claimed_at) - _aware(handoff.requested_at)).total_seconds()
        change = dataclasses.replace(change, first_wait_s=waited)
    return change


async def release(db: AsyncSession, actor: Actor, session_id: str) -> HandoffChange:
    """Put the held session back in the queue (its place by its first request)."""
    session, handoff = await _held(db, actor, session_id)
    previous = handoff.holder_name
    handoff.holder = handoff.holder_name = None
    session.status = SessionStatus.AGENT_REQUESTED.value
    await db.commit()
    return _change(session, handoff, previous)


async def transfer(db: AsyncSession, actor: Actor, session_id: str, to_agent_id: str) -> HandoffChange:
    """Give the held session (an admin: any open one) to another agent of the tenant."""
    session, handoff = await _held(db, actor, session_id)
    target = await get_agent(db, actor.tenant.id, to_agent_id)
    previous = handoff.holder_name
    _hold(handoff, target.id, target.name)
    session.status = SessionStatus.AGENT_ACTIVE.value
    await db.commit()
    return _change(session, handoff, previous)


async def end(db: AsyncSession, actor: Actor, session_id: str, outcome: HandoffOutcome) -> HandoffChange:
    """End the hand-off the actor holds: hand the session back to the bot, or resolve it."""
    session, handoff = await _held(db, actor, session_id)
    previous = handoff.holder_name
    handoff.ended_at, handoff.outcome = utcnow(), outcome.value
    handoff.holder = handoff.holder_name = None
    status = SessionStatus.RESOLVED if outcome == HandoffOutcome.RESOLVED else SessionStatus.BOT_ACTIVE
    session.status = status.value
    await db.commit()
    return _change(session, handoff, previous)


async def settle_open(db: AsyncSession, session_id: str, outcome: HandoffOutcome) -> bool:
    """The session's status was set outside the inbox (it closed, an admin resolved it or gave it back to the bot):
    its open hand-off, if any, ends with ``outcome``; the caller commits. Whether one was open."""
    handoff = await _open_handoff(db, session_id)
    if handoff is None:
        return False
    handoff.ended_at, handoff.outcome = utcnow(), outcome.value
    handoff.holder = handoff.holder_name = None
    return True


async def reply(db: AsyncSession, actor: Actor, session_id: str, text: str) -> StoredReply:
    """Store the agent's reply in the session the agent holds (see the module's docstring for the refusals)."""
    _, handoff = await _held(db, actor, session_id, strict=True)
    now = utcnow()
    message = Message(
        session_id=session_id,
        seq=await store.next_seq(db, session_id),
        role=MessageRole.AGENT.value,
        content=text,
        status=MessageStatus.COMPLETE.value,
        agent_id=actor.agent_id,
        created_at=now,
    )
    db.add(message)
    first = handoff.first_reply_at is None
    if first:
        handoff.first_reply_at = now
    await db.commit()
    return StoredReply(message, (now - _aware(handoff.requested_at)).total_seconds() if first else None)


async def add_note(db: AsyncSession, actor: Actor, session_id: str, text: str) -> AgentNote:
    """A private note on the tenant's session (agents and admins read it; never the customer, never the prompt)."""
    await store.get_session(db, actor.tenant.id, session_id)
    note = AgentNote(session_id=session_id, author=actor.name, agent_id=actor.agent_id, text=text)
    db.add(note)
    await db.commit()
    return note


async def notes(db: AsyncSession, tenant_id: str, session_id: str) -> list[AgentNote]:
    await store.get_session(db, tenant_id, session_id)
    rows = await db.execute(select(AgentNote).where(AgentNote.session_id == session_id).order_by(AgentNote.id))
    return list(rows.scalars())


async def first_reply_s(db: AsyncSession, handoff_session_id: str) -> float | None:
    """Seconds from the request to the first human reply of the session's latest hand-off (None: no reply yet)."""
    row = await db.execute(
        select(Handoff.requested_at, Handoff.first_reply_at)
        .where(Handoff.session_id == handoff_session_id)
        .order_by(Handoff.id.desc())
        .limit(1)
    )
    found = row.first()
    if found is None or found[1] is None:
        return None
    return (_aware(found[1]) - _aware(found[0])).total_seconds()


# ---------------------------------------------------------------------- helpers


async def _locked(db: AsyncSession, actor: Actor, session_id: str) -> tuple[ChatSession, Handoff | None]:
    session = await store.lock_session(db, actor.tenant.id, session_id)
    if session.status == SessionStatus.CLOSED.value:
        raise SessionClosedError("this session is closed")
    return session, await _open_handoff(db, session_id)


async def _held(
    db: AsyncSession, actor: Actor, session_id: str, *, strict: bool = False
) -> tuple[ChatSession, Handoff]:
    """The session and its hand-off, held by ``actor`` (an admin may act on any open one, unless ``strict``: a reply
    is written by the holder only, so the customer always knows who is talking)."""
    session, handoff = await _locked(db, actor, session_id)
    if handoff is None:
        raise NotClaimedError("this session is not handed off to a person")
    if handoff.holder != actor.ref and (strict or not actor.is_admin):
        holder = f"it is held by {handoff.holder_name}" if handoff.holder_name else "it waits to be claimed"
        raise NotClaimedError(f"claim this session first ({holder})")
    return session, handoff


async def _open_handoff(db: AsyncSession, session_id: str) -> Handoff | None:
    row = await db.execute(
        select(Handoff).where(Handoff.session_id == session_id, Handoff.ended_at.is_(None)).order_by(Handoff.id)
    )
    return row.scalars().first()


def _hold(handoff: Handoff, holder: str, name: str) -> None:
    handoff.holder, handoff.holder_name = holder, name
    if handoff.first_claimed_at is None:
        handoff.first_claimed_at = utcnow()


def _change(session: ChatSession, handoff: Handoff, previous: str | None) -> HandoffChange:
    return HandoffChange(
        session.id,
        session.tenant_id,
        SessionStatus(session.status),
        handoff.holder,
        handoff.holder_name,
        HandoffReason(handoff.reason),
        previous,
    )


async def _last_customer_messages(db: AsyncSession, session_ids: list[str]) -> dict[str, str]:
    if not session_ids:
        return {}
    latest = (
        select(Message.session_id, func.max(Message.seq).label("seq"))
        .where(Message.session_id.in_(session_ids), Message.role == MessageRole.USER.value)
        .group_by(Message.session_id)
        .subquery()
    )
    rows = await db.execute(
        select(Message.session_id, Message.content).join(
            latest, (Message.session_id == latest.c.session_id) & (Message.seq == latest.c.seq)
        )
    )
    return {session_id: content for session_id, content in rows}


def _aware(at: datetime) -> datetime:
    """SQLite returns naive datetimes (stored in UTC)."""
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)
