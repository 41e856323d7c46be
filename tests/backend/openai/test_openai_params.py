"""The sampling parameters, logprobs, ``n`` and structured output of ``/v1`` end to end: a real uvicorn server, the
official ``openai`` client, the tiny model (fp32). Each reply is compared with the engine's own run of the same
parameters, streamed and not."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import jsonschema_rs
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from engine.llm_engine import LLMEngine
from engine.outputs import RequestFinished
from engine.sampling_params import GrammarKind, RepetitionScope, SamplingParams, StructuredOutput
from support.server import CHAT_TOKEN, LiveServer, server_settings, serving

pytestmark = pytest.mark.anyio

TIMEOUT = 60.0
CONVERSATION = [
    {"role": "system", "content": "You are a helpful customer-service assistant for an online store."},
    {"role": "user", "content": "Hello, I ordered a blue jacket last week and it has not arrived yet."},
]
SCHEMA = {
    "type": "object",
    "properties": {
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "days": {"type": "integer", "minimum": 0, "maximum": 30},
        "note": {"type": "string", "maxLength": 10},
    },
    "required": ["status", "days", "note"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    """One server for the module (these tests keep no rows; each compares with the engine, not with the cache)."""
    tmp = tmp_path_factory.mktemp("openai-params")
    with serving(server_settings(f"sqlite+aiosqlite:///{tmp / 'db.sqlite'}", tmp), tiny_engine) as server:
        yield server


@pytest.fixture
async def client(live: LiveServer) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=f"{live.http}/v1", api_key=CHAT_TOKEN, max_retries=0, timeout=TIMEOUT) as c:
        yield c


async def direct(
    engine: LLMEngine, params: SamplingParams, messages: Sequence[dict[str, str]] = CONVERSATION
) -> RequestFinished:
    """The engine's own reply, in a namespace no request of the server uses."""
    stream = engine.generate(list(messages), params, namespace=f"direct-{time.monotonic()}")
    last = [e async for e in stream][-1]
    assert isinstance(last, RequestFinished)
    return last


async def complete(client: AsyncOpenAI, **params: Any) -> ChatCompletion:
    return await client.chat.completions.create(model="default", messages=CONVERSATION, **params)  # type: ignore[no-any-return]


async def stream(client: AsyncOpenAI, **params: Any) -> list[ChatCompletionChunk]:
    chunks = await client.chat.completions.create(model="default", messages=CONVERSATION, stream=True, **params)
    return [c async for c in chunks]


def streamed_text(chunks: list[ChatCompletionChunk], index: int = 0) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)


def finish_reasons(chunks: list[ChatCompletionChunk]) -> dict[int, str]:
    return {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason}


# --- penalties, min_p, top_k, logit_bias: the engine's reply with the same parameters -----------------------------


@pytest.mark.parametrize(
    ("api", "engine_params"),
    [
        (
            {"presence_penalty": 1.5, "frequency_penalty": 1.0, "extra_body": {"repetition_penalty": 1.6}},
            {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.6},
        ),
        (
            {"extra_body": {"repetition_penalty": 1.6, "repetition_penalty_scope": "reply"}},
            {"repetition_penalty": 1.6, "repetition_penalty_scope": RepetitionScope.REPLY},
        ),
        (
            {"temperature": 1.0, "seed": 3, "extra_body": {"min_p": 0.2, "top_k": 5}},
            {"temperature": 1.0, "seed": 3, "min_p": 0.2, "top_k": 5},
        ),
    ],
    ids=["penalties", "repetition-reply", "min_p-top_k"],
)
async def test_sampling_parameters_give_the_engines_reply_streamed_and_not(
    client: AsyncOpenAI, tiny_engine: LLMEngine, api: dict[str, Any], engine_params: dict[str, Any]
) -> None:
    api = {"temperature": 0, **api}
    expected = await direct(tiny_engine, SamplingParams(max_tokens=16, **{"temperature": 0.0, **engine_params}))
    plain = await direct(tiny_engine, SamplingParams(max_tokens=16))
    done = await complete(client, max_tokens=16, **api)
    chunks = await stream(client, max_tokens=16, **api)
    assert done.choices[0].message.content == expected.text
    assert streamed_text(chunks) == expected.text
    assert expected.text != plain.text  # the parameters changed the reply: they were not dropped


async def test_logit_bias_forces_a_token(client: AsyncOpenAI, tiny_engine: LLMEngine) -> None:
    token = 42
    expected = tiny_engine.tokenizer.decode([token] * 6)
    done = await complete(client, max_tokens=6, temperature=0, logit_bias={str(token): 100})
    chunks = await stream(client, max_tokens=6, temperature=0, logit_bias={str(token): 100})
    assert done.choices[0].message.content == expected
    assert streamed_text(chunks) == expected


# --- logprobs -----------------------------------------------------------------------------------------------------


async def test_logprobs_and_top_logprobs_in_openais_shape(client: AsyncOpenAI, tiny_engine: LLMEngine) -> None:
    expected = await direct(tiny_engine, SamplingParams(max_tokens=8, logprobs=3))
    done = await complete(client, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    chunks = await stream(client, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    logprobs = done.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert expected.logprobs is not None
    assert len(logprobs.content) == len(expected.token_ids) == 8
    for got, want in zip(logprobs.content, expected.logprobs, strict=True):
        assert got.token == tiny_engine.tokenizer.decode([want.token_id], skip_special_tokens=False)
        assert got.bytes == list(got.token.encode())
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([v for _, v in want.top], abs=1e-5)
        assert len(got.top_logprobs) == 3
        assert got.top_logprobs[0].token == got.token  # greedy: the most likely token was chosen
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in logprobs.content]
    assert done.choices[0].message.content == streamed_text(chunks) == expected.text


async def test_without_logprobs_there_are_none(client: AsyncOpenAI) -> None:
    done = await complete(client, max_tokens=3, temperature=0)
    assert done.choices[0].logprobs is None


# --- n --------------------------------------------------------------------------------------------------------------


async def test_n_choices_are_seeded_like_vllm_streamed_and_not(client: AsyncOpenAI, tiny_engine: LLMEngine) -> None:
    params = {"max_tokens": 8, "temperature": 1.0, "seed": 7}
    expected = [await direct(tiny_engine, SamplingParams(max_tokens=8, temperature=1.0, seed=7 + i)) for i in range(3)]
    done = await complete(client, n=3, **params)
    chunks = await stream(client, n=3, stream_options={"include_usage": True}, **params)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert [c.message.content for c in done.choices] == [e.text for e in expected]
    assert [streamed_text(chunks, i) for i in range(3)] == [e.text for e in expected]
    assert finish_reasons(chunks) == {0: "length", 1: "length", 2: "length"}
    assert done.usage is not None and done.usage.completion_tokens == 24
    assert done.usage.prompt_tokens == expected[0].stats.prompt_tokens  # the prompt once
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 24


async def test_the_other_choices_reuse_the_first_ones_prompt(client: AsyncOpenAI, tiny_engine: LLMEngine) -> None:
    messages = [{"role": "user", "content": f"A question nobody asked before {time.monotonic()}: " + "why? " * 40}]
    before = tiny_engine.stats()
    done = await client.chat.completions.create(model="default", messages=messages, n=3, max_tokens=2)  # type: ignore[arg-type]
    after = tiny_engine.stats()
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    assert done.usage.prompt_tokens_details.cached_tokens == 0  # choice 0 ran cold
    # NOTE: choices 1 and 2 each reuse the prompt's full blocks, all but the last token (always recomputed); the
    # engine-wide counter sees only this request (the module's requests run one at a time).
    block, prompt = tiny_engine.info.block_size, done.usage.prompt_tokens
    assert prompt > 2 * block
    assert after.cached_tokens - before.cached_tokens == 2 * ((prompt - 1) // block * block)


# --- structured output --------------------------------------------------------------------------------------------


async def test_json_schema_replies_parse_and_validate_streamed_and_not(client: AsyncOpenAI) -> None:
    validator = jsonschema_rs.validator_for(SCHEMA)
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA, "strict": True}}
    for seed in range(4):
        done = await complete(client, max_tokens=64, temperature=0.9, seed=seed, response_format=fmt)
        chunks = await stream(client, max_tokens=64, temperature=0.9, seed=seed, response_format=fmt)
        assert done.choices[0].finish_reason == "stop"
        reply = json.loads(done.choices[0].message.content or "")
        assert validator.is_valid(reply), reply
        assert streamed_text(chunks) == done.choices[0].message.content
        assert finish_reasons(chunks) == {0: "stop"}


async def test_json_object_replies_are_json_objects(client: AsyncOpenAI, tiny_engine: LLMEngine) -> None:
    # NOTE: the random model writes strings for ever; a bias towards "}" lets the object close within the test.
    [close] = tiny_engine.tokenizer.encode("}", add_special_tokens=False)
    structured = StructuredOutput(GrammarKind.JSON_OBJECT)
    params = SamplingParams(max_tokens=48, temperature=0.9, seed=2, logit_bias=((close, 5.0),), structured=structured)
    expected = await direct(tiny_engine, params)
    api = {"temperature": 0.9, "seed": 2, "logit_bias": {str(close): 5}, "response_format": {"type": "json_object"}}
    done = await complete(client, max_tokens=48, **api)
    chunks = await stream(client, max_tokens=48, **api)
    assert done.choices[0].message.content == streamed_text(chunks) == expected.text
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(expected.text), dict)
    text = await complete(client, max_tokens=4, temperature=0, response_format={"type": "text"})
    assert text.choices[0].message.content == (await direct(tiny_engine, SamplingParams(max_tokens=4))).text


async def test_a_schema_the_grammar_library_refuses_is_a_400_naming_response_format(client: AsyncOpenAI) -> None:
    import openai

    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "$ref": "#/nowhere"}}}
    with pytest.raises(openai.BadRequestError) as exc:
        await complete(client, max_tokens=4, response_format=bad)
    assert exc.value.param == "response_format"


# --- unsupported and invalid values: a 400 naming the parameter ------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "code", "param"),
    [
        ({"n": 9}, "unsupported_parameter", "n"),
        ({"logprobs": True, "top_logprobs": 21}, "invalid_request", "top_logprobs"),
        ({"top_logprobs": 2}, "invalid_request", "top_logprobs"),
        ({"logit_bias": {"abc": 1}}, "invalid_request", "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "invalid_request", "logit_bias"),
        ({"logit_bias": {"5": 101}}, "invalid_request", "logit_bias"),
        ({"presence_penalty": 2.5}, "invalid_request", "presence_penalty"),
        ({"repetition_penalty": 0}, "invalid_request", "repetition_penalty"),
        ({"repetition_penalty_scope": "prompt"}, "invalid_request", "repetition_penalty_scope"),
        ({"min_p": 1.5}, "invalid_request", "min_p"),
        ({"response_format": {"type": "xml"}}, "unsupported_parameter", "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "invalid_request", "response_format.json_schema"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "invalid_request", None),
        ({"functions": [{"name": "f"}]}, "unsupported_parameter", "functions"),
    ],
)
async def test_values_kvchat_cannot_honour_are_a_400_naming_the_parameter(
    client: AsyncOpenAI, extra: dict[str, Any], code: str, param: str | None
) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as exc:
        await complete(client, max_tokens=4, extra_body=extra)
    assert (exc.value.code, exc.value.param) == (code, param)
