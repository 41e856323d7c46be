"""Admin splitter rules and context settings through a real server on Postgres, two tenants: a tenant lists the
global rules read-only and its own, adds, edits, disables, shadows and deletes its own; a bad rule is a 422 with the
reason; the chat uses a change from the next message; settings are validated and per tenant."""

from __future__ import annotations

import httpx
import pytest
from test_admin_cache import A, connect, second_tenant

from backend.context.rules import DEFAULT_RULES
from backend.services import context_store
from support.server import CHAT_TOKEN, LiveServer, db_session
from support.ws_chat import Chat

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TICKET = "Please look at ZX-1234 for me, it is still open today."
ZX_RULE = {"name": "zx_ticket", "pattern": r"ZX-\d{4}", "block_type": "section", "priority": 500}
DEFAULT_SETTINGS = {
    "history_policy": "epoch",
    "shift_threshold": 0.78,  # the default scorer's tuned threshold (backend/context/topic.py)
    "start_temperature": 0.8,
    "shift_temperature": 0.3,
    "min_block_length": 8,
    "similarity_backend": "clf-static",
}


async def _block_types(http: httpx.AsyncClient, session_id: str, seq: int) -> list[str]:
    detail = (await http.get(f"/admin/sessions/{session_id}/detail", headers=A)).json()
    return [b["type"] for m in detail["messages"] if m["seq"] == seq for b in m["blocks"]]


async def test_bad_rules_are_refused_with_the_reason(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        broken = await http.post("/admin/rules", headers=A, json={**ZX_RULE, "pattern": "(ZX"})
        empty = await http.post("/admin/rules", headers=A, json={**ZX_RULE, "pattern": "x*"})
        lookahead = await http.post("/admin/rules", headers=A, json={**ZX_RULE, "pattern": "(?=foo)"})
        bad_type = await http.post("/admin/rules", headers=A, json={**ZX_RULE, "block_type": "poem"})
        listed = (await http.get("/admin/rules", headers=A)).json()
    assert (broken.status_code, broken.json()["code"]) == (422, "invalid_rule")
    assert broken.json()["detail"] == "rule 'zx_ticket' refused: not RE2 syntax: missing ): (ZX"
    assert (lookahead.status_code, lookahead.json()["code"]) == (422, "invalid_rule")
    assert lookahead.json()["detail"] == (
        "rule 'zx_ticket' refused: not RE2 syntax: invalid perl operator: (?= "
        "(RE2 has no lookarounds or backreferences)"
    )
    assert (empty.status_code, empty.json()["code"]) == (422, "invalid_rule")
    assert empty.json()["detail"] == "rule 'zx_ticket' refused: can match the empty string (at 0 in '')"
    assert (bad_type.status_code, bad_type.json()["code"]) == (422, "invalid_request")
    assert [r["scope"] for r in listed] == ["global"] * len(DEFAULT_RULES)  # nothing was stored


async def test_a_tenant_manages_its_own_rules_and_reads_the_global_ones(live: LiveServer) -> None:
    _, admin_b = await second_tenant(live)
    b = {"X-API-Key": admin_b}
    async with httpx.AsyncClient(base_url=live.http) as http:
        globals_ = (await http.get("/admin/rules", headers=A)).json()
        assert sorted(r["name"] for r in globals_) == sorted(r.name for r in DEFAULT_RULES)
        created = await http.post("/admin/rules", headers=A, json=ZX_RULE)
        assert created.status_code == 201, created.text
        rule = created.json()
        assert {k: rule[k] for k in ("scope", "name", "pattern", "block_type", "priority", "language", "enabled")} == {
            **ZX_RULE,
            "scope": "tenant",
            "language": "any",
            "enabled": True,
        }
        duplicate = await http.post("/admin/rules", headers=A, json=ZX_RULE)
        assert (duplicate.status_code, duplicate.json()["code"]) == (409, "rule_exists")

        # B sees only the global rules and cannot reach A's
        assert (await http.get("/admin/rules", headers=b)).json() == globals_
        for method in ("PUT", "DELETE"):
            resp = await http.request(method, f"/admin/rules/{rule['id']}", headers=b, json=ZX_RULE)
            assert (resp.status_code, resp.json()["code"]) == (404, "rule_not_found"), method
        # a global rule is read-only: shadow it by name instead
        question = next(r for r in globals_ if r["name"] == "question_en")
        read_only = await http.put(f"/admin/rules/{question['id']}", headers=A, json=ZX_RULE)
        assert (read_only.status_code, read_only.json()["code"]) == (403, "rule_read_only")
        gone = await http.delete(f"/admin/rules/{question['id']}", headers=A)
        assert (gone.status_code, gone.json()["code"]) == (403, "rule_read_only")
        shadow = {**{k: question[k] for k in ("name", "pattern", "block_type", "priority")}, "enabled": False}
        assert (await http.post("/admin/rules", headers=A, json=shadow)).status_code == 201

        edited = await http.put(f"/admin/rules/{rule['id']}", headers=A, json={**ZX_RULE, "priority": 600})
        assert (edited.status_code, edited.json()["priority"], edited.json()["id"]) == (200, 600, rule["id"])
        bad_edit = await http.put(f"/admin/rules/{rule['id']}", headers=A, json={**ZX_RULE, "pattern": "|"})
        assert (bad_edit.status_code, bad_edit.json()["code"]) == (422, "invalid_rule")
        listed = (await http.get("/admin/rules", headers=A)).json()
        assert [(r["scope"], r["name"], r["enabled"]) for r in listed if r["scope"] == "tenant"] == [
            ("tenant", "question_en", False),
            ("tenant", "zx_ticket", True),
        ]
        tenant_id = (await http.get("/admin/tenant", headers=A)).json()["id"]
        async with db_session(live) as db:
            used = {r.name: r for r in await context_store.load_rules(db, tenant_id)}
        assert "question_en" not in used  # shadowed by the disabled tenant rule
        assert used["zx_ticket"].priority == 600

        deleted = await http.delete(f"/admin/rules/{rule['id']}", headers=A)
        assert deleted.status_code == 204
        missing = await http.delete(f"/admin/rules/{rule['id']}", headers=A)
        assert (missing.status_code, missing.json()["code"]) == (404, "rule_not_found")
        assert [r["name"] for r in (await http.get("/admin/rules", headers=A)).json() if r["scope"] == "tenant"] == [
            "question_en"
        ]


async def test_the_chat_uses_a_changed_rule_from_the_next_message(live: LiveServer) -> None:
    async with connect(live) as ws, httpx.AsyncClient(base_url=live.http) as http:
        one = Chat(ws)
        session_id = await one.hello(CHAT_TOKEN)
        await one.turn(TICKET, "a")
        assert await _block_types(http, session_id, 1) == ["context"]
        rule = (await http.post("/admin/rules", headers=A, json=ZX_RULE)).json()
        await one.turn(TICKET, "b")
        assert await _block_types(http, session_id, 3) == ["section"]
        disabled = await http.put(f"/admin/rules/{rule['id']}", headers=A, json={**ZX_RULE, "enabled": False})
        assert disabled.json()["enabled"] is False
        await one.turn(TICKET, "c")
        assert await _block_types(http, session_id, 5) == ["context"]


async def test_context_settings_are_validated_and_per_tenant(live: LiveServer) -> None:
    _, admin_b = await second_tenant(live)
    wanted = {**DEFAULT_SETTINGS, "history_policy": "full", "start_temperature": 0.6, "min_block_length": 4}
    async with httpx.AsyncClient(base_url=live.http) as http:
        assert (await http.get("/admin/tenant/context-settings", headers=A)).json() == DEFAULT_SETTINGS
        put = await http.put("/admin/tenant/context-settings", headers=A, json=wanted)
        assert (put.status_code, put.json()) == (200, wanted)
        assert (await http.get("/admin/tenant/context-settings", headers=A)).json() == wanted
        other = await http.get("/admin/tenant/context-settings", headers={"X-API-Key": admin_b})
        assert other.json() == DEFAULT_SETTINGS
        for bad in (
            {**wanted, "shift_threshold": 1.5},
            {**wanted, "history_policy": "everything"},
            {**wanted, "similarity_backend": "bm25"},
            {**wanted, "min_block_length": 0},
            {k: v for k, v in wanted.items() if k != "history_policy"},
        ):
            resp = await http.put("/admin/tenant/context-settings", headers=A, json=bad)
            assert (resp.status_code, resp.json()["code"]) == (422, "invalid_request"), bad
        assert (await http.get("/admin/tenant/context-settings", headers=A)).json() == wanted
    # the next message uses them: a new topic starts at the tenant's start temperature
    async with connect(live) as ws, httpx.AsyncClient(base_url=live.http) as http:
        one = Chat(ws)
        session_id = await one.hello(CHAT_TOKEN)
        await one.turn(TICKET, "a")
        detail = (await http.get(f"/admin/sessions/{session_id}/detail", headers=A)).json()
    assert [(t["seq"], t["temperature"], t["epoch"]) for t in detail["temperature_history"]] == [(1, 0.6, 0)]
