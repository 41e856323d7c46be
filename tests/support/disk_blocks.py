"""Small chains of DiskBlocks with deterministic K/V, shared by the disk-tier tests."""

from __future__ import annotations

import torch

from engine.kv.block_hash import BlockHash, hash_block, root_hash
from engine.kv.disk_format import DiskBlock, LoadedBlock

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 2, 2, 8, 4
FINGERPRINT = "test-model"


def chain(
    n: int, *, namespace: str = "ns", parent: BlockHash | None = None, owner: str | None = None, start: int = 0
) -> list[DiskBlock]:
    """``n`` consecutive blocks of one namespace, continuing from ``parent`` (the root when None)."""
    root = root_hash(FINGERPRINT, namespace)
    prev = parent or root
    out = []
    for i in range(n):
        tokens = tuple(range((start + i) * BLOCK_SIZE, (start + i + 1) * BLOCK_SIZE))
        h = hash_block(prev, tokens)
        out.append(DiskBlock(h, prev, root, tokens, ("template", "untyped"), owner))
        prev = h
    return out


def block_kv(block: DiskBlock, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The K/V of ``block``: ``[layers, 2, block_size, heads, head_dim]``, a pure function of its hash."""
    g = torch.Generator().manual_seed(int.from_bytes(block.block_hash[:8], "little"))
    return torch.randn(LAYERS, 2, BLOCK_SIZE, HEADS, HEAD_DIM, generator=g).to(dtype)


def run_kv(blocks: list[DiskBlock], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[layers, 2, n, block_size, heads, head_dim]`` for ``blocks``."""
    return torch.stack([block_kv(b, dtype) for b in blocks], dim=2)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as integers, so NaN and -0.0 compare exactly."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_exact(loaded: list[LoadedBlock], blocks: list[DiskBlock], dtype: torch.dtype = torch.float32) -> None:
    assert [lb.block for lb in loaded] == blocks
    for lb in loaded:
        assert lb.kv.dtype == dtype
        assert torch.equal(bits(lb.kv), bits(block_kv(lb.block, dtype)))
