"""The values tool calling passes around: a tool's definition, a call, the caller's choice, a parsed reply."""

from __future__ import annotations

import enum
import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function name


class ToolFamily(enum.StrEnum):
    """How a model family writes tool calls.

    ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, results in
    ``<tool_response>`` blocks of a user turn (Qwen2.5 and Qwen3's chat templates; also kvchat's fallback for
    templates without tools, such as SmolLM2's). ``llama3_json``: the reply is ``{"name": ..., "parameters": {...}}``,
    results in an ``ipython`` turn (Llama 3.1+).
    """

    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"


class ToolChoiceMode(enum.StrEnum):
    AUTO = "auto"  # the model decides (its reply is parsed)
    NONE = "none"  # no tool: the tools are not offered
    REQUIRED = "required"  # at least one call (a grammar forces it)
    NAMED = "named"  # a call of one named tool (a grammar forces it)


class ToolError(ValueError):
    """A tool definition, choice or call message that cannot be used; ``param`` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One function the model may call: its name, what it does, and the JSON schema of its arguments."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def __post_init__(self) -> None:
        if not NAME.match(self.name):
            raise ToolError("tools", f"tool name {self.name!r} must be 1-64 letters, digits, '_' or '-'")
        if not isinstance(self.parameters, Mapping) or self.parameters.get("type", "object") != "object":
            raise ToolError("tools", f"the parameters of tool {self.name!r} must be a JSON schema of an object")

    def as_openai(self) -> dict[str, Any]:
        """OpenAI's tool object (what chat templates render)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made: ``arguments`` is the JSON text of an object (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: new_call_id())

    @property
    def parsed_arguments(self) -> dict[str, Any]:
        value = json.loads(self.arguments)
        if not isinstance(value, dict):
            raise ValueError("the arguments are not a JSON object")
        return value


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    name: str | None = None  # with NAMED

    @property
    def offers_tools(self) -> bool:
        return self.mode is not ToolChoiceMode.NONE

    @property
    def forces_call(self) -> bool:
        return self.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED)


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """A reply split into what the user reads and the calls it makes."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """A message of a conversation that may hold tool calls (an assistant's) or a tool's result (role ``tool``)."""

    role: str  # system | user | assistant | tool
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
