"""The inbox in the database (``backend/services/inbox.py``), on SQLite and Postgres: the queue's order and places,
claims one at a time, release keeps the first place, transfer, the expected wait (a median), the refusals that store
nothing, and notes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.core.errors import SessionClosedError, SessionNotFoundError
from backend.db.engine import create_db_engine, create_sessionmaker
from backend.db.models import Handoff, Message, utcnow
from backend.domain import HandoffOutcome, HandoffReason, SessionStatus
from backend.services import agents, inbox, tenants
from backend.services import sessions as store
from backend.services.agents import Actor
from backend.services.inbox_errors import ClaimedByOtherError, NotClaimedError, NotWaitingError
from backend.services.tenants import bootstrap_default_tenant

pytestmark = pytest.mark.anyio


@pytest.fixture
async def maker(db_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_db_engine(db_url)
    try:
        yield create_sessionmaker(engine)
    finally:
        await engine.dispose()


async def _actors(maker: async_sessionmaker[AsyncSession]) -> tuple[str, Actor, Actor, Actor]:
    """The default tenant's id, agents Dana and Sam, and its admin key as the support team."""
    tenant_id = (await bootstrap_default_tenant(maker, "chat-key", "admin-key")).tenant_id
    async with maker() as db:
        dana, sam = await agents.create_agent(db, tenant_id, "Dana"), await agents.create_agent(db, tenant_id, "Sam")
        await db.commit()
        found = [await agents.authenticate_actor(db, k) for k in (dana.key.key, sam.key.key, "admin-key")]
        assert await agents.authenticate_actor(db, "chat-key") is None  # a chat token is no agent
    assert [a.name if a else None for a in found] == ["Dana", "Sam", "Support"]
    assert found[2] is not None and found[2].is_admin
    return tenant_id, found[0], found[1], found[2]  # type: ignore[return-value]


async def _waiting_session(maker: async_sessionmaker[AsyncSession], tenant_id: str, text: str) -> str:
    async with maker() as db:
        session = await store.create_session(db, tenant_id)
        await db.commit()
        await store.add_user_message(db, session.id, "m1", text)
    async with maker() as db:
        change = await inbox.request(db, session.id, HandoffReason.CUSTOMER_ASKED)
    assert change is not None and change.status == SessionStatus.AGENT_REQUESTED
    return session.id


async def test_the_queue_is_oldest_first_and_a_released_session_keeps_its_place(
    maker: async_sessionmaker[AsyncSession],
) -> None:
    tenant_id, dana, sam, _ = await _actors(maker)
    first = await _waiting_session(maker, tenant_id, "first")
    second = await _waiting_session(maker, tenant_id, "second")
    async with maker() as db:
        assert await inbox.request(db, first, HandoffReason.NO_PROGRESS) is None  # asking twice keeps the place
        queue = await inbox.queue(db, tenant_id)
        assert [(e.session_id, e.last_customer_message, e.reason) for e in queue] == [
            (first, "first", HandoffReason.CUSTOMER_ASKED),
            (second, "second", HandoffReason.CUSTOMER_ASKED),
        ]
        assert (await inbox.place(db, tenant_id, second)) == inbox.QueuePlace(2, None)
    async with maker() as db:
        claimed = await inbox.claim(db, dana, first)
    assert (claimed.status, claimed.holder_name) == (SessionStatus.AGENT_ACTIVE, "Dana")
    assert claimed.first_wait_s is not None and claimed.first_wait_s >= 0
    async with maker() as db:
        assert await inbox.place(db, tenant_id, first) is None  # held: not waiting
        assert (await inbox.place(db, tenant_id, second)).position == 1  # type: ignore[union-attr]
        with pytest.raises(ClaimedByOtherError, match=r"^this session is claimed by Dana$"):
            await inbox.claim(db, sam, first)
    async with maker() as db:
        again = await inbox.claim(db, dana, first)  # a retry of one's own claim
    assert again.first_wait_s is None
    async with maker() as db:
        released = await inbox.release(db, dana, first)
    assert (released.status, released.holder, released.previous_holder_name) == (
        SessionStatus.AGENT_REQUESTED,
        None,
        "Dana",
    )
    async with maker() as db:
        assert await inbox.waiting_sessions(db, tenant_id) == [first, second]  # back at its first place


async def test_transfer_hand_back_and_resolve(maker: async_sessionmaker[AsyncSession]) -> None:
    tenant_id, dana, sam, admin = await _actors(maker)
    session_id = await _waiting_session(maker, tenant_id, "help")
    async with maker() as db:
        with pytest.raises(NotClaimedError):
            await inbox.transfer(db, sam, session_id, "Dana")  # nobody holds it: nothing to transfer
    async with maker() as db:
        await inbox.claim(db, dana, session_id)
    async with maker() as db:
        moved = await inbox.transfer(db, dana, session_id, "Sam")
    assert (moved.holder, moved.holder_name, moved.previous_holder_name) == (sam.agent_id, "Sam", "Dana")
    async with maker() as db:
        with pytest.raises(NotClaimedError, match="held by Sam"):
            await inbox.end(db, dana, session_id, HandoffOutcome.HANDED_BACK)
    async with maker() as db:
        # an admin acts on any open hand-off (but writes replies only in the sessions it holds)
        back = await inbox.end(db, admin, session_id, HandoffOutcome.HANDED_BACK)
    assert back.status == SessionStatus.BOT_ACTIVE
    async with maker() as db:
        with pytest.raises(NotWaitingError):
            await inbox.claim(db, dana, session_id)
        handoff = (await db.execute(select(Handoff))).scalar_one()
        status = (await store.get_session(db, tenant_id, session_id)).status
    assert (handoff.outcome, handoff.holder, status) == ("handed_back", None, "bot_active")
    async with maker() as db:
        assert await inbox.request(db, session_id, HandoffReason.TOOL_FAILED) is not None  # a new hand-off
        await inbox.claim(db, sam, session_id)
    async with maker() as db:
        resolved = await inbox.end(db, sam, session_id, HandoffOutcome.RESOLVED)
        reasons = list((await db.execute(select(Handoff.reason).order_by(Handoff.id))).scalars())
    assert resolved.status == SessionStatus.RESOLVED
    assert reasons == ["customer_asked", "tool_failed"]


async def test_replies_are_stored_only_by_the_holder_of_an_open_session(
    maker: async_sessionmaker[AsyncSession],
) -> None:
    tenant_id, dana, sam, admin = await _actors(maker)
    session_id = await _waiting_session(maker, tenant_id, "help")
    async with maker() as db:
        other = await tenants.create_tenant(db, "other")
        await tenants.issue_key(db, other.id, tenants.KeyKind.ADMIN)
        stranger = await agents.create_agent(db, other.id, "Dana")  # the same name in another tenant is fine
        await db.commit()
        outsider = await agents.authenticate_actor(db, stranger.key.key)
    assert outsider is not None
    for actor, error in ((dana, NotClaimedError), (admin, NotClaimedError), (outsider, SessionNotFoundError)):
        async with maker() as db:
            with pytest.raises(error):
                await inbox.reply(db, actor, session_id, "hello")
    async with maker() as db:
        await inbox.claim(db, dana, session_id)
    async with maker() as db:
        with pytest.raises(NotClaimedError):
            await inbox.reply(db, sam, session_id, "hello")
    async with maker() as db:
        first = await inbox.reply(db, dana, session_id, "Hi, Dana here.")
    async with maker() as db:
        second = await inbox.reply(db, dana, session_id, "Anything else?")
    assert (first.message.seq, first.message.role, first.message.agent_id) == (2, "agent", dana.agent_id)
    assert first.first_reply_s is not None and second.first_reply_s is None
    async with maker() as db:
        await db.execute(update(store.ChatSession).values(status=SessionStatus.CLOSED.value))
        await db.commit()
    async with maker() as db:
        with pytest.raises(SessionClosedError):
            await inbox.reply(db, dana, session_id, "late")
        count = await db.scalar(select(func.count()).select_from(Message).where(Message.role == "agent"))
    assert count == 2


async def test_the_expected_wait_is_the_median_of_recent_first_claims(maker: async_sessionmaker[AsyncSession]) -> None:
    tenant_id, _, _, _ = await _actors(maker)
    now = utcnow()
    async with maker() as db:
        session = await store.create_session(db, tenant_id)
        await db.flush()
        for wait_s in (10, 20, 3_600, 30):
            db.add(
                Handoff(
                    tenant_id=tenant_id,
                    session_id=session.id,
                    reason="customer_asked",
                    requested_at=now - timedelta(seconds=wait_s + 60),
                    first_claimed_at=now - timedelta(seconds=60),
                    ended_at=now,
                    outcome="resolved",
                )
            )
        await db.commit()
        assert await inbox.expected_wait_s(db, tenant_id) == pytest.approx(25.0)  # (20 + 30) / 2: not the hour
        assert await inbox.expected_wait_s(db, tenant_id, now + timedelta(days=2)) is None  # too old to count


async def test_notes_are_kept_per_session_of_the_tenant(maker: async_sessionmaker[AsyncSession]) -> None:
    tenant_id, dana, _, admin = await _actors(maker)
    session_id = await _waiting_session(maker, tenant_id, "help")
    async with maker() as db:
        await inbox.add_note(db, dana, session_id, "VIP")
        await inbox.add_note(db, admin, session_id, "refund approved")
        notes = await inbox.notes(db, tenant_id, session_id)
        messages = await store.messages_after(db, session_id)
    assert [(n.author, n.text) for n in notes] == [("Dana", "VIP"), ("Support", "refund approved")]
    assert [m.content for m in messages] == ["help"]  # a note is no message: never the customer's, never the prompt's
