"""The OpenAI-compatible API end to end: a real uvicorn server, the official ``openai`` client, the tiny model."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestFinished
from engine.sampling_params import SamplingParams
from support.server import (
    ADMIN_KEY,
    CHAT_TOKEN,
    LiveServer,
    add_chat_tenant,
    server_settings,
    serving,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.anyio

TIMEOUT = 30.0
CONVERSATION = [
    {"role": "system", "content": "You are a helpful customer-service assistant for an online store."},
    {"role": "user", "content": "Hello, I ordered a blue jacket last week and it has not arrived yet."},
]


@pytest.fixture
def live(sqlite_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    """A real server on SQLite (the API keeps no rows; ``test_openai_client_*`` also runs on Postgres)."""
    with serving(server_settings(sqlite_url, tmp_path), tiny_engine) as server:
        yield server


@pytest.fixture
async def client(live: LiveServer) -> AsyncIterator[AsyncOpenAI]:
    async with _client(live) as c:
        yield c


def _client(live: LiveServer, key: str = CHAT_TOKEN) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{live.http}/v1", api_key=key, max_retries=0, timeout=TIMEOUT)


def _model(engine: LLMEngine) -> str:
    return f"kvchat/{Path(engine.config.model).name}"


async def _direct(engine: LLMEngine, messages: list[dict[str, str]], max_tokens: int) -> RequestFinished:
    """The engine's own greedy output, in a namespace no test request uses."""
    stream = engine.generate(messages, SamplingParams(max_tokens=max_tokens), namespace=f"direct-{time.monotonic()}")
    events = [e async for e in stream]
    last = events[-1]
    assert isinstance(last, RequestFinished)
    return last


async def test_openai_client_non_streaming_and_streaming_match_the_engine(
    live_server: LiveServer, tiny_engine: LLMEngine
) -> None:
    expected = await _direct(tiny_engine, CONVERSATION, 16)
    async with _client(live_server) as client:
        done = await client.chat.completions.create(
            model=_model(tiny_engine),
            messages=CONVERSATION,
            max_tokens=16,
            temperature=0,  # type: ignore[arg-type]
        )
        stream = await client.chat.completions.create(
            model="default",
            messages=CONVERSATION,  # type: ignore[arg-type]
            max_completion_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    assert done.object == "chat.completion"
    assert done.id.startswith("chatcmpl-")
    assert done.model == _model(tiny_engine)
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == expected.text
    assert done.choices[0].finish_reason == "length"  # the tiny test model never emits EOS
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (expected.stats.prompt_tokens, 16)
    assert done.usage.total_tokens == done.usage.prompt_tokens + 16
    assert done.usage.prompt_tokens_details is not None
    assert done.usage.prompt_tokens_details.cached_tokens == 0  # a fresh tenant: nothing cached yet

    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert {c.id for c in chunks} == {chunks[0].id}
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content) == expected.text
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (done.usage.prompt_tokens, 16)
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: a prefix hit


async def test_a_growing_conversation_gets_prefix_hits(client: AsyncOpenAI, tiny_engine: LLMEngine) -> None:
    messages: list[Any] = list(CONVERSATION)
    cached, prompts = [], []
    for question in ("It was order 1234.", "Can you also check the delivery address?"):
        reply = await client.chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0)
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        prompts.append(reply.usage.prompt_tokens)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
        messages += [{"role": "user", "content": question}]
    block = tiny_engine.info.block_size
    assert cached[0] == 0
    assert cached[1] > 0
    assert cached[1] % block == 0  # only full blocks are cached
    assert prompts[0] - block < cached[1] < prompts[1]  # the whole first prompt's full blocks were reused


async def test_two_tenants_never_share_cached_tokens(live: LiveServer, client: AsyncOpenAI) -> None:
    await add_chat_tenant(live, "acme", "acme-chat-token")

    async def cached(c: AsyncOpenAI) -> int:
        reply = await c.chat.completions.create(model="default", messages=CONVERSATION, max_tokens=4)  # type: ignore[arg-type]
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return reply.usage.prompt_tokens_details.cached_tokens

    assert await cached(client) == 0
    assert await cached(client) > 0
    async with _client(live, "acme-chat-token") as acme:
        assert await cached(acme) == 0
        assert await cached(acme) > 0


async def test_models_lists_the_served_model_with_its_context_length(
    client: AsyncOpenAI, tiny_engine: LLMEngine
) -> None:
    models = [m async for m in client.models.list()]
    assert [m.id for m in models] == [_model(tiny_engine)]
    card = models[0].model_dump()
    assert card["object"] == "model"
    assert card["owned_by"] == "kvchat"
    assert card["max_model_len"] == card["context_length"] == tiny_engine.info.max_model_len
    assert (await client.models.retrieve(_model(tiny_engine))).id == _model(tiny_engine)
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-4o")


async def test_the_openai_client_raises_its_typed_errors(live: LiveServer, client: AsyncOpenAI) -> None:
    async with _client(live, "wrong-key") as bad:
        with pytest.raises(openai.AuthenticationError) as unauthorized:
            await bad.chat.completions.create(model="default", messages=CONVERSATION)  # type: ignore[arg-type]
    assert unauthorized.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as not_found:
        await client.chat.completions.create(model="gpt-4o", messages=CONVERSATION)  # type: ignore[arg-type]
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad_request:
        await client.chat.completions.create(model="default", messages=CONVERSATION, n=9)  # type: ignore[arg-type]
    assert (bad_request.value.code, bad_request.value.param) == ("unsupported_parameter", "n")


@pytest.mark.parametrize(
    ("headers", "body_extra", "status", "code", "param"),
    [
        ({}, {}, 401, "invalid_api_key", None),
        ({"Authorization": "Bearer nope"}, {}, 401, "invalid_api_key", None),
        ({"Authorization": f"Bearer {ADMIN_KEY}"}, {}, 401, "invalid_api_key", None),  # admin keys do not chat
        (None, {"model": "gpt-4o"}, 404, "model_not_found", "model"),
        (None, {"n": 9}, 400, "unsupported_parameter", "n"),  # past the server's cap
        (None, {"top_logprobs": 3}, 400, "invalid_request", "top_logprobs"),  # without logprobs: true
        (None, {"tools": [{"type": "retrieval"}]}, 400, "unsupported_parameter", "tools[0].type"),
        (None, {"presence_penalty": 2.5}, 400, "invalid_request", "presence_penalty"),
        (None, {"temperature": 3}, 400, "invalid_request", "temperature"),
        (None, {"max_tokens": 0}, 400, "invalid_request", "max_tokens"),
        (None, {"messages": []}, 400, "invalid_request", "messages"),
        (None, {"stop": [""]}, 400, "invalid_request", None),
        (None, {"min_tokens": 20, "max_tokens": 10}, 400, "invalid_request", None),
        (
            None,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400,
            "unsupported_parameter",
            "messages[0].content",
        ),
        (None, {"messages": [{"role": "function", "content": "42"}]}, 400, "unsupported_parameter", "messages[0]"),
    ],
)
async def test_errors_come_back_in_openai_shape(
    live: LiveServer,
    headers: dict[str, str] | None,
    body_extra: dict[str, Any],
    status: int,
    code: str,
    param: str | None,
) -> None:
    body = {"model": "default", "messages": CONVERSATION, "max_tokens": 4, **body_extra}
    auth = {"Authorization": f"Bearer {CHAT_TOKEN}"} if headers is None else headers
    async with httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT) as http:
        response = await http.post("/v1/chat/completions", json=body, headers=auth)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == (code, param)
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"


async def test_a_prompt_over_the_context_is_a_400_with_the_token_counts(
    live: LiveServer, tiny_engine: LLMEngine
) -> None:
    limit = tiny_engine.info.max_model_len
    prompt_tokens = len(tiny_engine.tokenize(CONVERSATION))
    async with httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT) as http:
        too_long = await http.post(
            "/v1/chat/completions",
            json={"model": "default", "messages": CONVERSATION, "max_tokens": limit},
            headers={"Authorization": f"Bearer {CHAT_TOKEN}"},
        )
        other_route = await http.get("/admin/sessions")
    assert too_long.status_code == 400
    error = too_long.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert f"maximum context length is {limit} tokens" in error["message"]
    assert f"({prompt_tokens} in the messages, {limit} in the completion)" in error["message"]
    assert other_route.status_code == 401
    assert other_route.json() == {"detail": "a valid admin API key is required", "code": "unauthorized"}


async def test_stop_strings_cut_the_reply_and_finish_with_stop(client: AsyncOpenAI, tiny_engine: LLMEngine) -> None:
    full = (await _direct(tiny_engine, CONVERSATION, 24)).text
    stop = next(full[i : i + 2] for i in range(4, len(full) - 2) if full.find(full[i : i + 2]) > 0)
    reply = await client.chat.completions.create(
        model="default",
        messages=CONVERSATION,
        max_tokens=24,
        temperature=0,
        stop=[stop],  # type: ignore[arg-type]
    )
    assert reply.choices[0].message.content == full[: full.find(stop)]
    assert reply.choices[0].finish_reason == "stop"


async def test_raw_sse_stream_is_well_formed(live: LiveServer) -> None:
    body = {"model": "default", "messages": CONVERSATION, "max_tokens": 6, "stream": True, "ignore_eos": True}
    async with (
        httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT) as http,
        http.stream("POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {CHAT_TOKEN}"}) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[0]["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)  # only with stream_options.include_usage


async def test_a_client_that_disconnects_mid_stream_frees_its_blocks(live: LiveServer, tiny_engine: LLMEngine) -> None:
    baseline = tiny_engine.stats()
    assert baseline.running == 0
    body = {"model": "default", "messages": CONVERSATION, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    async with (
        httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT) as http,
        http.stream("POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {CHAT_TOKEN}"}) as r,
    ):
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                seen += 1
                if seen == 2:
                    break
        assert tiny_engine.stats().running == 1
    deadline = time.monotonic() + TIMEOUT
    while True:
        now = tiny_engine.stats()
        if now.running == 0 and now.waiting == 0 and now.kv.num_used_blocks == baseline.kv.num_used_blocks:
            break
        assert time.monotonic() < deadline, f"blocks not freed: {now}"
        await asyncio.sleep(0.02)
    assert now.generated_tokens - baseline.generated_tokens < 1500  # it was cut short, not run to the end


@pytest.fixture
def busy_engine(tiny_model_dir: Path) -> Iterator[LLMEngine]:
    """An engine with one long request running and one waiting (max 1 each): the next request is refused as busy."""
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir), dtype="float32", device="cpu", max_kv_memory_mb=2, max_num_seqs=1, max_waiting=1
        )
    )
    asyncio.run(engine.start())
    long = SamplingParams(max_tokens=1500, ignore_eos=True)
    first = engine.submit([5, 6, 7], long, "busy", lambda _event: None)
    deadline = time.monotonic() + TIMEOUT
    while engine.stats().running != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    second = engine.submit([8, 9, 10], long, "busy", lambda _event: None)
    yield engine
    engine.abort(first)
    engine.abort(second)
    asyncio.run(engine.stop())


async def test_a_busy_engine_answers_503_with_retry_after(
    sqlite_url: str, tmp_path: Path, busy_engine: LLMEngine
) -> None:
    live = start_server(server_settings(sqlite_url, tmp_path), busy_engine)
    try:
        async with httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT) as http:
            response = await http.post(
                "/v1/chat/completions",
                json={"model": "default", "messages": CONVERSATION, "max_tokens": 4, "stream": True},
                headers={"Authorization": f"Bearer {CHAT_TOKEN}"},
            )
    finally:
        stop_server(live)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "busy")
