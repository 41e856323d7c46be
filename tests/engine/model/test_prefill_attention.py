"""The C prefill-chunk attention kernel against float64 SDPA, its row-level exactness, and when it is used."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import build, kernels, paged_attention, prefill_attention
from engine.model.kernels import Op
from engine.model.paged_attention import attend, build_plan

needs_kernel = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")


def _pool(
    dtype: torch.dtype, kv_heads: int, dim: int, tokens: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches ``[blocks, block_size, kv_heads, dim]`` and a shuffled block table covering ``tokens``."""
    gen = torch.Generator().manual_seed(seed)
    used = -(-tokens // block_size)
    total = used + 3
    table = torch.randperm(total, generator=gen)[:used].to(torch.long)
    k, v = (torch.randn(total, block_size, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    return k, v, table


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, start: int) -> torch.Tensor:
    """float64 SDPA over the gathered sequence, query t seeing keys 0..start + t."""
    q_len, dim = q.shape[0], q.shape[2]
    kv_heads = k.shape[2]
    kv_len = start + q_len
    keys, values = (c[table].reshape(-1, kv_heads, dim)[:kv_len].transpose(0, 1).double() for c in (k, v))
    mask = torch.arange(kv_len).unsqueeze(0) <= torch.arange(start, kv_len).unsqueeze(1)
    qh = q.transpose(0, 1).double()
    out = F.scaled_dot_product_attention(
        qh.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, enable_gqa=True
    )
    return out[0].transpose(0, 1)


@needs_kernel
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "q_len", "start", "block_size"),
    [
        (9, 3, 64, 30, 2000, 16),  # a follow-up turn over a long cached prefix
        (9, 3, 64, 80, 2000, 16),  # a longer one: few work items, tiles of up to 128 rows (AVX-512)
        (16, 2, 80, 70, 300, 16),  # the same with a group of 8: at most 16 positions a tile
        (9, 3, 64, 200, 0, 16),  # a cold causal chunk: many tiles, unequal work
        (4, 2, 128, 7, 13, 4),  # head dim 128, a prefix ending inside a block
        (8, 8, 32, 33, 64, 16),  # no GQA, head dim 32 (not a multiple of 64)
        (12, 2, 64, 1, 50, 16),  # one row, group of 6
        (6, 1, 256, 5, 0, 4),  # MQA, the largest head dim taken
        (16, 2, 80, 70, 3, 16),  # group 8 (> 96 rows per tile split), head dim 80
    ],
)
def test_kernel_matches_float64_sdpa(
    dtype: torch.dtype, tol: float, heads: int, kv_heads: int, dim: int, q_len: int, start: int, block_size: int
) -> None:
    lib = kernels.library("prefill_attention")
    assert lib is not None
    k, v, table = _pool(dtype, kv_heads, dim, start + q_len, block_size, seed=q_len + dim)
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(q_len, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    q = qkv[:, :heads]  # a strided view, as the model passes it
    out = torch.full((q_len, heads, dim), float("nan"), dtype=dtype)
    prefill_attention.prefill_attention(lib, q, out, start, k, v, table, dim**-0.5)
    ref = _reference(q, k, v, table, start)
    assert out.dtype == dtype
    assert not out.isnan().any()
    assert (out.double() - ref).abs().max().item() <= tol


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix", [237, 296, 220, 160])  # follow-up chunks of 63, 4, 80 and 140 rows
def test_a_row_computes_to_the_same_bits_cold_and_after_a_prefix_hit(dtype: torch.dtype, prefix: int) -> None:
    """The rows after ``prefix`` give identical bits in a cold chunk of the whole prompt and in a chunk that starts at
    ``prefix`` (what a prefix-cache hit runs), whatever the tiling of either call."""
    lib = kernels.library("prefill_attention")
    assert lib is not None
    heads, kv_heads, dim, total = 9, 3, 64, 300
    k, v, table = _pool(dtype, kv_heads, dim, total, 16, seed=3)
    q = torch.randn(total, heads, dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    cold = torch.empty_like(q)
    prefill_attention.prefill_attention(lib, q, cold, 0, k, v, table, dim**-0.5)
    hit = torch.empty_like(q[prefix:])
    prefill_attention.prefill_attention(lib, q[prefix:], hit, prefix, k, v, table, dim**-0.5)
    assert torch.equal(cold[prefix:], hit)


@needs_kernel
def test_attend_uses_the_kernel_for_prefill_spans_where_the_table_picks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    dtype, heads, kv_heads, dim = torch.float32, 4, 2, 64
    k, v, table = _pool(dtype, kv_heads, dim, 40, 4, seed=5)
    q = torch.randn(12, heads, dim, generator=torch.Generator().manual_seed(6))
    items = [(28, 12, table.tolist())]

    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx512f"}))
    plan = build_plan(items, 4, torch.device("cpu"))
    lib = paged_attention._kernel(plan, Op.PREFILL_ATTENTION, q, True)
    assert lib is not None
    kernel_out = torch.empty_like(q)
    prefill_attention.prefill_attention(lib, q, kernel_out, 28, k, v, table, dim**-0.5)
    assert torch.equal(attend(q, k, v, plan), kernel_out)

    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset())  # (no AVX2: the table picks SDPA)
    plan = build_plan(items, 4, torch.device("cpu"))
    sdpa = paged_attention._attend_prefill(q, k, v, plan.prefills[0], False)
    assert torch.equal(attend(q, k, v, plan), sdpa)
    assert (kernel_out - sdpa).abs().max().item() <= 1e-5


def test_supports_only_what_the_kernel_takes() -> None:
    cache = torch.zeros(2, 4, 2, 64)
    q = torch.zeros(3, 4, 64)
    out = torch.empty_like(q)
    assert prefill_attention.supports(q, out, cache, cache)
    assert not prefill_attention.supports(q.to(torch.bfloat16), out, cache, cache)  # mixed dtypes
    assert not prefill_attention.supports(q, out, cache, cache.transpose(0, 1))  # a V pool that is not contiguous
    odd = torch.zeros(3, 4, 24)
    odd_cache = torch.zeros(2, 4, 2, 24)
    assert not prefill_attention.supports(odd, torch.empty_like(odd), odd_cache, odd_cache)  # 24 % 16 != 0
    big = torch.zeros(3, 4, 512)
    big_cache = torch.zeros(2, 4, 2, 512)
    assert not prefill_attention.supports(big, torch.empty_like(big), big_cache, big_cache)  # > 256
    wide = torch.zeros(3, 2 * (prefill_attention.MAX_GROUP + 1), 64)
    assert not prefill_attention.supports(wide, torch.empty_like(wide), cache, cache)  # a group of 129 heads
    uneven = torch.zeros(3, 5, 64)
    assert not prefill_attention.supports(uneven, torch.empty_like(uneven), cache, cache)  # 5 heads over 2 kv heads


@needs_kernel
def test_an_empty_chunk_is_a_no_op() -> None:
    lib = kernels.library("prefill_attention")
    assert lib is not None
    k, v, table = _pool(torch.float32, 2, 64, 8, 4, seed=1)
    out = torch.zeros(0, 4, 64)
    prefill_attention.prefill_attention(lib, torch.zeros(0, 4, 64), out, 8, k, v, table, 0.125)
    assert out.shape == (0, 4, 64)
