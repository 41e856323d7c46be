"""The C verify kernel (csrc/cpu_kernels/verify_attention.c): a decode row and its drafts attended in one pass over
the sequence's K/V give, row by row, the bits of the lone-row decode kernel."""

from __future__ import annotations

import random

import pytest
import torch

from engine.model import build, cpu_kernels
from engine.model.paged_attention import attend, build_plan

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")
BS = 16  # block size of the cases


def _case(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, items: list[tuple[int, int]], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int, list[int]]]]:
    """Random caches ``[blocks, BS, kv_heads, dim]``, queries, and shuffled block tables for verify items
    ``(decode position, rows)``: the decode row at that position and ``rows - 1`` drafts after it."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    needs = [-(-(pos + n) // BS) for pos, n in items]
    free = list(range(sum(needs) + 3))
    rng.shuffle(free)
    tables = []
    for used in needs:
        tables.append(free[:used])
        del free[:used]
    shape = (sum(needs) + 3, BS, kv_heads, dim)
    k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    rows = sum(n for _, n in items)
    # (a slice of a wider tensor, as q is of the fused qkv projection: a row stride that is not heads * dim)
    q = torch.randn(rows, heads + 2 * kv_heads, dim, generator=gen).to(dtype)[:, :heads]
    return q, k, v, [(pos, n, table) for (pos, n), table in zip(items, tables, strict=True)]


def _lone(
    lib: object,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    items: list[tuple[int, int, list[int]]],
    skip: tuple[int, ...] = (),
) -> torch.Tensor:
    """Every row by the lone-row kernel, one call per row (row r of an item over its first pos + r + 1 tokens); the
    items at ``skip`` are not attended (their rows stay 0)."""
    out = q.new_zeros(q.shape)
    row = 0
    for i, (pos, n, table) in enumerate(items):
        for r in range(n if i not in skip else 0):
            index = torch.tensor([row + r])
            lens = torch.tensor([pos + r + 1])
            blocks = torch.tensor([table[: (pos + r + BS) // BS]])
            cpu_kernels.paged_decode(lib, q, index, k, v, blocks, lens, out, index, q.shape[-1] ** -0.5)  # type: ignore[arg-type]
        row += n
    return out


def _verify(
    lib: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, items: list[tuple[int, int, list[int]]]
) -> torch.Tensor:
    out = q.new_zeros(q.shape)
    firsts = torch.tensor([0, *[n for _, n, _ in items]]).cumsum(0)[:-1]
    counts = torch.tensor([n for _, n, _ in items])
    lens = torch.tensor([pos + 1 for pos, _, _ in items])
    width = max(len(t) for *_, t in items)
    table = torch.tensor([t + [0] * (width - len(t)) for *_, t in items])
    cpu_kernels.paged_verify(lib, q, firsts, counts, k, v, table, lens, out, q.shape[-1] ** -0.5)  # type: ignore[arg-type]
    return out


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "items"),
    [
        (9, 3, 64, [(0, 1)]),  # a lone decode row at position 0
        (9, 3, 64, [(1000, 2)]),  # 1k context, one draft
        (9, 3, 64, [(1020, 9)]),  # 8 drafts across a part boundary (cpu_kernels.PART = 128 tokens)
        (9, 3, 64, [(2047, 5)]),  # the decode row ends a part: every draft in a part of its own
        (9, 3, 64, [(124, 17)]),  # 16 drafts, over two part boundaries in bf16's pairs of tokens
        (9, 3, 64, [(300, 4), (5, 3), (770, 9), (127, 1)]),  # several items, one without drafts
        (4, 4, 128, [(255, 6), (40, 2)]),  # no GQA, head dim 128
        (8, 1, 24, [(600, 5)]),  # MQA, a head dim that is not a multiple of 16 (the plain loops)
        (10, 2, 128, [(517, 8)]),  # group 5 (register tiles of 4 + 1 rows), head dim 128
        (6, 2, 96, [(200, 7)]),  # head dim 96: bf16 pair-product scores, values by the plain loop
    ],
)
def test_each_row_gets_the_bits_of_the_lone_row_kernel(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, items: list[tuple[int, int]]
) -> None:
    lib = cpu_kernels.load()
    assert lib is not None
    q, k, v, cases = _case(dtype, heads, kv_heads, dim, items, seed=sum(p + n for p, n in items) + dim)
    lone = _lone(lib, q, k, v, cases)
    ours = _verify(lib, q, k, v, cases)
    assert torch.equal(ours, lone)
    assert ours.abs().sum().item() > 0  # (every row written: the rows start as zeros)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plan_sends_verify_items_to_the_verify_kernel_and_other_rows_to_the_lone_one(dtype: torch.dtype) -> None:
    # a batch of a verify item, a plain decode row, a prefill chunk and another verify item: each verify row gets the
    # bits it gets as a decode row of its own, the plain row those it gets alone
    lib = cpu_kernels.load()
    assert lib is not None
    q, k, v, cases = _case(dtype, 9, 3, 64, [(700, 5), (300, 1), (40, 6), (129, 3)], seed=7)
    items = [(pos, n, table) for pos, n, table in cases]
    plan = build_plan(
        items, BS, torch.device("cpu"), prompt=[False, False, True, False], verify=[True, False, False, True]
    )
    assert plan.verify is not None and plan.verify.plain is not None
    out = attend(q, k, v, plan)
    lone = _lone(lib, q, k, v, cases, skip=(2,))
    rows = [*range(0, 5), 5, *range(12, 15)]
    assert torch.equal(out[rows], lone[rows])


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "flags",
    [
        ["-DKVCHAT_L2_BYTES=1024"],  # no pipelined prefetch: each item fetches its own tokens ahead
        ["-DKVCHAT_L2_BYTES=67108864"],  # every item pipelined
        ["-mno-avx512f"],  # an AVX2 + FMA build (Zen 1-3): its 8-lane passes and plain bf16 loops
    ],
)
def test_other_builds_keep_the_rows_equal_to_their_lone_rows(dtype: torch.dtype, flags: list[str]) -> None:
    lib = build.open_library("cpu_kernels", "nothing (the test fails)", flags)
    assert lib is not None
    cpu_kernels.bind(lib)
    q, k, v, cases = _case(dtype, 9, 3, 64, [(1020, 9), (40, 3), (300, 1)], seed=11)
    assert torch.equal(_verify(lib, q, k, v, cases), _lone(lib, q, k, v, cases))
