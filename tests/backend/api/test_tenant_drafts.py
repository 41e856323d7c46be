"""The tenant's suffix drafts through the admin API on a real server with drafts on (the engine's switch): ``default``
until the tenant chooses; with ``off`` neither its chat turns nor its ``/v1`` requests verify a draft
(``kvchat:spec_decode_draft_tokens`` in ``/metrics`` stays put) while another tenant's do; a ``/v1`` request's own
``drafts`` wins over the tenant's; a bad value is a one-line 422 and changes nothing; each change is audited."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from prometheus_client.parser import text_string_to_metric_families
from test_admin_cache import A, second_tenant

from engine.llm_engine import LLMEngine
from engine.spec import suffix_drafts
from support.engines import make_engine, one_intra_op_thread
from support.server import CHAT_TOKEN, LiveServer, server_settings, serving
from support.ws_chat import Chat

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not suffix_drafts.available(), reason="needs the spec extra (arctic-inference)"),
]
URL = "/admin/tenant/drafts"
SPEC = "kvchat:spec_decode_"
# NOTE: the tiny model loops on a repeated phrase, so its greedy reply repeats its prompt and itself: drafts come
MESSAGES = [{"role": "user", "content": "order 5 order 5 order 5 order 5 order 5 order 5 order 5 order 5"}]


@pytest.fixture(scope="module")
def drafting_engine(tiny_model_dir: Path) -> Iterator[LLMEngine]:
    """The tiny engine with the switch on, its drafts verified at every batch size."""
    with one_intra_op_thread():
        engine = make_engine(tiny_model_dir, drafts=True, max_kv_memory_mb=16)
        engine.load()
        engine.core.scheduler.draft_limit = lambda decoding: 8
        yield engine


@pytest.fixture
def live(sqlite_url: str, tmp_path: Path, drafting_engine: LLMEngine) -> Iterator[LiveServer]:
    settings = server_settings(sqlite_url, tmp_path, reply_max_tokens=32, reply_repetition_penalty=1.0)
    with serving(settings, drafting_engine) as server:
        yield server


async def _drafted(http: httpx.AsyncClient) -> float:
    """``kvchat:spec_decode_draft_tokens`` as ``/metrics`` reads now."""
    text = (await http.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvchat:spec_decode_draft_tokens_total":
                return sample.value
    raise AssertionError("no kvchat:spec_decode_draft_tokens_total in /metrics")


async def _v1(http: httpx.AsyncClient, token: str, **extra: Any) -> None:
    body = {"model": "default", "max_tokens": 32, "temperature": 0, "messages": MESSAGES} | extra
    r = await http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text


async def _chat_turn(live: LiveServer, token: str) -> None:
    async with websockets.connect(live.ws) as ws:
        chat = Chat(ws)
        await chat.hello(token)
        await chat.turn(MESSAGES[0]["content"])


async def test_a_tenant_with_drafts_off_gets_none_while_the_switch_is_on(live: LiveServer) -> None:
    chat_b, admin_b = await second_tenant(live)
    async with httpx.AsyncClient(base_url=live.http, timeout=60.0) as http:
        assert (await http.get("/admin/tenant", headers=A)).json()["drafts"] == "default"
        put = await http.put(URL, headers=A, json={"drafts": "off"})
        assert (put.status_code, put.json()["drafts"]) == (200, "off")
        assert (await http.get("/admin/tenant", headers=A)).json()["drafts"] == "off"

        before = await _drafted(http)
        await _v1(http, CHAT_TOKEN)
        await _chat_turn(live, CHAT_TOKEN)
        assert await _drafted(http) == before  # tenant A: off, on both paths

        await _v1(http, chat_b)  # tenant B follows the switch (on)
        after_b = await _drafted(http)
        assert after_b > before
        await _chat_turn(live, chat_b)
        assert await _drafted(http) > after_b

        before = await _drafted(http)
        await _v1(http, CHAT_TOKEN, drafts=True)  # the request's own field wins over the tenant's
        assert await _drafted(http) > before
        before = await _drafted(http)
        await _v1(http, chat_b, drafts=False)
        assert await _drafted(http) == before

        assert (await http.get("/admin/tenant", headers={"X-API-Key": admin_b})).json()["drafts"] == "default"
        audit = (await http.get("/admin/audit", headers=A)).json()
    assert [e["action"] for e in audit][:1] == ["tenant.drafts"]


async def test_metrics_give_drafted_accepted_and_tokens_per_verify_step(live: LiveServer) -> None:
    """The counters and the histogram agree: its count is the verify steps, its sum the accepted drafts plus one token
    a step, and its buckets are cumulative up to the count."""
    async with httpx.AsyncClient(base_url=live.http, timeout=60.0) as http:
        await _v1(http, CHAT_TOKEN, drafts=True)
        text = (await http.get("/metrics")).text
    samples = {(x.name, x.labels.get("le")): x.value for f in text_string_to_metric_families(text) for x in f.samples}
    drafted, accepted = samples[(f"{SPEC}draft_tokens_total", None)], samples[(f"{SPEC}accepted_tokens_total", None)]
    steps = samples[(f"{SPEC}verify_steps_total", None)]
    assert drafted >= accepted > 0 and steps > 0
    assert samples[(f"{SPEC}tokens_per_verify_step_count", None)] == steps
    assert samples[(f"{SPEC}tokens_per_verify_step_sum", None)] == accepted + steps
    buckets = [v for (name, le), v in samples.items() if name == f"{SPEC}tokens_per_verify_step_bucket"]
    assert buckets == sorted(buckets) and buckets[-1] == steps


@pytest.mark.parametrize("body", [{"drafts": "sometimes"}, {"drafts": True}, {}, {"drafts": "on", "also": 1}])
async def test_a_bad_value_is_a_one_line_422_and_changes_nothing(live: LiveServer, body: dict[str, Any]) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        r = await http.put(URL, headers=A, json=body)
        after = (await http.get("/admin/tenant", headers=A)).json()
    assert (r.status_code, r.json()["code"]) == (422, "invalid_request")
    detail = r.json()["detail"]
    assert "\n" not in detail and detail.split(": ")[0] in {"drafts", "also"}
    assert after["drafts"] == "default"
