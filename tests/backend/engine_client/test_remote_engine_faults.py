"""``RemoteEngine`` against a replica that misbehaves: down, silent past the timeout, answering garbage, failing
before its first token (retried) or after it (an error, never a hang), busy, or serving another model.

The misbehaving replica is a raw socket server (``FakeReplica``): misbehaving is its point. It answers ``/kvchat/info``
with the tiny model's real info, so the client starts as against a real replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from backend.engine_client.remote import RemoteEngine
from backend.engine_client.remote_errors import EngineMismatch, EngineProtocolError, EngineUnreachable
from backend.engine_client.values import EngineBusy, RequestFinished, SamplingParams, TokenDelta
from backend.engine_client.wire import encode
from engine.llm_engine import LLMEngine
from support.fake_replica import FakeReplica
from support.server import free_port

pytestmark = pytest.mark.anyio
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def replica(tiny_engine: LLMEngine) -> Iterator[FakeReplica]:
    info = {"engine": "kvchat", "model": "kvchat/tiny", "info": encode(tiny_engine.info), "prompt_limit": 2048}
    fake = FakeReplica(info)
    yield fake
    fake.stop()


@pytest.fixture
async def remote(replica: FakeReplica, tiny_model_dir: Path) -> AsyncIterator[RemoteEngine]:
    replica.modes, replica.completions = ["ok"], 0
    engine = RemoteEngine(replica.url, model=str(tiny_model_dir), timeout_s=0.5, retries=2, backoff_s=0.01)
    await engine.start()
    yield engine
    await engine.stop()


async def _run(engine: RemoteEngine, events: list[Any] | None = None) -> list[Any]:
    events = [] if events is None else events
    async with asyncio.timeout(20):  # NOTE: a hang is the bug these tests look for; this bounds the test, not the code
        async for event in engine.generate(PROMPT, SamplingParams(max_tokens=1), "ns", session="s"):
            events.append(event)
    return events


async def test_a_good_replica_streams_its_tokens(remote: RemoteEngine) -> None:
    events = await _run(remote)
    assert isinstance(events[0], TokenDelta) and events[0].token_ids == (42,)
    assert isinstance(events[-1], RequestFinished) and events[-1].token_ids == (42,)


async def test_the_body_carries_what_the_engine_needs_of_the_prompt(remote: RemoteEngine, replica: FakeReplica) -> None:
    messages = [{"role": "system", "content": "Refunds are paid within 14 days."}, {"role": "user", "content": "Hi"}]
    tokenized = remote.tokenize_prompt(messages)
    async with asyncio.timeout(20):
        async for _ in remote.generate(messages, SamplingParams(max_tokens=1), "ns", session="s"):
            pass
    assert replica.last_body["prompt"] == tokenized.token_ids
    assert replica.last_body["kvchat"]["system_tokens"] == tokenized.system_tokens > 0  # (a release keeps them)


async def test_failures_before_the_first_token_are_retried(remote: RemoteEngine, replica: FakeReplica) -> None:
    replica.modes = ["http500", "garbage", "ok"]
    events = await _run(remote)
    assert isinstance(events[-1], RequestFinished)
    assert replica.completions == 3


@pytest.mark.parametrize(
    ("mode", "error", "words"),
    [
        ("silent", EngineUnreachable, "sent nothing for 0.5 s"),
        ("garbage", EngineProtocolError, "not an engine's"),
        ("http500", EngineUnreachable, "answered 500"),
    ],
)
async def test_a_replica_that_keeps_failing_is_a_clear_error(
    remote: RemoteEngine, replica: FakeReplica, mode: str, error: type[Exception], words: str
) -> None:
    replica.modes = [mode]
    with pytest.raises(error, match=words):
        await _run(remote)
    assert replica.completions == 3  # the first try and two retries


async def test_a_stream_cut_after_its_first_token_is_an_error_not_a_retry(
    remote: RemoteEngine, replica: FakeReplica
) -> None:
    replica.modes = ["cut", "ok"]
    seen: list[Any] = []
    with pytest.raises(EngineUnreachable, match=r"broke off the stream|closed the stream mid-reply"):
        await _run(remote, seen)
    assert [type(e) for e in seen] == [TokenDelta]
    assert replica.completions == 1


async def test_busy_is_the_engines_busy_at_once(remote: RemoteEngine, replica: FakeReplica) -> None:
    replica.modes = ["busy"]
    with pytest.raises(EngineBusy) as caught:
        await _run(remote)
    assert caught.value.retry_after_s == 2.0
    assert replica.completions == 1


async def test_a_replica_that_is_down(replica: FakeReplica, tiny_model_dir: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    engine = RemoteEngine(dead, [replica.url], model=str(tiny_model_dir), timeout_s=0.5, retries=1, backoff_s=0.01)
    await engine.start()
    try:
        with pytest.raises(EngineUnreachable, match="cannot be reached"):
            await _run(engine)
    finally:
        await engine.stop()
    with pytest.raises(EngineUnreachable, match="cannot be reached"):
        await RemoteEngine(dead, model=str(tiny_model_dir), timeout_s=0.5).start()


async def test_a_replica_of_another_model_is_refused_at_start(replica: FakeReplica, tiny_model_dir: Path) -> None:
    original = replica.info
    replica.info = {**original, "info": {**original["info"], "fingerprint": "f" * 64}}
    try:
        with pytest.raises(EngineMismatch, match="serves another model"):
            await RemoteEngine(replica.url, model=str(tiny_model_dir)).start()
    finally:
        replica.info = original
