"""The tenant's tools through the admin API on a real server (Postgres): create, read, replace, delete; the secret is
write-only; names are unique per tenant; bad definitions are a 422 naming the problem; writes are audited; one
tenant never sees another's tools."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from test_admin_cache import A, second_tenant

from support.server import LiveServer

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

ARGS = {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}
TOOL = {
    "name": "lookup_order",
    "description": "Find an order by its number.",
    "parameters": ARGS,
    "url": "https://shop.example/api/orders",
    "secret_header": "X-Shop-Key",
    "secret": "s3cret",
    "timeout_s": 3.0,
}


def shown(tool: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in tool.items() if k not in ("created_at", "updated_at")}


async def test_create_read_replace_delete(live: LiveServer) -> None:
    _, admin_b = await second_tenant(live)
    expected = {k: v for k, v in TOOL.items() if k != "secret"} | {"has_secret": True, "enabled": True}
    async with httpx.AsyncClient(base_url=live.http) as http:
        created = await http.post("/admin/tools", headers=A, json=TOOL)
        assert (created.status_code, shown(created.json())) == (201, expected)
        assert [shown(t) for t in (await http.get("/admin/tools", headers=A)).json()] == [expected]
        assert (await http.get("/admin/tools", headers={"X-API-Key": admin_b})).json() == []
        again = await http.post("/admin/tools", headers=A, json=TOOL)
        assert (again.status_code, again.json()) == (
            409,
            {"detail": "a tool named 'lookup_order' exists already", "code": "tool_exists"},
        )
        renamed = {**TOOL, "name": "find_order", "enabled": False}
        del renamed["secret"]  # left out: the stored secret stays
        replaced = await http.put("/admin/tools/lookup_order", headers=A, json=renamed)
        assert (replaced.status_code, replaced.json()["name"], replaced.json()["has_secret"]) == (
            200,
            "find_order",
            True,
        )
        no_secret = {**renamed, "secret_header": None}
        assert (await http.put("/admin/tools/find_order", headers=A, json=no_secret)).json()["has_secret"] is False
        assert (await http.get("/admin/tools/find_order", headers=A)).json()["enabled"] is False
        missing = await http.get("/admin/tools/lookup_order", headers=A)
        assert (missing.status_code, missing.json()) == (
            404,
            {"detail": "no tool named 'lookup_order'", "code": "tool_not_found"},
        )
        assert (await http.delete("/admin/tools/find_order", headers=A)).status_code == 204
        assert (await http.get("/admin/tools", headers=A)).json() == []
        audit = (await http.get("/admin/audit", headers=A)).json()
    assert [(r["action"], r["result"]) for r in audit[:5]] == [
        ("tool.delete", "ok"),
        ("tool.replace", "ok"),
        ("tool.replace", "ok"),
        ("tool.create", "tool_exists"),
        ("tool.create", "ok"),
    ]
    assert "s3cret" not in str(audit)


@pytest.mark.parametrize(
    ("change", "status", "detail"),
    [
        ({"name": "has space"}, 422, "tool name 'has space' must be 1-64 letters, digits, '_' or '-'"),
        (
            {"parameters": {"type": "array"}},
            422,
            "the parameters of tool 'lookup_order' must be a JSON schema of an object",
        ),
        (
            {"url": "ftp://shop.example/x"},
            422,
            "url must be an http:// or https:// URL with a host, got 'ftp://shop.example/x'",
        ),
        ({"url": "https:///nohost"}, 422, "url must be an http:// or https:// URL with a host, got 'https:///nohost'"),
        ({"secret_header": "Host"}, 422, "secret_header 'Host' cannot be used as a header name"),
        ({"secret_header": "X Key"}, 422, "secret_header 'X Key' cannot be used as a header name"),
        ({"secret_header": None}, 422, "a secret needs a secret_header to be sent in"),
        (
            {"url": "http://127.0.0.1:9000/orders"},
            422,
            "url 'http://127.0.0.1:9000/orders' is refused: 127.0.0.1 is a loopback address; tools may not call the "
            "server's own network (the operator allows it with KVCHAT_TOOLS_ALLOW_PRIVATE_NETWORKS)",
        ),
        (
            {"url": "http://localhost/orders"},
            422,
            "url 'http://localhost/orders' is refused: localhost resolves to 127.0.0.1, which is a loopback address; "
            "tools may not call the server's own network (the operator allows it with "
            "KVCHAT_TOOLS_ALLOW_PRIVATE_NETWORKS)",
        ),
        (
            {"url": "http://10.1.2.3/orders"},
            422,
            "url 'http://10.1.2.3/orders' is refused: 10.1.2.3 is a private address; tools may not call the server's "
            "own network (the operator allows it with KVCHAT_TOOLS_ALLOW_PRIVATE_NETWORKS)",
        ),
    ],
)
async def test_a_bad_definition_is_refused_naming_the_problem(
    live: LiveServer, change: dict[str, Any], status: int, detail: str
) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        response = await http.post("/admin/tools", headers=A, json={**TOOL, **change})
        after = (await http.get("/admin/tools", headers=A)).json()
    assert (response.status_code, response.json()) == (status, {"detail": detail, "code": "invalid_tool"})
    assert after == []
