"""Replies → text and tool calls, per family; and how much of a streaming reply may be shown."""

from __future__ import annotations

import json

import pytest

from backend.tools.parsers import parse, shown_length
from backend.tools.prompt import hermes_call, llama3_call
from backend.tools.types import ParsedReply, ToolCall, ToolFamily

HERMES, LLAMA3 = ToolFamily.HERMES, ToolFamily.LLAMA3_JSON


def calls(reply: ParsedReply) -> list[tuple[str, dict[str, object]]]:
    return [(c.name, json.loads(c.arguments)) for c in reply.tool_calls]


def test_hermes_calls_after_text_are_split_from_it() -> None:
    text = (
        'Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"id": "A1"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "refund", "arguments": "{\\"amount\\": 2}"}\n</tool_call>'
    )
    reply = parse(text, HERMES)
    assert reply.content == "Let me look."
    assert calls(reply) == [("lookup", {"id": "A1"}), ("refund", {"amount": 2})]
    assert len({c.id for c in reply.tool_calls}) == 2
    assert all(c.id.startswith("call_") for c in reply.tool_calls)


@pytest.mark.parametrize("end", ["", "\n", "\n</tool_ca"])
def test_a_hermes_call_cut_off_before_or_in_its_closing_tag_still_parses(end: str) -> None:
    reply = parse('<tool_call>\n{"name": "lookup", "arguments": {}}' + end, HERMES)
    assert (reply.content, calls(reply)) == (None, [("lookup", {})])


@pytest.mark.parametrize(
    "text",
    [
        "Plain answer, no call.",
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "x", "arguments": [1]}\n</tool_call>',
    ],
)
def test_hermes_text_without_a_well_formed_call_stays_text(text: str) -> None:
    assert parse(text, HERMES) == ParsedReply(text)


def test_llama3_calls_are_the_whole_reply() -> None:
    reply = parse(' {"name": "lookup", "parameters": {"id": "A1"}}; {"name": "refund", "arguments": {}} ', LLAMA3)
    assert (reply.content, calls(reply)) == (None, [("lookup", {"id": "A1"}), ("refund", {})])
    text = 'Sure. {"name": "lookup", "parameters": {}}'
    assert parse(text, LLAMA3) == ParsedReply(text)
    assert parse('{"name": "lookup", "parameters": {}} trailing', LLAMA3) == ParsedReply(
        '{"name": "lookup", "parameters": {}} trailing'
    )


@pytest.mark.parametrize("family", [HERMES, LLAMA3])
def test_what_the_prompt_writes_parses_back(family: ToolFamily) -> None:
    call = ToolCall("lookup", '{"id": "A1", "note": "ünï"}')
    written = hermes_call(call) if family is HERMES else llama3_call(call)
    [parsed] = parse(written, family).tool_calls
    assert (parsed.name, json.loads(parsed.arguments)) == ("lookup", {"id": "A1", "note": "ünï"})


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("Hello there", 11),
        ("Hello <tool", 6),
        ("Hello <tool_call>\n{", 6),
        ("a < b", 5),
        ("", 0),
    ],
)
def test_hermes_holds_back_what_may_begin_a_call(text: str, shown: int) -> None:
    assert shown_length(text, HERMES) == shown


@pytest.mark.parametrize(("text", "shown"), [("  ", 0), (' {"name"', 0), ("Sure", 4)])
def test_llama3_holds_back_a_reply_that_may_be_a_call(text: str, shown: int) -> None:
    assert shown_length(text, LLAMA3) == shown
