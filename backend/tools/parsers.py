"""A reply → the text the user reads and the tool calls it makes, one parser per family; and, while it streams, how
much of it may be shown before the end (text that may still turn into a call is held back).

A reply whose call does not parse (bad JSON, no name) is left as text, as vLLM's parsers do: the user sees what the
model wrote rather than losing it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from backend.tools.types import ParsedReply, ToolCall, ToolFamily

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.S)


def parse(text: str, family: ToolFamily) -> ParsedReply:
    if family is ToolFamily.LLAMA3_JSON:
        return _parse_llama3(text)
    return _parse_hermes(text)


def shown_length(text: str, family: ToolFamily) -> int:
    """How much of a reply still streaming may be shown: all but what could begin (or is) a tool call."""
    if family is ToolFamily.LLAMA3_JSON:
        # NOTE: a Llama 3 call is the whole reply, a JSON object: nothing is shown until the reply is known not to be
        # one (it started with something else).
        stripped = text.lstrip()
        return 0 if not stripped or stripped.startswith("{") else len(text)
    at = text.find(HERMES_OPEN)
    if at >= 0:
        return at
    for size in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(HERMES_OPEN[:size]):
            return len(text) - size
    return len(text)


def _parse_hermes(text: str) -> ParsedReply:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return ParsedReply(text)
    calls = []
    for match in _HERMES_CALL.finditer(text, start):
        call = _call(_without_partial_close(match.group(1)), "arguments")
        if call is None:
            return ParsedReply(text)
        calls.append(call)
    return ParsedReply(text[:start].strip() or None, tuple(calls))


def _without_partial_close(raw: str) -> str:
    """A call cut off inside its closing tag (``max_tokens``): the tag's beginning is not part of the JSON."""
    for size in range(len(HERMES_CLOSE) - 1, 0, -1):
        if raw.endswith(HERMES_CLOSE[:size]):
            return raw[:-size].rstrip()
    return raw


def _parse_llama3(text: str) -> ParsedReply:
    body = text.strip()
    if not body.startswith("{"):
        return ParsedReply(text)
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return ParsedReply(text)
        call = _call_from(obj, "parameters")
        if call is None:
            return ParsedReply(text)
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \n\t;":  # NOTE: Llama 3.2 separates parallel calls with ";"
            pos += 1
    return ParsedReply(None, tuple(calls))


def _call(raw: str, key: str) -> ToolCall | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return _call_from(obj, key)


def _call_from(obj: Any, key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments" if key == "parameters" else "parameters", {}))
    if isinstance(args, str):  # NOTE: some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
