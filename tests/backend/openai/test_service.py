"""The /v1 service without a server: parameter mapping, message mapping, and the SSE stream's framing."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backend.openai import schemas as s
from backend.openai.errors import OpenAIError
from backend.openai.service import ChatCompletions, _Meta, _Pending, chat_messages, sampling_params
from engine.errors import EngineBusy, PromptTooLongError
from engine.llm_engine import EngineInfo
from engine.outputs import FinishReason, RequestFinished, RequestStats, TokenDelta

INFO = EngineInfo("m", "f" * 64, "llama", "cpu", "float32", 64, 16, 1, 2048, 384)  # pool 1024 tokens < context
META = _Meta("chatcmpl-1", 1, "kvchat/m", "fp_x", include_usage=True)
STATS = RequestStats(10, 0, 10, 2, 0.0, 0.0, 0.0, 0)


def _req(**extra: Any) -> s.ChatCompletionRequest:
    return s.ChatCompletionRequest.model_validate(
        {"model": "default", "messages": [{"role": "user", "content": "hi"}]} | extra
    )


def test_defaults_follow_openai_and_fill_the_context() -> None:
    p = sampling_params(_req(), prompt_tokens=24, info=INFO)
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop) == (1.0, 1.0, 0, None, ())
    assert p.max_tokens == 1024 - 24  # the KV pool is smaller than the context here


def test_max_completion_tokens_wins_and_vllm_extensions_map() -> None:
    p = sampling_params(
        _req(max_tokens=5, max_completion_tokens=7, top_k=-1, min_tokens=3, ignore_eos=True, stop="END", seed=9),
        prompt_tokens=4,
        info=INFO,
    )
    assert (p.max_tokens, p.top_k, p.min_tokens, p.ignore_eos, p.stop, p.seed) == (7, 0, 3, True, ("END",), 9)


def test_a_prompt_that_fills_the_context_is_too_long() -> None:
    with pytest.raises(PromptTooLongError) as exc:
        sampling_params(_req(), prompt_tokens=1024, info=INFO)
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
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _frames(raw: list[str]) -> list[Any]:
    return [json.loads(f[6:]) if f.startswith("data: {") else f for f in raw]


@pytest.mark.anyio
async def test_stream_sends_keepalives_while_silent_then_chunks_usage_and_done() -> None:
    engine = _FakeEngine()
    pending = _Pending(engine, "chatcmpl-1")  # type: ignore[arg-type]
    events = ChatCompletions(engine, keepalive_s=0.01)._events(pending, META)  # type: ignore[arg-type]
    raw = [await anext(events), await anext(events)]  # the role chunk, then a keep-alive (nothing arrived)
    pending.sink(TokenDelta("chatcmpl-1", (5,), "Hi"))
    pending.sink(RequestFinished("chatcmpl-1", FinishReason.LENGTH, "Hi", (5, 6), STATS))
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


@pytest.mark.anyio
async def test_closing_the_stream_early_aborts_and_an_engine_error_becomes_an_error_event() -> None:
    engine = _FakeEngine()
    pending = _Pending(engine, "r1")  # type: ignore[arg-type]
    events = ChatCompletions(engine)._events(pending, META)  # type: ignore[arg-type]
    await anext(events)
    await events.aclose()
    assert engine.aborted == ["r1"]

    pending = _Pending(engine, "r2")  # type: ignore[arg-type]
    events = ChatCompletions(engine)._events(pending, META)  # type: ignore[arg-type]
    await anext(events)
    pending.sink(EngineBusy("queue full", 2.0))
    rest = _frames([f async for f in events])
    assert rest[0] == {
        "error": {"message": "queue full; retry after 2.0s", "type": "server_error", "param": None, "code": "busy"}
    }
    assert rest[1] == "data: [DONE]\n\n"
