"""Step 7 started ahead (``backend/chat/turn_plan.py``), through a real server on SQLite and on Postgres: a message
the bot answers has its turn's plan started once step 2 has read the context, and the turn uses that plan instead of
planning again; a message that another turn of the session precedes, a hand-off request, and a message whose store
had to read again under the lock are planned by their turn, once, as before."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import websockets
from test_ws_chat import TIMEOUT, Chat

from backend.chat.message_store import MessageStore
from backend.chat.turn_path import TurnPath
from backend.chat.turn_plan import Planned, TurnPlanner
from backend.chat.turn_state import Turn
from engine.llm_engine import LLMEngine
from support.server import LiveServer, server_settings, serving

pytestmark = pytest.mark.anyio


class Plans:
    """The seqs of the messages planned ahead (``TurnPlanner.ahead``), by their turn (``TurnPath._plan``), and every
    plan computed (``TurnPlanner.plan``, with its prompt's token ids)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ahead: list[int] = []
        self.by_turn: list[int] = []
        self.computed: Counter[int] = Counter()
        self.prompts: dict[int, tuple[int, ...]] = {}
        ahead, plan, by_turn = TurnPlanner.ahead, TurnPlanner.plan, TurnPath._plan

        def ahead_spy(planner: TurnPlanner, tenant_id: str, ctx: Any, message: Any, setup: Any) -> Any:
            self.ahead.append(message.seq)
            return ahead(planner, tenant_id, ctx, message, setup)

        def plan_spy(planner: TurnPlanner, ctx: Any, message: Any, setup: Any, observe: bool) -> Planned:
            planned = plan(planner, ctx, message, setup, observe)
            self.computed[message.seq] += 1
            self.prompts[message.seq] = tuple(planned[0].prepared.token_ids)
            return planned

        def by_turn_spy(path: TurnPath, turn: Turn, setup: Any) -> Planned:
            self.by_turn.append(turn.user_seq)
            return by_turn(path, turn, setup)

        monkeypatch.setattr(TurnPlanner, "ahead", ahead_spy)
        monkeypatch.setattr(TurnPlanner, "plan", plan_spy)
        monkeypatch.setattr(TurnPath, "_plan", by_turn_spy)


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> Plans:
    return Plans(monkeypatch)


@pytest.fixture
def live(plans: Plans, db_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    with serving(server_settings(db_url, tmp_path), tiny_engine) as server:
        yield server


PARCEL = "My parcel is late. Order #4061234567 was due on Monday."


@asynccontextmanager
async def _chatting(live: LiveServer) -> AsyncIterator[Chat]:
    async with websockets.connect(live.ws, open_timeout=TIMEOUT) as ws:
        chat = Chat(ws)
        await chat.hello()
        yield chat


async def _seq(chat: Chat, client_msg_id: str, text: str, seen: list[dict[str, Any]]) -> int:
    """Send a message and return its seq from its ack; the frames before the ack (another turn's) go to ``seen``."""
    await chat.send(type="user.message", client_msg_id=client_msg_id, text=text)
    frames = await chat.until("message.ack")
    seen.extend(frames)
    return int(frames[-1]["seq"])


async def test_a_quiet_sessions_message_is_planned_once_ahead_and_its_turn_uses_that_plan(
    live: LiveServer, plans: Plans
) -> None:
    async with _chatting(live) as chat:
        _, first = await chat.turn("m1", PARCEL)
        _, second = await chat.turn("m2", "It still has not arrived. Can you check the tracking for me?")
    assert (first["status"], second["status"]) == ("complete", "complete")
    seqs = sorted(plans.computed)
    assert plans.ahead == seqs and plans.by_turn == []  # every message planned ahead, none by its turn
    assert all(n == 1 for n in plans.computed.values())  # and none planned twice
    assert second["usage"]["prompt_tokens"] == len(plans.prompts[seqs[-1]])  # the prompt that went to the engine


async def test_a_message_behind_a_turn_in_flight_and_a_hand_off_are_not_planned_ahead(
    live: LiveServer, plans: Plans
) -> None:
    async with _chatting(live) as chat:
        seen: list[dict[str, Any]] = []
        first = await _seq(chat, "m1", PARCEL, seen)
        second = await _seq(chat, "m2", "Also, the kettle I bought broke.", seen)  # (the first turn is in flight)
        while sum(f["type"] == "message.completed" for f in seen) < 2:  # (the first may complete before m2's ack)
            seen.extend(await chat.until("message.completed"))
        handoff = await _seq(chat, "m3", "I want to talk to a real person", seen)
        await asyncio.sleep(0.2)  # (no turn: nothing more is planned)
    assert plans.ahead == [first]
    assert plans.by_turn == [second]  # read again after the first turn's reply, and planned then
    assert plans.computed == Counter({first: 1, second: 1})
    assert handoff not in plans.computed


async def test_a_plan_started_ahead_is_dropped_when_the_store_reads_again_under_the_lock(
    live: LiveServer, plans: Plans, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock_and_store = MessageStore._lock_and_store
    moved: list[bool] = []

    async def topic_moved_once(store: MessageStore, db: Any, *args: Any) -> Any:
        if not moved:  # as if another worker moved the session's topic between the read and the lock
            moved.append(True)
            await db.rollback()
            return None
        return await lock_and_store(store, db, *args)

    monkeypatch.setattr(MessageStore, "_lock_and_store", topic_moved_once)
    async with _chatting(live) as chat:
        _, done = await chat.turn("m1", PARCEL)
    assert done["status"] == "complete"
    assert plans.ahead == [1]  # started, then dropped: the store ran again with its reads under the lock
    assert plans.by_turn == [1]
