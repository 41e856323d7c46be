"""Tools rendered as plain messages give exactly the text the families' own templates give (Qwen2.5's, verbatim)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from backend.tools.prompt import render
from backend.tools.types import ChatTurn, ToolCall, ToolError, ToolFamily, ToolSpec
from engine.tokenizer import Tokenizer

# Qwen2.5-Instruct's chat template (tokenizer_config.json), with its tool branches.
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}"
    "{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided '
    'with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}'
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == \"assistant\" %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    '{%- elif message.role == "tool" %}'
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}"
    "{%- endif %}{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LOOKUP = ToolSpec(
    "lookup_order",
    "Find an order by its number.",
    {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
)
REFUND = ToolSpec(
    "refund", "Refund an order (ünïcödé).", {"type": "object", "properties": {"amount": {"type": "number"}}}
)
CALL_1 = ToolCall("lookup_order", '{"order_id": "A1234"}', "call_1")
CALL_2 = ToolCall("refund", '{"amount": 12.5}', "call_2")
TURNS = [
    ChatTurn("system", "You are the store's assistant."),
    ChatTurn("user", "Where is order A1234? Refund it if lost."),
    ChatTurn("assistant", "", (CALL_1, CALL_2)),
    ChatTurn("tool", '{"status": "lost"}'),
    ChatTurn("tool", '{"refunded": 12.5}'),
    ChatTurn("assistant", "Checking once more.", (CALL_1,)),
    ChatTurn("tool", '{"status": "lost"}'),
]


@pytest.fixture(scope="module")
def chatml(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


def qwen_rendering(tokenizer: Tokenizer, tools: list[ToolSpec]) -> str:
    """What Qwen2.5's own template writes for ``TURNS`` (arguments as objects, as vLLM hands them to templates)."""
    messages: list[dict[str, Any]] = []
    for t in TURNS:
        message: dict[str, Any] = {"role": t.role, "content": t.content}
        if t.tool_calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                for c in t.tool_calls
            ]
        messages.append(message)
    text = tokenizer.hf.apply_chat_template(
        messages,
        tools=[t.as_openai() for t in tools] or None,
        chat_template=QWEN25_TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert isinstance(text, str)
    return text


def plain_rendering(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> str:
    text = tokenizer.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str)
    return text


@pytest.mark.parametrize("tools", [[LOOKUP, REFUND], []], ids=["tools offered", "history only"])
def test_hermes_messages_render_exactly_as_qwen25s_template(chatml: Tokenizer, tools: list[ToolSpec]) -> None:
    messages = render(TURNS, tools, ToolFamily.HERMES)
    assert plain_rendering(chatml, messages) == qwen_rendering(chatml, tools)
    assert {m["role"] for m in messages} == {"system", "user", "assistant"}


def test_llama3_puts_the_tools_before_the_first_user_message_and_results_in_ipython_turns() -> None:
    turns = [TURNS[0], TURNS[1], ChatTurn("assistant", "", (CALL_1,)), ChatTurn("tool", '{"status": "lost"}')]
    messages = render(turns, [LOOKUP], ToolFamily.LLAMA3_JSON)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "ipython"]
    assert messages[1]["content"].startswith("Given the following functions, please respond with a JSON")
    assert messages[1]["content"].endswith(
        '"required": [\n                "order_id"\n            ]\n        }\n    }\n}\n\n'
        "Where is order A1234? Refund it if lost."
    )
    assert messages[2]["content"] == '{"name": "lookup_order", "parameters": {"order_id": "A1234"}}'
    assert messages[3]["content"] == '{"status": "lost"}'


def test_llama3_refuses_parallel_calls_in_the_history() -> None:
    with pytest.raises(ToolError, match=r"^Llama 3 models make one tool call at a time$") as raised:
        render(TURNS, [LOOKUP], ToolFamily.LLAMA3_JSON)
    assert raised.value.param == "messages"


def test_a_call_whose_arguments_are_not_an_object_is_refused() -> None:
    bad = ChatTurn("assistant", "", (ToolCall("lookup_order", "[1]", "call_9"),))
    with pytest.raises(ToolError, match=r"^the arguments of tool call 'call_9' are not a JSON object"):
        render([TURNS[1], bad], [], ToolFamily.HERMES)


@pytest.mark.parametrize(
    ("name", "parameters", "message"),
    [
        ("has space", {"type": "object"}, r"^tool name 'has space' must be 1-64 letters, digits, '_' or '-'$"),
        ("ok", {"type": "string"}, r"^the parameters of tool 'ok' must be a JSON schema of an object$"),
    ],
)
def test_a_bad_tool_definition_is_refused_by_name(name: str, parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(ToolError, match=message):
        ToolSpec(name, "", parameters)


@pytest.mark.parametrize("family", [ToolFamily.HERMES, ToolFamily.LLAMA3_JSON])
def test_segments_with_tools_and_results_render_as_the_plain_messages(family: ToolFamily) -> None:
    from backend.tools.prompt import answered, offer
    from engine.prompt import Segment, SegmentedPrompt

    base = SegmentedPrompt.of(
        ("system", [Segment("You are the store's ", "system_prompt"), Segment("assistant.", "policy_text")]),
        ("user", [Segment("Where is order A1234?", "question")]),
    )
    prompt = answered(offer(base, [LOOKUP], family), "", [CALL_1], ['{"status": "lost"}'], family)
    turns = [
        ChatTurn("system", "You are the store's assistant."),
        ChatTurn("user", "Where is order A1234?"),
        ChatTurn("assistant", "", (CALL_1,)),
        ChatTurn("tool", '{"status": "lost"}'),
    ]
    assert prompt.as_messages() == render(turns, [LOOKUP], family)
    assert prompt.add_generation_prompt
