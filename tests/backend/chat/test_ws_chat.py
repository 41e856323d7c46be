"""The chat websocket end to end: real uvicorn server, real engine (tiny model), SQLite and Postgres."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from sqlalchemy import func, select
from websockets.asyncio.client import ClientConnection

from backend.db.models import Message
from engine.llm_engine import LLMEngine
from support.server import (
    ADMIN_KEY,
    CHAT_TOKEN,
    LiveServer,
    db_session,
    server_settings,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.anyio

TIMEOUT = 30.0


class Chat:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws

    async def send(self, **frame: Any) -> None:
        await self.ws.send(json.dumps(frame))

    async def recv(self) -> dict[str, Any]:
        data = await asyncio.wait_for(self.ws.recv(), TIMEOUT)
        frame: dict[str, Any] = json.loads(data)
        return frame

    async def until(self, frame_type: str) -> list[dict[str, Any]]:
        frames = []
        while True:
            frame = await self.recv()
            frames.append(frame)
            if frame["type"] == frame_type:
                return frames

    async def hello(self, **extra: Any) -> dict[str, Any]:
        await self.send(type="hello", token=CHAT_TOKEN, **extra)
        welcome = await self.recv()
        assert welcome["type"] == "welcome", welcome
        return welcome

    async def turn(self, client_msg_id: str, text: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        await self.send(type="user.message", client_msg_id=client_msg_id, text=text)
        frames = await self.until("message.completed")
        return frames, frames[-1]


def _connect(live: LiveServer, **kwargs: Any) -> Any:
    return websockets.connect(live.ws, open_timeout=TIMEOUT, **kwargs)


async def _count_messages(live: LiveServer, session_id: str) -> int:
    async with db_session(live) as db:
        return int(await db.scalar(select(func.count()).select_from(Message).where(Message.session_id == session_id)))


async def test_full_turn_streams_deltas_equal_to_the_stored_reply(live_server: LiveServer) -> None:
    async with _connect(live_server) as ws:
        chat = Chat(ws)
        welcome = await chat.hello()
        assert welcome["status"] == "bot_active"
        assert welcome["messages"] == []
        frames, done = await chat.turn("m1", "Where is my order?")
        assert frames[0] == {"type": "message.ack", "client_msg_id": "m1", "seq": 1, "duplicate": False}
        deltas = "".join(f["text"] for f in frames if f["type"] == "message.delta")
        assert done["status"] == "complete"
        assert done["seq"] == 2
        assert done["text"] == deltas
        assert done["usage"]["prompt_tokens"] > 0
        assert done["usage"]["completion_tokens"] >= 1
        steps = done["usage"]["steps_ms"]  # the turn's path timed, in path order
        assert list(steps) == ["stored", "started", "planned", "submitted", "first_token", "first_shown"]
        assert list(steps.values()) == sorted(steps.values())
    async with db_session(live_server) as db:
        rows = (await db.execute(select(Message).order_by(Message.seq))).scalars().all()
    assert [(m.seq, m.role, m.status) for m in rows] == [(1, "user", "complete"), (2, "assistant", "complete")]
    assert rows[1].content == deltas
    assert rows[1].reply_to_seq == 1


async def test_second_turn_reuses_the_first_turns_kv(live_server: LiveServer) -> None:
    async with _connect(live_server) as ws:
        chat = Chat(ws)
        await chat.hello()
        _, first = await chat.turn("a", "Hello, I need help with a refund for a damaged item please.")
        _, second = await chat.turn("b", "It was the blue jacket.")
    assert first["usage"]["cached_tokens"] >= 0
    assert second["usage"]["cached_tokens"] > 0
    assert second["usage"]["cached_tokens"] + second["usage"]["prefilled_tokens"] == second["usage"]["prompt_tokens"]


async def test_reconnect_with_last_seq_replays_exactly_the_missed_messages(live_server: LiveServer) -> None:
    async with _connect(live_server) as ws:
        chat = Chat(ws)
        session_id = (await chat.hello())["session_id"]
        await chat.turn("1", "First question")
        await chat.turn("2", "Second question")
    async with _connect(live_server) as ws:
        welcome = await Chat(ws).hello(session_id=session_id, last_seq=2)
    assert welcome["session_id"] == session_id
    assert [(m["seq"], m["role"]) for m in welcome["messages"]] == [(3, "user"), (4, "assistant")]
    assert welcome["messages"][0]["content"] == "Second question"
    assert welcome["last_seq"] == 4
    async with _connect(live_server) as ws:
        welcome = await Chat(ws).hello(session_id=session_id, last_seq=4)
    assert welcome["messages"] == []


async def test_duplicate_client_msg_id_creates_no_second_message_or_reply(live_server: LiveServer) -> None:
    async with _connect(live_server) as ws:
        chat = Chat(ws)
        session_id = (await chat.hello())["session_id"]
        _, done = await chat.turn("same", "Can I change my address?")
        frames, replay = await chat.turn("same", "Can I change my address?")
    assert frames[0]["type"] == "message.ack"
    assert frames[0]["duplicate"] is True
    assert frames[0]["seq"] == 1
    assert replay["seq"] == done["seq"]
    assert replay["text"] == done["text"]
    assert not [f for f in frames if f["type"] == "message.delta"]
    assert await _count_messages(live_server, session_id) == 2


async def test_two_sockets_on_different_sessions_interleave_correctly(live_server: LiveServer) -> None:
    async with _connect(live_server) as ws1, _connect(live_server) as ws2:
        a, b = Chat(ws1), Chat(ws2)
        sa = (await a.hello())["session_id"]
        sb = (await b.hello())["session_id"]
        assert sa != sb
        (fa, da), (fb, db_) = await asyncio.gather(a.turn("x", "Track my parcel"), b.turn("x", "Cancel my order"))
    for frames, done in ((fa, da), (fb, db_)):
        assert {f.get("client_msg_id") for f in frames} == {"x"}
        assert "".join(f["text"] for f in frames if f["type"] == "message.delta") == done["text"]
    assert await _count_messages(live_server, sa) == 2
    assert await _count_messages(live_server, sb) == 2


async def test_db_pool_returns_to_baseline_while_sockets_stay_open(live_server: LiveServer) -> None:
    pool = live_server.state.db_engine.pool
    async with _connect(live_server) as ws1, _connect(live_server) as ws2:
        a, b = Chat(ws1), Chat(ws2)
        await a.hello()
        await b.hello()
        await asyncio.gather(a.turn("1", "hi"), b.turn("1", "hello"))
        await a.send(type="ping")
        assert (await a.recv())["type"] == "pong"
        assert pool.checkedout() == 0  # sockets open, no connection held


async def test_malformed_and_unknown_frames_get_errors_and_the_socket_stays_usable(live_server: LiveServer) -> None:
    async with _connect(live_server) as ws:
        chat = Chat(ws)
        await chat.hello()
        await ws.send("{not json")
        assert (await chat.recv())["code"] == "bad_json"
        await chat.send(type="teleport")
        assert (await chat.recv())["code"] == "unknown_type"
        await chat.send(type="user.message", client_msg_id="", text="x")
        err = await chat.recv()
        assert err["code"] == "invalid_frame"
        assert "client_msg_id" in err["message"]
        await chat.send(type="cancel")
        assert (await chat.recv())["code"] == "nothing_to_cancel"
        _, done = await chat.turn("ok", "still there?")
        assert done["status"] == "complete"


async def test_bad_token_closes_4401_and_unknown_session_4404(live_server: LiveServer) -> None:
    async with _connect(live_server) as ws:
        await ws.send(json.dumps({"type": "hello", "token": "nope"}))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), TIMEOUT)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 4401
    async with _connect(live_server) as ws:
        await ws.send(json.dumps({"type": "hello", "token": CHAT_TOKEN, "session_id": "no-such-session"}))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), TIMEOUT)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 4404


async def test_oversized_message_closes_1009(live_server: LiveServer) -> None:
    async with _connect(live_server, max_size=None) as ws:
        chat = Chat(ws)
        await chat.hello()
        await chat.send(type="user.message", client_msg_id="big", text="x" * (64 * 1024 + 1))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), TIMEOUT)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1009


async def test_asking_for_a_human_stops_the_bot(live_server: LiveServer) -> None:
    async with _connect(live_server) as ws:
        chat = Chat(ws)
        session_id = (await chat.hello())["session_id"]
        await chat.send(type="user.message", client_msg_id="h", text="I want to talk to a human please")
        ack = await chat.recv()
        status = await chat.recv()
        assert ack["type"] == "message.ack"
        assert status == {"type": "session.status", "session_id": session_id, "status": "agent_requested"}
        place = {"type": "session.queue", "session_id": session_id, "position": 1, "expected_wait_s": None}
        assert (await chat.recv()) == place  # the customer's place in the queue (issue 41)
        await chat.send(type="user.message", client_msg_id="h2", text="hello?")
        assert (await chat.recv())["type"] == "message.ack"
        assert (await chat.recv()) == status  # no bot reply is coming: the sender is told why
        assert (await chat.recv()) == place
        await chat.send(type="ping")
        assert (await chat.recv())["type"] == "pong"  # no reply was generated in between
    assert await _count_messages(live_server, session_id) == 2


async def test_transcript_export_json_and_text(live_server: LiveServer) -> None:
    async with _connect(live_server) as ws:
        chat = Chat(ws)
        session_id = (await chat.hello())["session_id"]
        _, done = await chat.turn("t", "Do you ship abroad?")
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(base_url=live_server.http, headers=headers) as http:
        as_json = await http.get(f"/admin/sessions/{session_id}/transcript")
        as_text = await http.get(f"/admin/sessions/{session_id}/transcript", params={"format": "text"})
        unauthorized = await http.get(f"/admin/sessions/{session_id}/transcript", headers={"Authorization": "Bearer x"})
        missing = await http.get("/admin/sessions/nope/transcript")
    assert as_json.status_code == 200
    body = as_json.json()
    assert body["session"]["id"] == session_id
    assert [(m["seq"], m["role"], m["content"]) for m in body["messages"]] == [
        (1, "user", "Do you ship abroad?"),
        (2, "assistant", done["text"]),
    ]
    assert as_text.status_code == 200
    assert as_text.headers["content-type"].startswith("text/plain")
    assert "user: Do you ship abroad?" in as_text.text
    assert unauthorized.status_code == 401
    assert missing.status_code == 404
    assert missing.json() == {"detail": "session nope not found", "code": "session_not_found"}


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_cancel_mid_stream_stores_a_cancelled_reply(db_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> None:
    live = start_server(server_settings(db_url, tmp_path, reply_max_tokens=1500), tiny_engine)
    try:
        async with _connect(live) as ws:
            chat = Chat(ws)
            session_id = (await chat.hello())["session_id"]
            await chat.send(type="user.message", client_msg_id="long", text="Tell me everything about returns.")
            assert (await chat.recv())["type"] == "message.ack"
            first = await chat.recv()
            assert first["type"] == "message.delta"
            await chat.send(type="cancel", client_msg_id="long")
            frames = await chat.until("message.completed")
        done = frames[-1]
        assert done["status"] == "cancelled"
        assert done["usage"]["completion_tokens"] < 1500
        async with db_session(live) as db:
            reply = (await db.execute(select(Message).where(Message.seq == 2))).scalar_one()
        assert (reply.status, reply.session_id) == ("cancelled", session_id)
        assert reply.content == done["text"]
        assert reply.content.startswith(first["text"])
    finally:
        stop_server(live)
