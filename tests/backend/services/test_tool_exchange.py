"""A reply's stored tool calls: the JSON round trip, and the prompt of the next turn, which writes the calls and
results before the answer exactly as the tool turn appended them (so it extends the prompt the answer came from)."""

from __future__ import annotations

import json

import pytest

from backend.context.builder import ContextRequest, HistoryMessage, build_context
from backend.domain import HistoryPolicy, MessageRole
from backend.engine_client.values import Segment, SegmentedPrompt
from backend.services.tool_exchange import ToolExchange, ToolStep
from backend.tools.prompt import TOOL_CALL, answered
from backend.tools.types import ToolCall, ToolFamily

CALL = ToolCall("lookup_order", '{"order_id": "A1234"}', "call_1")
EXCHANGE = ToolExchange((ToolStep("Let me check.", (CALL,), ('{"status": "shipped"}',)),), answer_from=14)


def test_the_json_round_trip_keeps_every_field() -> None:
    assert ToolExchange.from_json(EXCHANGE.to_json()) == EXCHANGE
    assert json.loads(EXCHANGE.to_json())["steps"][0]["calls"] == [
        {"id": "call_1", "name": "lookup_order", "arguments": '{"order_id": "A1234"}'}
    ]


@pytest.mark.parametrize("raw", ["{}", '{"steps": [{"content": ""}], "answer_from": 0}', "[]", "not json"])
def test_anything_else_is_a_value_error(raw: str) -> None:
    with pytest.raises(ValueError, match="not a stored tool exchange"):
        ToolExchange.from_json(raw)


@pytest.mark.parametrize("family", list(ToolFamily))
def test_the_steps_are_written_as_the_turn_appended_them(family: ToolFamily) -> None:
    prompt = SegmentedPrompt.of(("user", [Segment("Where is A1234?", "question")]))
    appended = answered(prompt, "", (CALL,), ('{"status": "shipped"}',), family)
    exchange = ToolExchange((ToolStep("", (CALL,), ('{"status": "shipped"}',)),))
    assert exchange.messages(family) == appended.messages[1:]
    assert {s.block_type for m in exchange.messages(family) for s in m.segments} == {TOOL_CALL}


def test_the_next_prompt_holds_the_calls_before_the_answer() -> None:
    reply = "Let me check. It has shipped."
    history = (
        HistoryMessage(1, MessageRole.USER, "Where is A1234?", 0),
        HistoryMessage(2, MessageRole.ASSISTANT, EXCHANGE.answer(reply), 0, (), EXCHANGE.messages(ToolFamily.HERMES)),
        HistoryMessage(3, MessageRole.USER, "Thanks!", 0),
    )
    request = ContextRequest("Be kind.", history, 0, HistoryPolicy.FULL, 10_000)
    built = build_context(request, lambda p: sum(len(m.content) for m in p.messages))
    assert [(m.role, m.content) for m in built.prompt.messages] == [
        ("system", "Be kind."),
        ("user", "Where is A1234?"),
        (
            "assistant",
            'Let me check.\n<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "A1234"}}\n</tool_call>',
        ),
        ("user", '<tool_response>\n{"status": "shipped"}\n</tool_response>'),
        ("assistant", "It has shipped."),
        ("user", "Thanks!"),
    ]
