"""Penalties, stop strings, logit bias, logprobs and a JSON grammar keep kvchat's exactness (fp32, tiny model):
a turn served from the prefix cache equals a cold one, and batch neighbours never change a reply."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.llm_engine import LLMEngine
from engine.outputs import FinishReason, RequestFinished, TokenLogprob
from engine.request_table import Collector
from engine.sampling_params import GrammarKind, SamplingParams, StructuredOutput
from support.engines import make_engine, one_intra_op_thread

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
PENALTIES = {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.3}
CONTROLS = {
    "penalties": SamplingParams(max_tokens=24, **PENALTIES),  # type: ignore[arg-type]
    "grammar": SamplingParams(
        max_tokens=64,
        temperature=0.8,
        seed=11,
        structured=StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)),
        **PENALTIES,  # type: ignore[arg-type]
    ),
    "bias-min-p-logprobs": SamplingParams(
        max_tokens=24, temperature=1.1, seed=5, min_p=0.05, logit_bias=((40, 4.0), (41, -4.0)), logprobs=2
    ),
}
SYSTEM = "You are a helpful customer-service assistant for an online store. Our return policy allows returns."
TURN_1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is my blue jacket order?"}]


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="module")
def cold(tiny_model_dir: Path) -> LLMEngine:
    engine = make_engine(tiny_model_dir, enable_prefix_caching=False, max_num_seqs=16)
    engine.load()
    return engine


@pytest.fixture(scope="module")
def warm(tiny_model_dir: Path) -> LLMEngine:
    engine = make_engine(tiny_model_dir, max_num_seqs=16)
    engine.load()
    return engine


def run(engine: LLMEngine, requests: list[tuple[list[dict[str, str]], SamplingParams]]) -> list[RequestFinished]:
    """The requests submitted together (one batch), driven to the end; results in order."""
    collect = Collector()
    ids = [engine.submit(messages, params, "exactness", collect) for messages, params in requests]
    engine.run_until_idle()
    return collect.results(ids)


def second_turn(first: RequestFinished) -> list[dict[str, str]]:
    reply = {"role": "assistant", "content": first.text}
    return [*TURN_1, reply, {"role": "user", "content": "Can I return it if it is late?"}]


def with_stop_from(params: SamplingParams, reference: RequestFinished) -> SamplingParams:
    """``params`` plus a stop string that its own cold reply contains, so the stop really fires."""
    text = reference.text
    stop = next(text[i : i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i : i + 2].strip())
    return SamplingParams(**{**_fields(params), "stop": (stop,)})


def same_reply(a: RequestFinished, b: RequestFinished) -> bool:
    """Same tokens and text; the same logprob ids, with values equal to float32 rounding (a cached prefix is computed
    in another order than a cold prefill: the logits may differ in their last bits, never in the choice)."""
    if (a.token_ids, a.text, a.finish_reason) != (b.token_ids, b.text, b.finish_reason):
        return False
    if a.logprobs is None or b.logprobs is None:
        return a.logprobs == b.logprobs
    return all(_close(x, y) for x, y in zip(a.logprobs, b.logprobs, strict=True))


def _close(a: TokenLogprob, b: TokenLogprob) -> bool:
    ids = (a.token_id, [t for t, _ in a.top]) == (b.token_id, [t for t, _ in b.top])
    values = [a.logprob, *(v for _, v in a.top)], [b.logprob, *(v for _, v in b.top)]
    return ids and all(abs(x - y) <= 1e-5 for x, y in zip(*values, strict=True))


def _fields(params: SamplingParams) -> dict[str, object]:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


@pytest.mark.parametrize("name", CONTROLS)
def test_a_cached_turn_equals_a_cold_one(cold: LLMEngine, warm: LLMEngine, name: str) -> None:
    params = CONTROLS[name]
    [first] = run(warm, [(TURN_1, params)])
    turn_2 = second_turn(first)
    [reference] = run(cold, [(turn_2, params)])
    stopped = with_stop_from(params, reference)
    [cold_stopped] = run(cold, [(turn_2, stopped)])

    [cached] = run(warm, [(turn_2, params)])
    [cached_stopped] = run(warm, [(turn_2, stopped)])

    assert cached.stats.cached_tokens > 0
    assert reference.stats.cached_tokens == 0
    assert same_reply(cached, reference)
    assert cold_stopped.finish_reason is FinishReason.STOP
    assert len(cold_stopped.token_ids) < len(reference.token_ids)
    assert same_reply(cached_stopped, cold_stopped)
    if params.structured is not None and reference.finish_reason is FinishReason.STOP:
        reply = json.loads(reference.text)
        assert set(reply) == {"status", "days", "note"}


def test_batch_neighbours_never_change_a_reply(cold: LLMEngine) -> None:
    turn_2 = [*TURN_1, {"role": "assistant", "content": "Let me check."}, {"role": "user", "content": "Thanks!"}]
    alone = {name: run(cold, [(turn_2, params)])[0] for name, params in CONTROLS.items()}
    neighbours = [
        (TURN_1, SamplingParams(max_tokens=30)),
        (turn_2, SamplingParams(max_tokens=10, temperature=1.0)),
        (TURN_1, SamplingParams(max_tokens=40, temperature=0.5, seed=1, repetition_penalty=2.0)),
        (TURN_1, SamplingParams(max_tokens=20, structured=StructuredOutput(GrammarKind.JSON_OBJECT))),
    ]
    together = run(cold, [neighbours[0], *((turn_2, p) for p in CONTROLS.values()), *neighbours[1:]])
    for (name, expected), got in zip(alone.items(), together[1:4], strict=True):
        assert same_reply(got, expected), name


def test_json_schema_replies_parse_and_validate(cold: LLMEngine) -> None:
    params = CONTROLS["grammar"]
    prompts = [[{"role": "user", "content": f"Order {i}: where is it?"}] for i in range(12)]
    results = run(cold, [(p, SamplingParams(**{**_fields(params), "seed": i})) for i, p in enumerate(prompts)])
    for result in results:
        assert result.finish_reason is FinishReason.STOP, result.text
        reply = json.loads(result.text)
        assert reply["status"] in {"pending", "shipped", "delivered"}
        assert 0 <= reply["days"] <= 30
        assert isinstance(reply["note"], str)
        assert len(reply["note"]) <= 10
