"""The admin audit trail through a real server on Postgres, two tenants: every admin write action is recorded with
its actor (the admin key's prefix), target and result (``ok`` or the error's code); reads are not; a tenant pages
through its own rows only."""

from __future__ import annotations

import re

import httpx
import pytest
from test_admin_cache import A, connect, second_tenant

from backend.core.security import display_prefix
from support.server import ADMIN_KEY, CHAT_TOKEN, LiveServer
from support.ws_chat import Chat

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

ACTOR = display_prefix(ADMIN_KEY)
RULE = {"name": "zx_ticket", "pattern": r"ZX-\d{4}", "block_type": "section", "priority": 500}
SETTINGS = {
    "history_policy": "budget",
    "shift_threshold": 0.2,
    "start_temperature": 0.8,
    "shift_temperature": 0.3,
    "min_block_length": 8,
    "similarity_backend": "tfidf",
}


async def test_every_admin_write_is_audited_with_its_result(live: LiveServer) -> None:
    _, admin_b = await second_tenant(live)
    async with connect(live) as ws:
        session_id = await Chat(ws).hello(CHAT_TOKEN)
    missing = "00000000-0000-0000-0000-000000000000"
    async with httpx.AsyncClient(base_url=live.http) as http:
        rule_id = (await http.post("/admin/rules", headers=A, json=RULE)).json()["id"]
        calls = [
            ("POST", f"/admin/sessions/{session_id}/flush", None, 200),
            ("POST", f"/admin/sessions/{missing}/flush", None, 404),
            ("PUT", f"/admin/sessions/{session_id}/context", {"pinned_context": "VIP"}, 200),
            ("POST", f"/admin/sessions/{session_id}/status", {"status": "resolved"}, 200),
            ("POST", "/admin/rules", {**RULE, "pattern": "x*"}, 422),
            ("PUT", f"/admin/rules/{rule_id}", {**RULE, "enabled": False}, 200),
            ("DELETE", f"/admin/rules/{rule_id}", None, 204),
            ("PUT", "/admin/tenant/context-settings", SETTINGS, 200),
            ("PUT", "/admin/tenant/context-settings", {**SETTINGS, "shift_threshold": 2}, 422),
            ("PUT", "/admin/tenant/system-prompt", {"system_prompt": "Be brief."}, 200),
            ("PUT", "/admin/tenant/cache", {"cache_scope": "private", "pin_prefix": False}, 200),
            ("PUT", "/admin/tenant/cache", {"cache_scope": "public", "pin_prefix": True}, 422),
            ("PUT", "/admin/tenant/policy-text", {"policy_text": "Refunds within 30 days."}, 200),
            ("POST", "/admin/tenant/keys/rotate", {"kind": "chat"}, 200),
            ("POST", f"/admin/tenant/keys/{missing}/revoke", None, 404),
            ("POST", "/admin/tenant/flush", None, 200),
            ("DELETE", f"/admin/sessions/{session_id}", None, 200),
            # reads are not audited
            ("GET", "/admin/sessions", None, 200),
            ("GET", "/admin/rules", None, 200),
        ]
        for method, path, body, expected in calls:
            resp = await http.request(method, path, headers=A, json=body)
            assert resp.status_code == expected, (method, path, resp.text)
        await http.post("/admin/tenant/flush", headers={"X-API-Key": "kvc_admin_wrong"})  # 401: no tenant to file it
        await http.post("/admin/tenant/flush", headers={"X-API-Key": admin_b})
        rows = (await http.get("/admin/audit", headers=A, params={"limit": 1000})).json()
        page = (await http.get("/admin/audit", headers=A, params={"limit": 3, "offset": 2})).json()
        rows_b = (await http.get("/admin/audit", headers={"X-API-Key": admin_b})).json()

    assert [(r["action"], r["target"], r["result"]) for r in reversed(rows)] == [
        ("rule.create", None, "ok"),
        ("session.flush", session_id, "ok"),
        ("session.flush", missing, "session_not_found"),
        ("session.context", session_id, "ok"),
        ("session.status", session_id, "ok"),
        ("rule.create", None, "invalid_rule"),
        ("rule.update", str(rule_id), "ok"),
        ("rule.delete", str(rule_id), "ok"),
        ("tenant.context_settings", None, "ok"),
        ("tenant.context_settings", None, "invalid_request"),
        ("tenant.system_prompt", None, "ok"),
        ("tenant.cache", None, "ok"),
        ("tenant.cache", None, "invalid_cache_settings"),
        ("tenant.policy_text", None, "ok"),
        ("key.rotate", None, "ok"),
        ("key.revoke", missing, "key_not_found"),
        ("tenant.flush", None, "ok"),
        ("session.delete", session_id, "ok"),
    ]
    assert {r["actor"] for r in rows} == {ACTOR}
    details = {r["action"]: r["detail"] for r in rows if r["result"] == "ok"}
    assert details["session.delete"].startswith("erased ") and "disk blocks" in details["session.delete"]
    assert details["tenant.policy_text"].startswith("freed ") and details["tenant.policy_text"].endswith(" blocks")
    assert details["session.flush"] == "freed 0 blocks (0 tokens) of the session"  # the session had no turn yet
    assert re.fullmatch(r"freed (\d+) blocks \((\d+) tokens\) of the tenant's whole namespace", details["tenant.flush"])
    assert page == rows[2:5]
    assert [(r["action"], r["result"], r["actor"]) for r in rows_b] == [("tenant.flush", "ok", display_prefix(admin_b))]
