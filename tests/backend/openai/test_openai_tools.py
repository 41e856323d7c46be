"""Tools on ``/v1`` end to end (a real server, the official ``openai`` client, the tiny model): the tools offered in
the model family's format, ``tool_choice`` (auto, none, required, a named function) with forced calls held to the
grammar, ``tool_calls`` in replies and streams, and a history that holds calls and their results."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import jsonschema_rs
import openai
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionChunk

from backend.tools.family import detect_family
from backend.tools.grammar import call_grammar
from backend.tools.parsers import parse
from backend.tools.prompt import render
from backend.tools.types import ChatTurn, ToolCall, ToolSpec
from engine.llm_engine import LLMEngine
from engine.outputs import RequestFinished
from engine.sampling_params import GrammarKind, SamplingParams, StructuredOutput
from support.server import CHAT_TOKEN, LiveServer, server_settings, serving

pytestmark = pytest.mark.anyio

TIMEOUT = 60.0
SYSTEM = "You are a helpful customer-service assistant for an online store."
QUESTION = "Where is my order 1234?"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
LOOKUP = {
    "type": "object",
    "properties": {"order_id": {"type": "integer", "minimum": 1, "maximum": 9999}},
    "required": ["order_id"],
    "additionalProperties": False,
}
CANCEL = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "reason": {"enum": ["late", "other"]},
    },
    "required": ["order_id", "reason"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "lookup_order", "description": "Find an order.", "parameters": LOOKUP}},
    {"type": "function", "function": {"name": "cancel_order", "description": "Cancel an order.", "parameters": CANCEL}},
]
SPECS = (ToolSpec("lookup_order", "Find an order.", LOOKUP), ToolSpec("cancel_order", "Cancel an order.", CANCEL))
SCHEMAS = {"lookup_order": LOOKUP, "cancel_order": CANCEL}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("openai-tools")
    with serving(server_settings(f"sqlite+aiosqlite:///{tmp / 'db.sqlite'}", tmp), tiny_engine) as server:
        yield server


@pytest.fixture
async def client(live: LiveServer) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=f"{live.http}/v1", api_key=CHAT_TOKEN, max_retries=0, timeout=TIMEOUT) as c:
        yield c


def family(engine: LLMEngine) -> Any:
    return detect_family(engine.tokenizer.chat_template)


async def direct(engine: LLMEngine, messages: list[dict[str, str]], params: SamplingParams) -> RequestFinished:
    """The engine's reply to ``messages`` as ``backend/tools/prompt.py`` renders them, in a namespace of its own."""
    stream = engine.generate(messages, params, namespace=f"direct-{time.monotonic()}")
    last = [e async for e in stream][-1]
    assert isinstance(last, RequestFinished)
    return last


def accumulate_calls(chunks: list[ChatCompletionChunk]) -> list[dict[str, str]]:
    """The calls of a stream, put together from OpenAI's deltas as a client does."""
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            assert delta.function is not None
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(
    ("tool_choice", "names"),
    [
        ("required", {"lookup_order", "cancel_order"}),
        ({"type": "function", "function": {"name": "cancel_order"}}, {"cancel_order"}),
    ],
    ids=["required", "named"],
)
async def test_a_forced_call_follows_the_grammar_streamed_and_not(
    client: AsyncOpenAI, tiny_engine: LLMEngine, tool_choice: Any, names: set[str]
) -> None:
    params: dict[str, Any] = {"tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": False}
    done = await client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=200, temperature=0, **params
    )  # type: ignore[arg-type]
    chunks = [
        c
        async for c in await client.chat.completions.create(
            model="default", messages=MESSAGES, max_tokens=200, temperature=0, stream=True, **params
        )
    ]  # type: ignore[arg-type]

    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    arguments = json.loads(call.function.arguments)
    assert jsonschema_rs.validator_for(SCHEMAS[call.function.name]).is_valid(arguments), arguments

    # the engine's own run of the prompt as the family renders it, under the forced-call grammar
    offered = SPECS if tool_choice == "required" else SPECS[1:]
    rendered = render([ChatTurn("system", SYSTEM), ChatTurn("user", QUESTION)], offered, family(tiny_engine))
    grammar = StructuredOutput(GrammarKind.LARK, call_grammar(offered, family(tiny_engine), parallel=False))
    expected = await direct(tiny_engine, rendered, SamplingParams(max_tokens=200, structured=grammar))
    assert done.usage is not None and done.usage.prompt_tokens == expected.stats.prompt_tokens
    [engine_call] = parse(expected.text, family(tiny_engine)).tool_calls
    assert (engine_call.name, json.loads(engine_call.arguments)) == (call.function.name, arguments)

    [streamed] = accumulate_calls(chunks)
    assert streamed["id"].startswith("call_")
    assert (streamed["name"], json.loads(streamed["arguments"])) == (call.function.name, arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


async def test_auto_offers_the_tools_in_the_familys_format_and_none_does_not(
    client: AsyncOpenAI, tiny_engine: LLMEngine
) -> None:
    turns = [ChatTurn("system", SYSTEM), ChatTurn("user", QUESTION)]
    offered = render(turns, SPECS, family(tiny_engine))
    expected = await direct(tiny_engine, offered, SamplingParams(max_tokens=12))
    plain = await direct(tiny_engine, MESSAGES, SamplingParams(max_tokens=12))

    auto = await client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=12, temperature=0, tools=TOOLS
    )  # type: ignore[arg-type]
    none = await client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=12, temperature=0, tools=TOOLS, tool_choice="none"
    )  # type: ignore[arg-type]
    chunks = [
        c
        async for c in await client.chat.completions.create(
            model="default", messages=MESSAGES, max_tokens=12, temperature=0, tools=TOOLS, stream=True
        )
    ]  # type: ignore[arg-type]

    assert auto.usage is not None and auto.usage.prompt_tokens == expected.stats.prompt_tokens
    assert auto.choices[0].message.content == expected.text  # the random model writes no call: the text comes back
    assert auto.choices[0].message.tool_calls is None
    assert auto.choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert none.usage is not None and none.usage.prompt_tokens == plain.stats.prompt_tokens
    assert none.choices[0].message.content == plain.text


async def test_a_history_with_calls_and_results_is_written_in_the_familys_format(
    client: AsyncOpenAI, tiny_engine: LLMEngine
) -> None:
    history: list[Any] = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup_order", "arguments": '{"order_id": 1234}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"status": "shipped", "eta": "Friday"}'},
    ]
    turns = [
        ChatTurn("system", SYSTEM),
        ChatTurn("user", QUESTION),
        ChatTurn("assistant", "", (ToolCall("lookup_order", '{"order_id": 1234}', "call_1"),)),
        ChatTurn("tool", '{"status": "shipped", "eta": "Friday"}'),
    ]
    expected = await direct(tiny_engine, render(turns, SPECS, family(tiny_engine)), SamplingParams(max_tokens=10))
    done = await client.chat.completions.create(
        model="default", messages=history, max_tokens=10, temperature=0, tools=TOOLS
    )  # type: ignore[arg-type]
    assert done.usage is not None and done.usage.prompt_tokens == expected.stats.prompt_tokens
    assert done.choices[0].message.content == expected.text


@pytest.mark.parametrize(
    ("extra", "code", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "unsupported_parameter", "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "invalid_request", "tools[0].function"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "invalid_request",
            "tools[0].function",
        ),
        ({"tools": TOOLS + TOOLS[:1]}, "invalid_request", "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "invalid_request", "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "refund"}}},
            "invalid_request",
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "invalid_request", "tool_choice"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "unsupported_parameter", "response_format"),
        ({"functions": [{"name": "f"}], "function_call": "auto"}, "unsupported_parameter", "functions"),
        ({"messages": [{"role": "function", "name": "f", "content": "1"}]}, "unsupported_parameter", "messages[0]"),
        ({"messages": [{"role": "tool", "content": None}]}, "invalid_request", "messages[0].content"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "hi",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            "invalid_request",
            "messages[0].tool_calls",
        ),
        (
            {
                "messages": [
                    *MESSAGES,
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1"}}]},
                ]
            },
            "invalid_request",
            "messages",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "$ref": "#/nowhere"}},
                    }
                ],
                "tool_choice": "required",
            },
            "invalid_request",
            "tools",
        ),
    ],
)
async def test_tool_values_kvchat_cannot_honour_are_a_400_naming_the_parameter(
    client: AsyncOpenAI, extra: dict[str, Any], code: str, param: str
) -> None:
    body: dict[str, Any] = {"model": "default", "messages": MESSAGES, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(**body)
    assert (exc.value.code, exc.value.param) == (code, param)
