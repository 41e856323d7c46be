"""Searching a tenant's sessions, on SQLite and Postgres: filters, paging, and never another tenant's rows."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from backend.db.engine import create_db_engine, create_sessionmaker
from backend.domain import SessionStatus
from backend.services import session_admin, tenants
from backend.services.session_admin import SessionQuery
from backend.services.sessions import create_session

pytestmark = pytest.mark.anyio


async def test_filters_and_paging(db_url: str) -> None:
    engine = create_db_engine(db_url)
    try:
        async with create_sessionmaker(engine)() as db:
            a = await tenants.create_tenant(db, "a")
            b = await tenants.create_tenant(db, "b")
            base = datetime(2026, 1, 1, tzinfo=UTC)
            made = {}
            for i, (ref, status, temp, epoch) in enumerate(
                [
                    ("cust-1", SessionStatus.BOT_ACTIVE, 0.8, 0),
                    ("cust-1", SessionStatus.CLOSED, 0.3, 2),
                    ("cust-2", SessionStatus.BOT_ACTIVE, None, 0),
                    ("cust-3", SessionStatus.AGENT_REQUESTED, 0.5, 1),
                ]
            ):
                s = await create_session(db, a.id, ref)
                s.status, s.semantic_temperature, s.topic_epoch = status.value, temp, epoch
                s.created_at = s.last_active_at = base + timedelta(hours=i)
                made[i] = s.id
            other = await create_session(db, b.id, "cust-1")
            await db.commit()

            async def ids(**filters: object) -> list[str]:
                rows = await session_admin.search_sessions(db, a.id, SessionQuery(**filters))  # type: ignore[arg-type]
                return [s.id for s in rows]

            assert await ids() == [made[3], made[2], made[1], made[0]]  # most recently active first
            assert other.id not in await ids(external_ref="cust-1")
            assert await ids(external_ref="cust-1") == [made[1], made[0]]
            assert await ids(status=SessionStatus.BOT_ACTIVE) == [made[2], made[0]]
            assert await ids(min_temperature=0.5) == [made[3], made[0]]
            assert await ids(max_temperature=0.4) == [made[1]]
            assert await ids(topic_epoch=0) == [made[2], made[0]]
            assert await ids(created_after=base + timedelta(minutes=30), created_before=base + timedelta(hours=2)) == [
                made[1]
            ]
            assert await ids(limit=2, offset=1) == [made[2], made[1]]
    finally:
        await engine.dispose()
