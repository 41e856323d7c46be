"""The operator's cache settings at runtime through a real server on Postgres (``/admin/cache/settings``), their audit,
and the KV cache by tier in ``/metrics`` and ``/admin/stats``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request

from backend.api.deps import operator_access
from engine.llm_engine import LLMEngine
from support.server import ADMIN_KEY, LiveServer, server_settings, serving

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TOKEN = "test-operator-token"
OPERATOR = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def live(pg_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    before = tiny_engine.cache_settings()
    try:
        with serving(server_settings(pg_url, tmp_path, operator_token=TOKEN), tiny_engine) as server:
            yield server
    finally:
        # NOTE: the engine is shared by the whole test session: what a test changed goes back
        tiny_engine.configure_cache(**before.as_dict())


async def test_the_operator_changes_cache_settings_without_a_restart(live: LiveServer, tiny_engine: LLMEngine) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        before = (await http.get("/admin/cache/settings", headers=OPERATOR)).json()
        changed = await http.put(
            "/admin/cache/settings",
            headers=OPERATOR,
            json={"memory_ttl_s": 30, "eviction_policy": "weighted", "type_weights": {"policy_text": 9.0}},
        )
        after = (await http.get("/admin/cache/settings", headers=OPERATOR)).json()
        trail = (await http.get("/admin/cache/audit", headers=OPERATOR)).json()
    assert changed.status_code == 200, changed.text
    assert after == changed.json()
    assert (after["memory_ttl_s"], after["eviction_policy"], after["disk_ttl_s"]) == (
        30.0,
        "weighted",
        before["disk_ttl_s"],
    )
    assert after["type_weights"] == {**before["type_weights"], "policy_text": 9.0}  # merged, not replaced
    s = tiny_engine.cache_settings()
    assert (s.memory_ttl_s, s.eviction_policy, s.type_weights["policy_text"]) == (30.0, "weighted", 9.0)
    assert [(r["actor"], r["action"], r["result"], r["detail"]) for r in trail] == [
        (
            "operator",
            "cache.settings",
            "ok",
            "eviction_policy=weighted, memory_ttl_s=30.0, type_weights={'policy_text': 9.0}",
        )
    ]


@pytest.mark.parametrize(
    "body",
    [
        {"memory_ttl_s": 0},
        {"eviction_policy": "fifo"},
        {"pin_max_fraction": 0.95},
        {"type_weights": {"identifier": 101}},
        {"unknown_knob": 1},
    ],
)
async def test_values_out_of_range_are_refused_before_the_engine(live: LiveServer, body: dict[str, object]) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        resp = await http.put("/admin/cache/settings", headers=OPERATOR, json=body)
    assert (resp.status_code, resp.json()["code"]) == (422, "invalid_request")


async def test_a_value_the_engine_refuses_is_a_422_with_its_reason(live: LiveServer, tiny_engine: LLMEngine) -> None:
    namespace = "operator-test-namespace"
    tiny_engine.pin_prefix(namespace, list(range(1, 2 * tiny_engine.info.block_size + 1)))
    try:
        async with httpx.AsyncClient(base_url=live.http) as http:
            resp = await http.put("/admin/cache/settings", headers=OPERATOR, json={"pin_max_fraction": 0})
            trail = (await http.get("/admin/cache/audit", headers=OPERATOR)).json()
    finally:
        tiny_engine.unpin(namespace)
    assert (resp.status_code, resp.json()["code"]) == (422, "invalid_cache_settings")
    assert "pin_max_fraction" in resp.json()["detail"]
    assert tiny_engine.cache_settings().pin_max_fraction > 0  # nothing changed
    assert [(r["result"], r["detail"]) for r in trail] == [("invalid_cache_settings", "pin_max_fraction=0.0")]


def _request(host: str, authorization: str | None = None) -> Request:
    headers = [(b"authorization", authorization.encode())] if authorization else []
    return Request({"type": "http", "method": "GET", "path": "/", "headers": headers, "client": (host, 5000)})


def test_without_a_token_only_loopback_clients_are_the_operator() -> None:
    operator_access(_request("127.0.0.1"), None, "KVCHAT_OPERATOR_TOKEN")
    operator_access(_request("::1"), None, "KVCHAT_OPERATOR_TOKEN")
    with pytest.raises(Exception, match="KVCHAT_OPERATOR_TOKEN") as refused:
        operator_access(_request("10.1.2.3"), None, "KVCHAT_OPERATOR_TOKEN")
    assert getattr(refused.value, "status_code", None) == 403
    # with a token, loopback alone is not enough, and the token works from anywhere
    with pytest.raises(Exception, match="bearer token") as wrong:
        operator_access(_request("127.0.0.1", "Bearer nope"), "s3cret", "KVCHAT_OPERATOR_TOKEN")
    assert getattr(wrong.value, "status_code", None) == 401
    operator_access(_request("10.1.2.3", "Bearer s3cret"), "s3cret", "KVCHAT_OPERATOR_TOKEN")


async def test_metrics_and_stats_report_the_kv_cache_by_tier(live: LiveServer, tiny_engine: LLMEngine) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        text = (await http.get("/metrics")).text
        stats = (await http.get("/admin/stats", headers={"X-API-Key": ADMIN_KEY})).json()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    t = tiny_engine.stats().tiers
    for state in ("used", "cached", "pinned"):
        assert ("kvchat:kv_blocks", (("state", state), ("tier", "memory"))) in samples
    assert samples[("kvchat:kv_blocks", (("state", "stored"), ("tier", "disk")))] == t.disk_blocks
    assert ("kvchat:kv_tier_bytes", (("tier", "memory"),)) in samples
    assert samples[("kvchat:kv_tier_bytes", (("tier", "disk"),))] == t.disk_bytes
    for name in ("disk_writes", "disk_writes_refused", "disk_quarantined", "promoted_blocks", "demoted_blocks"):
        assert (f"kvchat:kv_{name}_total", ()) in samples, name
    tiers = stats["engine"]["tiers"]
    assert set(tiers) == {"memory_bytes", "disk_bytes"}  # a tenant's view: bytes, not the hit-dependent counters
    assert tiers["memory_bytes"] <= stats["engine"]["kv_bytes_capacity"]
