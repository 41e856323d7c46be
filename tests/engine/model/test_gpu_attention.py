"""The CUDA attention path (SDPA over the block table, or flash-attn's paged kernel when installed) against the CPU
torch path. Runs only where CUDA is present; elsewhere this path is untested (README)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.model import paged_attention
from engine.model.paged_attention import attend, build_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
needs_flash = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn not installed")


def _case(
    dtype: torch.dtype, block_size: int, items: list[tuple[int, int]], seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int, list[int]]]]:
    """Queries and a pool with shuffled blocks for ``items`` = (cached, new) tokens per sequence."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 8, 2, 64
    need = [-(-(start + n) // block_size) for start, n in items]
    order = torch.randperm(sum(need) + 1, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n])
        at += n
    shape = (sum(need) + 1, block_size, kv_heads, dim)
    k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(sum(n for _, n in items), heads, dim, generator=gen).to(dtype)
    return q, k, v, [(start, n, t) for (start, n), t in zip(items, tables, strict=True)]


def _on(device: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, items: list, bs: int) -> torch.Tensor:
    dev = torch.device(device)
    plan = build_plan(items, bs, dev, prompt=[n > 1 for _, n, _ in items])
    return attend(q.to(dev), k.to(dev), v.to(dev), plan).cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_sdpa_matches_the_cpu_torch_path(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged_attention, "flash_attn_with_kvcache", None)  # (SDPA, whatever is installed)
    monkeypatch.setenv("KVCHAT_DISABLE_KERNELS", "1")  # (the CPU reference: the torch path too)
    items = [(0, 40), (17, 1), (100, 1), (60, 12)]  # a prefill, two decode rows, a chunk after a cached prefix
    q, k, v, plan_items = _case(dtype, 16, items)
    cpu = _on("cpu", q, k, v, plan_items, 16)
    cuda = _on("cuda", q, k, v, plan_items, 16)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(cuda, cpu, rtol=tol, atol=tol)


@needs_flash
def test_flash_attn_over_the_block_table_matches_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    items = [(0, 300), (500, 1), (260, 1)]
    q, k, v, plan_items = _case(torch.bfloat16, 256, items)
    flash = _on("cuda", q, k, v, plan_items, 256)
    monkeypatch.setattr(paged_attention, "flash_attn_with_kvcache", None)
    sdpa = _on("cuda", q, k, v, plan_items, 256)
    torch.testing.assert_close(flash, sdpa, rtol=2e-2, atol=2e-2)
