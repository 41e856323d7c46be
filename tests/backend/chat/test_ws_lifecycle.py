"""Chat websocket limits and lifecycle: rate limit, connection cap, Origin, shutdown, idle timeout, resume mid-reply,
messages too long to ever answer, turns cut off by a crash (marked on start), and the SIGTERM drain of a real
``kvchat serve`` process."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from sqlalchemy import select
from test_ws_chat import TIMEOUT, Chat

from backend.db.engine import create_db_engine, create_sessionmaker
from backend.db.models import Message
from backend.services import sessions as store
from backend.services.tenants import bootstrap_default_tenant
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from support.server import (
    ADMIN_KEY,
    CHAT_TOKEN,
    LiveServer,
    db_session,
    server_settings,
    serving,
    start_server,
    stop_server,
)
from support.server_process import ServerProcess, start_server_process, tiny_server_env

pytestmark = pytest.mark.anyio


@pytest.fixture
def make_server(tmp_path: Path, sqlite_url: str, tiny_engine: LLMEngine) -> Iterator[Any]:
    started: list[LiveServer] = []

    def make(**overrides: Any) -> LiveServer:
        live = start_server(server_settings(sqlite_url, tmp_path, **overrides), tiny_engine)
        started.append(live)
        return live

    yield make
    for live in started:
        stop_server(live)


async def _closed_code(ws: Any) -> int:
    """Read until the server closes the socket; return the close code it sent."""
    code = None
    try:
        while True:
            await asyncio.wait_for(ws.recv(), TIMEOUT)
    except websockets.ConnectionClosed as closed:
        code = closed.rcvd.code if closed.rcvd is not None else None
    assert code is not None
    return int(code)


async def test_rate_limit_answers_with_an_error_and_keeps_the_socket(make_server: Any) -> None:
    live = make_server(ws_rate_per_second=1.0, ws_rate_burst=2)
    async with websockets.connect(live.ws) as ws:
        chat = Chat(ws)
        await chat.hello()
        for _ in range(4):
            await chat.send(type="ping")
        frames = [await chat.recv() for _ in range(4)]
    assert [f["type"] for f in frames[:2]] == ["pong", "pong"]
    limited = [f for f in frames if f["type"] == "error"]
    assert limited
    assert limited[0]["code"] == "rate_limited"
    assert limited[0]["retry_after_ms"] > 0


async def test_malformed_frames_count_against_the_rate_limit(make_server: Any) -> None:
    live = make_server(ws_rate_per_second=1.0, ws_rate_burst=2)
    async with websockets.connect(live.ws) as ws:
        chat = Chat(ws)
        await chat.hello()
        for _ in range(4):
            await ws.send("{not json")
        codes = [(await chat.recv())["code"] for _ in range(4)]
    assert codes[:2] == ["bad_json", "bad_json"]
    assert "rate_limited" in codes[2:]


async def test_hello_with_an_absurd_last_seq_is_refused_cleanly(make_server: Any) -> None:
    live = make_server()
    async with websockets.connect(live.ws) as ws:
        session_id = (await Chat(ws).hello())["session_id"]
    async with websockets.connect(live.ws) as ws:
        await ws.send(json.dumps({"type": "hello", "token": CHAT_TOKEN, "session_id": session_id, "last_seq": 10**30}))
        err = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT))
        assert (err["type"], err["code"]) == ("error", "invalid_frame")
        assert await _closed_code(ws) == 4401


async def test_connection_cap_per_tenant_closes_1013(make_server: Any) -> None:
    live = make_server(max_connections_per_tenant=1)
    async with websockets.connect(live.ws) as first:
        await Chat(first).hello()
        async with websockets.connect(live.ws) as second:
            await second.send(json.dumps({"type": "hello", "token": CHAT_TOKEN}))
            assert await _closed_code(second) == 1013
    async with websockets.connect(live.ws) as third:  # the slot is free again
        await Chat(third).hello()


async def test_origin_allowlist(make_server: Any) -> None:
    live = make_server(allowed_origins=["https://shop.example"])
    async with websockets.connect(live.ws, origin="https://evil.example") as ws:  # type: ignore[arg-type]
        assert await _closed_code(ws) == 1008
    async with websockets.connect(live.ws, origin="https://shop.example") as ws:  # type: ignore[arg-type]
        await Chat(ws).hello()


async def test_server_shutdown_closes_sockets_with_1012(make_server: Any) -> None:
    live = make_server()
    async with websockets.connect(live.ws) as ws:
        await Chat(ws).hello()
        await asyncio.to_thread(stop_server, live)
        assert await _closed_code(ws) == 1012


async def test_idle_timeout_closes_the_session_and_refuses_new_messages(make_server: Any) -> None:
    live = make_server(session_timeout_seconds=1)
    async with websockets.connect(live.ws) as ws:
        chat = Chat(ws)
        session_id = (await chat.hello())["session_id"]
        status = await chat.recv()  # the sweeper runs every second
        assert status == {"type": "session.status", "session_id": session_id, "status": "closed"}
        await chat.send(type="user.message", client_msg_id="late", text="are you there?")
        err = await chat.recv()
        assert (err["type"], err["code"], err["client_msg_id"]) == ("error", "session_closed", "late")


async def test_resolved_session_reopens_on_a_customer_reply(make_server: Any) -> None:
    live = make_server()
    async with websockets.connect(live.ws) as ws:
        chat = Chat(ws)
        session_id = (await chat.hello())["session_id"]
        async with httpx.AsyncClient(base_url=live.http, headers={"X-API-Key": ADMIN_KEY}) as http:
            resp = await http.post(f"/admin/sessions/{session_id}/status", json={"status": "resolved"})
        assert resp.status_code == 200
        assert resp.json()["status"] == "resolved"
        assert (await chat.recv())["status"] == "resolved"
        frames, done = await chat.turn("again", "One more question")
        assert {"type": "session.status", "session_id": session_id, "status": "bot_active"} in frames
        assert done["status"] == "complete"


async def test_reconnect_mid_reply_attaches_to_the_reply_in_flight(make_server: Any) -> None:
    live = make_server(reply_max_tokens=300)
    # NOTE: max_queue=None: this socket stops reading after the first delta, and with the default queue (16 frames) the
    # client stops reading the transport once deltas pile up, so the server's close reply sat unread until the close
    # timeout (10 s) and the reply could finish before the reconnect (a flaky failure, ~1 run in 10 on a fast CPU)
    async with websockets.connect(live.ws, max_queue=None) as ws:
        chat = Chat(ws)
        session_id = (await chat.hello())["session_id"]
        await chat.send(type="user.message", client_msg_id="q", text="Explain the whole return policy")
        assert (await chat.recv())["type"] == "message.ack"
        assert (await chat.recv())["type"] == "message.delta"
    async with websockets.connect(live.ws) as ws:  # the first socket dropped; the reply keeps going
        chat = Chat(ws)
        welcome = await chat.hello(session_id=session_id, last_seq=1)
        assert welcome["in_flight"]["client_msg_id"] == "q"
        await chat.send(type="user.message", client_msg_id="q", text="Explain the whole return policy")
        frames = await chat.until("message.completed")
    acks = [f for f in frames if f["type"] == "message.ack"]
    assert acks == [{"type": "message.ack", "client_msg_id": "q", "seq": 1, "duplicate": True}]
    done = frames[-1]
    assert done["status"] == "complete"
    assert done["text"].startswith(welcome["in_flight"]["text"])
    async with db_session(live) as db:
        rows = (await db.execute(select(Message).order_by(Message.seq))).scalars().all()
    assert [(m.seq, m.role, m.status) for m in rows] == [(1, "user", "complete"), (2, "assistant", "complete")]


def test_cli_chat_client_talks_to_the_server(make_server: Any) -> None:
    live = make_server()
    result = subprocess.run(
        [sys.executable, "-m", "backend.cli", "chat", "--url", live.ws, "--token", CHAT_TOKEN],
        input="Hello there\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "session " in result.stderr
    assert "bot> " in result.stdout
    assert "prompt tokens" in result.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "backend.cli", "chat", "--url", live.ws, "--token", "wrong"],
        input="",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 1
    assert "refused" in bad.stderr


async def test_engine_busy_is_an_error_frame_with_retry_after(
    sqlite_url: str, tmp_path: Path, tiny_model_dir: Path
) -> None:

    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", max_num_seqs=1, max_waiting=1)
    )
    await engine.start()
    # NOTE: replies of 500 tokens, not 200: on a fast CPU the first 200-token reply could finish before the third
    # message arrived, and then nobody was busy (~1 whole-file run in 20 failed so on a Zen 5)
    # (no shutdown grace: the replies still running when the test ends are cut off at once, not waited for)
    settings = server_settings(sqlite_url, tmp_path, reply_max_tokens=500, shutdown_grace_seconds=0)
    live = await asyncio.to_thread(start_server, settings, engine)
    try:
        async with (
            websockets.connect(live.ws) as w1,
            websockets.connect(live.ws) as w2,
            websockets.connect(live.ws) as w3,
        ):
            chats = [Chat(w1), Chat(w2), Chat(w3)]
            for chat in chats:
                await chat.hello()
            for chat in chats:
                await chat.send(type="user.message", client_msg_id="m", text="hello")
            outcomes = []
            for chat in chats:
                frames = []
                while not frames or frames[-1]["type"] not in ("message.completed", "error"):
                    frames.append(await chat.recv())
                outcomes.append(frames[-1])
            busy = [f for f in outcomes if f["type"] == "error"]
            assert busy, outcomes
            assert {f["code"] for f in busy} == {"busy"}
            assert all(f["retry_after_ms"] > 0 and f["client_msg_id"] == "m" for f in busy)
            # the user message was kept: retrying the same client_msg_id later gets a reply, not a duplicate
            retry = chats[outcomes.index(busy[0])]
            frames = []
            for _ in range(50):
                await retry.send(type="user.message", client_msg_id="m", text="hello")
                frames = await retry.until("message.ack")
                nxt = await retry.recv()
                if nxt["type"] != "error":
                    break
                await asyncio.sleep(nxt["retry_after_ms"] / 1000)
            assert frames[-1]["duplicate"] is True
    finally:
        await asyncio.to_thread(stop_server, live)
        await engine.stop()


# ---------------------------------------------------------------- messages that can never be answered


async def test_a_message_too_long_to_answer_is_refused_before_the_ack(
    pg_url: str, tmp_path: Path, tiny_engine: LLMEngine
) -> None:
    info = tiny_engine.info
    limit = min(info.max_model_len, info.num_blocks * info.block_size) - 12  # reply_max_tokens=12
    text = " ".join(f"w{i}x{i * 7 % 13}" for i in range(7000))  # ~60 KB: under the frame limit, far over the budget
    assert 50_000 < len(text.encode()) < 64 * 1024 - 200
    with serving(server_settings(pg_url, tmp_path, reply_max_tokens=12), tiny_engine) as live:
        async with websockets.connect(live.ws) as ws:
            chat = Chat(ws)
            session_id = (await chat.hello())["session_id"]
            await chat.send(type="user.message", client_msg_id="long", text=text)
            err = await chat.recv()
            assert (err["type"], err["code"], err["client_msg_id"]) == ("error", "message_too_long", "long")
            assert re.fullmatch(
                rf"message too long: (at least )?\d+ tokens with the system prompt; the limit is {limit} tokens",
                err["message"],
            )
            _, done = await chat.turn("short", "Where is my order?")  # the socket is still open
            assert done["status"] == "complete"
        async with db_session(live) as db:
            rows = (await db.execute(select(Message).where(Message.session_id == session_id))).scalars().all()
    assert sorted((m.seq, m.role, m.client_msg_id) for m in rows) == [(1, "user", "short"), (2, "assistant", None)]


# ---------------------------------------------------------------- turns cut off by a crash


async def _crashed_turn(db_url: str) -> str:
    """The state a kill -9 leaves: an acknowledged message the bot owed a reply, and no reply."""
    engine = create_db_engine(db_url)
    try:
        maker = create_sessionmaker(engine)
        tenant_id = (await bootstrap_default_tenant(maker, CHAT_TOKEN, ADMIN_KEY)).tenant_id
        async with maker() as db:
            session = await store.create_session(db, tenant_id)
            await db.commit()
            await store.add_user_message(db, session.id, "q1", "Where is my order?", awaiting_reply=True)
        return session.id
    finally:
        await engine.dispose()


async def test_a_restart_marks_the_turn_a_crash_cut_off_and_welcome_names_it(
    pg_url: str, tmp_path: Path, tiny_engine: LLMEngine
) -> None:
    session_id = await _crashed_turn(pg_url)
    with serving(server_settings(pg_url, tmp_path), tiny_engine) as live:
        async with websockets.connect(live.ws) as ws:
            chat = Chat(ws)
            welcome = await chat.hello(session_id=session_id, last_seq=0)
            assert [
                (m["seq"], m["role"], m["status"], m["content"], m["reply_to_seq"]) for m in welcome["messages"]
            ] == [
                (1, "user", "complete", "Where is my order?", None),
                (2, "assistant", "incomplete", "", 1),
            ]
            assert welcome["cut_off"] == [1]
            assert welcome["in_flight"] is None
            # a retry of the cut-off message gets the marker, not a second reply
            await chat.send(type="user.message", client_msg_id="q1", text="Where is my order?")
            ack, done = await chat.recv(), await chat.recv()
            assert ack == {"type": "message.ack", "client_msg_id": "q1", "seq": 1, "duplicate": True}
            assert (done["type"], done["seq"], done["status"], done["text"]) == (
                "message.completed",
                2,
                "incomplete",
                "",
            )
        async with websockets.connect(live.ws) as ws:
            welcome = await Chat(ws).hello(session_id=session_id, last_seq=2)
            assert (welcome["messages"], welcome["cut_off"]) == ([], [])


async def test_a_start_beside_a_live_worker_leaves_its_awaiting_turns_alone(
    pg_url: str, tmp_path: Path, tiny_engine: LLMEngine
) -> None:
    session_id = await _crashed_turn(pg_url)
    peer = create_db_engine(pg_url, application_name="kvchat-worker:4242:peer")  # another serving process
    try:
        async with peer.connect():
            with serving(server_settings(pg_url, tmp_path), tiny_engine) as live:
                async with db_session(live) as db:
                    rows = (await db.execute(select(Message).where(Message.session_id == session_id))).scalars().all()
    finally:
        await peer.dispose()
    assert [(m.seq, m.role, m.status) for m in rows] == [(1, "user", "awaiting_reply")]


# ---------------------------------------------------------------- SIGTERM on a real kvchat serve process


@pytest.fixture
def serve_process(pg_url: str, tiny_model_dir: Path, tmp_path: Path) -> Iterator[Any]:
    started: list[ServerProcess] = []

    def start(**settings: object) -> ServerProcess:
        env = tiny_server_env(pg_url, tiny_model_dir, tmp_path, **settings)
        server = start_server_process(env, tmp_path / f"serve-{len(started)}.log")
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


async def _until_connections_refused(port: int) -> None:
    """The server stops listening as its drain begins (and keeps serving the sockets it has)."""
    for _ in range(300):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return
        writer.close()
        await writer.wait_closed()
        await asyncio.sleep(0.05)
    raise AssertionError("the server kept accepting connections after SIGTERM")


async def _first_delta(chat: Chat, client_msg_id: str) -> list[str]:
    await chat.send(type="user.message", client_msg_id=client_msg_id, text="Explain the whole return policy")
    frames = await chat.until("message.delta")
    assert [f["type"] for f in frames] == ["message.ack", "message.delta"]
    return [frames[-1]["text"]]


async def _rest_of_reply(chat: Chat, client_msg_id: str, deltas: list[str]) -> tuple[dict[str, Any], list[Any]]:
    """Read to the reply's completion; return it and every other frame seen on the way."""
    others = []
    while True:
        frame = await chat.recv()
        if frame["type"] == "message.delta" and frame["client_msg_id"] == client_msg_id:
            deltas.append(frame["text"])
        elif frame["type"] == "message.completed" and frame["client_msg_id"] == client_msg_id:
            return frame, others
        else:
            others.append(frame)


async def _stored(pg_url: str) -> list[tuple[int, str, str, str]]:
    engine = create_db_engine(pg_url)
    try:
        async with create_sessionmaker(engine)() as db:
            rows = (await db.execute(select(Message).order_by(Message.seq))).scalars().all()
            return [(m.seq, m.role, m.status, m.content) for m in rows]
    finally:
        await engine.dispose()


async def test_sigterm_lets_the_reply_in_flight_finish_and_refuses_new_turns(pg_url: str, serve_process: Any) -> None:
    # NOTE: the commit-delay hook holds the reply in flight for 3 s after its last token, whatever the CPU's speed
    server = serve_process(reply_max_tokens=40, shutdown_grace_seconds=120, test_commit_delay_seconds=3)
    async with websockets.connect(server.ws) as ws:
        chat = Chat(ws)
        await chat.hello()
        deltas = await _first_delta(chat, "q")
        server.proc.send_signal(signal.SIGTERM)
        await _until_connections_refused(server.port)  # the drain has begun
        await chat.send(type="user.message", client_msg_id="late", text="one more thing")
        done, others = await _rest_of_reply(chat, "q", deltas)
        assert await _closed_code(ws) == 1012
    assert [(f["type"], f["code"], f["client_msg_id"]) for f in others] == [("error", "shutting_down", "late")]
    assert (done["status"], done["finish_reason"]) == ("complete", "length")
    assert done["text"] == "".join(deltas)
    assert server.terminate() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
    assert await _stored(pg_url) == [
        (1, "user", "complete", "Explain the whole return policy"),
        (2, "assistant", "complete", "".join(deltas)),
    ]


async def test_sigterm_past_the_grace_period_stores_exactly_the_text_that_was_sent(
    pg_url: str, serve_process: Any
) -> None:
    server = serve_process(reply_max_tokens=1500, shutdown_grace_seconds=0)
    async with websockets.connect(server.ws) as ws:
        chat = Chat(ws)
        await chat.hello()
        deltas = await _first_delta(chat, "q")
        server.proc.send_signal(signal.SIGTERM)
        done, others = await _rest_of_reply(chat, "q", deltas)
        assert await _closed_code(ws) == 1012
    assert others == []
    assert (done["status"], done["finish_reason"]) == ("incomplete", "interrupted")
    assert done["text"] == "".join(deltas)
    assert server.terminate() in (0, -signal.SIGTERM)
    assert await _stored(pg_url) == [
        (1, "user", "complete", "Explain the whole return policy"),
        (2, "assistant", "incomplete", "".join(deltas)),
    ]
