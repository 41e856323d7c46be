"""The /v1 service without a server: parameter mapping, message mapping, and the SSE stream's framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from backend.openai import schemas as s
from backend.openai.errors import OpenAIError
from backend.openai.reply import Reply
from backend.openai.service import KEEPALIVE_S, ChatCompletions, _Meta, chat_messages, sampling_params
from engine.errors import EngineBusy, EngineError, PromptTooLongError
from engine.outputs import FinishReason, GenerationEvent, RequestFinished, RequestStats, TokenDelta

LIMIT = 1024  # the engine's prompt_limit (its KV pool, smaller than its context here)
META = _Meta("chatcmpl-1", 1, "kvchat/m", "fp_x", include_usage=True)
STATS = RequestStats(10, 0, 10, 2, 0.0, 0.0, 0.0, 0)


def _req(**extra: Any) -> s.ChatCompletionRequest:
    return s.ChatCompletionRequest.model_validate(
        {"model": "default", "messages": [{"role": "user", "content": "hi"}]} | extra
    )


def test_defaults_follow_openai_and_fill_the_context() -> None:
    p = sampling_params(_req(), prompt_tokens=24, limit=LIMIT)
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop) == (1.0, 1.0, 0, None, ())
    assert p.max_tokens == 1024 - 24  # the KV pool is smaller than the context here


def test_max_completion_tokens_wins_and_vllm_extensions_map() -> None:
    p = sampling_params(
        _req(max_tokens=5, max_completion_tokens=7, top_k=-1, min_tokens=3, ignore_eos=True, stop="END", seed=9),
        prompt_tokens=4,
        limit=LIMIT,
    )
    assert (p.max_tokens, p.top_k, p.min_tokens, p.ignore_eos, p.stop, p.seed) == (7, 0, 3, True, ("END",), 9)


def test_a_prompt_that_fills_the_context_is_too_long() -> None:
    with pytest.raises(PromptTooLongError) as exc:
        sampling_params(_req(), prompt_tokens=1024, limit=LIMIT)
    assert (exc.value.prompt_tokens, exc.value.max_tokens, exc.value.limit) == (1024, 1, 1024)


def test_messages_map_developer_to_system_and_join_text_parts() -> None:
    messages = [
        s.ChatMessageIn(role="developer", content="rules"),
        s.ChatMessageIn.model_validate(
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ),
        s.ChatMessageIn(role="assistant", content=None),
    ]
    assert chat_messages(messages) == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]
    with pytest.raises(OpenAIError) as exc:
        chat_messages([s.ChatMessageIn(role="user", content=None)])
    assert (exc.value.status, exc.value.code) == (400, "invalid_request")


class _FakeEngine:
    """What ``ChatCompletions`` streams from: ``generate`` yields what the test puts in ``events``."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.events: asyncio.Queue[GenerationEvent | EngineError] = asyncio.Queue()
        self.closed = False

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def generate(self) -> AsyncGenerator[GenerationEvent, None]:
        try:
            while True:
                event = await self.events.get()
                if isinstance(event, EngineError):
                    raise event
                yield event
        finally:
            self.closed = True


def _reply(engine: _FakeEngine, request_id: str) -> Reply:
    return Reply(engine, request_id, engine.generate())  # type: ignore[arg-type]


def _frames(raw: list[str]) -> list[Any]:
    return [json.loads(f[6:]) if f.startswith("data: {") else f for f in raw]


def _completions(engine: _FakeEngine, keepalive_s: float = KEEPALIVE_S) -> ChatCompletions:
    return ChatCompletions(engine, "kvchat/m", keepalive_s=keepalive_s)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_stream_sends_keepalives_while_silent_then_chunks_usage_and_done() -> None:
    engine = _FakeEngine()
    reply = _reply(engine, "chatcmpl-1")
    events = _completions(engine, keepalive_s=0.01)._events(reply, META, None)
    raw = [await anext(events), await anext(events)]  # the role chunk, then a keep-alive (nothing arrived)
    engine.events.put_nowait(TokenDelta("chatcmpl-1", (5,), "Hi"))
    engine.events.put_nowait(RequestFinished("chatcmpl-1", FinishReason.LENGTH, "Hi", (5, 6), STATS))
    raw += [f async for f in events if f != ": keep-alive\n\n"]
    frames = _frames(raw)
    assert frames[1] == ": keep-alive\n\n"
    assert frames[2]["choices"][0]["delta"] == {"content": "Hi"}
    assert frames[3]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert frames[4]["choices"] == []
    assert frames[4]["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert frames[5] == "data: [DONE]\n\n"
    assert engine.aborted == []  # finished normally: nothing to abort
    assert engine.closed


@pytest.mark.anyio
async def test_closing_the_stream_early_aborts_and_an_engine_error_becomes_an_error_event() -> None:
    engine = _FakeEngine()
    events = _completions(engine)._events(_reply(engine, "r1"), META, None)
    await anext(events)
    await events.aclose()
    assert engine.aborted == ["r1"]

    engine = _FakeEngine()
    events = _completions(engine)._events(_reply(engine, "r2"), META, TokenDelta("r2", (5,), "Hi"))
    assert [_frames([await anext(events)])[0]["choices"][0]["delta"] for _ in range(2)] == [
        {"role": "assistant", "content": ""},
        {"content": "Hi"},
    ]
    engine.events.put_nowait(EngineBusy("queue full", 2.0))
    rest = _frames([f async for f in events])
    assert rest[0] == {
        "error": {"message": "queue full; retry after 2.0s", "type": "server_error", "param": None, "code": "busy"}
    }
    assert rest[1] == "data: [DONE]\n\n"
    assert engine.aborted == ["r2"] and engine.closed


@pytest.mark.anyio
async def test_a_read_that_times_out_leaves_the_request_running() -> None:
    engine = _FakeEngine()
    reply = _reply(engine, "r3")
    assert await reply.next(0.01) is None
    assert await reply.next(0.01) is None
    engine.events.put_nowait(TokenDelta("r3", (5,), "Hi"))
    assert await reply.next(1.0) == TokenDelta("r3", (5,), "Hi")
    assert (engine.aborted, engine.closed) == ([], False)  # silence never cancelled the stream
    await reply.close()
    await reply.close()
    assert engine.aborted == ["r3"] and engine.closed
