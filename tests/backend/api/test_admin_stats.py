"""``GET /admin/stats``: the topic shifts and invalidations of the tenant over the window.

The counts come from ``topic_history`` and ``invalidation_events`` (on SQLite and Postgres): only the tenant's own
rows, only inside the window. Through a real server, a scripted topic shift moves both.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import websockets

from backend.db.engine import create_db_engine, create_sessionmaker
from backend.db.models import InvalidationEvent, TopicHistory, utcnow
from backend.domain import InvalidationReason
from backend.services import stats, tenants
from backend.services.sessions import create_session
from engine.llm_engine import LLMEngine
from support.server import ADMIN_KEY, CHAT_TOKEN, LiveServer, server_settings, serving

pytestmark = pytest.mark.anyio

PARCEL = "My parcel is late. Order #4061234567 was due on Monday, where is it?"
KETTLE = "Another thing: the kettle from order #5550001111 broke. Can I return it?"
TIMEOUT = 30.0


async def test_context_events_count_the_tenants_own_rows_inside_the_window(db_url: str) -> None:
    engine = create_db_engine(db_url)
    now = utcnow()
    try:
        async with create_sessionmaker(engine)() as db:
            a = await tenants.create_tenant(db, "a")
            b = await tenants.create_tenant(db, "b")
            sa = await create_session(db, a.id)
            sb = await create_session(db, b.id)
            for session_id, seq, shift, age_s in [
                (sa.id, 1, False, 10),  # the session's first message: not a shift
                (sa.id, 3, True, 20),
                (sa.id, 5, True, 30),
                (sa.id, 7, True, 600),  # outside a 300 s window
                (sb.id, 1, True, 10),  # another tenant's
            ]:
                db.add(
                    TopicHistory(
                        session_id=session_id,
                        message_seq=seq,
                        similarity=None,
                        temperature=0.3,
                        shift=shift,
                        topic_epoch=seq // 2,
                        created_at=now - timedelta(seconds=age_s),
                    )
                )
            events: list[tuple[str, str | None, int]] = [
                (a.id, sa.id, 5),
                (a.id, None, 50),  # its session was deleted: the event stays the tenant's
                (a.id, sa.id, 900),  # outside the window
                (b.id, sb.id, 5),
            ]
            for tenant_id, event_session_id, age_s in events:
                db.add(
                    InvalidationEvent(
                        tenant_id=tenant_id,
                        session_id=event_session_id,
                        reason=InvalidationReason.EPOCH_DROPPED.value,
                        actor="system",
                        blocks_freed=2,
                        tokens_freed=32,
                        created_at=now - timedelta(seconds=age_s),
                    )
                )
            await db.commit()

            assert await stats.context_events(db, a.id, 300.0) == stats.ContextEvents(topic_shifts=2, invalidations=2)
            assert await stats.context_events(db, a.id, 3600.0) == stats.ContextEvents(topic_shifts=3, invalidations=3)
            assert await stats.context_events(db, a.id, 15.0) == stats.ContextEvents(topic_shifts=0, invalidations=1)
            assert await stats.context_events(db, b.id, 300.0) == stats.ContextEvents(topic_shifts=1, invalidations=1)
    finally:
        await engine.dispose()


@pytest.fixture
def live(db_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    with serving(server_settings(db_url, tmp_path), tiny_engine) as server:
        yield server


async def test_a_topic_shift_moves_the_stats(live: LiveServer) -> None:
    headers = {"X-API-Key": ADMIN_KEY}
    async with httpx.AsyncClient(base_url=live.http, headers=headers) as http:
        before = (await http.get("/admin/stats", params={"window_s": 300})).json()
        assert (before["topic_shifts"], before["invalidations"]) == (0, 0)
        # a new order number the bot did not ask for: a shift, and epoch 0 is dropped from the prompt (and freed)
        await _chat(live, PARCEL, KETTLE)
        after = await http.get("/admin/stats", params={"window_s": 300})
    assert after.status_code == 200
    assert (after.json()["topic_shifts"], after.json()["invalidations"]) == (1, 1)


async def _chat(live: LiveServer, *texts: str) -> None:
    """One session, one completed turn per text."""
    async with websockets.connect(live.ws, open_timeout=TIMEOUT) as ws:
        await ws.send(json.dumps({"type": "hello", "token": CHAT_TOKEN}))
        await asyncio.wait_for(ws.recv(), TIMEOUT)
        for i, text in enumerate(texts):
            await ws.send(json.dumps({"type": "user.message", "client_msg_id": f"m{i}", "text": text}))
            while json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))["type"] != "message.completed":
                pass
