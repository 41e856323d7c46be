"""The tenant's handbook through a real server on Postgres: a load, the section a topic gets (``topic.section`` in
``message.completed`` and the session detail), two sessions sharing the section's cached blocks, an edit that frees
exactly the blocks holding the old text (and audits the version), and clear 422s for a bad handbook."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_admin_cache import A, connect

from backend.context.handbook import Section
from backend.services import handbook
from backend.services.tenants import DEFAULT_SYSTEM_PROMPT
from engine.llm_engine import LLMEngine
from support.server import CHAT_TOKEN, LiveServer, server_settings, serving
from support.ws_chat import Chat

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

RETURNS = "Items can be returned within 30 days for a refund. A damaged or broken item: ask for a photo, then refund."
SHIPPING = "Standard shipping takes 3 to 5 business days. Give the tracking number and the carrier's estimate."
HANDBOOK = f"# Returns and refunds\n{RETURNS}\n\n# Shipping and delivery\n{SHIPPING}\n"
REFUND_Q = "Hi, I want a refund: the blender I bought arrived broken."
SHIPPING_Q = "How long does shipping take, and where is my tracking number?"


async def _load(http: httpx.AsyncClient, content: str, fmt: str = "markdown") -> httpx.Response:
    return await http.put("/admin/tenant/handbook", headers=A, json={"format": fmt, "content": content})


async def _turn(live: LiveServer, text: str) -> tuple[str, dict[str, Any]]:
    async with connect(live) as ws:
        chat = Chat(ws)
        session = await chat.hello(CHAT_TOKEN)
        return session, await chat.turn(text)


def _through_section(live: LiveServer, title: str, text: str) -> int:
    """Full-block tokens of ``[system][section]``: what a second session on the section finds cached."""
    ids, _ = handbook._section_ids(live.state.engine, DEFAULT_SYSTEM_PROMPT, "", [Section(title, text)])
    block = live.state.engine.info.block_size
    return len(ids) // block * block


async def test_a_bad_handbook_is_refused_and_nothing_is_stored(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        not_json = await _load(http, "{", "abcd")
        empty = await _load(http, "  ")
        twice = await _load(http, "# A\nx\n# A\ny\n")
        bad_format = await _load(http, "# A\nx", "docx")
        after = (await http.get("/admin/tenant/handbook", headers=A)).json()
    assert (not_json.status_code, not_json.json()["code"]) == (422, "invalid_handbook")
    assert not_json.json()["detail"].startswith("the handbook is not valid JSON")
    assert (empty.status_code, empty.json()["code"]) == (422, "invalid_handbook")
    assert twice.json()["detail"] == "section 2: the title 'A' is used twice; titles name sections"
    assert (bad_format.status_code, bad_format.json()["code"]) == (422, "invalid_request")
    assert after == {"version": 0, "sections": []}


async def test_a_topic_gets_its_section_shared_by_sessions_and_an_edit_frees_exactly_its_blocks(
    live: LiveServer,
) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        loaded = await _load(http, HANDBOOK)
        assert loaded.status_code == 200, loaded.text
        assert {k: loaded.json()[k] for k in ("version", "sections", "added")} == {
            "version": 1,
            "sections": 2,
            "added": ["Returns and refunds", "Shipping and delivery"],
        }
        s1, first = await _turn(live, REFUND_Q)
        assert first["topic"]["section"] == ["Returns and refunds"]
        detail = (await http.get(f"/admin/sessions/{s1}/detail", headers=A)).json()
        assert detail["section"] == ["Returns and refunds"]
        assert detail["temperature_history"][0]["section"] == ["Returns and refunds"]

        # A second session on the same section finds [system][section] cached; one on the other section does not.
        _, second = await _turn(live, REFUND_Q + " Order 302-1234567.")
        shared = _through_section(live, "Returns and refunds", RETURNS)
        assert second["usage"]["cached_tokens"] >= shared
        _, other = await _turn(live, SHIPPING_Q)
        assert other["topic"]["section"] == ["Shipping and delivery"]
        assert other["usage"]["cached_tokens"] < shared

        # An edit of the returns section frees its blocks and what follows them; the shipping session keeps its.
        engine = live.state.engine
        cached_before = engine.stats().kv.num_cached_blocks
        edited = await http.patch(
            "/admin/tenant/handbook/section", headers=A, json={"title": "Returns and refunds", "text": "60 days now."}
        )
        assert edited.status_code == 200, edited.text
        body = edited.json()
        assert (body["version"], body["changed"], body["kept"]) == (2, ["Returns and refunds"], 1)
        assert body["blocks_freed"] > 0
        assert engine.stats().kv.num_cached_blocks == cached_before - body["blocks_freed"]
        audit = (await http.get("/admin/audit", headers=A)).json()
        row = next(r for r in audit if r["action"] == "tenant.handbook" and "v2" in (r["detail"] or ""))
        assert row["detail"].startswith("handbook v2: 1 changed, 0 added, 0 removed, 1 kept; freed ")

        _, again = await _turn(live, REFUND_Q)
        assert again["usage"]["cached_tokens"] < shared  # the old text is gone from the cache
        _, shipping_again = await _turn(live, SHIPPING_Q)
        assert shipping_again["usage"]["cached_tokens"] >= _through_section(live, "Shipping and delivery", SHIPPING)
        listed = (await http.get("/admin/tenant/handbook", headers=A)).json()
        assert [(s["title"], s["version"]) for s in listed["sections"]] == [
            ("Returns and refunds", 2),
            ("Shipping and delivery", 1),
        ]


def test_a_fresh_install_gives_the_default_tenant_the_builtin_handbook(
    pg_url: str, tmp_path: Path, tiny_engine: LLMEngine
) -> None:
    with serving(server_settings(pg_url, tmp_path, default_handbook="builtin"), tiny_engine) as live:
        listed = httpx.get(f"{live.http}/admin/tenant/handbook", headers=A).json()
    assert listed["version"] == 1
    assert [s["title"] for s in listed["sections"]] == [
        "Returns and refunds",
        "Shipping and delivery",
        "Order status and changes",
        "Account and password",
        "Talking to a person",
    ]


ABCD_HANDBOOK = {
    "Product Defect": {
        "description": "refunds and returns",
        "subflows": {
            "Initiate Refund": {
                "instructions": ["Ask for the refund reason."],
                "actions": [{"text": "Pull up the account.", "subtext": []}],
                "examples": ["I want my money back for the jacket", "refund please, the zipper broke"],
            },
            "Refund Status": {
                "instructions": ["Look up the refund."],
                "actions": [{"text": "Validate the purchase.", "subtext": []}],
                "examples": ["has my refund gone through yet", "where is the money you owe me"],
            },
        },
    },
    "Account Access": {
        "description": "logging in",
        "subflows": {
            "Reset Password": {
                "instructions": ["Send the reset link."],
                "actions": [{"text": "Verify the identity.", "subtext": []}],
                "examples": ["I forgot my password", "cannot log in to my account"],
            },
        },
    },
}


async def test_a_handbook_with_examples_ranks_with_its_group_classifier_on_the_server(live: LiveServer) -> None:
    """ABCD-style sections with example questions: the server fits the handbook's group classifier when it indexes
    the version, and a customer's request gets the section its examples describe."""
    async with httpx.AsyncClient(base_url=live.http) as http:
        loaded = await _load(http, json.dumps(ABCD_HANDBOOK), "abcd")
        assert loaded.status_code == 200, loaded.text
        _, refund = await _turn(live, "Hi, the zipper on my jacket broke and I want my money back.")
        _, password = await _turn(live, "I forgot my password and cannot log in.")
        tenant_id = (await http.get("/admin/tenant", headers=A)).json()["id"]
    assert refund["topic"]["section"][:1] == ["Product Defect: Initiate Refund"]
    assert password["topic"]["section"][:1] == ["Account Access: Reset Password"]
    index = live.state.chat.context.handbook_index(tenant_id)
    assert index is not None and index.groups_fitted
