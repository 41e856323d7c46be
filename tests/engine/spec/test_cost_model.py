"""The draft cost model: the draft length with the most tokens per ms, none where drafts do not pay."""

from __future__ import annotations

import pytest
import torch

from engine.spec.cost_model import (
    MEASURED,
    UNMEASURED,
    Acceptance,
    DraftCostModel,
    LiveCostModel,
    chances,
    for_machine,
    score,
)

MODEL = DraftCostModel(base_ms=((1, 16.0), (4, 20.0), (16, 40.0)), row_ms=1.0, acceptance=0.5)


def test_the_step_is_interpolated_between_measured_batches_and_extrapolated_beyond() -> None:
    expected = [16.0, pytest.approx(16 + 4 / 3), 20.0, 30.0, 40.0, 60.0]
    assert [MODEL.step_ms(b) for b in (1, 2, 4, 10, 16, 28)] == expected


def test_fewer_drafts_pay_as_the_batch_grows_and_none_at_last() -> None:
    likely = [0.9**i for i in range(1, 17)]
    rows = [MODEL.rows(b, likely) for b in (1, 2, 4, 8, 16)]
    assert rows == sorted(rows, reverse=True)
    assert rows[0] >= 8 > rows[-1]
    costly = DraftCostModel(base_ms=((1, 16.0), (16, 40.0)), row_ms=3.0, acceptance=0.5)  # a share of 2.5 ms at 16
    assert costly.rows(1, likely) > 0
    assert costly.gain(16, [1.0]) < 1.05
    assert costly.rows(16, [1.0] * 8) == costly.limit(16) == 0


def test_a_draft_sure_to_pass_is_verified_whole_where_a_row_costs_less_than_a_token() -> None:
    assert MODEL.rows(1, [1.0] * 20) == 20
    assert MODEL.rows(16, [1.0] * 30) == MODEL.limit(16) == MODEL.max_draft_tokens == 24  # a share of 2.5 ms, 1 a row


def test_the_draft_stops_where_its_tokens_become_unlikely() -> None:
    assert MODEL.rows(4, [1.0, 1.0, 1.0, 0.1, 0.05]) == 3
    assert MODEL.rows(1, [0.02]) == 0


def test_the_verify_paths_own_cost_raises_the_chance_a_lone_first_token_needs() -> None:
    plain = DraftCostModel(base_ms=((1, 10.0), (16, 30.0)), row_ms=1.0, acceptance=0.5)
    with_path = DraftCostModel(base_ms=((1, 10.0), (16, 30.0)), row_ms=1.0, verify_ms=2.0, acceptance=0.5)
    assert plain.rows(1, [0.2]) == 1  # 1.2 tokens for 11 ms against 1 for 10
    assert with_path.rows(1, [0.2]) == 0  # 1.2 for 13 ms
    assert with_path.rows(1, [0.9, 0.8, 0.7]) == 3  # longer likely drafts still pay


def test_chances_follow_the_tree_scaled_by_the_measured_rate() -> None:
    assert chances([1.0, 1.0, 0.5], 1.0) == [1.0, 1.0, 0.5]
    assert chances([1.0, 1.0, 0.5], 0.5) == [0.5, 0.25, 0.0625]
    assert chances([0.5, 0.5], 1.0) == [0.5, 0.5]  # the second token surely follows the first


def test_a_draft_is_scored_on_the_positions_the_request_produced() -> None:
    assert score([5, 6, 7], [1.0, 1.0, 0.5], [5, 6, 7, 8]) == (3, 2.5)
    assert score([5, 6, 7], [1.0, 1.0, 0.5], [5, 9]) == (1, 2.0)  # passed one, failed at the second
    assert score([5, 6, 7], [1.0, 1.0, 0.5], [4]) == (0, 1.0)  # not verified: the decoded token tries the first


def test_the_measured_rate_moves_from_the_prior_to_what_passes() -> None:
    rate = Acceptance(0.5)
    assert rate.rate() == 0.5
    for _ in range(100):
        rate.observe(0, 1.0)
    assert rate.rate() < 0.1
    for _ in range(100):
        rate.observe(4, 4.0)
    assert rate.rate() > 0.95
    assert Acceptance(0.5).rate(prior=0.9) == 0.9


def test_the_live_model_verifies_more_of_a_request_whose_drafts_pass() -> None:
    live = LiveCostModel(MODEL)
    likely = [1.0] * 8
    passing, failing = Acceptance(0.5), Acceptance(0.5)
    for _ in range(40):
        passing.observe(4, 4.0)
        failing.observe(0, 1.0)
    assert live.rows(1, likely, passing) == 8 > live.rows(1, likely) > live.rows(1, likely, failing) == 0


def test_kinds_not_measured_draft_for_a_lone_sequence_only() -> None:
    assert UNMEASURED.limit(1) > 0
    assert UNMEASURED.limit(2) == 0
    assert for_machine(torch.bfloat16, "cuda") is None
    assert (
        for_machine(torch.bfloat16, flags=frozenset({"amx_bf16", "amx_tile", "avx512_bf16", "avx512f"}))
        is (MEASURED[("AMX", torch.bfloat16)])
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zen4_has_its_own_model_in_both_dtypes(dtype: torch.dtype) -> None:
    zen4 = frozenset({"avx2", "fma", "avx512f", "avx512_bf16"})
    model = for_machine(dtype, flags=zen4)
    assert model is MEASURED[("AVX-512 + AVX512-BF16", dtype)]
    assert model.rows(1, [1.0, 1.0]) > 0  # a lone sequence verifies drafts at the prior acceptance


def test_a_row_cost_that_grows_with_the_batch_turns_drafts_off_sooner() -> None:
    flat = DraftCostModel(base_ms=((1, 28.0), (16, 100.0)), row_ms=1.5, acceptance=0.5)
    growing = DraftCostModel(base_ms=((1, 28.0), (16, 100.0)), row_ms=((1, 1.5), (16, 3.0)), acceptance=0.5)
    assert growing.row_cost(1) == 1.5 and growing.row_cost(16) == 3.0 and growing.row_cost(31) == 4.5
    assert growing.rows(1, [0.6] * 8) == flat.rows(1, [0.6] * 8) > 0  # the same figure where they agree
    chances = [0.5, 0.25]
    assert flat.rows(16, chances) > 0  # at 1.5 ms a row, a half-sure draft still pays beside 15 others ...
    assert growing.rows(16, chances) == 0  # ... at the 3 ms measured there, it does not
