"""The engine's values survive JSON both ways (``backend/engine_client/wire.py``, ``messages.py``), and errors keep
their class."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from backend.engine_client.messages import CompletionRequest, KvchatExtra
from backend.engine_client.remote_cache import _summed
from backend.engine_client.values import (
    EngineBusy,
    EngineStats,
    InvalidSamplingParamsError,
    PromptTooLongError,
    SamplingParams,
    StructuredOutput,
    TokenLogprob,
    TokenSpan,
)
from backend.engine_client.wire import WireError, decode, encode, error_body, error_from_body
from engine.errors import RequestFailed
from engine.llm_engine import LLMEngine
from engine.sampling_params import GrammarKind, RepetitionScope


def _through_json(value: object) -> object:
    return json.loads(json.dumps(encode(value)))


def test_sampling_params_round_trip_exactly() -> None:
    params = SamplingParams(
        max_tokens=7, temperature=0.7, top_k=5, seed=3, stop=("END",), stop_token_ids=(2,),
        logit_bias=((4, -1.5),), logprobs=2, structured=StructuredOutput(GrammarKind.JSON_OBJECT),
        repetition_penalty=1.2, repetition_penalty_scope=RepetitionScope.REPLY,
    )  # fmt: skip
    read = decode(SamplingParams, _through_json(params))
    assert read == params
    assert read.repetition_penalty_scope is RepetitionScope.REPLY


@pytest.mark.parametrize("drafts", [None, False, True])
def test_the_drafts_choice_travels_to_an_engine_server(drafts: bool | None) -> None:
    sent = CompletionRequest(prompt=[1, 2], kvchat=KvchatExtra(sampling=SamplingParams(max_tokens=3, drafts=drafts)))
    read = CompletionRequest.model_validate_json(json.dumps(sent.model_dump(mode="json", exclude_none=True)))
    assert read.kvchat is not None and read.kvchat.sampling is not None
    assert read.kvchat.sampling.drafts is drafts


def test_bad_sampling_is_the_engines_error() -> None:
    with pytest.raises(InvalidSamplingParamsError):
        decode(SamplingParams, {"temperature": -1.0})
    with pytest.raises(WireError, match="structured"):
        decode(SamplingParams, {"structured": {"kind": "nope"}})
    with pytest.raises(WireError, match="repetition_penalty_scope"):
        decode(SamplingParams, {"repetition_penalty_scope": "prompt"})


def test_a_completion_request_round_trips_with_its_extras() -> None:
    spans = (TokenSpan(0, 4, "policy", 1, None), TokenSpan(4, 9, "question", 2, 1))
    params = SamplingParams(max_tokens=3, stop=("x",), logit_bias=((1, 2.0),))
    sent = CompletionRequest(
        prompt=[1, 2, 3], stream=True, kvchat=KvchatExtra(spans=spans, system_tokens=4, session="s", sampling=params)
    )
    read = CompletionRequest.model_validate_json(json.dumps(sent.model_dump(mode="json", exclude_none=True)))
    assert read.kvchat is not None
    assert read.kvchat.spans == spans and read.kvchat.sampling == params and read.kvchat.system_tokens == 4
    with pytest.raises(ValidationError):
        KvchatExtra.model_validate({"spans": [{"start": 5, "end": 1, "block_type": "x"}]})


def test_logprobs_round_trip() -> None:
    kind = tuple[TokenLogprob, ...]
    logprobs = (TokenLogprob(3, -0.5, ((3, -0.5), (9, -1.25))),)
    assert decode(kind, json.loads(json.dumps(encode(logprobs, kind)))) == logprobs


def test_stats_round_trip_and_sum(tiny_engine: LLMEngine) -> None:
    stats = tiny_engine.stats()
    decoded = decode(EngineStats, _through_json(stats))
    assert decoded == stats
    double = _summed([decoded, decoded])
    assert double.kv.num_blocks == 2 * stats.kv.num_blocks
    assert double.cache.num_lookups == 2 * stats.cache.num_lookups
    assert dict(double.cache.hit_tokens_by_type) == {k: 2 * v for k, v in stats.cache.hit_tokens_by_type.items()}


def test_a_report_with_a_missing_field_is_a_wire_error(tiny_engine: LLMEngine) -> None:
    data = encode(tiny_engine.stats())
    del data["kv"]["num_blocks"]
    with pytest.raises(WireError, match=r"kv\.num_blocks"):
        decode(EngineStats, data)
    with pytest.raises(WireError):
        decode(EngineStats, [1, 2])


def test_errors_keep_their_class_and_details() -> None:
    busy = error_from_body(_through_json(error_body(EngineBusy("queue full", 2.5))), "x")
    assert isinstance(busy, EngineBusy) and busy.retry_after_s == 2.5
    long = error_from_body(_through_json(error_body(PromptTooLongError(10, 5, 12, "KV cache pool"))), "x")
    assert isinstance(long, PromptTooLongError) and long.limit == 12 and "KV cache pool" in str(long)
    assert isinstance(error_from_body({"error": {"code": "whatever", "message": "m"}}, "x"), RequestFailed)
    assert isinstance(error_from_body("<html>", "the replica failed"), RequestFailed)
