from __future__ import annotations

import pytest

from engine.errors import EmptyPromptError
from engine.kv.block_hash import root_hash
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus

ROOT = root_hash("m", "ns")


def test_status_is_finished() -> None:
    assert not SequenceStatus.WAITING.is_finished
    assert not SequenceStatus.RUNNING.is_finished
    assert SequenceStatus.FINISHED_STOPPED.is_finished
    assert SequenceStatus.FINISHED_LENGTH.is_finished
    assert SequenceStatus.FINISHED_ABORTED.is_finished


def test_new_sequence_defaults_and_token_views() -> None:
    seq = Sequence("r1", [1, 2, 3], SamplingParams(max_tokens=4), ROOT)
    assert seq.status is SequenceStatus.WAITING
    assert (seq.num_computed_tokens, seq.num_cached_tokens, seq.num_prefilled_tokens, seq.num_preemptions) == (
        0,
        0,
        0,
        0,
    )
    assert seq.first_scheduled_time is None
    assert seq.arrival_time > 0
    seq.append_token(9)
    seq.append_token(8)
    assert seq.all_token_ids == [1, 2, 3, 9, 8]
    assert seq.output_token_ids == [9, 8]
    assert seq.prompt_token_ids == [1, 2, 3]
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (5, 3, 2)
    assert not seq.is_finished
    assert "r1" in repr(seq)


def test_all_token_ids_is_a_copy() -> None:
    seq = Sequence("r1", [1, 2], SamplingParams(), ROOT)
    seq.all_token_ids.append(5)
    assert seq.num_tokens == 2


def test_empty_prompt_is_rejected() -> None:
    with pytest.raises(EmptyPromptError):
        Sequence("r1", [], SamplingParams(), ROOT)


def test_identity_equality() -> None:
    a = Sequence("r1", [1], SamplingParams(), ROOT)
    b = Sequence("r1", [1], SamplingParams(), ROOT)
    assert a != b
    assert a == a
