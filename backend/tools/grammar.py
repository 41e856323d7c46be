"""The grammar that holds a reply to tool calls when the caller requires one (``tool_choice`` ``required`` or a
named function): each call's JSON must name a tool and match that tool's parameter schema. A Lark grammar in
llguidance's dialect, with the schemas embedded (``engine/grammar.py`` compiles it)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from backend.tools.types import ToolFamily, ToolSpec

# NOTE: the JSON as the templates write it (json.dumps's separators, one line): engine/grammar.py's JSON_OPTIONS.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_grammar(tools: Sequence[ToolSpec], family: ToolFamily, parallel: bool = True) -> str:
    """A grammar whose sentences are one call (or, with ``parallel``, several) of one of ``tools``."""
    key = "parameters" if family is ToolFamily.LLAMA3_JSON else "arguments"
    body = json.dumps({"anyOf": [_call_schema(t, key) for t in tools], "x-guidance": _JSON_STYLE})
    if family is ToolFamily.LLAMA3_JSON:
        return f"start: %json {body}"
    more = ' ("\\n" call)*' if parallel else ""
    return f'start: call{more}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {body}'


def _call_schema(tool: ToolSpec, key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, key: dict(tool.parameters)},
        "required": ["name", key],
        "additionalProperties": False,
    }
