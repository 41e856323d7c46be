"""Bad input and internal failures: each raises a typed ``EngineError`` with a clear message, and the engine keeps
serving — after every failure a normal request on the same engine succeeds with the tokens a clean run produces."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine.config import EngineConfig
from engine.errors import (
    EmptyPromptError,
    EngineError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    ModelLoadError,
    PromptTooLongError,
    RequestFailed,
)
from engine.llm_engine import LLMEngine
from engine.outputs import FinishReason, GenerationEvent, RequestFinished
from engine.sampling_params import SamplingParams
from engine.testing import Faults
from support.engines import make_engine, one_intra_op_thread

NS = "errors"  # nothing this module caches is shared with other modules' requests
PROBE = [200 + i % 50 for i in range(37)]
PARAMS = SamplingParams(max_tokens=4)


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="module")
def probe_tokens(tiny_model_dir: Path) -> tuple[int, ...]:
    """What a clean engine generates for ``PROBE``: the reference every "still serves" check compares with."""
    engine = make_engine(tiny_model_dir)
    return engine.generate_sync([PROBE], PARAMS, NS)[0].token_ids


async def final_of(engine: LLMEngine, prompt: Any, params: SamplingParams = PARAMS, **kw: Any) -> RequestFinished:
    events = [event async for event in engine.generate(prompt, params, NS, **kw)]
    assert isinstance(events[-1], RequestFinished)
    return events[-1]


async def assert_serves(engine: LLMEngine, probe_tokens: tuple[int, ...]) -> None:
    final = await final_of(engine, PROBE)
    assert (final.finish_reason, final.token_ids) == (FinishReason.LENGTH, probe_tokens)
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv.num_used_blocks) == (0, 0, 0)


# ---------------------------------------------------------------------------------------------------- bad prompts

VOCAB = 384  # the tiny model's vocabulary
BAD_PROMPTS = [
    pytest.param([], EmptyPromptError, r"^the prompt is empty: it must contain at least one token$", id="empty-list"),
    pytest.param("", EmptyPromptError, r"^the prompt is empty", id="empty-string"),
    pytest.param(
        [7] * 2049,
        PromptTooLongError,
        r"^prompt of 2049 tokens plus max_tokens=4 exceeds the model context of 2048 tokens$",
        id="longer-than-context",
    ),
    pytest.param(
        [7] * 2045,
        PromptTooLongError,
        r"^prompt of 2045 tokens plus max_tokens=4 exceeds the model context of 2048 tokens$",
        id="no-room-to-generate",
    ),
    pytest.param(
        [5, VOCAB, 6], InvalidRequestError, rf"^token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)$", id="oov"
    ),
    pytest.param([5, -1], InvalidRequestError, r"^token id -1 is outside the vocabulary", id="negative-id"),
    pytest.param([5, "x"], InvalidRequestError, r"^prompt must be chat messages, a string, or a list of token ids$"),
    pytest.param([True, 5], InvalidRequestError, r"^prompt must be chat messages", id="bool-id"),
    pytest.param(
        [{"role": "wizard", "content": "hi"}], InvalidRequestError, r"^messages\[0\] has role 'wizard'", id="bad-role"
    ),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("prompt", "error", "message"), BAD_PROMPTS)
async def test_bad_prompt_raises_a_typed_error_and_the_engine_serves_on(
    tiny_engine: LLMEngine, probe_tokens: tuple[int, ...], prompt: Any, error: type[EngineError], message: str
) -> None:
    assert tiny_engine.info.vocab_size == VOCAB
    with pytest.raises(error, match=message) as raised:
        await final_of(tiny_engine, prompt)
    assert type(raised.value) is error
    await assert_serves(tiny_engine, probe_tokens)


@pytest.mark.anyio
async def test_prompt_too_long_carries_the_counts(tiny_engine: LLMEngine, probe_tokens: tuple[int, ...]) -> None:
    with pytest.raises(PromptTooLongError) as raised:
        await final_of(tiny_engine, [7] * 3000, SamplingParams(max_tokens=10))
    assert (raised.value.prompt_tokens, raised.value.max_tokens, raised.value.limit) == (3000, 10, 2048)
    assert raised.value.code == "prompt_too_long"
    await assert_serves(tiny_engine, probe_tokens)


def test_a_bad_prompt_in_a_sync_batch_queues_none_of_it(tiny_model_dir: Path, probe_tokens: tuple[int, ...]) -> None:
    engine = make_engine(tiny_model_dir)
    engine.load()
    with pytest.raises(EmptyPromptError):
        engine.generate_sync([PROBE, [5, 6], []], PARAMS, NS)
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.requests_finished, stats.kv.num_used_blocks) == (0, 0, 2, 0)
    results = engine.generate_sync([PROBE], PARAMS, NS)
    assert [r.token_ids for r in results] == [probe_tokens]
    assert engine.stats().requests_finished == 3


# ---------------------------------------------------------------------------------------------------- sampling params

BAD_PARAMS = [
    ({"max_tokens": 0}, r"^max_tokens must be an integer >= 1, got 0$"),
    ({"max_tokens": 2.5}, r"^max_tokens must be an integer >= 1, got 2\.5$"),
    ({"temperature": -0.1}, r"^temperature must be in \[0, 100\], got -0\.1$"),
    ({"temperature": float("nan")}, r"^temperature must be in \[0, 100\], got nan$"),
    ({"top_k": -1}, r"^top_k must be an integer >= 0 \(0 disables it\), got -1$"),
    ({"top_p": 0.0}, r"^top_p must be in \(0, 1\], got 0\.0$"),
    ({"top_p": 1.5}, r"^top_p must be in \(0, 1\], got 1\.5$"),
    ({"seed": -3}, r"^seed must be an integer in \[0, 2\*\*64\), got -3$"),
    ({"min_tokens": 5, "max_tokens": 4}, r"^min_tokens must be in \[0, max_tokens=4\], got 5$"),
    ({"stop_token_ids": (3, -1)}, r"^stop_token_ids must be non-negative integers$"),
    ({"stop": ("",)}, r"^stop strings must be non-empty strings$"),
    ({"stop": tuple("abcdefghijklmnopq")}, r"^at most 16 stop strings are allowed, got 17$"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("kwargs", "message"), BAD_PARAMS, ids=[next(iter(k)) for k, _ in BAD_PARAMS])
async def test_invalid_sampling_params_raise_a_typed_error(
    tiny_engine: LLMEngine, probe_tokens: tuple[int, ...], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=message) as raised:
        await final_of(tiny_engine, PROBE, SamplingParams(**kwargs))
    assert raised.value.code == "invalid_sampling_params"
    await assert_serves(tiny_engine, probe_tokens)


# ---------------------------------------------------------------------------------------------------- model loading


def test_unknown_model_path_is_a_model_load_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    engine = LLMEngine(EngineConfig(model=str(missing), device="cpu", dtype="float32", cache_dir=str(tmp_path)))
    with pytest.raises(ModelLoadError, match=rf"^model path '{missing}' does not exist$") as raised:
        engine.load()
    assert raised.value.code == "model_load_failed"
    assert not engine.is_running


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"GGUF" + bytes(range(256)) * 4, r"^cannot convert GGUF file 'broken\.gguf': "),
        (b"GG", r"^'broken\.gguf' is not a GGUF file \(bad magic b'GG'\) nor a model folder$"),
        (b"PK\x03\x04 not a gguf at all", r"^'broken\.gguf' is not a GGUF file \(bad magic b'PK\\x03\\x04'\)"),
    ],
    ids=["corrupt-body", "truncated", "bad-magic"],
)
def test_corrupt_gguf_is_a_model_load_error(tmp_path: Path, content: bytes, message: str) -> None:
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(content)
    engine = LLMEngine(EngineConfig(model=str(gguf), device="cpu", dtype="float32", cache_dir=str(tmp_path / "cache")))
    with pytest.raises(ModelLoadError, match=message):
        engine.load()
    # Nothing half-converted is left behind to be picked up by the next start.
    models = tmp_path / "cache" / "models"
    assert not models.exists() or list(models.iterdir()) == []


def test_folder_without_weights_is_a_model_load_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    folder = tmp_path / "no-weights"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"^no \*\.safetensors weights in "):
        LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32")).load()


@pytest.mark.anyio
async def test_a_failed_load_leaves_the_running_engine_serving(
    tmp_path: Path, tiny_engine: LLMEngine, probe_tokens: tuple[int, ...]
) -> None:
    broken = LLMEngine(EngineConfig(model=str(tmp_path / "missing"), cache_dir=str(tmp_path)))
    with pytest.raises(ModelLoadError):
        await broken.start()
    assert not broken.is_running  # its step thread (which loads the model) has ended
    with pytest.raises(ModelLoadError):
        await broken.start()  # and a retry fails the same way, instead of hanging
    await assert_serves(tiny_engine, probe_tokens)


# ---------------------------------------------------------------------------------------------------- request ids


@pytest.mark.anyio
async def test_duplicate_request_id_is_refused_and_the_first_request_is_untouched(
    tiny_engine: LLMEngine, probe_tokens: tuple[int, ...]
) -> None:
    events: list[GenerationEvent] = []
    async for event in tiny_engine.generate(PROBE, SamplingParams(max_tokens=1500), NS, request_id="dup"):
        events.append(event)
        if len(events) == 1:  # "dup" is in flight for at least 1499 more steps
            with pytest.raises(InvalidRequestError, match=r"^request id 'dup' is already in flight$"):
                await final_of(tiny_engine, [9, 9, 9], request_id="dup")
        if len(events) == 3:
            tiny_engine.abort("dup")
    final = events[-1]
    assert isinstance(final, RequestFinished)
    assert (final.request_id, final.finish_reason) == ("dup", FinishReason.ABORTED)
    assert final.token_ids[:3] == probe_tokens[:3]  # greedy: the refused duplicate did not disturb it
    await assert_serves(tiny_engine, probe_tokens)


# ---------------------------------------------------------------------------------------------------- step failures


class Sink:
    def __init__(self) -> None:
        self.events: list[GenerationEvent | EngineError] = []
        self.done = threading.Event()

    def __call__(self, event: GenerationEvent | EngineError) -> None:
        self.events.append(event)
        if isinstance(event, RequestFinished | EngineError):
            self.done.set()


@pytest.mark.anyio
async def test_a_step_failing_for_every_request_fails_each_alone_and_the_engine_serves_on(
    tiny_model_dir: Path, probe_tokens: tuple[int, ...]
) -> None:
    engine = make_engine(tiny_model_dir)
    engine.load()
    faults = Faults(forward_requests={"in-flight-0", "in-flight-1"}).install(engine)
    # Queued before the step loop starts, so both are in the first (failing) step.
    sinks = [Sink(), Sink()]
    for i, sink in enumerate(sinks):
        engine.submit(PROBE[i:], PARAMS, NS, sink, request_id=f"in-flight-{i}")
    await engine.start()
    try:
        for sink in sinks:
            assert await anyio.to_thread.run_sync(sink.done.wait, 30)
            [error] = sink.events
            assert type(error) is RequestFailed
            assert str(error) == "internal engine error (see the server log)"
        # The batch failed, then each request failed alone.
        assert faults.forward_batches == [("in-flight-0", "in-flight-1"), ("in-flight-0",), ("in-flight-1",)]
        stats = engine.stats()
        assert (stats.running, stats.waiting, stats.kv.num_used_blocks, stats.requests_finished) == (0, 0, 0, 0)
        await assert_serves(engine, probe_tokens)
    finally:
        await engine.stop()


def test_a_failing_request_in_a_sync_run_raises_its_error_and_the_engine_serves_on(
    tiny_model_dir: Path, probe_tokens: tuple[int, ...]
) -> None:
    engine = make_engine(tiny_model_dir)
    engine.load()
    faults = Faults(forward_tokens={PROBE[0]}).install(engine)
    with pytest.raises(RequestFailed, match=r"^internal engine error \(see the server log\)$"):
        engine.generate_sync([PROBE, [5, 6, 7]], PARAMS, NS)
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv.num_used_blocks, stats.requests_finished) == (0, 0, 0, 1)
    faults.clear()
    assert [r.token_ids for r in engine.generate_sync([PROBE], PARAMS, NS)] == [probe_tokens]


def test_a_failing_scheduler_still_fails_the_requests_in_flight_and_the_engine_serves_on(
    tiny_model_dir: Path, probe_tokens: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside the isolated parts (forward, sampling, detokenizing) a failure is a bug: every request fails."""
    engine = make_engine(tiny_model_dir)
    engine.load()
    scheduler = engine._scheduler
    assert scheduler is not None
    real = scheduler.schedule

    def schedule() -> Any:
        monkeypatch.setattr(scheduler, "schedule", real)
        raise RuntimeError("simulated scheduler bug")

    monkeypatch.setattr(scheduler, "schedule", schedule)
    with pytest.raises(RuntimeError, match=r"^simulated scheduler bug$"):
        engine.generate_sync([PROBE, [5, 6, 7]], PARAMS, NS)
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv.num_used_blocks) == (0, 0, 0)
    assert [r.token_ids for r in engine.generate_sync([PROBE], PARAMS, NS)] == [probe_tokens]


def test_random_valid_prompts_still_work_after_errors(tiny_model_dir: Path, probe_tokens: tuple[int, ...]) -> None:
    """Errors interleaved with good requests in one synchronous engine: each error leaves no trace."""
    engine = make_engine(tiny_model_dir)
    engine.load()
    rng = random.Random(3)
    bad: list[Any] = [[], [VOCAB], [7] * 2050, [-5]]
    for prompt in bad:
        with pytest.raises(InvalidRequestError):
            engine.generate_sync([prompt], PARAMS, NS)
        good = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 40))]
        assert engine.generate_sync([good], PARAMS, NS)[0].finish_reason is FinishReason.LENGTH
    assert engine.generate_sync([PROBE], PARAMS, NS)[0].token_ids == probe_tokens
    assert engine.stats().requests_finished == len(bad) + 1


def test_max_waiting_zero_is_refused_at_config_time() -> None:
    with pytest.raises(InvalidRequestError, match="max_waiting=0"):
        EngineConfig(max_waiting=0)


def test_generate_sync_on_a_running_engine_queues_nothing(tiny_engine: LLMEngine) -> None:
    before = tiny_engine.stats()
    with pytest.raises(InvalidRequestError, match="cannot be used while the step loop runs"):
        tiny_engine.generate_sync([PROBE], PARAMS, NS)
    after = tiny_engine.stats()
    assert (after.running, after.waiting, after.requests_finished) == (0, 0, before.requests_finished)
