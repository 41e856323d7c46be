"""``/ws/agent`` on a real server (Postgres, the tiny model): who may open it, what a bad frame gets, the rate limit,
and the inbox frames it carries."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from engine.llm_engine import LLMEngine
from support.server import ADMIN_KEY, CHAT_TOKEN, LiveServer, server_settings, serving

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]
TIMEOUT_S = 30.0


@pytest.fixture
def live(pg_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    with serving(server_settings(pg_url, tmp_path), tiny_engine) as server:
        yield server


def _feed_url(live: LiveServer) -> str:
    return live.ws.replace("/ws/chat", "/ws/agent")


async def _recv(ws: Any) -> dict[str, Any]:
    frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
    return frame


@pytest.mark.parametrize(
    ("hello", "reason"),
    [
        ({"type": "hello", "token": CHAT_TOKEN}, "invalid key"),  # a chat token is no agent
        ({"type": "ping"}, "the first frame must be hello"),
        ({"type": "hello", "token": 5}, "the first frame must be hello"),
    ],
)
async def test_only_an_agent_or_admin_key_opens_the_feed(live: LiveServer, hello: dict[str, Any], reason: str) -> None:
    async with websockets.connect(_feed_url(live)) as ws:
        await ws.send(json.dumps(hello))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await _read_until_closed(ws)
    assert closed.value.rcvd is not None
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4401, reason)


async def _read_until_closed(ws: Any) -> None:
    """Read (an ``error`` frame may come first) until the socket closes: that raises ``ConnectionClosed``."""
    while True:
        await _recv(ws)


async def test_bad_frames_get_errors_and_a_burst_is_rate_limited(live: LiveServer) -> None:
    async with websockets.connect(_feed_url(live)) as ws:
        await ws.send(json.dumps({"type": "hello", "token": ADMIN_KEY}))  # an admin key acts as the support team
        welcome = await _recv(ws)
        assert (welcome["type"], welcome["agent_name"], welcome["queue"]) == ("agent.welcome", "Support", [])
        await ws.send("{not json")
        assert (await _recv(ws))["code"] == "bad_json"
        await ws.send(json.dumps({"type": "typing", "session_id": "\u0000"}))
        assert (await _recv(ws))["code"] == "invalid_frame"
        await ws.send(json.dumps({"type": "typing", "session_id": "not-a-session"}))  # nothing to tell anyone
        for n in range(20):
            await ws.send(json.dumps({"type": "ping", "nonce": str(n)}))
        frames = [await _recv(ws) for _ in range(20)]
    kinds = [f["type"] if f["type"] == "pong" else f["code"] for f in frames]
    assert kinds.count("rate_limited") >= 5  # a burst of 10 frames a client, then 5 a second
    assert kinds[0] == "pong"


async def test_the_feed_carries_a_hand_off_and_the_customers_messages(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        agent = (
            await http.post("/admin/tenant/agents", headers={"X-API-Key": ADMIN_KEY}, json={"name": "Dana"})
        ).json()
    async with websockets.connect(_feed_url(live)) as feed, websockets.connect(live.ws) as customer:
        await feed.send(json.dumps({"type": "hello", "token": agent["key"]}))
        assert (await _recv(feed))["agent_name"] == "Dana"
        await customer.send(json.dumps({"type": "hello", "token": CHAT_TOKEN}))
        session_id = (await _recv(customer))["session_id"]
        await customer.send(json.dumps({"type": "user.message", "client_msg_id": "a", "text": "I want a human"}))
        handoff = await _recv(feed)
        assert handoff["type"] == "inbox.handoff"
        assert (handoff["entry"]["session_id"], handoff["entry"]["status"]) == (session_id, "agent_requested")
        await customer.send(json.dumps({"type": "user.message", "client_msg_id": "b", "text": "Hello?"}))
        message = await _recv(feed)
        assert (message["type"], message["session_id"], message["seq"], message["text"]) == (
            "inbox.message",
            session_id,
            2,
            "Hello?",
        )
        await customer.send(json.dumps({"type": "typing"}))
        assert await _recv(feed) == {"type": "typing", "session_id": session_id, "who": "customer", "name": None}
