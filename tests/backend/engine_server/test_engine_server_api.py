"""``kvchat engine-serve``'s app over the tiny model, in process (httpx's ASGI transport): OpenAI's completions with
token-id prompts and segment spans, cached tokens, the namespace from a header or ``cache_salt``, the secret, the
control routes, and every error as one line of JSON."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest

from backend.engine_client.remote import RemoteEngine
from backend.engine_client.values import DEFAULT_SHARE, FairShare, SamplingParams, TokenizedPrompt
from backend.engine_server.app import create_engine_app
from engine.llm_engine import LLMEngine
from engine.spec import suffix_drafts
from support.engines import make_engine, one_intra_op_thread

pytestmark = pytest.mark.anyio
SECRET = "engine-test-secret"
AUTH = {"Authorization": f"Bearer {SECRET}"}
PROMPT = list(range(10, 60))  # 50 tokens: 3 full blocks of 16


@pytest.fixture
async def http(tiny_engine: LLMEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = create_engine_app(tiny_engine, SECRET, owns_engine=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as client:
        yield client


def _events(text: str) -> list[Any]:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


async def _complete(http: httpx.AsyncClient, salt: str, **extra: Any) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": 3, "cache_salt": salt, **extra}
    response = await http.post("/v1/completions", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


async def test_health_needs_no_secret_and_everything_else_does(http: httpx.AsyncClient) -> None:
    assert (await http.get("/health")).json() == {"status": "ok"}
    for method, path in [("GET", "/kvchat/info"), ("GET", "/metrics"), ("POST", "/v1/completions")]:
        response = await http.request(method, path, json={})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "unauthorized"
    wrong = await http.get("/kvchat/info", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401


async def test_info_names_the_model_and_its_fingerprint(http: httpx.AsyncClient, tiny_engine: LLMEngine) -> None:
    info = (await http.get("/kvchat/info", headers=AUTH)).json()
    assert info["engine"] == "kvchat"
    assert info["info"]["fingerprint"] == tiny_engine.info.fingerprint
    assert info["prompt_limit"] == tiny_engine.prompt_limit


async def test_second_request_reports_cached_tokens_by_tier(http: httpx.AsyncClient) -> None:
    first = await _complete(http, "ns-cache")
    second = await _complete(http, "ns-cache")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # 3 full blocks; the last token recomputed
    assert second["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]["memory"] == 48
    assert second["kvchat"]["stats"]["prefilled_tokens"] == 2
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]  # reuse never changes an output


async def test_another_namespace_shares_nothing(http: httpx.AsyncClient) -> None:
    await _complete(http, "tenant-a")
    other = await _complete(http, "tenant-b")
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # NOTE: the trusted header wins over the body's cache_salt
    body = {"prompt": PROMPT, "max_tokens": 1, "cache_salt": "tenant-c"}
    via_header = await http.post("/v1/completions", json=body, headers=AUTH | {"X-Kvchat-Namespace": "tenant-a"})
    assert via_header.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48


async def test_stream_sends_token_ids_then_usage_then_done(http: httpx.AsyncClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "stream": True, "cache_salt": "ns-stream"}
    response = await http.post("/v1/completions", json=body, headers=AUTH)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = _events(response.text)
    ids = [t for e in events for t in e["choices"][0]["token_ids"]]
    assert len(ids) == 4
    last = events[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 4
    assert last["kvchat"]["stats"]["prompt_tokens"] == len(PROMPT)


async def test_spans_label_the_cached_blocks_by_type(http: httpx.AsyncClient) -> None:
    spans = [
        {"start": 0, "end": 32, "block_type": "policy", "block_id": 7},
        {"start": 32, "end": 50, "block_type": "question", "block_id": 8, "parent_id": 7},
    ]
    kvchat = {"spans": spans, "session": "typed-session"}
    await _complete(http, "ns-typed", kvchat=kvchat)
    second = await _complete(http, "ns-typed", kvchat=kvchat)
    stats = second["kvchat"]["stats"]
    assert stats["prompt_tokens_by_type"] == {"policy": 32, "question": 18}
    assert stats["cached_tokens_by_type"] == {"policy": 32, "question": 16}


async def test_session_footprint_erase_and_release(http: httpx.AsyncClient) -> None:
    kvchat = {"session": "erase-me"}
    await _complete(http, "ns-erase", kvchat=kvchat)
    footprint = (await http.post("/kvchat/sessions/footprint", json={"session": "erase-me"}, headers=AUTH)).json()
    assert footprint == {"blocks": 3, "tokens": 48}
    erased = await http.post(
        "/kvchat/sessions/erase", json={"session": "erase-me", "namespace": "ns-erase"}, headers=AUTH
    )
    assert erased.json()["memory_blocks"] == 3
    after = (await http.post("/kvchat/sessions/footprint", json={"session": "erase-me"}, headers=AUTH)).json()
    assert after == {"blocks": 0, "tokens": 0}
    again = await _complete(http, "ns-erase")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    released = await http.post("/kvchat/sessions/release", json={"session": "erase-me"}, headers=AUTH)
    assert released.json() == {"blocks_freed": 0}


async def test_a_release_keeps_the_system_tokens_the_backend_counted(http: httpx.AsyncClient) -> None:
    await _complete(http, "ns-system", kvchat={"session": "alone", "system_tokens": 35})
    released = await http.post("/kvchat/sessions/release", json={"session": "alone"}, headers=AUTH)
    assert released.json() == {"blocks_freed": 1}  # 3 full blocks: the 2 the 35 system tokens fill stay
    again = await _complete(http, "ns-system")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


async def test_invalidate_flush_pin_temperature_settings_stats_metrics(http: httpx.AsyncClient) -> None:
    await _complete(http, "ns-ctl", kvchat={"session": "ctl"})
    cut = await http.post("/kvchat/invalidate", json={"namespace": "ns-ctl", "session": "ctl", "from_position": 16},
                          headers=AUTH)  # fmt: skip
    assert cut.json()["blocks_freed"] == 2
    flushed = await http.post("/kvchat/flush", json={"namespace": "ns-ctl"}, headers=AUTH)
    assert flushed.json()["blocks_freed"] == 1
    pinned = await http.post("/kvchat/pin", json={"namespace": "ns-pin", "token_ids": PROMPT}, headers=AUTH)
    assert pinned.json() == {"blocks": 3, "tokens": 48, "cached": 0}
    assert (await http.post("/kvchat/unpin", json={"namespace": "ns-pin"}, headers=AUTH)).json() == {"blocks": 0}
    hot = await http.post("/kvchat/sessions/temperature", json={"session": "ctl", "temperature": 0.9}, headers=AUTH)
    assert hot.json() == {"ok": True}
    settings = (await http.get("/kvchat/cache/settings", headers=AUTH)).json()
    assert settings["eviction_policy"] in ("lru", "weighted")
    stats = (await http.get("/kvchat/stats", headers=AUTH)).json()
    assert stats["kv"]["num_blocks"] > 0 and stats["requests_finished"] >= 1
    metrics = await http.get("/metrics", headers=AUTH)
    assert "kvchat:prefix_cache_hits" in metrics.text


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"prompt": [1, 2, 3], "max_tokens": 100_000}, 400, "prompt_too_long"),
        ({"prompt": [1, 10_000_000]}, 400, "invalid_request"),
        ({"prompt": []}, 400, "invalid_request"),
        ({"prompt": [1], "temperature": -1}, 400, "invalid_sampling_params"),
        ({"prompt": [1], "kvchat": {"spans": [["x"]]}}, 400, "invalid_request"),
        ({"prompt": [1], "kvchat": {"bogus": 1}}, 400, "invalid_request"),
        ({"prompt": [1], "kvchat": {"system_tokens": -1}}, 400, "invalid_request"),
    ],
)
async def test_errors_are_one_line_json(http: httpx.AsyncClient, body: dict[str, Any], status: int, code: str) -> None:
    response = await http.post("/v1/completions", json=body, headers=AUTH)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert "\n" not in error["message"] and "Traceback" not in response.text


async def test_bad_json_unknown_path_and_control_errors(http: httpx.AsyncClient) -> None:
    bad = await http.post("/v1/completions", content=b"{not json", headers=AUTH | {"content-type": "application/json"})
    assert (bad.status_code, bad.json()["error"]) == (400, {"code": "invalid_request", "type": "invalid_request",
                                                             "message": "the body is not valid JSON"})  # fmt: skip
    missing = await http.get("/nope", headers=AUTH)
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")
    refused = await http.post("/kvchat/cache/settings", json={"changes": {"no_such": 1}}, headers=AUTH)
    assert (refused.status_code, refused.json()["error"]["code"]) == (400, "invalid_request")


async def test_chat_completions_render_the_template_here(http: httpx.AsyncClient) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "cache_salt": "ns-chat"}
    whole = (await http.post("/v1/chat/completions", json=body, headers=AUTH)).json()
    assert whole["object"] == "chat.completion"
    assert len(whole["choices"][0]["token_ids"]) == 2
    streamed = await http.post("/v1/chat/completions", json=body | {"stream": True}, headers=AUTH)
    events = _events(streamed.text)
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


class _ShareSpy:
    """The tiny engine, recording the fair share each ``generate`` is charged to."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.shares: list[FairShare] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        share = args[5] if len(args) > 5 else kwargs.get("share", DEFAULT_SHARE)
        self.shares.append(share)
        return self._engine.generate(*args, **kwargs)


async def test_the_tenants_fair_share_travels_to_the_engine(tiny_engine: LLMEngine) -> None:
    """An engine process or replica of ours schedules by the tenant the backend names (engine.fair_share); without
    it, every request would be charged to one tenant and served first come, first served."""
    spy = _ShareSpy(tiny_engine)
    app = create_engine_app(spy, SECRET, owns_engine=False)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as http:
        await _complete(http, "t1", kvchat={"share": {"tenant": "tenant-a", "weight": 2.0}})
        await _complete(http, "t1")
    assert spy.shares == [FairShare("tenant-a", 2.0), DEFAULT_SHARE]
    sent = RemoteEngine._body(  # (what the backend's client sends)
        cast(RemoteEngine, SimpleNamespace(model="m")),
        TokenizedPrompt([1, 2, 3]),
        SamplingParams(),
        "ns",
        None,
        FairShare("b", 1.0),
    )
    assert sent["kvchat"]["share"] == {"tenant": "b", "weight": 1.0}


@pytest.mark.skipif(not suffix_drafts.available(), reason="needs the spec extra (arctic-inference)")
async def test_the_tenants_drafts_choice_travels_to_the_engine(tiny_model_dir: Path) -> None:
    """With the engine's switch on, a request the backend sends with ``drafts: false`` (a tenant with drafts off)
    verifies none, as its stats show; one that says nothing follows the switch."""
    with one_intra_op_thread():
        engine = make_engine(tiny_model_dir, drafts=True)
        await engine.start()
        engine.core.scheduler.draft_limit = lambda decoding: 8
        sent = RemoteEngine._body(  # (what the backend's client sends)
            cast(RemoteEngine, SimpleNamespace(model="m")),
            TokenizedPrompt([5, 6, 7, 8, 9, 10, 11, 12] * 4),
            SamplingParams(max_tokens=32, drafts=False),
            "ns",
            None,
            DEFAULT_SHARE,
        )
        assert sent["kvchat"]["sampling"]["drafts"] is False
        sent["stream"] = False  # (one JSON answer to read the stats from)
        app = create_engine_app(engine, SECRET, owns_engine=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as http:
            off = await http.post("/v1/completions", json=sent, headers=AUTH)
            del sent["kvchat"]["sampling"]["drafts"]
            default = await http.post("/v1/completions", json=sent, headers=AUTH)
        await engine.stop()
    assert off.json()["kvchat"]["stats"]["drafted_tokens"] == 0
    assert default.json()["kvchat"]["stats"]["drafted_tokens"] > 0
    assert default.json()["choices"][0]["token_ids"] == off.json()["choices"][0]["token_ids"]
