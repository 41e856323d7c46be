"""Per-session seq allocation under concurrent writers, and the ``awaiting_reply`` lifecycle that lets a restart find
the turns a crash cut off — on SQLite and Postgres."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.db.engine import create_db_engine, create_sessionmaker
from backend.db.models import Message
from backend.domain import MessageStatus
from backend.services import sessions as store
from backend.services.tenants import bootstrap_default_tenant

pytestmark = pytest.mark.anyio


async def test_a_reply_and_a_customer_message_stored_at_once_both_land(db_url: str) -> None:
    engine = create_db_engine(db_url)
    maker = create_sessionmaker(engine)
    try:
        tenant_id = (await bootstrap_default_tenant(maker, "c", "a")).tenant_id
        async with maker() as db:
            session = await store.create_session(db, tenant_id)
            await db.commit()
            await store.add_user_message(db, session.id, "m0", "first")
        for i in range(1, 6):  # the race is timing-dependent; several rounds make a lost write near-certain to show
            async with maker() as a, maker() as b:
                await asyncio.gather(
                    store.add_user_message(a, session.id, f"m{i}", f"message {i}"),
                    store.add_assistant_message(
                        b, session.id, 2 * i - 1, f"reply {i}", MessageStatus.COMPLETE, store.TokenUsage()
                    ),
                )
        async with maker() as db:
            seqs = list((await db.execute(select(Message.seq).order_by(Message.seq))).scalars())
        assert seqs == list(range(1, 12))
    finally:
        await engine.dispose()


@pytest.fixture
async def maker(db_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_db_engine(db_url)
    try:
        yield create_sessionmaker(engine)
    finally:
        await engine.dispose()


async def _new_session(maker: async_sessionmaker[AsyncSession]) -> str:
    tenant_id = (await bootstrap_default_tenant(maker, "c", "a")).tenant_id
    async with maker() as db:
        session = await store.create_session(db, tenant_id)
        await db.commit()
    return session.id


async def _rows(
    maker: async_sessionmaker[AsyncSession], session_id: str
) -> list[tuple[int, str, str, str, int | None]]:
    async with maker() as db:
        rows = await db.execute(select(Message).where(Message.session_id == session_id).order_by(Message.seq))
        return [(m.seq, m.role, m.content, m.status, m.reply_to_seq) for m in rows.scalars()]


async def test_a_reply_settles_the_message_it_answers(maker: async_sessionmaker[AsyncSession]) -> None:
    session_id = await _new_session(maker)
    async with maker() as db:
        await store.add_user_message(db, session_id, "m1", "hello", awaiting_reply=True)
        await store.add_user_message(db, session_id, "m2", "not for the bot")
    async with maker() as db:
        assert [(m.seq, m.client_msg_id) for m in await store.awaiting_replies(db)] == [(1, "m1")]
        await store.add_assistant_message(db, session_id, 1, "hi", MessageStatus.COMPLETE, store.TokenUsage())
    async with maker() as db:
        assert await store.awaiting_replies(db) == []
    assert await _rows(maker, session_id) == [
        (1, "user", "hello", "complete", None),
        (2, "user", "not for the bot", "complete", None),
        (3, "assistant", "hi", "complete", 1),
    ]


async def test_a_cut_off_turn_gets_exactly_one_incomplete_marker(maker: async_sessionmaker[AsyncSession]) -> None:
    session_id = await _new_session(maker)
    async with maker() as db:
        await store.add_user_message(db, session_id, "m1", "first", awaiting_reply=True)
        await store.add_user_message(db, session_id, "m2", "second", awaiting_reply=True)
    async with maker() as a, maker() as b:  # two starting processes race to mark the same turn
        marked = await asyncio.gather(
            store.settle_interrupted(a, session_id, 1), store.settle_interrupted(b, session_id, 1)
        )
    assert sorted(m is not None for m in marked) == [False, True]
    async with maker() as db:
        assert await store.settle_interrupted(db, session_id, 2) is not None
        assert await store.settle_interrupted(db, session_id, 2) is None
        assert await store.awaiting_replies(db) == []
    assert await _rows(maker, session_id) == [
        (1, "user", "first", "complete", None),
        (2, "user", "second", "complete", None),
        (3, "assistant", "", "incomplete", 1),
        (4, "assistant", "", "incomplete", 2),
    ]


async def test_a_retried_message_awaits_a_reply_again(maker: async_sessionmaker[AsyncSession]) -> None:
    session_id = await _new_session(maker)
    async with maker() as db:
        message, _ = await store.add_user_message(db, session_id, "m1", "hello")
        await store.await_reply(db, message)
    async with maker() as db:
        assert [m.seq for m in await store.awaiting_replies(db)] == [1]


async def test_a_message_never_gets_a_second_reply(maker: async_sessionmaker[AsyncSession]) -> None:
    session_id = await _new_session(maker)
    async with maker() as db:
        await store.add_user_message(db, session_id, "m1", "hello", awaiting_reply=True)
        first = await store.add_assistant_message(db, session_id, 1, "hi", MessageStatus.COMPLETE, store.TokenUsage())
    async with maker() as db:  # a retried store whose first commit had landed, or a late reply after a marker
        again = await store.add_assistant_message(db, session_id, 1, "late", MessageStatus.COMPLETE, store.TokenUsage())
    assert (again.seq, again.content, again.status) == (first.seq, "hi", "complete")
    assert await _rows(maker, session_id) == [
        (1, "user", "hello", "complete", None),
        (2, "assistant", "hi", "complete", 1),
    ]


async def test_a_message_stored_between_a_replys_reads_and_its_lock_moves_the_reply_on(
    maker: async_sessionmaker[AsyncSession], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the reply reads its seq before it takes the session's lock (SQLite's one writer); a customer message that lands
    # in between takes that seq, so the reply's insert fails and it is stored again with the reads under the lock
    session_id = await _new_session(maker)
    async with maker() as db:
        await store.add_user_message(db, session_id, "m1", "hello", awaiting_reply=True)
    lock, landed = store._lock_session, []

    async def lock_after_a_message_lands(db: AsyncSession, locked_id: str) -> object:
        if not landed:
            landed.append(locked_id)
            async with maker() as other:
                await store.add_user_message(other, locked_id, "m2", "are you there?")
        return await lock(db, locked_id)

    monkeypatch.setattr(store, "_lock_session", lock_after_a_message_lands)
    async with maker() as db:
        reply = await store.add_assistant_message(db, session_id, 1, "hi", MessageStatus.COMPLETE, store.TokenUsage())
    assert (landed, reply.seq) == ([session_id], 3)
    assert await _rows(maker, session_id) == [
        (1, "user", "hello", "complete", None),
        (2, "user", "are you there?", "complete", None),
        (3, "assistant", "hi", "complete", 1),
    ]
