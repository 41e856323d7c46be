"""The tenant's reply settings through the admin API on a real server (Postgres): the server's defaults until the
tenant sets its own, values the engine refuses are a 422 naming them, a reset returns to the defaults, each write
is audited, and one tenant's settings are not another's."""

from __future__ import annotations

import httpx
import pytest
from test_admin_cache import A, second_tenant

from support.server import LiveServer

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

URL = "/admin/tenant/reply-settings"
OWN = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 40,
    "min_p": 0.05,
    "repetition_penalty": 1.15,
    "repetition_penalty_scope": "reply",
    "presence_penalty": 0.3,
    "frequency_penalty": 0.2,
    "stop": ["\nCustomer:"],
    "tool_use": "required",
}


async def test_defaults_then_own_settings_then_reset(live: LiveServer) -> None:
    s = live.settings
    defaults = {
        "temperature": s.reply_temperature,
        "top_p": s.reply_top_p,
        "top_k": s.reply_top_k,
        "min_p": s.reply_min_p,
        "repetition_penalty": s.reply_repetition_penalty,
        "repetition_penalty_scope": s.reply_repetition_penalty_scope,
        "presence_penalty": s.reply_presence_penalty,
        "frequency_penalty": s.reply_frequency_penalty,
        "stop": [],
        "tool_use": "auto",
        "source": "defaults",
    }
    _, admin_b = await second_tenant(live)
    async with httpx.AsyncClient(base_url=live.http) as http:
        assert (await http.get(URL, headers=A)).json() == defaults
        put = await http.put(URL, headers=A, json=OWN)
        assert (put.status_code, put.json()) == (200, {**OWN, "source": "tenant"})
        assert (await http.get(URL, headers=A)).json() == {**OWN, "source": "tenant"}
        assert (await http.get(URL, headers={"X-API-Key": admin_b})).json() == defaults  # B has its own
        reset = await http.delete(URL, headers=A)
        assert (reset.status_code, reset.json()) == (200, defaults)
        assert (await http.get(URL, headers=A)).json() == defaults
        audit = (await http.get("/admin/audit", headers=A)).json()
    actions = [(row["action"], row["result"]) for row in audit][:2]
    assert actions == [("tenant.reply_settings.reset", "ok"), ("tenant.reply_settings", "ok")]


@pytest.mark.parametrize(
    ("change", "loc"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty_scope": "prompt"}, "repetition_penalty_scope"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"stop": [""]}, "stop.0"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"tool_use": "sometimes"}, "tool_use"),
        ({"seed": 3}, "seed"),
    ],
)
async def test_out_of_range_values_are_refused_by_name(live: LiveServer, change: dict[str, object], loc: str) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        response = await http.put(URL, headers=A, json={**OWN, **change})
        after = (await http.get(URL, headers=A)).json()
    assert response.status_code == 422
    assert response.json()["code"] == "invalid_request"
    assert response.json()["detail"].startswith(f"{loc}: ")
    assert after["source"] == "defaults"  # nothing was stored
