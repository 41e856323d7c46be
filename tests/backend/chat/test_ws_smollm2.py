"""One end-to-end chat on the real default model (SmolLM2-135M-Instruct): two turns over the websocket."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets
from sqlalchemy import select
from test_ws_chat import Chat

from backend.db.models import Message
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from support.server import db_session, server_settings, start_server, stop_server

pytestmark = [pytest.mark.slow, pytest.mark.anyio]


@pytest.fixture(scope="module")
def smollm2_engine() -> Iterator[LLMEngine]:
    engine = LLMEngine(EngineConfig(model="smollm2", max_kv_memory_mb=64, max_num_seqs=4))
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.stop())


async def test_two_turns_with_smollm2(sqlite_url: str, tmp_path: Path, smollm2_engine: LLMEngine) -> None:
    live = start_server(server_settings(sqlite_url, tmp_path, reply_max_tokens=24), smollm2_engine)
    try:
        async with websockets.connect(live.ws) as ws:
            chat = Chat(ws)
            await chat.hello()
            frames1, first = await chat.turn("1", "Hi! My order has not arrived yet. What can I do?")
            frames2, second = await chat.turn("2", "It was shipped ten days ago.")
        for frames, done in ((frames1, first), (frames2, second)):
            assert done["status"] == "complete"
            assert "".join(f["text"] for f in frames if f["type"] == "message.delta") == done["text"]
            assert done["text"].strip()
        assert first["usage"]["cached_tokens"] == 0
        assert second["usage"]["cached_tokens"] > 0
        assert second["usage"]["prefilled_tokens"] < second["usage"]["prompt_tokens"]
        async with db_session(live) as db:
            stored = (await db.execute(select(Message).order_by(Message.seq))).scalars().all()
        assert [m.content for m in stored if m.role == "assistant"] == [first["text"], second["text"]]
    finally:
        stop_server(live)
