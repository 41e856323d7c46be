"""The kernel-selection table: what it picks for known CPUs, that the loader and ``linear`` follow it, and what this
machine exercised."""

from __future__ import annotations

import pytest
import torch

from engine.model import kernels
from engine.model.kernels import Layout, Op

ZEN1 = frozenset({"avx2", "fma"})
ZEN4 = ZEN1 | {"avx512f", "avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_tile"}
BF16, F32 = torch.bfloat16, torch.float32


def _pick(op: Op, dtype: torch.dtype, rows: int, flags: frozenset[str]) -> str:
    """The first row for these CPU flags, assuming every library builds."""
    return next(i.name for i in kernels.TABLE if i.op is op and i.matches(dtype, rows, flags))


@pytest.mark.parametrize(
    ("flags", "dtype", "rows", "expected"),
    [
        (SAPPHIRE_RAPIDS, BF16, 1, "amx_tiles"),
        (SAPPHIRE_RAPIDS, BF16, kernels.WIDE_ROWS - 1, "amx_tiles"),
        (SAPPHIRE_RAPIDS, BF16, kernels.WIDE_ROWS, "F.linear_dense_copy"),
        (SAPPHIRE_RAPIDS, BF16, 2048, "F.linear_dense_copy"),
        (SAPPHIRE_RAPIDS, F32, 2048, "fp32_panels"),
        (ZEN4, BF16, 2048, "bf16_pairs"),
        (ZEN4, BF16, 16, "bf16_pairs"),
        (ZEN1, F32, 2048, "fp32_panels"),
        (frozenset(), F32, 48, "gguf_blocks"),
        (frozenset(), F32, 49, "F.linear"),
        (frozenset(), BF16, 4, "gguf_blocks"),
        (frozenset(), BF16, 5, "F.linear"),
    ],
)
def test_linear_rows(flags: frozenset[str], dtype: torch.dtype, rows: int, expected: str) -> None:
    assert _pick(Op.LINEAR, dtype, rows, flags) == expected


def test_attention_rows() -> None:
    assert _pick(Op.PREFILL_ATTENTION, BF16, 30, SAPPHIRE_RAPIDS) == "sdpa"
    assert _pick(Op.PREFILL_ATTENTION, BF16, 30, ZEN4) == "c_tiles"
    assert _pick(Op.PREFILL_ATTENTION, F32, 30, ZEN1) == "c_tiles"
    assert _pick(Op.PREFILL_ATTENTION, BF16, 30, ZEN1) == "sdpa"
    assert _pick(Op.DECODE_ATTENTION, BF16, 0, ZEN1) == "sdpa_view"  # a lone row, no bf16 pair products
    assert _pick(Op.DECODE_ATTENTION, BF16, 0, ZEN4) == "c_paged"
    assert _pick(Op.DECODE_ATTENTION, BF16, 2, ZEN1) == "c_paged"


def test_every_operation_has_a_torch_row_for_every_dtype() -> None:
    for op in Op:
        for dtype in (F32, BF16, torch.float16):
            assert any(i.op is op and i.library is None and dtype in i.dtypes for i in kernels.TABLE), (op, dtype)


def test_cuda_takes_the_torch_rows() -> None:
    assert kernels.weight_layout(BF16, "cuda", packed_weights=True) is Layout.DENSE
    assert all(kernels.choose(op, BF16, device="cuda").library is None for op in Op)


def test_the_loader_layout_follows_the_table() -> None:
    for dtype in (F32, BF16):
        layout = kernels.weight_layout(dtype, "cpu", packed_weights=True)
        assert layout is (kernels.choose(Op.LINEAR, dtype).layout or Layout.DENSE)
    assert kernels.weight_layout(F32, "cpu", packed_weights=False) is not Layout.GGUF_BLOCKS


def test_doctor_prints_the_resolved_table(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for op in Op:
        assert op.value in out
    assert "cpu:" in out and "library cpu_kernels" in out


def test_this_machine_says_which_kernel_paths_it_exercised() -> None:
    # NOTE: what a green run covered: each kernel's own tests run where it is listed here as exercised, and skip
    # where it is listed as skipped (another CPU kind); printed so that the run says it (pytest -s or -rA).
    ran, skipped = kernels.exercised()
    print(f"\nkernel paths exercised on this machine ({len(ran)}):", *ran, sep="\n  ")
    print(f"kernel paths skipped on this machine ({len(skipped)}):", *skipped, sep="\n  ")
    assert ran
    assert all(f"{i.op.value}/{i.name}/" in " ".join(ran) for i in kernels.TABLE if i.library is None)
    assert set(ran).isdisjoint(skipped)


def test_a_dense_copy_is_kept_only_where_the_table_can_pick_it(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = kernels.dense_copy_rows(BF16, "cpu")
    amx = kernels.choose(Op.LINEAR, BF16, 1).name == "amx_tiles"
    assert rows == (kernels.WIDE_ROWS if amx else None)
    assert kernels.dense_copy_rows(F32, "cpu") is None
    assert kernels.dense_copy_rows(BF16, "cuda") is None
    if amx:  # (the dense copy's row first: it takes a call only from WIDE_ROWS rows, and only a weight with a copy)
        assert [i.name for i, _ in kernels.linear_plan(Layout.BF16_PANELS, BF16)][:2] == [
            "F.linear_dense_copy",
            "amx_tiles",
        ]
