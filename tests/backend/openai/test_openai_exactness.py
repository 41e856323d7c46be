"""Exactness through ``/v1`` (a real server, the official ``openai`` client, the tiny model in fp32), with
penalties, a stop string, a JSON-schema grammar and logprobs on: a turn served from the prefix cache equals a cold
one, and batch neighbours do not change a reply. (``tests/engine/test_sampling_exactness.py`` proves the same of
the engine alone.)"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion

from backend.domain import KeyKind
from backend.services.tenants import add_key, create_tenant
from engine.llm_engine import LLMEngine
from engine.outputs import FinishReason, RequestFinished
from engine.sampling_params import GrammarKind, SamplingParams, StructuredOutput
from support.server import CHAT_TOKEN, LiveServer, db_session, server_settings, serving

pytestmark = pytest.mark.anyio

TIMEOUT = 120.0
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
PENALTIES = {"presence_penalty": 0.3, "frequency_penalty": 0.4}
API = {
    "max_tokens": 64,
    "temperature": 0.8,
    "seed": 11,
    "logprobs": True,
    "top_logprobs": 2,
    "response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}},
    "extra_body": {"repetition_penalty": 1.3},
    **PENALTIES,
}
ENGINE = SamplingParams(
    max_tokens=64,
    temperature=0.8,
    seed=11,
    logprobs=2,
    structured=StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)),
    repetition_penalty=1.3,
    **PENALTIES,  # type: ignore[arg-type]
)
SYSTEM = "You are a helpful customer-service assistant for an online store. Our return policy allows returns."
TURN_1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is my blue jacket order?"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("openai-exactness")
    with serving(server_settings(f"sqlite+aiosqlite:///{tmp / 'db.sqlite'}", tmp), tiny_engine) as server:
        yield server


async def _new_tenant(live: LiveServer, name: str) -> str:
    """A fresh tenant (its own cache namespace, empty) and its chat token."""
    token = f"{name}-{time.monotonic_ns()}"
    async with db_session(live) as db:
        tenant = await create_tenant(db, name)
        await add_key(db, tenant.id, KeyKind.CHAT, token)
        await db.commit()
    return token


@pytest.fixture
async def fresh(live: LiveServer) -> AsyncIterator[AsyncOpenAI]:
    """A client of a tenant nothing is cached for yet."""
    key = await _new_tenant(live, "fresh")
    async with AsyncOpenAI(base_url=f"{live.http}/v1", api_key=key, max_retries=0, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture
async def client(live: LiveServer) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=f"{live.http}/v1", api_key=CHAT_TOKEN, max_retries=0, timeout=TIMEOUT) as c:
        yield c


async def ask(client: AsyncOpenAI, messages: list[dict[str, str]], **extra: Any) -> ChatCompletion:
    return await client.chat.completions.create(model="default", messages=messages, **{**API, **extra})  # type: ignore[no-any-return]


def reply_of(done: ChatCompletion) -> tuple[str | None, str | None, list[tuple[str, list[str]]]]:
    """Content, finish reason, and each token with its top tokens (the logprob values are compared apart)."""
    choice = done.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    tokens = [(e.token, [t.token for t in e.top_logprobs]) for e in choice.logprobs.content]
    return choice.message.content, choice.finish_reason, tokens


def assert_same(a: ChatCompletion, b: ChatCompletion) -> None:
    """Same content, finish and tokens; logprob values equal to float32 rounding (a cached prefix is computed in
    another order than a cold prefill: the logits may differ in their last bits, never in the choice)."""
    assert reply_of(a) == reply_of(b)
    la, lb = a.choices[0].logprobs, b.choices[0].logprobs
    assert la is not None and lb is not None and la.content is not None and lb.content is not None
    for x, y in zip(la.content, lb.content, strict=True):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
        assert [t.logprob for t in x.top_logprobs] == pytest.approx([t.logprob for t in y.top_logprobs], abs=1e-5)


async def direct(engine: LLMEngine, messages: list[dict[str, str]]) -> RequestFinished:
    stream = engine.generate(messages, ENGINE, namespace=f"direct-{time.monotonic()}")
    last = [e async for e in stream][-1]
    assert isinstance(last, RequestFinished)
    return last


def a_stop_in(text: str) -> str:
    """Two characters from the second half of ``text`` (so the stop fires after some tokens)."""
    return next(text[i : i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i : i + 2].strip())


def cached(done: ChatCompletion) -> int:
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    return done.usage.prompt_tokens_details.cached_tokens or 0


async def test_a_cached_turn_equals_a_cold_one(client: AsyncOpenAI, fresh: AsyncOpenAI, tiny_engine: LLMEngine) -> None:
    first = await ask(client, TURN_1)
    turn_2 = [*TURN_1, {"role": "assistant", "content": first.choices[0].message.content or ""}]
    turn_2.append({"role": "user", "content": "Can I return it if it is late?"})
    unstopped = await direct(tiny_engine, turn_2)
    assert unstopped.finish_reason is FinishReason.STOP  # the grammar completed
    stop = a_stop_in(unstopped.text)

    warm = await ask(client, turn_2, stop=[stop])  # the tenant's cache holds turn 1
    cold = await ask(fresh, turn_2, stop=[stop])  # a tenant with nothing cached
    again = await ask(fresh, turn_2, stop=[stop])  # the same request again: now from the cache
    assert cached(warm) > 0 and cached(cold) == 0 and cached(again) > 0
    assert_same(warm, cold)
    assert_same(again, cold)
    assert cold.choices[0].finish_reason == "stop"
    assert cold.choices[0].message.content == unstopped.text[: unstopped.text.find(stop)]

    chunks = await client.chat.completions.create(model="default", messages=turn_2, stream=True, stop=[stop], **API)  # type: ignore[call-overload]
    streamed = [c async for c in chunks]
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cold.choices[0].message.content


async def test_batch_neighbours_do_not_change_a_reply(client: AsyncOpenAI, tiny_engine: LLMEngine) -> None:
    messages = [*TURN_1, {"role": "assistant", "content": "Let me check."}, {"role": "user", "content": "Thanks!"}]
    alone = await ask(client, messages, stop=["}"])
    neighbours: list[dict[str, Any]] = [
        {"max_tokens": 40, "temperature": 0},
        {"max_tokens": 30, "temperature": 1.0, "seed": 1, "response_format": {"type": "json_object"}},
        {"max_tokens": 50, "temperature": 0.5, "seed": 2, "extra_body": {"repetition_penalty": 2.0}},
        {"max_tokens": 30, "temperature": 0, "n": 2, "logit_bias": {"42": 3}, "logprobs": True},
    ]
    started = tiny_engine.stats().steps
    together = await asyncio.gather(
        *(client.chat.completions.create(model="default", messages=TURN_1, **n) for n in neighbours[:2]),
        ask(client, messages, stop=["}"]),
        *(client.chat.completions.create(model="default", messages=TURN_1, **n) for n in neighbours[2:]),
    )
    steps = tiny_engine.stats().steps - started
    assert_same(together[2], alone)
    total = sum(d.usage.completion_tokens for d in together if d.usage is not None)
    assert steps < total  # the replies shared engine steps: they ran in one batch
