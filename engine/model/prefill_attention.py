"""C attention for prefill chunks: many query rows of one sequence over its paged K/V, causal, read through the
block table in place (no gather copy, no mask tensor).

Work items are (kv head, tile of query positions) holding every query head of the group (GQA without repeating K/V);
keys go in chunks of 64 through register tiles, an online softmax and fp32 accumulators.

NOTE: a query row's output depends only on that row and its keys 0..pos, summed in a fixed order, so a row computes
to the same bits in a cold prefill as after a prefix-cache hit, and in any batch (unlike SDPA), given finite K/V.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.model.build import open_library
from engine.model.cpu_kernels import attention_args

MAX_HEAD_DIM = 256
MAX_GROUP = 128  # query heads per kv head (the C side's 16 * MAXV rows)
ROWS_PER_TILE = 96  # query rows (positions x group) per work item: more rows share each converted K/V chunk


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (logged once) when it cannot be built or kernels are disabled."""
    lib = open_library("prefill_attention", "SDPA")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = lib.kvchat_prefill_attention
    fn.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ptr, i64, ptr, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.argtypes += [ctypes.c_int, i64]
    fn.restype = ctypes.c_int
    return lib


def supports(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel takes this chunk: CPU, fp32 or bf16 throughout, unit-stride heads, contiguous pools, a
    query group of at most ``MAX_GROUP`` heads."""
    dim, heads, kv_heads = q.shape[-1], q.shape[-2], k_cache.shape[-2]
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and all(t.dtype == q.dtype and t.is_contiguous() for t in (k_cache, v_cache))
        and v_cache.shape == k_cache.shape
        and out.dtype == q.dtype
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUP
        and all(t.stride(-1) == 1 and t.stride(-2) == dim for t in (q, out))
        and dim % 16 == 0
        and dim <= MAX_HEAD_DIM
    )


def prefill_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    out: torch.Tensor,
    start_pos: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    scale: float,
) -> None:
    """``out[t] = softmax(q[t] K^T * scale) V`` over keys ``0..start_pos + t`` of one sequence (causal chunk).

    ``q``/``out``: ``[q_len, heads, D]`` (row stride free); caches: ``[blocks, block_size, kv_heads, D]``;
    ``table``: int64 block ids covering ``start_pos + q_len`` tokens.
    """
    q_len = q.shape[0]
    status = lib.kvchat_prefill_attention(
        q.data_ptr(),
        q.stride(0),
        out.data_ptr(),
        out.stride(0),
        q_len,
        start_pos,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.shape[1],
        table.data_ptr(),
        *attention_args(q, k_cache, scale),
        ROWS_PER_TILE,
    )
    if status == -1:
        raise MemoryError("prefill attention kernel: out of memory for its scratch buffers")
    if status != 0:
        raise ValueError(f"prefill attention kernel refused the shapes (status {status})")
