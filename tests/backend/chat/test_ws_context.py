"""The context layer through a real server: blocks and topic stored per message, the topic on the wire, the
prompt from the context builder (segments reach the engine), a dropped epoch freed in the engine and recorded, the
turn after it equal to a cold run, and a closed session's release recorded."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from sqlalchemy import select
from test_ws_chat import TIMEOUT, Chat

from backend.context.blocks import BlockType
from backend.context.rules import Rule
from backend.context.topic import TopicSettings
from backend.core.config import Settings
from backend.db.models import InvalidationEvent, Message, SemanticBlock, Tenant, TopicHistory
from backend.domain import HistoryPolicy
from backend.services import context_store
from backend.services.context_store import ContextSettings
from backend.services.reply_settings import defaults_of
from backend.services.tenants import DEFAULT_TENANT
from engine.llm_engine import LLMEngine
from engine.outputs import RequestFinished
from support.server import ADMIN_KEY, LiveServer, db_session, server_settings, serving

pytestmark = pytest.mark.anyio

PARCEL = "My parcel is late. Order #4061234567 was due on Monday, where is it?"
KETTLE = "Another thing: the kettle from order #5550001111 broke. Can I return it?"


@pytest.fixture
def live(db_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    with serving(server_settings(db_url, tmp_path), tiny_engine) as server:
        yield server


def _connect(live: LiveServer) -> Any:
    return websockets.connect(live.ws, open_timeout=TIMEOUT)


async def _rows(live: LiveServer, model: Any, session_id: str) -> list[Any]:
    async with db_session(live) as db:
        query = select(model).where(model.session_id == session_id).order_by(model.id)
        return list((await db.execute(query)).scalars())


async def test_messages_are_split_and_the_topic_reaches_the_client(live: LiveServer) -> None:
    async with _connect(live) as ws:
        chat = Chat(ws)
        welcome = await chat.hello()
        assert welcome["topic"] == {"epoch": 0, "temperature": None, "section": []}
        session_id = welcome["session_id"]
        _, first = await chat.turn("a", PARCEL)
        frames, second = await chat.turn("b", KETTLE)
    assert first["topic"] == {"epoch": 0, "temperature": 0.8, "section": []}
    # a new order number the bot did not ask for is a new problem: a topic shift, announced before the reply
    shift = [f for f in frames if f["type"] == "session.topic"]
    assert shift == [
        {
            "type": "session.topic",
            "session_id": session_id,
            "seq": 3,
            "topic": {"epoch": 1, "temperature": 0.3, "section": []},
        }
    ]
    assert second["topic"] == {"epoch": 1, "temperature": 0.3, "section": []}

    history = await _rows(live, TopicHistory, session_id)
    assert [(h.message_seq, h.temperature, h.shift, h.topic_epoch) for h in history] == [
        (1, 0.8, False, 0),
        (3, 0.3, True, 1),
    ]
    # the classifier's on-topic probability: none for a session's first message, under the threshold at the shift
    assert history[0].similarity is None
    assert history[1].similarity is not None and history[1].similarity < TopicSettings().shift_threshold
    messages = {m.id: m for m in await _rows(live, Message, session_id)}
    blocks = await _rows(live, SemanticBlock, session_id)
    by_seq = Counter(messages[b.message_id].seq for b in blocks)
    assert set(by_seq) == {1, 2, 3, 4}  # customer messages and replies alike
    user_blocks = [
        (
            messages[b.message_id].seq,
            b.block_type,
            messages[b.message_id].content[b.char_start : b.char_end],
            b.topic_epoch,
        )
        for b in blocks
        if messages[b.message_id].role == "user"
    ]
    assert user_blocks == [
        (1, "context", "My parcel is late.", 0),
        (1, "identifier", "Order #4061234567 was due on Monday, where is it?", 0),
        # "Can I return it?" is under min_block_length (8 tokens): merged, the identifier type wins
        (3, "identifier", "Another thing: the kettle from order #5550001111 broke. Can I return it?", 1),
    ]
    replies = {b.topic_epoch for b in blocks if messages[b.message_id].role == "assistant"}
    assert replies == {0, 1}
    async with httpx.AsyncClient(base_url=live.http) as client:
        got = (await client.get(f"/admin/sessions/{session_id}", headers={"X-API-Key": ADMIN_KEY})).json()
    assert (got["topic_epoch"], got["semantic_temperature"]) == (1, 0.3)


async def test_a_dropped_epoch_is_freed_and_the_next_turn_equals_a_cold_run(
    live: LiveServer, tiny_engine: LLMEngine
) -> None:
    context = live.state.chat.context
    block = tiny_engine.info.block_size
    before = tiny_engine.stats().cache
    async with _connect(live) as ws:
        chat = Chat(ws)
        session_id = (await chat.hello())["session_id"]
        _, first = await chat.turn("a", PARCEL)
        prompt1 = _ids(context.last_prompt(session_id))
        middle = tiny_engine.stats().cache
        _, second = await chat.turn("b", KETTLE)
        prompt2 = _ids(context.last_prompt(session_id))
    after = tiny_engine.stats().cache

    # segments reached the engine: its stats count prompt tokens by the builder's block types
    queried = Counter(middle.query_tokens_by_type) - Counter(before.query_tokens_by_type)
    assert {"system_prompt", "identifier", "context", "template"} <= set(queried)
    assert sum(queried.values()) == first["usage"]["prompt_tokens"] == len(prompt1)

    # the shift dropped epoch 0: the prompt changed right after the shared system prompt
    changed = next(i for i, (a, b) in enumerate(zip(prompt1, prompt2, strict=False)) if a != b)
    events = await _rows(live, InvalidationEvent, session_id)
    assert [(e.reason, e.actor) for e in events] == [("epoch_dropped", "system")]
    freed = after.invalidations["epoch_dropped"].blocks_freed - _freed(before, "epoch_dropped")
    # turn 1's chain: its prompt and reply (the last sampled token never reaches the KV), full blocks only
    assert freed == (len(prompt1) + first["usage"]["completion_tokens"] - 1) // block - changed // block
    assert freed >= 1
    assert (events[0].blocks_freed, events[0].tokens_freed) == (freed, freed * block)
    # what survived is exactly the unchanged prefix's full blocks; everything after it was computed again
    assert second["usage"]["prompt_tokens"] == len(prompt2)
    assert second["usage"]["cached_tokens"] == (changed // block) * block

    # the turn after the invalidation equals a cold run of the same prompt (fp32, greedy)
    cold = await _cold_run(tiny_engine, prompt2, live.settings)
    assert cold.stats.cached_tokens == 0
    assert cold.text == second["text"]
    assert cold.stats.completion_tokens == second["usage"]["completion_tokens"]


async def test_closing_a_session_records_the_release(live: LiveServer, tiny_engine: LLMEngine) -> None:
    async with _connect(live) as ws:
        chat = Chat(ws)
        session_id = (await chat.hello())["session_id"]
        await chat.turn("a", PARCEL)
    before = _freed(tiny_engine.stats().cache, "session_released")
    async with httpx.AsyncClient(base_url=live.http) as client:
        r = await client.post(
            f"/admin/sessions/{session_id}/status", json={"status": "closed"}, headers={"X-API-Key": ADMIN_KEY}
        )
    assert r.status_code == 200
    freed = _freed(tiny_engine.stats().cache, "session_released") - before
    events = await _rows(live, InvalidationEvent, session_id)
    block = tiny_engine.info.block_size
    assert [(e.reason, e.actor, e.blocks_freed, e.tokens_freed) for e in events] == [
        ("session_closed", "admin", freed, freed * block)
    ]
    assert freed >= 1
    assert live.state.chat.context.last_prompt(session_id) is None


async def test_closing_the_last_session_keeps_the_system_prompt_for_the_next_one(
    live: LiveServer, tiny_engine: LLMEngine
) -> None:
    # NOTE: a system prompt of this test alone, so no other session holds its blocks (the engine is shared): before,
    # the release dropped them with the session's own, and the next conversation computed them again.
    system = f"You answer for the shop {uuid.uuid4().hex}. Refunds are paid within 14 days of the return. " * 3
    headers = {"X-API-Key": ADMIN_KEY}
    async with httpx.AsyncClient(base_url=live.http) as client:
        edited = await client.put("/admin/tenant/system-prompt", json={"system_prompt": system}, headers=headers)
        assert edited.status_code == 200, edited.text
        async with _connect(live) as ws:
            chat = Chat(ws)
            session_id = (await chat.hello())["session_id"]
            await chat.turn("a", PARCEL)
        last = live.state.chat.context.last_prompt(session_id)
        assert last is not None
        block = tiny_engine.info.block_size
        system_blocks = last.context_from // block
        assert system_blocks >= 2
        footprint = tiny_engine.session_footprint(session_id).blocks
        before = _freed(tiny_engine.stats().cache, "session_released")
        closed = await client.post(f"/admin/sessions/{session_id}/status", json={"status": "closed"}, headers=headers)
        assert closed.status_code == 200, closed.text
    freed = _freed(tiny_engine.stats().cache, "session_released") - before
    assert 1 <= freed <= footprint - system_blocks

    async with _connect(live) as ws:
        chat = Chat(ws)
        await chat.hello()
        _, done = await chat.turn("b", KETTLE)
    assert done["usage"]["cached_tokens"] >= system_blocks * block


async def test_editing_the_pinned_context_frees_exactly_the_dependent_blocks(
    live: LiveServer, tiny_engine: LLMEngine
) -> None:
    context = live.state.chat.context
    block = tiny_engine.info.block_size
    async with _connect(live) as ws_a, _connect(live) as ws_b:
        a, b = Chat(ws_a), Chat(ws_b)
        session_a = (await a.hello())["session_id"]
        session_b = (await b.hello())["session_id"]
        _, a1 = await a.turn("a1", PARCEL)
        _, b1 = await b.turn("b1", "Hello, my jacket arrived torn at the seam and I would like a new one please.")
        last_a, last_b = context.last_prompt(session_a), context.last_prompt(session_b)
        assert last_a is not None and last_b is not None
        assert last_a.context_from == last_b.context_from  # both start after the same system prompt
        before = _freed(tiny_engine.stats().cache, "pinned_context_edited")
        async with httpx.AsyncClient(base_url=live.http) as client:
            r = await client.put(
                f"/admin/sessions/{session_a}/context",
                json={"pinned_context": "VIP customer since 2019; prefers e-mail."},
                headers={"X-API-Key": ADMIN_KEY},
            )
        assert r.status_code == 200, r.text
        got = r.json()
        freed = _freed(tiny_engine.stats().cache, "pinned_context_edited") - before
        # exactly A's blocks from the one holding the first token after the system prompt to the end of its chain,
        # save those B's chain still lists: here the block holding the system prompt's end and its end marker
        shared = b1["usage"]["cached_tokens"] // block
        assert shared == last_a.context_from // block + 1
        chain_a = (len(last_a.token_ids) + a1["usage"]["completion_tokens"] - 1) // block
        expected = chain_a - shared
        assert expected >= 1
        assert (got["blocks_freed"], got["tokens_freed"], got["deferred"]) == (expected, expected * block, 0)
        assert freed == expected
        assert (got["pinned_context"], got["session"]["context_version"]) == (
            "VIP customer since 2019; prefers e-mail.",
            1,
        )
        events = await _rows(live, InvalidationEvent, session_a)
        assert [(e.reason, e.actor, e.blocks_freed) for e in events] == [("pinned_context_edited", "admin", expected)]

        # A's next turn: the shared system prompt's blocks are still cached, everything from the pinned context on
        # is computed again; B's whole chain survived
        _, a2 = await a.turn("a2", "Any news?")
        _, b2 = await b.turn("b2", "Thanks, any news?")
        new_a = _ids(context.last_prompt(session_a))
        assert "VIP customer since 2019" in tiny_engine.tokenizer.decode(new_a)
        assert a2["usage"]["cached_tokens"] == (last_a.context_from // block) * block
        # NOTE: the block where B's prompt ends and its reply begins hits only when the reply's text encodes back to
        # the sampled ids (the tiny model's random ids often do not); every block of B's first prompt hits
        chain_b = (len(last_b.token_ids) + b1["usage"]["completion_tokens"] - 1) // block
        assert b2["usage"]["cached_tokens"] in ((len(last_b.token_ids) // block) * block, chain_b * block)
    assert await _rows(live, InvalidationEvent, session_b) == []


async def test_an_idle_timeout_records_the_release_as_timed_out(
    sqlite_url: str, tmp_path: Path, tiny_engine: LLMEngine
) -> None:
    with serving(server_settings(sqlite_url, tmp_path, session_timeout_seconds=1), tiny_engine) as live:
        async with _connect(live) as ws:
            chat = Chat(ws)
            session_id = (await chat.hello())["session_id"]
            await chat.turn("a", PARCEL)
            before = _freed(tiny_engine.stats().cache, "session_released")
            assert (await chat.until("session.status"))[-1]["status"] == "closed"  # the sweeper runs every second
        # NOTE: the event is written right after the status frame goes out
        events: list[Any] = []
        for _ in range(50):
            events = await _rows(live, InvalidationEvent, session_id)
            if events:
                break
            await asyncio.sleep(0.1)
    freed = _freed(tiny_engine.stats().cache, "session_released") - before
    assert freed >= 1
    assert [(e.reason, e.actor, e.blocks_freed) for e in events] == [("session_timed_out", "system", freed)]


async def test_a_full_policy_tenant_keeps_every_turn_and_frees_nothing(
    live: LiveServer, tiny_engine: LLMEngine
) -> None:
    async with db_session(live) as db:
        tenant_id = await _default_tenant(db)
        full = ContextSettings(HistoryPolicy.FULL, topic=TopicSettings(backend="tfidf"))
        await context_store.save_settings(db, tenant_id, full)
        await db.commit()
    context = live.state.chat.context
    block = tiny_engine.info.block_size
    async with _connect(live) as ws:
        chat = Chat(ws)
        session_id = (await chat.hello())["session_id"]
        _, first = await chat.turn("a", PARCEL)
        prompt1 = _ids(context.last_prompt(session_id))
        frames, second = await chat.turn("b", KETTLE)
        prompt2 = _ids(context.last_prompt(session_id))
    assert [f["topic"] for f in frames if f["type"] == "session.topic"] == [
        {"epoch": 1, "temperature": 0.3, "section": []}
    ]
    # the shift is tracked, but under ``full`` nothing leaves the prompt: it extends turn 1's, nothing is freed
    assert prompt2[: len(prompt1)] == prompt1
    assert await _rows(live, InvalidationEvent, session_id) == []
    chain = (len(prompt1) + first["usage"]["completion_tokens"] - 1) // block
    assert (len(prompt1) // block) * block <= second["usage"]["cached_tokens"] <= chain * block


async def test_a_new_tenant_rule_applies_from_the_next_message(live: LiveServer) -> None:
    text = "I am a VIP member and my jacket tore at the seam on day one."
    async with _connect(live) as ws:
        chat = Chat(ws)
        session_id = (await chat.hello())["session_id"]
        await chat.turn("a", text)
        async with db_session(live) as db:
            rule = Rule("vip_member", r"\bVIP\b", BlockType.IDENTIFIER, 95)
            await context_store.add_rule(db, rule, await _default_tenant(db))
            await db.commit()
        await chat.turn("b", text)
    messages = {m.id: m for m in await _rows(live, Message, session_id)}
    blocks = await _rows(live, SemanticBlock, session_id)
    assert [(messages[b.message_id].seq, b.block_type) for b in blocks if messages[b.message_id].role == "user"] == [
        (1, "context"),
        (3, "identifier"),
    ]


async def _default_tenant(db: Any) -> str:
    return str((await db.execute(select(Tenant.id).where(Tenant.name == DEFAULT_TENANT))).scalar_one())


def _ids(last: Any) -> list[int]:
    assert last is not None
    return list(last.token_ids)


def _freed(stats: Any, reason: str) -> int:
    counts = stats.invalidations.get(reason)
    return counts.blocks_freed if counts is not None else 0


async def _cold_run(engine: LLMEngine, prompt: list[int], settings: Settings) -> RequestFinished:
    """The reply the chat's default reply settings give ``prompt`` with nothing cached."""
    params = defaults_of(settings).params(settings.reply_max_tokens)
    finished = None
    async for event in engine.generate(prompt, params, namespace=f"cold-{uuid.uuid4().hex}"):
        if isinstance(event, RequestFinished):
            finished = event
    assert finished is not None
    return finished
