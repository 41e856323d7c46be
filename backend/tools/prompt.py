"""Tools, calls and results written into a conversation the way the model family's own chat template writes them,
as plain system/user/assistant messages (so every chat template renders them, the prefix cache shares them with
plain turns, and control-token strings in them stay text).

Hermes (Qwen2.5's template, verbatim): the tool list goes after the system message under ``# Tools``; an assistant's
calls follow its text as ``<tool_call>`` blocks; consecutive tool results become one user turn of
``<tool_response>`` blocks. Llama 3.1 (its template with ``tools_in_user_message``): the tool list and the answer
format go before the first user message; a call is the assistant's whole reply ``{"name": ..., "parameters": ...}``;
a result is an ``ipython`` turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from backend.tools.types import ChatTurn, ToolCall, ToolError, ToolFamily, ToolSpec
from engine.prompt import Segment, SegmentedMessage, SegmentedPrompt

DEFAULT_SYSTEM = "You are a helpful assistant."
_HERMES_HEAD = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_HERMES_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
_LLAMA3_HEAD = (
    "Given the following functions, please respond with a JSON for a function call with its proper arguments that "
    "best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    "Do not use variables.\n\n"
)

Message = dict[str, str]
TOOLS = "tools"  # the block type of the tool list (the engine's stats by block type show it apart)
TOOL_CALL = "tool_call"  # of an assistant's calls, and of the results the model reads


def render(turns: Sequence[ChatTurn], tools: Sequence[ToolSpec], family: ToolFamily) -> list[Message]:
    """The conversation as plain messages for the engine, with ``tools`` offered (none: only calls and results of
    the history are written)."""
    if family is ToolFamily.LLAMA3_JSON:
        return _llama3(turns, tools)
    return _hermes(turns, tools)


def _hermes(turns: Sequence[ChatTurn], tools: Sequence[ToolSpec]) -> list[Message]:
    out: list[Message] = []
    rest = list(turns)
    if tools:
        system = rest.pop(0).content if rest and rest[0].role == "system" else DEFAULT_SYSTEM
        listed = "".join("\n" + _dumps(t.as_openai()) for t in tools)
        out.append({"role": "system", "content": system + _HERMES_HEAD + listed + _HERMES_TAIL})
    results: list[str] = []
    for turn in rest:
        if turn.role == "tool":
            results.append(f"<tool_response>\n{turn.content}\n</tool_response>")
            continue
        if results:
            out.append({"role": "user", "content": "\n".join(results)})
            results = []
        if turn.role == "assistant" and turn.tool_calls:
            calls = "\n".join(hermes_call(c) for c in turn.tool_calls)
            out.append({"role": "assistant", "content": f"{turn.content}\n{calls}" if turn.content else calls})
        else:
            out.append({"role": turn.role, "content": turn.content})
    if results:
        out.append({"role": "user", "content": "\n".join(results)})
    return out


def hermes_call(call: ToolCall) -> str:
    """One call as Qwen2.5's template writes it."""
    return f'<tool_call>\n{{"name": "{call.name}", "arguments": {_dumps(_arguments(call))}}}\n</tool_call>'


def _llama3(turns: Sequence[ChatTurn], tools: Sequence[ToolSpec]) -> list[Message]:
    out: list[Message] = []
    pending_tools = bool(tools)
    for turn in turns:
        if turn.role == "user" and pending_tools:
            listed = "".join(json.dumps(t.as_openai(), indent=4, ensure_ascii=False) + "\n\n" for t in tools)
            out.append({"role": "user", "content": _LLAMA3_HEAD + listed + turn.content})
            pending_tools = False
        elif turn.role == "assistant" and turn.tool_calls:
            if len(turn.tool_calls) > 1:
                raise ToolError("messages", "Llama 3 models make one tool call at a time")
            out.append({"role": "assistant", "content": llama3_call(turn.tool_calls[0])})
        elif turn.role == "tool":
            out.append({"role": "ipython", "content": turn.content})
        else:
            out.append({"role": turn.role, "content": turn.content})
    if pending_tools:
        raise ToolError("messages", "tools need a user message to be offered in (Llama 3 puts them there)")
    return out


def llama3_call(call: ToolCall) -> str:
    """One call as Llama 3.1's template writes it."""
    return f'{{"name": "{call.name}", "parameters": {_dumps(_arguments(call))}}}'


def _arguments(call: ToolCall) -> object:
    try:
        return call.parsed_arguments
    except ValueError as exc:
        raise ToolError("messages", f"the arguments of tool call {call.id!r} are not a JSON object: {exc}") from None


def _dumps(value: object) -> str:
    # NOTE: what the templates' ``tojson`` writes (transformers: ensure_ascii off, default separators).
    return json.dumps(value, ensure_ascii=False)


def offer(prompt: SegmentedPrompt, tools: Sequence[ToolSpec], family: ToolFamily) -> SegmentedPrompt:
    """``prompt`` (the chat's own, in segments) with ``tools`` offered where ``render`` puts them: after the system
    message (Hermes) or before the first user message (Llama 3), as one more segment."""
    if not tools:
        return prompt
    messages = list(prompt.messages)
    if family is ToolFamily.LLAMA3_JSON:
        listed = "".join(json.dumps(t.as_openai(), indent=4, ensure_ascii=False) + "\n\n" for t in tools)
        at = next((i for i, m in enumerate(messages) if m.role == "user"), None)
        if at is None:
            raise ToolError("messages", "tools need a user message to be offered in (Llama 3 puts them there)")
        head = Segment(_LLAMA3_HEAD + listed, TOOLS)
        messages[at] = SegmentedMessage("user", (head, *messages[at].segments))
    else:
        listed = "".join("\n" + _dumps(t.as_openai()) for t in tools)
        tail = Segment(_HERMES_HEAD + listed + _HERMES_TAIL, TOOLS)
        if messages and messages[0].role == "system":
            messages[0] = SegmentedMessage("system", (*messages[0].segments, tail))
        else:
            messages.insert(0, SegmentedMessage("system", (Segment(DEFAULT_SYSTEM, TOOLS), tail)))
    return SegmentedPrompt(tuple(messages), prompt.add_generation_prompt)


def answered(
    prompt: SegmentedPrompt, text: str, calls: Sequence[ToolCall], results: Sequence[str], family: ToolFamily
) -> SegmentedPrompt:
    """``prompt`` followed by the assistant's reply so far (its ``text`` and ``calls``) and the calls' ``results``,
    as ``render`` writes them, ready for the model to go on."""
    turns = [ChatTurn("assistant", text, tuple(calls)), *(ChatTurn("tool", r) for r in results)]
    written = render(turns, (), family)
    added = tuple(SegmentedMessage(m["role"], (Segment(m["content"], TOOL_CALL),)) for m in written)
    return SegmentedPrompt((*prompt.messages, *added), prompt.add_generation_prompt)
