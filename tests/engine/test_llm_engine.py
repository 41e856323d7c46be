"""LLMEngine end to end on the tiny random model (fp32, CPU): streaming, stats, abort, seeds, stops, admission control,
namespaces and session release. Async tests use the session's running ``tiny_engine``; tests that need their own
configuration build an engine from ``tiny_model_dir``.

Prompts are token-id lists (exact lengths, so exact block counts), each with its own first token so no two tests share
a cached block unless they mean to; the tests that count cached blocks also use a namespace of their own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine.config import EngineConfig
from engine.errors import EngineBusy, EngineError, EngineStopped, InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.outputs import FinishReason, GenerationEvent, RequestFinished, TokenDelta
from engine.sampling_params import SamplingParams
from support.engines import make_engine, one_intra_op_thread

BS = 16
FIRST_ID = 3  # ids below are the tokenizer's special tokens


def fresh(n: int, seed: int) -> list[int]:
    """``n`` random token ids; the first is ``FIRST_ID + seed``, so prompts of different seeds share no block."""
    rng = random.Random(seed)
    return [FIRST_ID + seed] + [rng.randrange(FIRST_ID, 384) for _ in range(n - 1)]


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    """A loaded engine without a step loop, driven by ``generate_sync`` / ``run_until_idle``."""
    engine = make_engine(tiny_model_dir)
    engine.load()
    return engine


class Collector:
    """A ``submit`` sink: records the events (called from the step thread) and signals the first and the last."""

    def __init__(self) -> None:
        self.events: list[GenerationEvent | EngineError] = []
        self.started = threading.Event()
        self.done = threading.Event()

    def __call__(self, event: GenerationEvent | EngineError) -> None:
        self.events.append(event)
        self.started.set()
        if isinstance(event, RequestFinished | EngineError):
            self.done.set()

    @property
    def final(self) -> RequestFinished:
        last = self.events[-1]
        assert isinstance(last, RequestFinished), last
        return last


async def wait_for(event: threading.Event) -> None:
    assert await anyio.to_thread.run_sync(event.wait, 30), "timed out waiting for the engine"


async def collect(stream: AsyncIterator[GenerationEvent]) -> tuple[list[TokenDelta], RequestFinished]:
    events = [event async for event in stream]
    *deltas, final = events
    assert all(isinstance(d, TokenDelta) for d in deltas)
    assert isinstance(final, RequestFinished)
    return [d for d in deltas if isinstance(d, TokenDelta)], final


# ---------------------------------------------------------------------------------------------------- sync engine


def test_namespaces_never_share(engine: LLMEngine) -> None:
    prompt = fresh(40, 1)
    params = SamplingParams(max_tokens=4)

    a1, a2, b1, b2 = (engine.generate_sync([prompt], params, ns)[0] for ns in ("a", "a", "b", "b"))

    assert [r.stats.cached_tokens for r in (a1, a2, b1, b2)] == [0, 32, 0, 32]
    assert a1.token_ids == a2.token_ids == b1.token_ids == b2.token_ids


def test_seeded_sampling_is_reproducible_across_runs_and_batches(engine: LLMEngine) -> None:
    prompt = fresh(30, 2)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    reseeded = dataclasses.replace(seeded, seed=7)
    alone = [engine.generate_sync([prompt], seeded)[0] for _ in range(2)]  # the second run is a prefix hit

    mixed = {
        "greedy": (fresh(20, 3), SamplingParams(max_tokens=12)),
        "unseeded": (fresh(50, 4), SamplingParams(max_tokens=12, temperature=1.0)),
        "seeded": (prompt, seeded),
        "other seed": (fresh(10, 5), SamplingParams(max_tokens=12, temperature=0.9, seed=99)),
        "same prompt, other seed": (prompt, reseeded),
    }
    sinks = {name: Collector() for name in mixed}
    for name, (p, params) in mixed.items():
        engine.submit(p, params, "default", sinks[name])
    engine.run_until_idle()
    greedy = engine.generate_sync([prompt], SamplingParams(max_tokens=12))[0]

    assert alone[1].stats.cached_tokens == 16
    assert alone[0].token_ids == alone[1].token_ids == sinks["seeded"].final.token_ids
    assert alone[0].text == sinks["seeded"].final.text
    # It really samples: another seed, or greedy decoding, gives other tokens.
    assert sinks["same prompt, other seed"].final.token_ids != alone[0].token_ids
    assert greedy.token_ids != alone[0].token_ids


def test_max_tokens_finishes_with_length(engine: LLMEngine) -> None:
    results = engine.generate_sync([fresh(9, 6), fresh(33, 7)], SamplingParams(max_tokens=5))
    assert [(r.finish_reason, len(r.token_ids), r.stats.completion_tokens) for r in results] == [
        (FinishReason.LENGTH, 5, 5)
    ] * 2


def test_stop_string_cuts_the_text_before_it(engine: LLMEngine) -> None:
    prompt = fresh(24, 8)
    full = engine.generate_sync([prompt], SamplingParams(max_tokens=24))[0]
    # A 2-character ASCII stop string that first completes well inside the reply.
    start = next(i for i in range(4, len(full.text) - 1) if full.text[i : i + 2].isascii() and full.text[i].isalnum())
    stop = full.text[start : start + 2]
    cut = full.text.find(stop)
    # The stop string completes with the first token whose text contains all of it.
    n = next(n for n in range(1, 25) if stop in engine.tokenizer.decode(list(full.token_ids[:n])))

    stopped = engine.generate_sync([prompt], SamplingParams(max_tokens=24, stop=(stop, "never-there")))[0]

    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.text == full.text[:cut]
    assert stopped.token_ids == full.token_ids[:n]
    assert n < 24


def test_stop_token_id_ends_the_request_without_its_text(engine: LLMEngine) -> None:
    prompt = fresh(20, 9)
    full = engine.generate_sync([prompt], SamplingParams(max_tokens=16))[0]
    k = next(i for i in range(2, 16) if full.token_ids[i] not in full.token_ids[:i])

    stopped = engine.generate_sync([prompt], SamplingParams(max_tokens=16, stop_token_ids=(full.token_ids[k],)))[0]
    before = engine.generate_sync([prompt], SamplingParams(max_tokens=k))[0]

    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == full.token_ids[: k + 1]  # the stop token is reported, its text is not
    assert stopped.text == before.text


def test_a_client_whose_event_loop_closed_does_not_break_the_engine(tiny_model_dir: Path) -> None:
    """Regression: events for a stream whose loop had closed raised in the step thread and killed it."""
    engine = make_engine(tiny_model_dir)
    asyncio.run(engine.start())
    try:
        loop = asyncio.new_event_loop()
        stream = engine.generate(fresh(20, 10), SamplingParams(max_tokens=30), request_id="orphan")
        first = loop.run_until_complete(anext(stream))
        assert isinstance(first, TokenDelta)
        loop.close()  # the client goes away without closing its stream: its next events have nowhere to go

        async def serve() -> RequestFinished:
            _, final = await collect(engine.generate(fresh(20, 11), SamplingParams(max_tokens=4)))
            return final

        final = asyncio.run(asyncio.wait_for(serve(), 30))
        assert (final.finish_reason, len(final.token_ids)) == (FinishReason.LENGTH, 4)
        asyncio.run(stream.aclose())  # aborts the orphan if it is still running
    finally:
        asyncio.run(engine.stop())
    assert engine.stats().kv.num_used_blocks == 0


# ---------------------------------------------------------------------------------------------------- async API


@pytest.mark.anyio
async def test_stream_deltas_concatenate_to_the_final_event(tiny_engine: LLMEngine) -> None:
    prompt = fresh(40, 20)
    params = SamplingParams(max_tokens=12)
    before = tiny_engine.stats()

    deltas, final = await collect(tiny_engine.generate(prompt, params, namespace="stream"))
    _, again = await collect(tiny_engine.generate(prompt, params, namespace="stream"))

    assert "".join(d.text for d in deltas) == final.text
    assert tuple(t for d in deltas for t in d.token_ids) == final.token_ids
    # One delta per sampled token, then at most one more with text the detokenizer held back to the end.
    assert [len(d.token_ids) for d in deltas[:12]] == [1] * 12 and [d.token_ids for d in deltas[12:]] in ([], [()])
    assert all(d.request_id == final.request_id for d in deltas)
    assert (final.finish_reason, len(final.token_ids)) == (FinishReason.LENGTH, 12)
    s = final.stats
    assert (s.prompt_tokens, s.cached_tokens, s.prefilled_tokens, s.completion_tokens) == (40, 0, 40, 12)
    assert s.ttft_s > 0 and s.queue_s >= 0 and s.decode_tokens_per_s > 0 and s.num_preemptions == 0
    assert again.token_ids == final.token_ids and again.text == final.text
    assert (again.stats.cached_tokens, again.stats.prefilled_tokens) == (32, 8)
    after = tiny_engine.stats()
    assert after.requests_finished - before.requests_finished == 2
    assert after.prompt_tokens - before.prompt_tokens == 80
    assert after.cached_tokens - before.cached_tokens == 32
    assert after.generated_tokens - before.generated_tokens == 24
    assert after.kv.num_used_blocks == before.kv.num_used_blocks


@pytest.mark.anyio
async def test_stream_reports_the_stop_token_without_text(tiny_engine: LLMEngine) -> None:
    prompt = fresh(20, 27)
    _, full = await collect(tiny_engine.generate(prompt, SamplingParams(max_tokens=16)))
    k = next(i for i in range(2, 16) if full.token_ids[i] not in full.token_ids[:i])
    params = SamplingParams(max_tokens=16, stop_token_ids=(full.token_ids[k],))

    deltas, final = await collect(tiny_engine.generate(prompt, params))

    assert (final.finish_reason, final.token_ids) == (FinishReason.STOP, full.token_ids[: k + 1])
    assert tuple(t for d in deltas for t in d.token_ids) == final.token_ids
    assert deltas[k].token_ids == (full.token_ids[k],) and deltas[k].text == ""
    assert "".join(d.text for d in deltas) == final.text


@pytest.mark.anyio
async def test_closing_the_stream_early_aborts_and_releases_blocks(tiny_engine: LLMEngine) -> None:
    baseline = tiny_engine.stats().kv.num_used_blocks
    received = 0
    async with aclosing(tiny_engine.generate(fresh(40, 21), SamplingParams(max_tokens=2000))) as stream:
        async for event in stream:
            assert isinstance(event, TokenDelta)
            received += 1
            if received == 2:
                assert tiny_engine.stats().kv.num_used_blocks > baseline
                break

    # Aborts are applied at the start of a step, so once a later request has run, the abort has been applied.
    _, final = await collect(tiny_engine.generate(fresh(5, 22), SamplingParams(max_tokens=2)))
    assert final.finish_reason is FinishReason.LENGTH
    stats = tiny_engine.stats()
    assert (stats.running, stats.waiting, stats.kv.num_used_blocks) == (0, 0, baseline)


@pytest.mark.anyio
async def test_abort_by_request_id_finishes_the_stream_as_aborted(tiny_engine: LLMEngine) -> None:
    baseline = tiny_engine.stats().kv.num_used_blocks
    events: list[GenerationEvent] = []
    async for event in tiny_engine.generate(fresh(40, 23), SamplingParams(max_tokens=2000), request_id="to-abort"):
        events.append(event)
        if len(events) == 2:
            tiny_engine.abort("to-abort")

    final = events[-1]
    assert isinstance(final, RequestFinished)
    assert (final.request_id, final.finish_reason) == ("to-abort", FinishReason.ABORTED)
    assert 2 <= len(final.token_ids) < 2000
    assert final.text == "".join(e.text for e in events[:-1] if isinstance(e, TokenDelta))
    # The blocks are freed before the final event is sent.
    assert tiny_engine.stats().kv.num_used_blocks == baseline
    tiny_engine.abort("to-abort")  # aborting a finished request is a no-op
    tiny_engine.abort("never-existed")


@pytest.mark.anyio
async def test_seeded_stream_matches_a_seeded_run_alone(tiny_engine: LLMEngine, engine: LLMEngine) -> None:
    prompt = fresh(25, 24)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=42)
    alone = engine.generate_sync([prompt], seeded)[0]
    results: dict[str, RequestFinished] = {}

    async def run(name: str, p: list[int], params: SamplingParams) -> None:
        results[name] = (await collect(tiny_engine.generate(p, params)))[1]

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "seeded", prompt, seeded)
        tg.start_soon(run, "unseeded", fresh(60, 25), SamplingParams(max_tokens=10, temperature=1.0))
        tg.start_soon(run, "greedy", fresh(30, 26), SamplingParams(max_tokens=10))

    assert results["seeded"].token_ids == alone.token_ids


@pytest.mark.anyio
async def test_engine_busy_when_the_waiting_queue_is_full(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, max_num_seqs=1, max_waiting=1)
    await engine.start()
    try:
        long = SamplingParams(max_tokens=1500)
        running, queued = Collector(), Collector()
        engine.submit(fresh(10, 30), long, "default", running, "running")
        await wait_for(running.started)  # admitted: it holds the only running slot for 1500 steps
        engine.submit(fresh(10, 31), long, "default", queued, "queued")

        with pytest.raises(EngineBusy, match=r"^1 requests are already waiting; retry after 1\.0s$") as busy:
            engine.submit(fresh(10, 32), long, "default", Collector(), "third")
        assert (busy.value.retry_after_s, busy.value.code) == (1.0, "busy")
        with pytest.raises(EngineBusy):
            await collect(engine.generate(fresh(10, 33), long))
        stats = engine.stats()
        assert (stats.running, stats.waiting) == (1, 1)

        engine.abort("running")
        engine.abort("queued")
        await wait_for(running.done)
        await wait_for(queued.done)
        assert running.final.finish_reason is queued.final.finish_reason is FinishReason.ABORTED
        _, final = await collect(engine.generate(fresh(10, 34), SamplingParams(max_tokens=3)))
        assert (final.finish_reason, len(final.token_ids)) == (FinishReason.LENGTH, 3)
        assert engine.stats().kv.num_used_blocks == 0
    finally:
        await engine.stop()


@pytest.mark.anyio
async def test_release_session_frees_its_unique_blocks_and_keeps_the_shared_prefix(tiny_engine: LLMEngine) -> None:
    ns = "sessions"
    shared, own1, own2 = fresh(32, 40), fresh(32, 41), fresh(32, 42)
    params = SamplingParams(max_tokens=8)

    # Each turn leaves 4 full blocks cached (64 prompt + 7 computed reply tokens): 2 shared, 2 its own.
    _, first = await collect(tiny_engine.generate(shared + own1, params, ns, session="s1"))
    _, second = await collect(tiny_engine.generate(shared + own2, params, ns, session="s2"))
    assert (first.stats.cached_tokens, second.stats.cached_tokens) == (0, 32)
    cached_before = tiny_engine.stats().kv.num_cached_blocks

    assert tiny_engine.release_session("s1") == 2
    assert tiny_engine.release_session("s1") == 0
    assert tiny_engine.release_session("unknown") == 0
    assert tiny_engine.stats().kv.num_cached_blocks == cached_before - 2

    _, again1 = await collect(tiny_engine.generate(shared + own1, params, ns, session="s3"))
    _, again2 = await collect(tiny_engine.generate(shared + own2, params, ns))
    assert again1.stats.cached_tokens == 32  # the shared prefix survived; s1's own blocks are gone
    assert again2.stats.cached_tokens == 48  # s2's blocks are untouched (the last prompt token is recomputed)
    assert (again1.token_ids, again2.token_ids) == (first.token_ids, second.token_ids)


@pytest.mark.anyio
async def test_releasing_the_last_session_keeps_its_system_message_cached(tiny_engine: LLMEngine) -> None:
    # NOTE: before, the last open session's release dropped the system prompt with the rest, so the next
    # conversation computed it again (the replay's 16-session level began with a cold 1,090-token prefill).
    ns, bs = "released-system", tiny_engine.info.block_size
    system = {"role": "system", "content": "Refunds are paid within 14 days of the return. " * 3}
    first = [system, {"role": "user", "content": "Where is my order?"}]
    second = [system, {"role": "user", "content": "Can I change the address?"}]
    system_tokens = tiny_engine.tokenize_prompt(first).system_tokens
    assert system_tokens >= 2 * bs
    params = SamplingParams(max_tokens=8)

    await collect(tiny_engine.generate(first, params, ns, session="alone"))
    cached_before = tiny_engine.stats().kv.num_cached_blocks
    freed = tiny_engine.release_session("alone")
    assert freed > 0  # its own turn left
    assert tiny_engine.stats().kv.num_cached_blocks == cached_before - freed

    _, nxt = await collect(tiny_engine.generate(second, params, ns, session="next"))
    assert nxt.stats.cached_tokens == system_tokens // bs * bs


@pytest.mark.anyio
async def test_the_step_thread_loads_the_model(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: so that only one thread holds an OpenMP pool while the engine serves (engine/openmp.py)
    loaded_on: list[str] = []
    original = ModelRunner.from_config

    def spy(config: EngineConfig) -> ModelRunner:
        loaded_on.append(threading.current_thread().name)
        return original(config)

    monkeypatch.setattr(ModelRunner, "from_config", spy)
    engine = make_engine(tiny_model_dir)
    info = await engine.start()
    try:
        assert loaded_on == ["kvchat-engine"]
        assert engine.is_running
        assert await engine.start() == info  # a second start is a no-op
        assert loaded_on == ["kvchat-engine"]
    finally:
        await engine.stop()


def test_submit_many_is_all_or_none_and_schedules_together(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, max_num_seqs=2, max_waiting=1)
    engine.load()
    params = SamplingParams(max_tokens=3)
    with pytest.raises(EngineBusy):  # room for 3: two free running slots and one waiting place
        engine.submit_many([(fresh(8, 40 + i), params, "default", Collector()) for i in range(4)])
    assert (engine.stats().waiting, engine.stats().running) == (0, 0)
    with pytest.raises(InvalidRequestError, match=r"^request id 'x' is already in flight$"):
        engine.submit_many([(fresh(8, 43 + i), params, "default", Collector()) for i in range(2)], ["x", "x"])
    assert engine.stats().waiting == 0

    sinks = [Collector() for _ in range(2)]
    ids = engine.submit_many([(fresh(8, 45 + i), params, "default", sink) for i, sink in enumerate(sinks)])
    assert engine.stats().waiting == 2
    engine.run_until_idle()
    finals = [sink.events[-1] for sink in sinks]
    assert [f.request_id for f in finals if isinstance(f, RequestFinished)] == ids
    assert engine.stats().steps == 3  # one prefill step for both, then two shared decode steps


def _held_load(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[str]]:
    """Make model loading wait until the returned event is set; the list records the loading threads' names."""
    release = threading.Event()
    calls: list[str] = []
    original = ModelRunner.from_config

    def held(config: EngineConfig) -> ModelRunner:
        calls.append(threading.current_thread().name)
        release.wait(10)
        return original(config)

    monkeypatch.setattr(ModelRunner, "from_config", held)
    return release, calls


@pytest.mark.anyio
async def test_starts_share_one_load_and_serving_begins_only_once_loaded(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, calls = _held_load(monkeypatch)
    engine = make_engine(tiny_model_dir)
    first = asyncio.ensure_future(engine.start())
    second = asyncio.ensure_future(engine.start())
    await asyncio.sleep(0.05)
    assert not engine.is_running  # still loading
    with pytest.raises(EngineStopped):
        await collect(engine.generate([5, 6, 7], SamplingParams(max_tokens=1)))
    release.set()
    try:
        assert await first == await second
        assert engine.is_running
        assert calls == ["kvchat-engine"]
    finally:
        await engine.stop()


@pytest.mark.anyio
async def test_stop_during_a_load_makes_start_fail_and_a_new_start_works(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, _ = _held_load(monkeypatch)
    engine = make_engine(tiny_model_dir)
    starting = asyncio.ensure_future(engine.start())
    await asyncio.sleep(0.05)
    stopping = asyncio.ensure_future(engine.stop())
    await asyncio.sleep(0.05)
    release.set()
    await stopping
    with pytest.raises(EngineStopped, match="stopped while it was loading"):
        await starting
    assert not engine.is_running
    await engine.start()
    try:
        assert engine.is_running
        _, final = await collect(engine.generate([5, 6, 7], SamplingParams(max_tokens=2)))
        assert final.stats.completion_tokens == 2
    finally:
        await engine.stop()


# ---------------------------------------------------------------------------------------------------- the bridge


class TokenizerSpy:
    """Wraps the engine tokenizer's encoding methods: counts calls, records their threads, can make them slow."""

    METHODS = ("encode", "apply_chat_template", "apply_chat_template_segments")

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, delay_s: float = 0.0) -> None:
        self.calls = 0
        self.threads: set[int] = set()
        self.delay_s = delay_s
        for name in self.METHODS:
            monkeypatch.setattr(engine.tokenizer, name, self._wrap(getattr(engine.tokenizer, name)))

    def _wrap(self, method: Callable[..., list[int]]) -> Callable[..., list[int]]:
        def spy(*args: Any, **kwargs: Any) -> list[int]:
            self.calls += 1
            self.threads.add(threading.get_ident())
            time.sleep(self.delay_s)
            return method(*args, **kwargs)

        return spy


@pytest.mark.anyio
async def test_generate_tokenizes_off_the_event_loop_and_a_tokenized_prompt_never_again(
    tiny_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = TokenizerSpy(tiny_engine, monkeypatch)
    params = SamplingParams(max_tokens=4)
    _, from_text = await collect(tiny_engine.generate("hello there, a prompt in plain text", params))
    assert spy.calls == 1 and threading.get_ident() not in spy.threads  # tokenized once, in a worker thread
    tokenized = await asyncio.to_thread(tiny_engine.tokenize_prompt, "hello there, a prompt in plain text")
    assert spy.calls == 2
    _, from_ids = await collect(tiny_engine.generate(tokenized, params))
    assert spy.calls == 2  # a TokenizedPrompt is checked, never tokenized again
    assert from_ids.token_ids == from_text.token_ids
    assert from_ids.stats.prompt_tokens == from_text.stats.prompt_tokens == len(tokenized.token_ids)


@pytest.mark.anyio
async def test_an_abort_while_the_request_registers_ends_it_once_registered(
    tiny_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = TokenizerSpy(tiny_engine, monkeypatch, delay_s=0.3)
    events: list[GenerationEvent] = []
    stream = tiny_engine.generate(
        "a prompt that takes a while to tokenize", SamplingParams(max_tokens=2000), request_id="early"
    )
    async with aclosing(stream):
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.1)  # registering: the tokenizer is still busy
        assert spy.calls == 1 and not first.done()
        tiny_engine.abort("early")
        events.append(await first)
        events += [event async for event in stream]
    (final,) = events
    assert isinstance(final, RequestFinished)
    assert (final.request_id, final.finish_reason, final.token_ids) == ("early", FinishReason.ABORTED, ())


@pytest.mark.anyio
async def test_cancelling_generate_while_it_registers_aborts_the_request_once_registered(
    tiny_engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    TokenizerSpy(tiny_engine, monkeypatch, delay_s=0.3)
    before = tiny_engine.stats()

    async def consume() -> None:
        await collect(tiny_engine.generate("cancelled while it registers", SamplingParams(max_tokens=2000)))

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):  # the registration finishes in its thread, then the request is aborted before a step
        after = tiny_engine.stats()
        if after.requests_finished > before.requests_finished:
            break
        await asyncio.sleep(0.05)
    assert after.requests_finished == before.requests_finished + 1
    assert after.generated_tokens == before.generated_tokens and (after.running, after.waiting) == (0, 0)
    assert after.kv.num_used_blocks == before.kv.num_used_blocks
