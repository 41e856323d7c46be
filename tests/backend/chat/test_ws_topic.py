"""Topic shifts and hand-offs read from the words, through a real server: a second issue without any number gets
its ``session.topic`` frame, and a hand-off request in Chinese stops the bot."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from sqlalchemy import select
from test_ws_chat import TIMEOUT, Chat

from backend.context.topic import TopicSettings
from backend.db.models import Message, SemanticBlock, TopicHistory
from engine.llm_engine import LLMEngine
from support.server import LiveServer, db_session, server_settings, serving

pytestmark = pytest.mark.anyio

PARCEL = "My parcel is late. Order #4061234567 was due on Monday, where is it?"
FOLLOW_UP = "so it is still not here, should I just wait?"
SECOND_ISSUE = "How do I change the password of my account?"


@pytest.fixture
def live(db_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    with serving(server_settings(db_url, tmp_path), tiny_engine) as server:
        yield server


async def _rows(live: LiveServer, model: Any, session_id: str) -> list[Any]:
    async with db_session(live) as db:
        query = select(model).where(model.session_id == session_id).order_by(model.id)
        return list((await db.execute(query)).scalars())


async def test_a_second_issue_without_any_number_starts_a_new_topic(live: LiveServer) -> None:
    async with websockets.connect(live.ws, open_timeout=TIMEOUT) as ws:
        chat = Chat(ws)
        session_id = (await chat.hello())["session_id"]
        await chat.turn("a", PARCEL)
        follow_frames, follow = await chat.turn("b", FOLLOW_UP)
        shift_frames, shifted = await chat.turn("c", SECOND_ISSUE)
    assert not [f for f in follow_frames if f["type"] == "session.topic"]
    assert follow["topic"]["epoch"] == 0
    topics = [f for f in shift_frames if f["type"] == "session.topic"]
    assert topics == [
        {
            "type": "session.topic",
            "session_id": session_id,
            "seq": 5,
            "topic": {"epoch": 1, "temperature": 0.3, "section": []},
        }
    ]
    assert shift_frames.index(topics[0]) < next(i for i, f in enumerate(shift_frames) if f["type"] == "message.delta")
    assert shifted["topic"] == {"epoch": 1, "temperature": 0.3, "section": []}
    history = await _rows(live, TopicHistory, session_id)
    assert [(h.message_seq, h.shift, h.topic_epoch) for h in history] == [(1, False, 0), (3, False, 0), (5, True, 1)]
    threshold = TopicSettings().shift_threshold
    assert history[1].similarity >= threshold > history[2].similarity  # the classifier's on-topic probability


@pytest.mark.parametrize("text", ["我要转人工客服！", "请帮我转接人工。"])
async def test_a_chinese_handoff_request_sets_agent_requested(live: LiveServer, text: str) -> None:
    async with websockets.connect(live.ws, open_timeout=TIMEOUT) as ws:
        chat = Chat(ws)
        session_id = (await chat.hello())["session_id"]
        await chat.send(type="user.message", client_msg_id="h", text=text)
        assert (await chat.recv())["type"] == "message.ack"
        status = await chat.recv()
        assert status == {"type": "session.status", "session_id": session_id, "status": "agent_requested"}
        assert (await chat.recv())["type"] == "session.queue"  # (issue 41: the place in the queue)
        await chat.send(type="ping")
        assert (await chat.recv())["type"] == "pong"  # no bot reply was generated
    messages = await _rows(live, Message, session_id)
    assert [(m.role, m.content) for m in messages] == [("user", text)]
    blocks = await _rows(live, SemanticBlock, session_id)
    assert [(b.block_type, text[b.char_start : b.char_end]) for b in blocks] == [("handoff", text)]
