"""Tools in the chat, end to end on a real server (Postgres, the tiny model): the tenant registers an HTTP tool on
loopback and requires a call (a grammar holds the model to one), the bot calls it, and the customer's reply carries
the tool's data, never the call's text; a tool that times out, answers garbage or fails gives the graceful reply and
an audit row; the call and result are stored with the reply, so the next turn's prompt extends the cached one.

NOTE: the tiny random model writes noise around the forced call; the reply carries the order's data through the
``Details:`` line (``backend/chat/tool_facts.py``), as every tool reply does. ``test_ws_tools_smollm2.py`` runs the
lookup with the real model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from sqlalchemy import select
from test_ws_chat import Chat

from backend.chat.tool_turn import GRACEFUL_REPLY
from backend.db.models import AdminAudit, Message
from engine.llm_engine import LLMEngine
from support.server import ADMIN_KEY, LiveServer, db_session, server_settings, serving
from support.tool_endpoint import ORDER, ToolServer, tool_server

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

A = {"X-API-Key": ADMIN_KEY}
ORDER_DETAILS = "Details: order id: A1234; status: shipped; carrier: DHL; eta: 2026-05-03."
ARGS = {
    "type": "object",
    "properties": {"order_id": {"type": "string", "pattern": "^[A-Z][0-9]{4}$"}},
    "required": ["order_id"],
}


@pytest.fixture
def endpoint() -> Iterator[ToolServer]:
    with tool_server(slow_s=2.0) as server:
        yield server


@pytest.fixture
def live(pg_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    settings = server_settings(pg_url, tmp_path, reply_max_tokens=64, tools_allow_private_networks=True)
    with serving(settings, tiny_engine) as server:
        yield server


async def register(live: LiveServer, url: str, tool_use: str = "required", timeout_s: float = 3.0) -> None:
    tool = {
        "name": "lookup_order",
        "description": "Find an order by its number.",
        "parameters": ARGS,
        "url": url,
        "secret_header": "X-Shop-Key",
        "secret": "s3cret",
        "timeout_s": timeout_s,
    }
    async with httpx.AsyncClient(base_url=live.http) as http:
        assert (await http.post("/admin/tools", headers=A, json=tool)).status_code == 201
        settings = {"temperature": 0.0, "repetition_penalty": 1.2, "tool_use": tool_use}
        assert (await http.put("/admin/tenant/reply-settings", headers=A, json=settings)).status_code == 200
        # NOTE: the whole history, so that no topic shift drops the first turn from the second turn's prompt
        context = (await http.get("/admin/tenant/context-settings", headers=A)).json() | {"history_policy": "full"}
        assert (await http.put("/admin/tenant/context-settings", headers=A, json=context)).status_code == 200


def deltas(frames: list[dict[str, Any]]) -> list[str]:
    return [f["text"] for f in frames if f["type"] == "message.delta"]


async def tool_audit(live: LiveServer) -> list[tuple[str, str, str | None, str]]:
    async with db_session(live) as db:
        rows = (await db.execute(select(AdminAudit).where(AdminAudit.action == "tool.call"))).scalars().all()
    return [(r.actor, r.action, r.target, r.result) for r in rows]


async def replies(live: LiveServer) -> list[Message]:
    async with db_session(live) as db:
        rows = (await db.execute(select(Message).where(Message.role == "assistant").order_by(Message.seq))).scalars()
        return list(rows.all())


async def test_a_required_call_reaches_the_tool_and_the_reply_carries_its_data(
    live: LiveServer, endpoint: ToolServer
) -> None:
    await register(live, endpoint.url("/order"))
    async with websockets.connect(live.ws) as ws:
        chat = Chat(ws)
        session_id = (await chat.hello())["session_id"]
        frames, first = await chat.turn("1", "Where is my order A1234?")
        frames2, second = await chat.turn("2", "Thanks. Has order A1234 left the warehouse?")

    for fr, done in ((frames, first), (frames2, second)):
        assert done["status"] == "complete"
        assert "".join(deltas(fr)) == done["text"]  # what streamed is the reply
        assert not any("<tool_call>" in d or "</tool_call>" in d for d in deltas(fr))  # never the call's text
        assert done["text"].endswith("\n\n" + ORDER_DETAILS)  # the lookup's values, word for word
    # one POST per turn, the grammar's arguments, the tenant's secret and the bot's headers
    assert [r.path for r in endpoint.received] == ["/order", "/order"]
    for got in endpoint.received:
        assert set(got.body) == {"order_id"} and re.fullmatch(r"[A-Z][0-9]{4}", got.body["order_id"])
        assert got.headers["X-Shop-Key"] == "s3cret"
        assert (got.headers["X-Kvchat-Tool"], got.headers["X-Kvchat-Session"]) == ("lookup_order", session_id)
    assert await tool_audit(live) == [("bot", "tool.call", "lookup_order", "ok")] * 2
    # the call and the result are stored with the reply ...
    stored = await replies(live)
    assert [m.content for m in stored] == [first["text"], second["text"]]
    exchange = json.loads(stored[0].tool_exchange or "")
    (step,) = exchange["steps"]
    assert [c["name"] for c in step["calls"]] == ["lookup_order"]
    assert [json.loads(r) for r in step["results"]] == [ORDER]
    assert exchange["answer_from"] == 0  # nothing was shown before the call
    # ... so the second turn's prompt extends the first turn's last prompt (the results read): all of it is cached
    block = live.state.engine.info.block_size
    assert second["usage"]["cached_tokens"] >= first["usage"]["prompt_tokens"] // block * block


@pytest.mark.parametrize(
    ("path", "timeout_s", "outcome"),
    [("/slow", 0.5, "timeout"), ("/garbage", 3.0, "bad_response"), ("/fail", 3.0, "http_error")],
)
async def test_a_failing_tool_gives_the_graceful_reply_and_an_audit_row(
    live: LiveServer, endpoint: ToolServer, path: str, timeout_s: float, outcome: str
) -> None:
    await register(live, endpoint.url(path), timeout_s=timeout_s)
    async with websockets.connect(live.ws) as ws:
        chat = Chat(ws)
        await chat.hello()
        frames, done = await chat.turn("1", "Where is my order A1234?")
    assert (done["status"], done["text"]) == ("complete", GRACEFUL_REPLY)
    assert "".join(deltas(frames)) == GRACEFUL_REPLY
    assert [r.path for r in endpoint.received] == [path]
    assert await tool_audit(live) == [("bot", "tool.call", "lookup_order", outcome)]
    (stored,) = await replies(live)
    (step,) = json.loads(stored.tool_exchange or "")["steps"]
    assert step["results"] == [json.dumps({"error": outcome})]


async def test_tools_off_is_a_plain_reply(live: LiveServer, endpoint: ToolServer) -> None:
    await register(live, endpoint.url("/order"), tool_use="none")
    async with websockets.connect(live.ws) as ws:
        chat = Chat(ws)
        await chat.hello()
        frames, done = await chat.turn("1", "Where is my order A1234?")
    assert done["status"] == "complete"
    assert "".join(deltas(frames)) == done["text"]
    assert endpoint.received == []
    assert await tool_audit(live) == []
    (stored,) = await replies(live)
    assert stored.tool_exchange is None


async def test_the_settings_page_test_button_makes_one_audited_call(live: LiveServer, endpoint: ToolServer) -> None:
    await register(live, endpoint.url("/order"))
    async with httpx.AsyncClient(base_url=live.http) as http:
        tried = await http.post("/admin/tools/lookup_order/test", headers=A, json={"arguments": {"order_id": "A1234"}})
        failing = await http.post("/admin/tools/nope/test", headers=A, json={"arguments": {}})
    assert tried.status_code == 200
    body = tried.json()
    assert (body["outcome"], json.loads(body["content"])) == ("ok", ORDER)
    assert re.fullmatch(r"session admin-test: HTTP 200 in \d+ ms", body["detail"])
    (got,) = endpoint.received
    assert (got.body, got.headers["X-Shop-Key"], got.headers["X-Kvchat-Session"]) == (
        {"order_id": "A1234"},
        "s3cret",
        "admin-test",
    )
    assert (failing.status_code, failing.json()) == (404, {"detail": "no tool named 'nope'", "code": "tool_not_found"})
    assert await tool_audit(live) == [(ADMIN_KEY[:12], "tool.call", "lookup_order", "ok")]
