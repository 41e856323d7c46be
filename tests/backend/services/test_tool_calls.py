"""Tool calls against a real HTTP endpoint on loopback, audited in a real database: the answer reaches the model,
and a timeout, garbage, an HTTP error, an unknown tool or bad arguments fail with their own outcome and an audit
row each. Private addresses are refused unless the operator allows them."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from sqlalchemy import select

from backend.db.engine import create_db_engine, create_sessionmaker
from backend.db.models import AdminAudit
from backend.services.tenant_tools import ToolEndpoint
from backend.services.tenants import create_tenant
from backend.services.tool_calls import CallOutcome, ToolCaller
from backend.tools.types import ToolCall
from support.tool_endpoint import ORDER, ToolServer, tool_server

pytestmark = pytest.mark.anyio
ARGS = {"type": "object", "properties": {"order_id": {"type": "string"}}}


@pytest.fixture
def endpoint() -> Iterator[ToolServer]:
    with tool_server(slow_s=1.0) as server:
        yield server


def tool(server: ToolServer, path: str, timeout_s: float = 0.5) -> ToolEndpoint:
    return ToolEndpoint("lookup_order", "Find an order.", ARGS, server.url(path), "X-Shop-Key", "s3cret", timeout_s)


async def test_each_outcome_is_returned_and_audited(sqlite_url: str, endpoint: ToolServer) -> None:
    db_engine = create_db_engine(sqlite_url)
    sessionmaker = create_sessionmaker(db_engine)
    try:
        async with sessionmaker() as db:
            tenant = await create_tenant(db, "shop")
            await db.commit()
        caller = ToolCaller(sessionmaker, allow_private_networks=True)
        call = ToolCall("lookup_order", '{"order_id": "A1234"}')
        results = []
        for path in ("/order", "/slow", "/garbage", "/fail"):
            results.append(await caller.call(tenant.id, "sess-1", {"lookup_order": tool(endpoint, path)}, call))
        results.append(await caller.call(tenant.id, "sess-1", {}, call))
        bad = ToolCall("lookup_order", "[1, 2]")
        results.append(await caller.call(tenant.id, "sess-1", {"lookup_order": tool(endpoint, "/order")}, bad))
        refused = ToolCaller(sessionmaker, allow_private_networks=False)
        results.append(await refused.call(tenant.id, "sess-1", {"lookup_order": tool(endpoint, "/order")}, call))
        async with sessionmaker() as db:
            rows = list((await db.execute(select(AdminAudit).order_by(AdminAudit.id))).scalars())
    finally:
        await db_engine.dispose()

    assert [r.outcome for r in results] == [
        CallOutcome.OK,
        CallOutcome.TIMEOUT,
        CallOutcome.BAD_RESPONSE,
        CallOutcome.HTTP_ERROR,
        CallOutcome.UNKNOWN_TOOL,
        CallOutcome.BAD_ARGUMENTS,
        CallOutcome.REFUSED_ADDRESS,
    ]
    assert json.loads(results[0].content) == ORDER
    assert all(r.content == "" for r in results[1:])
    assert [r.path for r in endpoint.received] == ["/order", "/slow", "/garbage", "/fail"]
    first = endpoint.received[0]
    assert first.body == {"order_id": "A1234"}
    assert (first.headers["X-Shop-Key"], first.headers["X-Kvchat-Tool"], first.headers["X-Kvchat-Session"]) == (
        "s3cret",
        "lookup_order",
        "sess-1",
    )
    assert [(r.actor, r.action, r.target, r.result) for r in rows] == [
        ("bot", "tool.call", "lookup_order", o.value) for o in (r.outcome for r in results)
    ]
    assert all(r.tenant_id == tenant.id for r in rows)
    assert rows[0].detail is not None and rows[0].detail.startswith("session sess-1: HTTP 200 in ")
    assert rows[1].detail is not None and rows[1].detail.startswith("session sess-1: no answer within 0.5 s in ")
    assert rows[2].detail is not None and rows[2].detail.startswith("session sess-1: HTTP 200, not JSON in ")
