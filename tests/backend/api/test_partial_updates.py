"""Every settings route takes a partial update (issue 45): ``PATCH`` changes the fields it names, the others keep their
value, a bad value is a 422 naming the field and changes nothing, and each change is audited like a ``PUT``. A real
server on Postgres."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from support.server import ADMIN_KEY, LiveServer

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]
A = {"X-API-Key": ADMIN_KEY}


async def _audit(http: httpx.AsyncClient, n: int) -> list[tuple[str, str | None, str, str]]:
    rows = (await http.get("/admin/audit", headers=A)).json()[:n]
    return [(r["action"], r["target"], r["result"], r["actor"]) for r in rows]


async def test_reply_settings_patch_keeps_the_other_fields(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        before = (await http.get("/admin/tenant/reply-settings", headers=A)).json()
        patched = await http.patch("/admin/tenant/reply-settings", headers=A, json={"top_k": 40, "stop": ["END"]})
        bad = await http.patch("/admin/tenant/reply-settings", headers=A, json={"temperature": 3})
        null = await http.patch("/admin/tenant/reply-settings", headers=A, json={"temperature": None})
        unknown = await http.patch("/admin/tenant/reply-settings", headers=A, json={"temprature": 1})
        after = (await http.get("/admin/tenant/reply-settings", headers=A)).json()
        audit = await _audit(http, 4)
    assert patched.status_code == 200
    expected = before | {"top_k": 40, "stop": ["END"], "source": "tenant"}
    assert patched.json() == expected == after
    assert (bad.status_code, bad.json()) == (
        422,
        {"detail": "temperature: Input should be less than or equal to 2", "code": "invalid_request"},
    )
    assert (null.status_code, null.json()["detail"]) == (422, "temperature: Input should be a valid number")
    assert (unknown.status_code, unknown.json()["detail"]) == (422, "temprature: Extra inputs are not permitted")
    refused = ("tenant.reply_settings", None, "invalid_request", ADMIN_KEY[:12])
    assert audit == [refused] * 3 + [("tenant.reply_settings", None, "ok", ADMIN_KEY[:12])]  # newest first


async def test_context_settings_patch(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        before = (await http.get("/admin/tenant/context-settings", headers=A)).json()
        patched = await http.patch("/admin/tenant/context-settings", headers=A, json={"history_policy": "full"})
        bad = await http.patch("/admin/tenant/context-settings", headers=A, json={"min_block_length": 0})
        after = (await http.get("/admin/tenant/context-settings", headers=A)).json()
    assert patched.json() == before | {"history_policy": "full"} == after
    assert (bad.status_code, bad.json()["detail"]) == (
        422,
        "min_block_length: Input should be greater than or equal to 1",
    )


async def test_tenant_cache_patch(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        patched = await http.patch("/admin/tenant/cache", headers=A, json={"replica_erase": "reset_cache"})
        after = (await http.get("/admin/tenant/cache", headers=A)).json()
    assert patched.status_code == 200
    assert (after["cache_scope"], after["pin_prefix"], after["replica_erase"]) == ("private", False, "reset_cache")


async def test_a_tool_and_a_rule_patch_keep_the_rest(live: LiveServer) -> None:
    tool: dict[str, Any] = {
        "name": "lookup_order",
        "parameters": {"type": "object", "properties": {}},
        "url": "https://shop.example/api/orders",
        "secret_header": "X-Shop-Key",
        "secret": "s3cret",
    }
    rule = {"name": "order_no", "pattern": "#[0-9]{6,}", "block_type": "identifier", "priority": 5}
    async with httpx.AsyncClient(base_url=live.http) as http:
        assert (await http.post("/admin/tools", headers=A, json=tool)).status_code == 201
        off = await http.patch("/admin/tools/lookup_order", headers=A, json={"enabled": False})
        renamed = await http.patch("/admin/tools/lookup_order", headers=A, json={"timeout_s": 99})
        created = await http.post("/admin/rules", headers=A, json=rule)
        rule_id = created.json()["id"]
        disabled = await http.patch(f"/admin/rules/{rule_id}", headers=A, json={"enabled": False})
        global_id = next(r["id"] for r in (await http.get("/admin/rules", headers=A)).json() if r["scope"] == "global")
        read_only = await http.patch(f"/admin/rules/{global_id}", headers=A, json={"enabled": False})
    assert off.status_code == 200
    assert (off.json()["enabled"], off.json()["has_secret"], off.json()["url"]) == (
        False,
        True,
        "https://shop.example/api/orders",
    )
    assert (renamed.status_code, renamed.json()["detail"]) == (
        422,
        "timeout_s: Input should be less than or equal to 30",
    )
    assert disabled.status_code == 200
    assert {k: disabled.json()[k] for k in (*rule, "enabled")} == rule | {"enabled": False}
    assert read_only.status_code == 403, read_only.json()


async def test_operator_cache_settings_take_a_patch(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        patched = await http.patch("/admin/cache/settings", json={"memory_ttl_s": 120})
    assert (patched.status_code, patched.json()["memory_ttl_s"]) == (200, 120)
