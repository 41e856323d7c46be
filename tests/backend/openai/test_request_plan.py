"""A ``/v1`` request → its plan and sampling parameters, without a server or an engine."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backend.openai import schemas as s
from backend.openai.errors import OpenAIError
from backend.openai.request_plan import plan, sampling_params
from backend.tools.types import ChatTurn, ToolCall, ToolChoiceMode, ToolFamily
from engine.errors import PromptTooLongError
from engine.sampling_params import GrammarKind, RepetitionScope, StructuredOutput

LIMIT = 1024  # the engine's prompt_limit (its KV pool, smaller than its context here)
VOCAB = 100
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
CANCEL = {"type": "function", "function": {"name": "cancel"}}


def _req(**extra: Any) -> s.ChatCompletionRequest:
    return s.ChatCompletionRequest.model_validate(
        {"model": "default", "messages": [{"role": "user", "content": "hi"}]} | extra
    )


def _plan(family: ToolFamily = ToolFamily.HERMES, **extra: Any) -> Any:
    return plan(_req(**extra), family, VOCAB)


def _refusal(**extra: Any) -> tuple[int, str, str | None]:
    with pytest.raises(OpenAIError) as exc:
        _plan(**extra)
    return exc.value.status, exc.value.code, exc.value.param


def test_defaults_follow_openai_and_fill_the_context() -> None:
    req = _req()
    p = sampling_params(req, plan(req, ToolFamily.HERMES, VOCAB), prompt_tokens=24, limit=LIMIT)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.stop) == (1.0, 1.0, 0, 0.0, None, ())
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.logit_bias) == (1.0, 0.0, 0.0, ())
    assert p.repetition_penalty_scope is RepetitionScope.ALL
    assert (p.logprobs, p.structured) == (None, None)
    assert p.max_tokens == 1024 - 24  # the KV pool is smaller than the context here


def test_every_sampling_parameter_reaches_the_engine() -> None:
    req = _req(
        max_tokens=5,
        max_completion_tokens=7,
        top_k=-1,
        min_tokens=3,
        ignore_eos=True,
        stop="END",
        seed=9,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        repetition_penalty_scope="reply",
        logit_bias={"7": 5, "3": -100},
        logprobs=True,
        top_logprobs=4,
        drafts=False,
    )
    p = sampling_params(req, plan(req, ToolFamily.HERMES, VOCAB), prompt_tokens=4, limit=LIMIT)
    assert (p.max_tokens, p.top_k, p.min_tokens, p.ignore_eos, p.stop, p.seed) == (7, 0, 3, True, ("END",), 9)
    assert p.drafts is False
    assert p.repetition_penalty_scope is RepetitionScope.REPLY
    assert (p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.1, 0.5, -0.5, 1.2)
    assert p.logit_bias == ((7, 5.0), (3, -100.0))
    assert p.logprobs == 4


@pytest.mark.parametrize(
    ("own", "tenant", "sent"),
    [(None, None, None), (None, False, False), (None, True, True), (True, False, True), (False, True, False)],
)
def test_the_requests_drafts_win_over_the_tenants(own: bool | None, tenant: bool | None, sent: bool | None) -> None:
    req = _req() if own is None else _req(drafts=own)
    p = sampling_params(req, plan(req, ToolFamily.HERMES, VOCAB), prompt_tokens=4, limit=LIMIT, drafts=tenant)
    assert p.drafts is sent  # (None: the engine's switch decides)


def test_a_prompt_that_fills_the_context_is_too_long() -> None:
    req = _req()
    with pytest.raises(PromptTooLongError) as exc:
        sampling_params(req, plan(req, ToolFamily.HERMES, VOCAB), prompt_tokens=1024, limit=LIMIT)
    assert (exc.value.prompt_tokens, exc.value.max_tokens, exc.value.limit) == (1024, 1, 1024)


def test_logprobs_without_top_logprobs_report_the_chosen_token_only() -> None:
    assert _plan(logprobs=True).top_logprobs == 0
    assert _plan(logprobs=False, top_logprobs=0).top_logprobs is None


@pytest.mark.parametrize(
    ("extra", "refusal"),
    [
        ({"n": 9}, (400, "unsupported_parameter", "n")),
        ({"logprobs": True, "top_logprobs": 21}, (400, "invalid_request", "top_logprobs")),
        ({"logit_bias": {"-1": 1}}, (400, "invalid_request", "logit_bias")),
        ({"logit_bias": {"100": 1}}, (400, "invalid_request", "logit_bias")),  # the vocabulary is [0, 100)
        ({"logit_bias": {"7": 1, "07": 2}}, (400, "invalid_request", "logit_bias")),
        ({"logit_bias": {"7": float("nan")}}, (400, "invalid_request", "logit_bias")),
    ],
)
def test_refusals_name_the_parameter(extra: dict[str, Any], refusal: tuple[int, str, str]) -> None:
    assert _refusal(**extra) == refusal


def test_n_up_to_the_cap_is_planned() -> None:
    assert _plan(n=8).n == 8


def test_messages_become_turns_with_calls_and_results() -> None:
    messages = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    assert _plan(messages=messages).turns == (
        ChatTurn("system", "rules"),
        ChatTurn("user", "a\nb"),
        ChatTurn("assistant", "", (ToolCall("lookup", "{}", "c1"),)),
        ChatTurn("tool", "42"),
    )


def test_response_formats_become_grammars() -> None:
    assert _plan(response_format={"type": "text"}).grammar is None
    assert _plan(response_format={"type": "json_object"}).grammar == StructuredOutput(GrammarKind.JSON_OBJECT)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    planned = _plan(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert planned.grammar == StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(schema))
    assert planned.grammar_param == "response_format"


def test_tool_choice_decides_what_is_offered_and_what_is_forced() -> None:
    auto = _plan(tools=[LOOKUP, CANCEL])
    assert auto.tools is not None and auto.tools.choice.mode is ToolChoiceMode.AUTO
    assert [t.name for t in auto.tools.offered] == ["lookup", "cancel"]
    assert auto.grammar is None

    assert _plan(tools=[LOOKUP, CANCEL], tool_choice="none").tools is None  # not offered, replies not parsed

    required = _plan(tools=[LOOKUP, CANCEL], tool_choice="required")
    assert required.grammar is not None and required.grammar.kind is GrammarKind.LARK
    assert '("\\n" call)*' in required.grammar.spec  # parallel calls by default
    assert required.grammar_param == "tools"
    single = _plan(tools=[LOOKUP, CANCEL], tool_choice="required", parallel_tool_calls=False)
    assert single.grammar is not None and '("\\n" call)*' not in single.grammar.spec

    named = _plan(tools=[LOOKUP, CANCEL], tool_choice={"type": "function", "function": {"name": "cancel"}})
    assert named.tools is not None and [t.name for t in named.tools.offered] == ["cancel"]
    assert named.grammar is not None and '"cancel"' in named.grammar.spec and '"lookup"' not in named.grammar.spec

    llama = _plan(ToolFamily.LLAMA3_JSON, tools=[LOOKUP], tool_choice="required")
    assert llama.grammar is not None and llama.grammar.spec.startswith("start: %json")
