"""The bot hands off on its own (issue 41), under the tenant's hand-off settings: after N replies on one topic, or
when a tool call fails; each hand-off records its reason, the customer hears their place in the queue, and
``/metrics`` counts it. Real server (Postgres, the tiny model)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select
from test_ws_tools import register

from backend.chat.tool_turn import GRACEFUL_REPLY
from backend.db.models import Handoff
from engine.llm_engine import LLMEngine
from support.server import ADMIN_KEY, CHAT_TOKEN, LiveServer, db_session, server_settings, serving
from support.tool_endpoint import ToolServer, tool_server

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]
A = {"X-API-Key": ADMIN_KEY}
TIMEOUT_S = 60.0
# one topic over two messages (the pair test_ws_topic.py shows staying in epoch 0)
PARCEL = "My parcel is late. Order #4061234567 was due on Monday, where is it?"
FOLLOW_UP = "so it is still not here, should I just wait?"


@pytest.fixture
def live(pg_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    settings = server_settings(pg_url, tmp_path, reply_max_tokens=64, tools_allow_private_networks=True)
    with serving(settings, tiny_engine) as server:
        yield server


@pytest.fixture
def endpoint() -> Iterator[ToolServer]:
    with tool_server(slow_s=2.0) as server:
        yield server


async def _until(ws: Any, kind: str) -> list[dict[str, Any]]:
    frames = [json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))]
    while frames[-1]["type"] != kind:
        frames.append(json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S)))
    return frames


async def _settings(live: LiveServer, no_progress_turns: int, on_tool_failure: bool) -> None:
    body = {"no_progress_turns": no_progress_turns, "on_tool_failure": on_tool_failure}
    async with httpx.AsyncClient(base_url=live.http) as http:
        put = await http.put("/admin/tenant/handoff-settings", headers=A, json=body)
        assert put.json() == body
        assert (await http.get("/admin/tenant/handoff-settings", headers=A)).json() == body


async def _reasons(live: LiveServer, session_id: str) -> list[str]:
    async with db_session(live) as db:
        rows = await db.execute(select(Handoff.reason).where(Handoff.session_id == session_id))
        return list(rows.scalars())


def _handoffs_metric(live: LiveServer) -> dict[str, float]:
    text = httpx.get(f"{live.http}/metrics").text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "kvchat:handoffs")
    return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}


async def test_n_bot_replies_on_one_topic_hand_the_session_to_a_person(live: LiveServer) -> None:
    await _settings(live, no_progress_turns=2, on_tool_failure=False)
    async with websockets.connect(live.ws) as ws:
        await ws.send(json.dumps({"type": "hello", "token": CHAT_TOKEN}))
        session_id = (await _until(ws, "welcome"))[-1]["session_id"]
        await ws.send(json.dumps({"type": "user.message", "client_msg_id": "m1", "text": PARCEL}))
        first = await _until(ws, "message.completed")
        assert "session.status" not in [f["type"] for f in first]  # one reply: not yet
        await ws.send(json.dumps({"type": "user.message", "client_msg_id": "m2", "text": FOLLOW_UP}))
        frames = await _until(ws, "session.queue")
    kinds = [f["type"] for f in frames]
    assert kinds.index("message.completed") < kinds.index("session.status")  # the reply first, then the hand-off
    assert {"type": "session.status", "session_id": session_id, "status": "agent_requested"} in frames
    assert frames[-1]["position"] == 1
    assert await _reasons(live, session_id) == ["no_progress"]
    assert _handoffs_metric(live) == {"no_progress": 1.0}


async def test_a_failed_tool_call_hands_the_session_to_a_person(live: LiveServer, endpoint: ToolServer) -> None:
    await register(live, endpoint.url("/fail"))
    await _settings(live, no_progress_turns=0, on_tool_failure=True)
    async with websockets.connect(live.ws) as ws:
        await ws.send(json.dumps({"type": "hello", "token": CHAT_TOKEN}))
        session_id = (await _until(ws, "welcome"))[-1]["session_id"]
        await ws.send(json.dumps({"type": "user.message", "client_msg_id": "m1", "text": "Where is order A1234?"}))
        frames = await _until(ws, "session.queue")
    completed = next(f for f in frames if f["type"] == "message.completed")
    assert completed["text"] == GRACEFUL_REPLY
    assert await _reasons(live, session_id) == ["tool_failed"]
    assert _handoffs_metric(live) == {"tool_failed": 1.0}


async def test_without_settings_the_bot_never_hands_off_on_its_own(live: LiveServer) -> None:
    async with websockets.connect(live.ws) as ws:
        await ws.send(json.dumps({"type": "hello", "token": CHAT_TOKEN}))
        session_id = (await _until(ws, "welcome"))[-1]["session_id"]
        for n in range(3):
            await ws.send(json.dumps({"type": "user.message", "client_msg_id": f"m{n}", "text": "Where is my parcel?"}))
            frames = await _until(ws, "message.completed")
            assert "session.status" not in [f["type"] for f in frames]
    assert await _reasons(live, session_id) == []
