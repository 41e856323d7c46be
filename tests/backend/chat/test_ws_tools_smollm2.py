"""Tools in the chat with the real default model (SmolLM2-135M-Instruct) on a real server (Postgres): the tenant's
order lookup on loopback, a call required (the grammar holds the model to one), and the customer's reply.

What is the model's and what is kvchat's: the model writes the call (its ``order_id`` argument copied from the
customer's message, under the grammar) and the answer after reading the result; kvchat makes the call and adds the
result's values on a ``Details:`` line (``backend/chat/tool_facts.py``), so the reply carries the looked-up data
whatever the 135M model wrote (its own answer is not reliable: a run had it say the shipped order "has not been
shipped yet"). The test prints the model's answer, which it does not check.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from test_ws_chat import Chat
from test_ws_tools import ORDER_DETAILS, deltas, register, replies, tool_audit

from backend.chat.tool_facts import DETAILS
from backend.chat.tool_turn import GRACEFUL_REPLY
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from support.server import LiveServer, server_settings, serving
from support.tool_endpoint import ORDER, ToolServer, tool_server

pytestmark = [pytest.mark.slow, pytest.mark.anyio, pytest.mark.postgres]
FRAME_TIMEOUT_S = 600.0  # the call's step streams nothing: on 2 busy cores the first frame can take minutes


class SlowChat(Chat):
    async def recv(self) -> dict[str, Any]:
        frame: dict[str, Any] = json.loads(await asyncio.wait_for(self.ws.recv(), FRAME_TIMEOUT_S))
        return frame


@pytest.fixture(scope="module")
def smollm2_engine() -> Iterator[LLMEngine]:
    engine = LLMEngine(EngineConfig(model="smollm2", max_kv_memory_mb=128, max_num_seqs=4))
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.stop())


@pytest.fixture
def endpoint() -> Iterator[ToolServer]:
    with tool_server(slow_s=2.0) as server:
        yield server


@pytest.fixture
def live(pg_url: str, tmp_path: Path, smollm2_engine: LLMEngine) -> Iterator[LiveServer]:
    settings = server_settings(pg_url, tmp_path, reply_max_tokens=64, tools_allow_private_networks=True)
    with serving(settings, smollm2_engine) as server:
        yield server


async def test_an_order_lookup_with_smollm2(live: LiveServer, endpoint: ToolServer) -> None:
    await register(live, endpoint.url("/order"))
    async with websockets.connect(live.ws) as ws:
        chat = SlowChat(ws)
        await chat.hello()
        frames, done = await chat.turn("1", "Hi! Where is my order A1234?")
    assert done["status"] == "complete"
    assert "".join(deltas(frames)) == done["text"]
    assert "tool_call" not in done["text"]
    assert [(r.path, r.body) for r in endpoint.received] == [("/order", {"order_id": "A1234"})]
    assert await tool_audit(live) == [("bot", "tool.call", "lookup_order", "ok")]
    assert done["text"].endswith("\n\n" + ORDER_DETAILS)  # the lookup's values, word for word
    (stored,) = await replies(live)
    (step,) = json.loads(stored.tool_exchange or "")["steps"]
    assert [json.loads(r) for r in step["results"]] == [ORDER]
    model_part = done["text"].split(DETAILS)[0]
    print(f"\nthe model's answer: {model_part!r}\nadded: {done['text'][len(model_part) :]!r}")


async def test_a_tool_that_times_out_with_smollm2(live: LiveServer, endpoint: ToolServer) -> None:
    await register(live, endpoint.url("/slow"), timeout_s=0.5)
    async with websockets.connect(live.ws) as ws:
        chat = SlowChat(ws)
        await chat.hello()
        _, done = await chat.turn("1", "Hi! Where is my order A1234?")
    assert (done["status"], done["text"]) == ("complete", GRACEFUL_REPLY)
    assert await tool_audit(live) == [("bot", "tool.call", "lookup_order", "timeout")]
