"""Two tenants' messages at the turn path's gate (steps 1-2, ``backend/core/fair_gate.py``), through a real server on
SQLite with one slot (``KVCHAT_TURN_SUBMIT_CONCURRENCY=1``): tenant A's first message holds the slot while its
others queue; tenant B's message, arriving after them, is stored next, before A's queued ones. (First come, first
served, B's would be stored last: issue 42.)"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import websockets
from test_ws_chat import TIMEOUT, Chat

from backend.chat.message_store import MessageStore, Stored
from backend.chat.protocol import UserMessage
from backend.core.fair_gate import FairGate
from engine.llm_engine import LLMEngine
from support.server import LiveServer, add_chat_tenant, server_settings, serving

pytestmark = pytest.mark.anyio

B_KEY = "tenant-b-chat-key"
A_QUEUED = 3


class Gate:
    """Who reached the gate (tenant ids, in order), what step 2 stored (client_msg_ids, in commit order), and A's
    first message held in step 2 until ``release`` is set. The server runs on its own thread and loop."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.arrived: list[str] = []
        self.stored: list[str] = []
        self.holding = threading.Event()
        self.release = threading.Event()
        hold, store = FairGate.hold, MessageStore.store

        def counted(gate: FairGate, owner: str) -> Any:
            self.arrived.append(owner)  # NOTE: the caller queues before its task yields the loop
            return hold(gate, owner)

        async def held(messages: MessageStore, tenant_id: str, session_id: str, frame: UserMessage) -> Stored:
            if frame.client_msg_id == "a0":
                self.holding.set()
                assert await asyncio.to_thread(self.release.wait, TIMEOUT)  # (a threading.Event: the test's thread)
            stored = await store(messages, tenant_id, session_id, frame)
            self.stored.append(frame.client_msg_id)
            return stored

        monkeypatch.setattr(FairGate, "hold", counted)
        monkeypatch.setattr(MessageStore, "store", held)

    async def until(self, done: Any) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not done():
            assert time.monotonic() < deadline, (self.arrived, self.stored)
            await asyncio.sleep(0.01)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Gate:
    return Gate(monkeypatch)


@pytest.fixture
def live(gate: Gate, sqlite_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    with serving(server_settings(sqlite_url, tmp_path, turn_submit_concurrency=1), tiny_engine) as server:
        yield server


async def _chat(stack: AsyncExitStack, live: LiveServer, token: str | None = None) -> Chat:
    chat = Chat(await stack.enter_async_context(websockets.connect(live.ws, open_timeout=TIMEOUT)))
    if token is None:
        await chat.hello()
    else:
        await chat.send(type="hello", token=token)
        assert (await chat.recv())["type"] == "welcome"
    return chat


async def test_tenant_bs_message_is_stored_before_tenant_as_queued_ones(live: LiveServer, gate: Gate) -> None:
    b_id = await add_chat_tenant(live, "tenant-b", B_KEY)
    async with AsyncExitStack() as stack:
        a_chats = [await _chat(stack, live) for _ in range(1 + A_QUEUED)]  # (one submit per session at a time)
        b_chat = await _chat(stack, live, B_KEY)
        await a_chats[0].send(type="user.message", client_msg_id="a0", text="Where is my order?")
        await gate.until(gate.holding.is_set)  # a0 holds the one slot, in step 2
        for i, chat in enumerate(a_chats[1:], 1):
            await chat.send(type="user.message", client_msg_id=f"a{i}", text=f"Where is order {i}?")
        await gate.until(lambda: len(gate.arrived) == 1 + A_QUEUED)  # A's others wait at the gate
        await b_chat.send(type="user.message", client_msg_id="b0", text="Can I change my address?")
        await gate.until(lambda: b_id in gate.arrived)
        assert gate.stored == []
        gate.release.set()
        for chat in [*a_chats, b_chat]:
            await chat.until("message.completed")
    # FIFO: a0 a1 a2 a3 b0. Fair: B holds no slot, so the slot a0 frees is B's.
    assert gate.stored[:2] == ["a0", "b0"]
    assert sorted(gate.stored[2:]) == [f"a{i}" for i in range(1, 1 + A_QUEUED)]
    assert gate.arrived.count(b_id) == 1
