"""Admin cache routes through a real server on Postgres, two tenants: flush a session's cache (the session stays and
its next turn equals a cold run; what other sessions share survives), flush a whole tenant's cache (another tenant's
survives), and a session's detail (blocks, temperature history, invalidation events, cache footprint)."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
import websockets
from sqlalchemy import select

from backend.core.config import Settings
from backend.db.models import InvalidationEvent, TopicHistory
from backend.domain import KeyKind
from backend.services import context_store, tenants
from backend.services.reply_settings import defaults_of
from engine.llm_engine import LLMEngine
from engine.outputs import RequestFinished
from support.server import ADMIN_KEY, CHAT_TOKEN, LiveServer, db_session
from support.ws_chat import Chat

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TIMEOUT = 60
A = {"X-API-Key": ADMIN_KEY}
IN_PROCESS = {"complete": True, "replicas": []}  # the in-process engine: no replica to name
PARCEL = "My parcel is late. Order #4061234567 was due on Monday, where is it?"
KETTLE = "Another thing: the kettle from order #5550001111 broke. Can I return it?"


def connect(live: LiveServer) -> Any:
    return websockets.connect(live.ws, open_timeout=TIMEOUT)


async def second_tenant(live: LiveServer) -> tuple[str, str]:
    """Tenant B: returns its (chat token, admin key)."""
    async with db_session(live) as db:
        tenant = await tenants.create_tenant(db, f"tenant-b-{uuid.uuid4().hex[:6]}")
        chat = await tenants.issue_key(db, tenant.id, KeyKind.CHAT)
        admin = await tenants.issue_key(db, tenant.id, KeyKind.ADMIN)
        await db.commit()
    return chat.key, admin.key


async def completion(live: LiveServer, token: str, text: str) -> dict[str, Any]:
    body = {"model": "default", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": text}]}
    async with httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT) as http:
        resp = await http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"})
    assert resp.status_code == 200, resp.text
    usage: dict[str, Any] = resp.json()["usage"]
    return usage


def chain_blocks(prompt_tokens: int, completion_tokens: int, block: int) -> int:
    """A turn's recorded chain: its prompt and reply (the last sampled token never reaches the KV), full blocks."""
    return (prompt_tokens + completion_tokens - 1) // block


def prompt_ids(live: LiveServer, session_id: str) -> list[int]:
    last = live.state.chat.context.last_prompt(session_id)
    assert last is not None
    return list(last.token_ids)


async def cold_run(engine: LLMEngine, prompt: list[int], settings: Settings) -> RequestFinished:
    """The reply the chat's default reply settings give ``prompt`` with nothing cached."""
    params = defaults_of(settings).params(settings.reply_max_tokens)
    finished = None
    async for event in engine.generate(prompt, params, namespace=f"cold-{uuid.uuid4().hex}"):
        if isinstance(event, RequestFinished):
            finished = event
    assert finished is not None
    return finished


async def test_flushing_a_session_frees_its_own_blocks_and_keeps_the_shared_prefix(
    live: LiveServer, tiny_engine: LLMEngine
) -> None:
    block = tiny_engine.info.block_size
    _, admin_b = await second_tenant(live)
    async with connect(live) as ws1, connect(live) as ws2, httpx.AsyncClient(base_url=live.http) as http:
        one, two = Chat(ws1), Chat(ws2)
        s1, s2 = await one.hello(CHAT_TOKEN), await two.hello(CHAT_TOKEN)
        t1 = await one.turn(PARCEL)
        t2 = await two.turn("Hello, my jacket arrived torn at the seam and I would like a new one please.")
        chain1 = chain_blocks(t1["usage"]["prompt_tokens"], t1["usage"]["completion_tokens"], block)
        chain2 = chain_blocks(t2["usage"]["prompt_tokens"], t2["usage"]["completion_tokens"], block)
        shared = t2["usage"]["cached_tokens"] // block  # the system prompt's blocks session 2 found cached
        assert shared >= 1
        detail = (await http.get(f"/admin/sessions/{s1}/detail", headers=A)).json()
        assert detail["cache_footprint"] == {"blocks": chain1, "tokens": chain1 * block}

        other = await http.post(f"/admin/sessions/{s1}/flush", headers={"X-API-Key": admin_b})
        assert (other.status_code, other.json()["code"]) == (404, "session_not_found")
        flushed = await http.post(f"/admin/sessions/{s1}/flush", headers=A)
        assert flushed.status_code == 200, flushed.text
        # position 0 takes the whole chain, save the blocks session 2's chain lists (the shared system prompt)
        assert flushed.json() == {
            **IN_PROCESS,
            "blocks_freed": chain1 - shared,
            "tokens_freed": (chain1 - shared) * block,
        }
        again = await http.post(f"/admin/sessions/{s1}/flush", headers=A)
        assert again.json() == {**IN_PROCESS, "blocks_freed": 0, "tokens_freed": 0}

        d1 = (await http.get(f"/admin/sessions/{s1}/detail", headers=A)).json()
        d2 = (await http.get(f"/admin/sessions/{s2}/detail", headers=A)).json()
        assert d1["session"]["status"] == "bot_active"  # the session stays
        assert d1["cache_footprint"] == {"blocks": 0, "tokens": 0}
        assert d2["cache_footprint"] == {"blocks": chain2, "tokens": chain2 * block}
        events = [(e["reason"], e["actor"], e["blocks_freed"], e["tokens_freed"]) for e in d1["invalidation_events"]]
        assert events == [
            ("admin_flush", "admin", chain1 - shared, (chain1 - shared) * block),
            ("admin_flush", "admin", 0, 0),
        ]
        assert d2["invalidation_events"] == []

        # the next turn works: only the shared system prompt hits, and it equals a cold run of the same prompt
        t1b = await one.turn("Any news?")
        assert t1b["usage"]["cached_tokens"] == shared * block
        cold = await cold_run(tiny_engine, prompt_ids(live, s1), live.settings)
        assert (cold.text, cold.stats.completion_tokens) == (t1b["text"], t1b["usage"]["completion_tokens"])
        # and session 2's chain survived whole: its next turn hits every block of its first prompt (and the block
        # where its reply begins when the reply's text encodes back to the sampled ids; the tiny model's often do not)
        t2b = await two.turn("Thanks, any news?")
        assert t2b["usage"]["cached_tokens"] in ((t2["usage"]["prompt_tokens"] // block) * block, chain2 * block)


async def test_the_sessions_summary_carries_each_open_sessions_footprint(
    live: LiveServer, tiny_engine: LLMEngine
) -> None:
    block = tiny_engine.info.block_size
    _, admin_b = await second_tenant(live)
    async with connect(live) as ws1, connect(live) as ws2, httpx.AsyncClient(base_url=live.http) as http:
        one, two = Chat(ws1), Chat(ws2)
        s1, s2 = await one.hello(CHAT_TOKEN), await two.hello(CHAT_TOKEN)
        t1 = await one.turn(PARCEL)
        await two.turn(KETTLE)
        closed = await http.post(f"/admin/sessions/{s2}/status", headers=A, json={"status": "closed"})
        assert closed.status_code == 200, closed.text
        summary = await http.get("/admin/sessions/summary?limit=10", headers=A)
        assert summary.status_code == 200, summary.text
        listed = (await http.get("/admin/sessions?limit=10", headers=A)).json()
        others = (await http.get("/admin/sessions/summary", headers={"X-API-Key": admin_b})).json()
    chain1 = chain_blocks(t1["usage"]["prompt_tokens"], t1["usage"]["completion_tokens"], block)
    rows = summary.json()
    # the list's rows, in its order, each with the footprint the detail route reports; none for a closed session
    assert [{k: v for k, v in r.items() if k != "cache_footprint"} for r in rows] == listed
    assert {r["id"]: r["cache_footprint"] for r in rows} == {
        s1: {"blocks": chain1, "tokens": chain1 * block},
        s2: None,
    }
    assert others == []  # another tenant's admin sees none of these


async def test_flushing_a_tenant_frees_its_cache_and_not_another_tenants(
    live: LiveServer, tiny_engine: LLMEngine
) -> None:
    block = tiny_engine.info.block_size
    chat_b, admin_b = await second_tenant(live)
    question = "Hello there, what are your opening hours on public holidays this year?"
    async with connect(live) as ws, httpx.AsyncClient(base_url=live.http) as http:
        one = Chat(ws)
        s1 = await one.hello(CHAT_TOKEN)
        t1 = await one.turn(PARCEL)
        first_a = await completion(live, CHAT_TOKEN, question)
        first_b = await completion(live, chat_b, question)
        full = (first_a["prompt_tokens"] - 1) // block * block  # a repeat hits every prompt block but the last token's
        assert (await completion(live, CHAT_TOKEN, question))["prompt_tokens_details"]["cached_tokens"] == full
        cached_before = tiny_engine.stats().kv.num_cached_blocks

        flushed = await http.post("/admin/tenant/flush", headers=A)
        assert flushed.status_code == 200, flushed.text
        freed = flushed.json()["blocks_freed"]
        cached_after = tiny_engine.stats().kv.num_cached_blocks
        assert freed == cached_before - cached_after
        assert freed >= chain_blocks(t1["usage"]["prompt_tokens"], t1["usage"]["completion_tokens"], block)
        assert flushed.json() == {**IN_PROCESS, "blocks_freed": freed, "tokens_freed": freed * block}
        assert (await http.post("/admin/tenant/flush", headers=A)).json() == {
            **IN_PROCESS,
            "blocks_freed": 0,
            "tokens_freed": 0,
        }
        audit = (await http.get("/admin/audit", headers=A)).json()
        assert [(r["action"], r["detail"]) for r in audit[:2]] == [
            ("tenant.flush", "freed 0 blocks (0 tokens) of the tenant's whole namespace"),
            ("tenant.flush", f"freed {freed} blocks ({freed * block} tokens) of the tenant's whole namespace"),
        ]

        detail = (await http.get(f"/admin/sessions/{s1}/detail", headers=A)).json()
        assert detail["cache_footprint"] == {"blocks": 0, "tokens": 0}
        assert detail["session"]["status"] == "bot_active"
        tenant_id = (await http.get("/admin/tenant", headers=A)).json()["id"]
        async with db_session(live) as db:
            rows = await db.execute(
                select(InvalidationEvent).where(InvalidationEvent.tenant_id == tenant_id).order_by(InvalidationEvent.id)
            )
            events = [(e.session_id, e.reason, e.actor, e.blocks_freed) for e in rows.scalars()]
        assert events == [(None, "admin_flush", "admin", freed), (None, "admin_flush", "admin", 0)]
        # A's repeat starts cold; B's repeat still hits its whole cached prompt
        repeat_a = await completion(live, CHAT_TOKEN, question)
        repeat_b = await completion(live, chat_b, question)
        assert repeat_a["prompt_tokens_details"]["cached_tokens"] == 0
        assert repeat_b["prompt_tokens_details"]["cached_tokens"] == (first_b["prompt_tokens"] - 1) // block * block
        assert (await one.turn("Any news?"))["usage"]["cached_tokens"] == 0
        # B's own flush frees B's blocks only: A's just-recomputed ones stay
        before_b = tiny_engine.stats().kv.num_cached_blocks
        flushed_b = (await http.post("/admin/tenant/flush", headers={"X-API-Key": admin_b})).json()
        assert flushed_b["blocks_freed"] >= (first_b["prompt_tokens"] - 1) // block
        assert tiny_engine.stats().kv.num_cached_blocks == before_b - flushed_b["blocks_freed"]
        assert (await completion(live, CHAT_TOKEN, question))["prompt_tokens_details"]["cached_tokens"] == full


async def test_session_detail_has_blocks_temperatures_events_and_footprint(
    live: LiveServer, tiny_engine: LLMEngine
) -> None:
    block = tiny_engine.info.block_size
    _, admin_b = await second_tenant(live)
    async with connect(live) as ws:
        one = Chat(ws)
        s1 = await one.hello(CHAT_TOKEN)
        await one.turn(PARCEL)
        t2 = await one.turn(KETTLE)  # another topic: a shift, and epoch 0 leaves the prompt
    async with httpx.AsyncClient(base_url=live.http) as http:
        resp = await http.get(f"/admin/sessions/{s1}/detail", headers=A)
        other = await http.get(f"/admin/sessions/{s1}/detail", headers={"X-API-Key": admin_b})
    assert resp.status_code == 200, resp.text
    assert (other.status_code, other.json()["code"]) == (404, "session_not_found")
    got = resp.json()
    async with db_session(live) as db:
        blocks = await context_store.load_blocks(db, s1)
        topics = list(
            (
                await db.execute(select(TopicHistory).where(TopicHistory.session_id == s1).order_by(TopicHistory.id))
            ).scalars()
        )

    assert got["session"]["id"] == s1
    assert got["pinned_context"] == ""
    assert [(m["seq"], m["role"]) for m in got["messages"]] == [
        (1, "user"),
        (2, "assistant"),
        (3, "user"),
        (4, "assistant"),
    ]
    assert [m["content"] for m in got["messages"]][::2] == [PARCEL, KETTLE]
    expected_blocks = {
        seq: [
            {
                "index": b.key.index,
                "type": b.type.value,
                "start": b.start,
                "end": b.end,
                "parent": None if b.parent is None else {"seq": b.parent.seq, "index": b.parent.index},
            }
            for b in blocks
            if b.key.seq == seq
        ]
        for seq in (1, 2, 3, 4)
    }
    assert {m["seq"]: m["blocks"] for m in got["messages"]} == expected_blocks
    first = got["messages"][0]
    identifiers = [PARCEL[b["start"] : b["end"]] for b in first["blocks"] if b["type"] == "identifier"]
    assert any("#4061234567" in text for text in identifiers), first["blocks"]

    assert got["temperature_history"] == [
        {
            "seq": t.message_seq,
            "similarity": t.similarity,
            "temperature": t.temperature,
            "shift": t.shift,
            "epoch": t.topic_epoch,
            "section": [],  # the tenant has no handbook
        }
        for t in topics
    ]
    points = [(t["seq"], t["similarity"], t["temperature"], t["shift"], t["epoch"]) for t in got["temperature_history"]]
    assert points[0] == (1, None, 0.8, False, 0)  # a new topic starts at 0.8
    assert (points[1][0], *points[1][2:]) == (3, 0.3, True, 1)  # the kettle: a shift to 0.3 and epoch 1
    assert [(e["reason"], e["actor"]) for e in got["invalidation_events"]] == [("epoch_dropped", "system")]
    chain = chain_blocks(t2["usage"]["prompt_tokens"], t2["usage"]["completion_tokens"], block)
    assert got["cache_footprint"] == {"blocks": chain, "tokens": chain * block}
