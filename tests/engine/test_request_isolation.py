"""One poisoned request fails alone (issue 20, defect 1): faults injected into the forward pass or the sampler for one
request of a batch fail that request with ``RequestFailed``; the others finish with exactly the tokens of a clean run
(greedy, fp32 tiny model); no block leaks, no block of the failed step is published, and the engine serves on."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine.errors import EngineError, RequestFailed
from engine.llm_engine import LLMEngine
from engine.outputs import FinishReason, GenerationEvent, RequestFinished, TokenDelta
from engine.sampling_params import SamplingParams
from engine.testing import Faults
from support.engines import make_engine, one_intra_op_thread

NS = "isolation"
BS = 16
PARAMS = SamplingParams(max_tokens=6)
INTERNAL = "internal engine error (see the server log)"


def prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids starting with a token of their own (no two prompts share a cached block)."""
    rng = random.Random(seed)
    return [10 + seed] + [rng.randrange(20, 384) for _ in range(n - 1)]


INNOCENT = {"a": prompt(37, 1), "b": prompt(5, 2), "c": prompt(50, 3)}
POISON = prompt(40, 4)  # two full blocks + 8 tokens: a clean run would publish two blocks
POISON_TOKEN = 7  # appears in no other prompt
POISONED = [*POISON[:20], POISON_TOKEN, *POISON[21:]]


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="module")
def clean_tokens(tiny_model_dir: Path) -> dict[str, tuple[int, ...]]:
    """What a clean engine generates for each prompt, run without the poisoned one."""
    engine = make_engine(tiny_model_dir)
    names = [*INNOCENT, "poison"]
    results = engine.generate_sync([*INNOCENT.values(), POISON], PARAMS, NS)
    return {name: r.token_ids for name, r in zip(names, results, strict=True)}


class Events:
    def __init__(self) -> None:
        self.events: list[GenerationEvent | EngineError] = []

    def __call__(self, event: GenerationEvent | EngineError) -> None:
        self.events.append(event)

    @property
    def final(self) -> RequestFinished:
        final = self.events[-1]
        assert isinstance(final, RequestFinished), self.events
        return final


def run_batch(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, Events]:
    """Submit ``prompts`` together (one batch, request id = name) and drive the engine until idle."""
    sinks = {name: Events() for name in prompts}
    engine.submit_many([(p, PARAMS, NS, sinks[name]) for name, p in prompts.items()], list(prompts))
    engine.run_until_idle()
    return sinks


def loaded(tiny_model_dir: Path) -> LLMEngine:
    engine = make_engine(tiny_model_dir)
    engine.load()
    return engine


def assert_failed_alone(sink: Events) -> None:
    [error] = [e for e in sink.events if isinstance(e, EngineError)]
    assert type(error) is RequestFailed
    assert (error.code, str(error)) == ("request_failed", INTERNAL)
    assert sink.events[-1] is error
    assert not any(isinstance(e, RequestFinished) for e in sink.events)


FAULTS: dict[str, Callable[[], Faults]] = {
    "forward-raises": lambda: Faults(forward_requests={"poison"}),
    "forward-on-a-poisoned-token": lambda: Faults(forward_tokens={POISON_TOKEN}),
    "forward-writes-nan-kv": lambda: Faults(corrupt_kv={"poison"}),
    "nan-logits": lambda: Faults(nan_logits={"poison"}),
    "sampler-raises": lambda: Faults(sample_requests={"poison"}),
}


@pytest.mark.parametrize("make_faults", FAULTS.values(), ids=FAULTS.keys())
def test_a_poisoned_request_fails_alone_and_the_others_match_a_clean_run(
    tiny_model_dir: Path, clean_tokens: dict[str, tuple[int, ...]], make_faults: Callable[[], Faults]
) -> None:
    engine = loaded(tiny_model_dir)
    free_before = engine.stats().kv.num_free_blocks
    faults = make_faults().install(engine)
    prompts = {"a": INNOCENT["a"], "poison": POISONED, "b": INNOCENT["b"], "c": INNOCENT["c"]}
    sinks = run_batch(engine, prompts)

    assert_failed_alone(sinks["poison"])
    for name in INNOCENT:
        assert (sinks[name].final.finish_reason, sinks[name].final.token_ids) == (
            FinishReason.LENGTH,
            clean_tokens[name],
        )
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv.num_used_blocks) == (0, 0, 0)
    assert stats.kv.num_free_blocks == free_before
    assert stats.requests_finished == 3

    # The engine serves on: the same prompts again (a, b, c now hit the cache) give the same tokens.
    faults.clear()
    again = run_batch(engine, {**INNOCENT, "poison": POISONED})
    for name in INNOCENT:
        assert again[name].final.token_ids == clean_tokens[name]
        assert again[name].final.stats.cached_tokens == (len(INNOCENT[name]) - 1) // BS * BS
    # No block the failed step wrote was published: the poisoned prompt is computed from scratch.
    assert again["poison"].final.stats.cached_tokens == 0
    assert engine.stats().kv.num_free_blocks == free_before


def test_a_failing_forward_is_bisected_down_to_the_culprit(tiny_model_dir: Path) -> None:
    engine = loaded(tiny_model_dir)
    faults = Faults(forward_requests={"poison"}).install(engine)
    run_batch(engine, {"a": INNOCENT["a"], "poison": POISONED, "b": INNOCENT["b"], "c": INNOCENT["c"]})
    assert faults.forward_batches[:5] == [
        ("a", "poison", "b", "c"),  # the whole step fails
        ("a", "poison"),  # the half with the culprit fails
        ("a",),
        ("poison",),  # fails alone: failed
        ("b", "c"),
    ]
    assert faults.forward_batches[5] == ("a", "b", "c")  # the next step: the culprit is gone


def test_the_blocks_of_a_failed_step_are_zeroed_before_they_are_freed(tiny_model_dir: Path) -> None:
    engine = loaded(tiny_model_dir)
    Faults(corrupt_kv={"poison"}).install(engine)
    assert engine._runner is not None
    pool = engine._runner.kv_pool
    run_batch(engine, {"poison": POISONED})
    assert not bool(pool.isnan().any())


def test_a_request_failing_mid_decode_keeps_its_streamed_tokens_and_the_others_go_on(
    tiny_model_dir: Path, clean_tokens: dict[str, tuple[int, ...]]
) -> None:
    engine = loaded(tiny_model_dir)
    faults = Faults().install(engine)
    sinks = {name: Events() for name in ("a", "poison")}

    def poison_after_two_tokens(event: GenerationEvent | EngineError) -> None:
        sinks["poison"](event)
        if isinstance(event, TokenDelta) and len(sinks["poison"].events) == 2:
            faults.nan_logits.add("poison")

    engine.submit_many(
        [(INNOCENT["a"], PARAMS, NS, sinks["a"]), (POISON, PARAMS, NS, poison_after_two_tokens)], ["a", "poison"]
    )
    engine.run_until_idle()
    assert sinks["a"].final.token_ids == clean_tokens["a"]
    tokens = [t for e in sinks["poison"].events if isinstance(e, TokenDelta) for t in e.token_ids]
    assert tokens == list(clean_tokens["poison"][:2])
    assert_failed_alone(sinks["poison"])
    assert engine.stats().kv.num_used_blocks == 0


def test_a_sink_that_raises_fails_only_its_own_request(
    tiny_model_dir: Path, clean_tokens: dict[str, tuple[int, ...]]
) -> None:
    engine = loaded(tiny_model_dir)
    good = Events()
    calls: list[GenerationEvent | EngineError] = []

    def broken(event: GenerationEvent | EngineError) -> None:
        calls.append(event)
        raise RuntimeError("the client went away badly")

    engine.submit_many([(INNOCENT["a"], PARAMS, NS, good), (INNOCENT["b"], PARAMS, NS, broken)], ["a", "broken"])
    engine.run_until_idle()
    assert good.final.token_ids == clean_tokens["a"]
    assert [type(e) for e in calls] == [TokenDelta, RequestFailed]  # its first token raised; the error was offered
    assert engine.stats().kv.num_used_blocks == 0
