"""The /v1 service without a server: the SSE stream's framing, of one choice and of several, with tool calls."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from backend.openai.choice import ChoiceState
from backend.openai.reply import Reply
from backend.openai.request_plan import ToolUse
from backend.openai.service import KEEPALIVE_S, ChatCompletions, _Meta, _Run
from backend.tools.types import ToolChoice, ToolChoiceMode, ToolFamily, ToolSpec
from engine.errors import EngineBusy, EngineError
from engine.outputs import FinishReason, GenerationEvent, RequestFinished, RequestStats, TokenDelta

META = _Meta("chatcmpl-1", 1, "kvchat/m", "fp_x", include_usage=True)
STATS = RequestStats(10, 0, 10, 2, 0.0, 0.0, 0.0, 0)
AUTO_TOOLS = ToolUse((ToolSpec("lookup"),), ToolChoice(ToolChoiceMode.AUTO), ToolFamily.HERMES, parallel=True)


class _FakeEngine:
    """What ``ChatCompletions`` streams from: each request's ``generate`` yields what the test puts in its queue."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.queues: dict[str, asyncio.Queue[GenerationEvent | EngineError]] = {}
        self.closed: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def put(self, request_id: str, *events: GenerationEvent | EngineError) -> None:
        for event in events:
            self.queues.setdefault(request_id, asyncio.Queue()).put_nowait(event)

    async def generate(self, request_id: str) -> AsyncGenerator[GenerationEvent, None]:
        queue = self.queues.setdefault(request_id, asyncio.Queue())
        try:
            while True:
                event = await queue.get()
                if isinstance(event, EngineError):
                    raise event
                yield event
        finally:
            self.closed.append(request_id)


def _frames(raw: list[str]) -> list[Any]:
    return [json.loads(f[6:]) if f.startswith("data: {") else f for f in raw]


def _completions(engine: _FakeEngine, keepalive_s: float = KEEPALIVE_S) -> ChatCompletions:
    return ChatCompletions(engine, "kvchat/m", keepalive_s=keepalive_s)  # type: ignore[arg-type]


async def _run(engine: _FakeEngine, ids: list[str], tools: ToolUse | None = None) -> _Run:
    """A started run of choices ``ids`` (their first events must be queued already)."""
    replies = [Reply(engine, rid, engine.generate(rid)) for rid in ids]  # type: ignore[arg-type]
    firsts = [await r.next() for r in replies]
    states = [ChoiceState(i, tools, None) for i in range(len(ids))]
    return _Run(META, replies, firsts, states)  # type: ignore[arg-type]


def _finished(rid: str, text: str, reason: FinishReason = FinishReason.LENGTH) -> RequestFinished:
    return RequestFinished(rid, reason, text, (5, 6), STATS)


@pytest.mark.anyio
async def test_stream_sends_keepalives_while_silent_then_chunks_usage_and_done() -> None:
    engine = _FakeEngine()
    engine.put("chatcmpl-1", TokenDelta("chatcmpl-1", (5,), "Hi"))
    events = _completions(engine, keepalive_s=0.01)._events(await _run(engine, ["chatcmpl-1"]))
    raw = [await anext(events), await anext(events), await anext(events)]  # role, "Hi", a keep-alive
    engine.put("chatcmpl-1", TokenDelta("chatcmpl-1", (6,), "!"), _finished("chatcmpl-1", "Hi!"))
    raw += [f async for f in events if f != ": keep-alive\n\n"]
    frames = _frames(raw)
    assert frames[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert frames[1]["choices"][0]["delta"] == {"content": "Hi"}
    assert frames[2] == ": keep-alive\n\n"
    assert frames[3]["choices"][0]["delta"] == {"content": "!"}
    assert frames[4]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert frames[5]["choices"] == []
    assert frames[5]["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert frames[6] == "data: [DONE]\n\n"
    assert engine.aborted == []  # finished normally: nothing to abort
    assert engine.closed == ["chatcmpl-1"]


@pytest.mark.anyio
async def test_closing_the_stream_early_aborts_and_an_engine_error_becomes_an_error_event() -> None:
    engine = _FakeEngine()
    engine.put("r1", TokenDelta("r1", (5,), "Hi"))
    events = _completions(engine)._events(await _run(engine, ["r1"]))
    await anext(events)
    await events.aclose()
    assert engine.aborted == ["r1"]

    engine = _FakeEngine()
    engine.put("r2", TokenDelta("r2", (5,), "Hi"))
    events = _completions(engine)._events(await _run(engine, ["r2"]))
    assert [_frames([await anext(events)])[0]["choices"][0]["delta"] for _ in range(2)] == [
        {"role": "assistant", "content": ""},
        {"content": "Hi"},
    ]
    engine.put("r2", EngineBusy("queue full", 2.0))
    rest = _frames([f async for f in events])
    assert rest[0] == {
        "error": {"message": "queue full; retry after 2.0s", "type": "server_error", "param": None, "code": "busy"}
    }
    assert rest[1] == "data: [DONE]\n\n"
    assert engine.aborted == ["r2"] and engine.closed == ["r2"]


@pytest.mark.anyio
async def test_a_read_that_times_out_leaves_the_request_running() -> None:
    engine = _FakeEngine()
    reply = Reply(engine, "r3", engine.generate("r3"))  # type: ignore[arg-type]
    assert await reply.next(0.01) is None
    assert await reply.next(0.01) is None
    engine.put("r3", TokenDelta("r3", (5,), "Hi"))
    assert await reply.next(1.0) == TokenDelta("r3", (5,), "Hi")
    assert (engine.aborted, engine.closed) == ([], [])  # silence never cancelled the stream
    await reply.close()
    await reply.close()
    assert engine.aborted == ["r3"] and engine.closed == ["r3"]


@pytest.mark.anyio
async def test_choices_stream_side_by_side_each_with_its_index_and_usage_sums_them() -> None:
    engine = _FakeEngine()
    engine.put("a", TokenDelta("a", (5,), "A"))
    engine.put("b", TokenDelta("b", (7,), "B"))
    events = _completions(engine)._events(await _run(engine, ["a", "b"]))
    engine.put("b", _finished("b", "B", FinishReason.STOP))
    engine.put("a", TokenDelta("a", (6,), "a"), _finished("a", "Aa"))
    frames = _frames([f async for f in events])
    chunks = [c["choices"][0] for c in frames[:-2]]
    assert [c["index"] for c in chunks[:2]] == [0, 1]
    assert all(c["delta"] == {"role": "assistant", "content": ""} for c in chunks[:2])
    text = {i: "".join(c["delta"].get("content", "") for c in chunks[2:] if c["index"] == i) for i in (0, 1)}
    assert text == {0: "Aa", 1: "B"}
    assert {c["index"]: c["finish_reason"] for c in chunks if c["finish_reason"]} == {0: "length", 1: "stop"}
    assert frames[-2]["usage"]["completion_tokens"] == 4  # 2 + 2
    assert frames[-2]["usage"]["prompt_tokens"] == 10  # the prompt once
    assert frames[-1] == "data: [DONE]\n\n"
    assert sorted(engine.closed) == ["a", "b"] and engine.aborted == []


@pytest.mark.anyio
async def test_a_streamed_tool_call_is_held_back_and_sent_in_openais_delta_shape() -> None:
    engine = _FakeEngine()
    engine.put("t", TokenDelta("t", (1,), "Let me check. <tool"))
    events = _completions(engine)._events(await _run(engine, ["t"], AUTO_TOOLS))
    call = '_call>\n{"name": "lookup", "arguments": {"order": 7}}\n</tool_call>'
    engine.put("t", TokenDelta("t", (2,), call), _finished("t", "Let me check. <tool" + call, FinishReason.STOP))
    chunks = [c["choices"][0] for c in _frames([f async for f in events])[:-2]]
    deltas = [c["delta"] for c in chunks[1:]]
    assert deltas[0] == {"content": "Let me check."}  # the call's beginning and the space before it held back
    head, args = deltas[1]["tool_calls"][0], deltas[2]["tool_calls"][0]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "lookup", "arguments": ""}
    assert args == {"index": 0, "function": {"arguments": '{"order": 7}'}}
    assert chunks[-1]["finish_reason"] == "tool_calls"


@pytest.mark.anyio
async def test_text_that_only_looked_like_a_call_is_sent_at_the_end() -> None:
    engine = _FakeEngine()
    engine.put("u", TokenDelta("u", (1,), "Use <tool"))
    events = _completions(engine)._events(await _run(engine, ["u"], AUTO_TOOLS))
    engine.put("u", TokenDelta("u", (2,), "s> tags"), _finished("u", "Use <tools> tags", FinishReason.STOP))
    chunks = [c["choices"][0] for c in _frames([f async for f in events])[:-2]]
    assert "".join(c["delta"].get("content", "") for c in chunks) == "Use <tools> tags"
    assert chunks[-1]["finish_reason"] == "stop"
