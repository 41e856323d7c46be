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
    return next(i.name for i in kernels.TABLE if i.op is op and i.matches(dtype, rows, flags) and not i.opt_in)


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
        (frozenset(), F32, 1, "F.linear"),
        (frozenset(), BF16, 1, "F.linear"),
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
    assert kernels.weight_layout(BF16, "cuda") is Layout.DENSE
    assert all(kernels.choose(op, BF16, device="cuda").library is None for op in Op)


def test_the_loader_layout_follows_the_table() -> None:
    for dtype in (F32, BF16):
        layout = kernels.weight_layout(dtype, "cpu")
        assert layout is (kernels.choose(Op.LINEAR, dtype).layout or Layout.DENSE)


def test_doctor_prints_the_resolved_table(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for op in Op:
        assert op.value in out
    assert "cpu:" in out and "library cpu_kernels" in out
    from engine.device import cpu_kind

    assert f"cpu kind: {cpu_kind()} " in out


def test_this_machine_says_which_kernel_paths_it_exercised() -> None:
    # NOTE: what a green run covered: each kernel's own tests run where it is listed here as exercised, and skip
    # where it is listed as skipped (another CPU kind); printed so that the run says it (pytest -s or -rA).
    ran, skipped = kernels.exercised()
    print(f"\nkernel paths exercised on this machine ({len(ran)}):", *ran, sep="\n  ")
    print(f"kernel paths skipped on this machine ({len(skipped)}):", *skipped, sep="\n  ")
    assert sorted(ran + skipped) == sorted(kernels.row_key(i) for i in kernels.TABLE)
    assert set(ran).isdisjoint(skipped)
    # every row the resolved table picks for this CPU is one this machine exercises
    picked = {(r["op"], r["runs"]) for r in kernels.resolve()}
    ran_names = {tuple(key.split("/")[:2]) for key in ran}
    assert picked <= ran_names, picked - ran_names
    # the torch rows that need (and yield to) no CPU feature run everywhere
    assert all(kernels.row_key(i) in ran for i in kernels.TABLE if i.library is None and not i.needs and not i.without)


AVX2_ONLY = frozenset({"avx2", "fma", "avx", "sse4_2"})
AVX512 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"}
AMX_XEON = AVX512 | {"amx_bf16", "amx_tile", "amx_int8"}


def _names(flags: frozenset[str], compiler: bool) -> set[str]:
    ran, _ = kernels.exercised(flags, builds=lambda _name: compiler)
    # (prefill attention's c_tiles has two rows, told apart by their dtypes)
    return {key if key.startswith("prefill attention/c_tiles") else key.rsplit("/", 1)[0] for key in ran}


@pytest.mark.parametrize(
    ("flags", "compiler", "runs", "skips"),
    [
        (
            AMX_XEON,
            True,
            {"linear/F.linear_dense_copy", "linear/amx_tiles", "linear/bf16_pairs", "linear/fp32_panels"},
            {"decode attention/sdpa_view"},
        ),
        (
            AVX512,
            True,
            {"linear/bf16_pairs", "linear/fp32_panels", "prefill attention/c_tiles/bfloat16+float32"},
            {"linear/F.linear_dense_copy", "linear/amx_tiles", "decode attention/sdpa_view"},
        ),
        (
            AVX2_ONLY,
            True,
            {"linear/fp32_panels", "prefill attention/c_tiles/float32", "decode attention/sdpa_view"},
            {"linear/bf16_pairs", "linear/amx_tiles", "prefill attention/c_tiles/bfloat16+float32"},
        ),
        (
            AMX_XEON,
            False,
            {"linear/F.linear", "decode attention/sdpa", "norm/F.rms_norm", "argmax/torch"},
            # no compiler: no kernel, and no dense copy beside panels the loader never makes
            {"linear/F.linear_dense_copy", "linear/amx_tiles", "decode attention/c_paged", "norm/c_rms_norm"},
        ),
    ],
    ids=["amx", "avx512-no-amx", "avx2-only", "no-compiler"],
)
def test_exercised_paths_follow_each_cpu_kinds_table(
    flags: frozenset[str], compiler: bool, runs: set[str], skips: set[str]
) -> None:
    names = _names(flags, compiler)
    assert runs <= names, runs - names
    assert not skips & names, skips & names
    # whatever the kind, the torch rows without CPU needs are exercised: every operation runs in every dtype
    ran = kernels.exercised(flags, builds=lambda _n: compiler)[0]
    for impl in kernels.TABLE:
        if impl.library is None and not impl.needs and not impl.without:
            assert kernels.row_key(impl) in ran


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


def test_a_library_is_built_only_for_a_cpu_one_of_its_rows_is_for(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    loaders = {name: (lambda name=name: built.append(name)) for name in ("amx_panels", "bf16_panels", "panel_linear")}
    monkeypatch.setattr(kernels, "_loaders", lambda: loaders)
    assert kernels.library("amx_panels", AVX512) is None
    assert kernels.library("bf16_panels", AVX2_ONLY) is None
    assert built == []  # not for these CPUs: never compiled
    kernels.library("amx_panels", AMX_XEON)
    kernels.library("panel_linear", AVX2_ONLY)
    assert built == ["amx_panels", "panel_linear"]


def test_int8_rows_serve_only_int8_weights() -> None:
    for dtype in (F32, BF16):
        assert all(not i.opt_in for i, _ in kernels.candidates(Op.LINEAR, dtype, 1, frozenset()))
        assert kernels.weight_layout(dtype, "cpu") is not Layout.INT8
        plan = [i.name for i, _ in kernels.linear_plan(Layout.INT8, dtype)]
        assert plan[0] == "int8pack_mm" and plan[-1] == "F.linear"


def test_the_prefill_chunk_beside_other_requests_is_the_kinds_and_none_where_unmeasured() -> None:
    zen = frozenset({"avx2", "fma", "avx512f", "avx512_bf16"})
    assert kernels.prefill_chunk(BF16, flags=zen) == 512 and kernels.prefill_chunk(F32, flags=zen) == 256
    assert kernels.prefill_chunk(BF16, flags=zen | {"amx_bf16", "amx_tile"}) == 0  # (not measured with a cap)
    assert kernels.prefill_chunk(BF16, "cuda", flags=zen) == 0


def test_a_lone_tenants_steps_are_capped_only_where_measured_to_pay() -> None:
    zen = frozenset({"avx2", "fma", "avx512f", "avx512_bf16"})
    assert kernels.caps_lone_steps(BF16, flags=zen) and kernels.caps_lone_steps(F32, flags=zen)
    assert not kernels.caps_lone_steps(F32, flags=frozenset({"avx2", "fma"}))  # (AVX2: its chunk cost tokens/s)
    assert not kernels.caps_lone_steps(BF16, "cuda", flags=zen)
