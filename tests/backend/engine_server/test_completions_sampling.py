"""An engine server's ``/v1`` fields → the engine's ``SamplingParams`` (``sampling_of``), without a server."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from backend.engine_client.messages import CompletionRequest
from backend.engine_server.completions import sampling_of
from engine.sampling_params import RepetitionScope


def test_the_repetition_penalty_scope_reaches_the_engine() -> None:
    body = CompletionRequest.model_validate(
        {"prompt": [1, 2], "repetition_penalty": 1.2, "repetition_penalty_scope": "reply"}
    )
    params = sampling_of(body)
    assert (params.repetition_penalty, params.repetition_penalty_scope) == (1.2, RepetitionScope.REPLY)
    left_out = sampling_of(CompletionRequest.model_validate({"prompt": [1, 2], "repetition_penalty": 1.2}))
    assert left_out.repetition_penalty_scope is RepetitionScope.ALL


def test_an_unknown_scope_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="repetition_penalty_scope"):
        CompletionRequest.model_validate({"prompt": [1], "repetition_penalty_scope": "prompt"})
