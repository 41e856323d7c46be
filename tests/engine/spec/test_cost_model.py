"""The draft cost model: the draft length with the most tokens per ms, none where drafts do not pay."""

from __future__ import annotations

import pytest
import torch

from engine.spec.cost_model import MEASURED, UNMEASURED, DraftCostModel, LiveCostModel, for_machine

MODEL = DraftCostModel(base_ms=((1, 16.0), (4, 20.0), (16, 40.0)), row_ms=1.0, acceptance=0.5)


def test_the_step_is_interpolated_between_measured_batches_and_extrapolated_beyond() -> None:
    expected = [16.0, pytest.approx(16 + 4 / 3), 20.0, 30.0, 40.0, 60.0]
    assert [MODEL.step_ms(b) for b in (1, 2, 4, 10, 16, 28)] == expected


def test_fewer_drafts_pay_as_the_batch_grows_and_none_at_last() -> None:
    limits = [MODEL.limit(b) for b in (1, 2, 4, 8, 16, 64)]
    assert limits == sorted(limits, reverse=True)
    assert limits[0] >= 2
    assert MODEL.limit(64) == 0
    assert MODEL.gain(64, 1) < 1.05


def test_a_higher_acceptance_drafts_more() -> None:
    assert MODEL.limit(1, acceptance=0.9) > MODEL.limit(1, acceptance=0.5) > MODEL.limit(1, acceptance=0.2)


def test_the_live_estimate_follows_the_acceptance_within_its_bounds() -> None:
    live = LiveCostModel(MODEL)
    assert live.acceptance == 0.5
    for _ in range(200):
        live.observe(8, 0)
    assert live.acceptance == 0.3
    for _ in range(200):
        live.observe(8, 8)
    assert live.acceptance == 0.9
    assert live.limit(1) == MODEL.limit(1, 0.9)


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
    assert model.limit(1) > 0  # a lone sequence verifies drafts at the prior acceptance
