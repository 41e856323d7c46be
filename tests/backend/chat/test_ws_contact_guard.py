"""No invented contact details, end to end: the real default model (SmolLM2-135M-Instruct), held by a grammar to a
reply with a URL and a phone number that no source holds (``support/forced_engine.py``), next to a URL of the
tenant's policy text and the customer's own order number. The socket never receives the invented ones, nor any
prefix of them; the stored reply is what the socket received; ``/metrics`` counts them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets
from sqlalchemy import select
from test_ws_chat import Chat

from backend.db.models import Message
from engine.config import EngineConfig
from support.forced_engine import ForcedReplyEngine
from support.server import ADMIN_KEY, db_session, server_settings, serving

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

POLICY = "Returns within 30 days: https://shop.example.com/returns."
FORCED = "Return it at https://shop.example.com/returns or www.fake-returns.com, order 302-1234567, or call 1082567394."
SHOWN = "Return it at https://shop.example.com/returns or [link removed], order 302-1234567, or call [number removed]."


@pytest.fixture(scope="module")
def forced_engine() -> Iterator[ForcedReplyEngine]:
    engine = ForcedReplyEngine(EngineConfig(model="smollm2", max_kv_memory_mb=64, max_num_seqs=4))
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.stop())


async def test_an_invented_url_and_number_never_reach_the_socket(
    sqlite_url: str, tmp_path: Path, forced_engine: ForcedReplyEngine
) -> None:
    forced_engine.forced = FORCED
    with serving(server_settings(sqlite_url, tmp_path, reply_max_tokens=64), forced_engine) as live:
        async with httpx.AsyncClient(base_url=live.http, headers={"X-API-Key": ADMIN_KEY}) as http:
            r = await http.put("/admin/tenant/policy-text", json={"policy_text": POLICY})
            assert r.status_code == 200
        async with websockets.connect(live.ws) as ws:
            chat = Chat(ws)
            await chat.hello()
            frames, done = await chat.turn("1", "My blender arrived with a cracked jug. Order 302-1234567.")
        deltas = [f["text"] for f in frames if f["type"] == "message.delta"]
        assert "".join(deltas) == done["text"] == SHOWN
        assert done["status"] == "complete"
        # no frame carried the invented URL or number, or a piece of either
        sent = json.dumps(frames)
        for piece in ("www", "fake", "1082", "567394"):
            assert piece not in sent
        async with db_session(live) as db:
            stored = (await db.execute(select(Message).where(Message.role == "assistant"))).scalars().all()
        assert [m.content for m in stored] == [SHOWN]
        async with httpx.AsyncClient(base_url=live.http) as http:
            metrics = (await http.get("/metrics")).text
        assert 'kvchat:contacts_blocked_total{kind="url"} 1.0' in metrics
        assert 'kvchat:contacts_blocked_total{kind="phone"} 1.0' in metrics
        assert 'kvchat:contacts_blocked_total{kind="email"}' not in metrics
