"""Per-session seq allocation under concurrent writers, on SQLite and Postgres."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select

from backend.db.engine import create_db_engine, create_sessionmaker
from backend.db.models import Message, MessageStatus
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
