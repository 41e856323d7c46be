"""The small CPU kernels of ``csrc/cpu_kernels/`` (a file per operation): paged decode attention (and its verify
variant: a decode row and its drafts in one pass over the K/V), RMSNorm (+ residual add), RoPE + KV store, SwiGLU
and argmax, one C call each instead of several torch ops a layer.

Decode attention reads K/V in place through the block table (torch gathers a padded copy first), in work items of
(sequence, kv head, ``PART`` tokens) whose partial softmaxes a second pass merges (split-K, so one long sequence still
keeps every thread busy). The norm, activation and argmax round where transformers' modules round, so outputs match
the torch path. ``kernels.py`` decides where each runs.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.model.build import open_library

# Tokens per work item of decode attention (a multiple of 16: the bf16 score pass writes 16 at a time).
PART = 128


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (logged once) when it cannot be built or is disabled."""
    lib = open_library("cpu_kernels", "the torch path")
    return None if lib is None else bind(lib)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the argument types of a built kernel library's functions (``load``; tests build variants)."""
    fn = lib.kvchat_paged_decode
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, i64, ptr]
    fn.argtypes += [i64, i64, i64, i64, ctypes.c_float, ctypes.c_int, ctypes.c_int, i64]
    fn.restype = None
    verify = lib.kvchat_paged_verify
    verify.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, i64]
    verify.argtypes += [i64, i64, i64, i64, ctypes.c_float, ctypes.c_int, ctypes.c_int, i64]
    verify.restype = None
    rope = lib.kvchat_rope_store
    rope.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int]
    rope.restype = None
    norm = lib.kvchat_rms_norm
    norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    norm.restype = None
    argmax = lib.kvchat_argmax
    argmax.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
    argmax.restype = None
    silu_mul = lib.kvchat_silu_mul
    silu_mul.argtypes = [ptr, ptr, i64, i64, ctypes.c_int, ctypes.c_int]
    silu_mul.restype = None
    return lib


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel can take these queries and caches (CPU, fp32 or bf16, contiguous pools of one shape)."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and all(c.dtype == q.dtype and c.is_contiguous() for c in (k_cache, v_cache))
        and v_cache.shape == k_cache.shape
        and q.stride(-1) == 1
        and q.stride(-2) == q.shape[-1]
    )


def rms_norm(
    lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``rms_norm(x) * weight`` over the last axis of a contiguous ``[rows, hidden]`` ``x`` (fp32 or bf16, as
    ``weight``). With ``residual``, first ``x += residual`` in place (the residual stream of the next layer)."""
    out = torch.empty_like(x)
    res = 0 if residual is None else residual.data_ptr()
    bf16 = int(x.dtype == torch.bfloat16)
    lib.kvchat_rms_norm(
        x.data_ptr(), res, weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, bf16, torch.get_num_threads()
    )
    return out


def rope_store(
    lib: ctypes.CDLL,
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    rope: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """RoPE on q and k of a fused ``qkv`` ``[n, (heads + 2 kv_heads) * D]`` (q rotated in place), k and v written
    into pool slots ``slots`` of the caches ``[blocks, bs, kv_heads, D]``; returns q as ``[n, heads, D]`` (a view).

    ``rope``: the ``[max_len, 2, D]`` table of ``llama.rope_tables``; ``positions``/``slots``: int64 ``[n]``.
    """
    n, dim = qkv.shape[0], rope.shape[-1]
    lib.kvchat_rope_store(
        qkv.data_ptr(),
        qkv.stride(0),
        n,
        heads,
        kv_heads,
        dim,
        rope.data_ptr(),
        positions.data_ptr(),
        slots.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        int(qkv.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return qkv[:, : heads * dim].view(n, heads, dim)


def rope_supported(
    qkv: torch.Tensor, rope: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
) -> bool:
    index_ok = all(t.dtype == torch.int64 and t.is_contiguous() and t.device.type == "cpu" for t in (positions, slots))
    return (
        index_ok
        and qkv.device.type == "cpu"
        and qkv.dtype in (torch.float32, torch.bfloat16)
        and rope.dtype == qkv.dtype
        and cache.dtype == qkv.dtype
        and qkv.stride(1) == 1
        and rope.is_contiguous()
        and cache.is_contiguous()
        and rope.shape[-1] <= 512
    )


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` for a contiguous ``[rows, 2 * inter]`` fused gate/up product (fp32 or bf16):
    ``[rows, inter]``. One pass instead of torch's two over strided halves (a 2000-token chunk of SmolLM2 in bf16:
    ~10 ms a layer there)."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((rows, inter))
    bf16 = int(gate_up.dtype == torch.bfloat16)
    lib.kvchat_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter, bf16, torch.get_num_threads())
    return out


def argmax(lib: ctypes.CDLL, x: torch.Tensor) -> list[int]:
    """``x.argmax(dim=-1).tolist()`` for a ``argmax_supported`` ``x`` ``[rows, cols]``."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.kvchat_argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    result: list[int] = out.tolist()
    return result


def argmax_supported(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0 and x.is_contiguous()


def silu_mul_supported(gate_up: torch.Tensor) -> bool:
    return (
        gate_up.device.type == "cpu"
        and gate_up.dtype in (torch.float32, torch.bfloat16)
        and gate_up.dim() == 2
        and gate_up.shape[1] % 2 == 0
        and gate_up.is_contiguous()
    )


def norm_supported(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    same = residual is None or (residual.dtype == x.dtype and residual.is_contiguous())
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.dtype == x.dtype
        and (x.is_contiguous() and weight.is_contiguous() and same)
    )


def paged_decode(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    q_rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    out: torch.Tensor,
    out_rows: torch.Tensor,
    scale: float,
) -> None:
    """``out[out_rows[b]] = softmax(q[q_rows[b]] K_b^T * scale) V_b`` for every decode row ``b``.

    ``q``/``out``: ``[rows, heads, D]`` (row stride free); caches: ``[blocks, block_size, kv_heads, D]``;
    ``table``: int64 ``[B, max_blocks]``; ``lens``, ``q_rows``, ``out_rows``: int64 ``[B]``.
    """
    batch, max_blocks = table.shape
    lib.kvchat_paged_decode(
        q.data_ptr(),
        q.stride(0),
        q_rows.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.shape[1],
        table.data_ptr(),
        max_blocks,
        lens.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        out_rows.data_ptr(),
        batch,
        *attention_args(q, k_cache, scale),
        PART,
    )


def paged_verify(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    first_rows: torch.Tensor,
    counts: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """The rows of verify items (a decode row and its drafts): item ``s``'s row ``r`` is flat row
    ``first_rows[s] + r`` of ``q`` and ``out`` (``r < counts[s]``) and attends the first ``lens[s] + r`` tokens of
    its sequence, with the bits ``paged_decode`` gives it as a decode row of its own; K/V are read once per item.

    Shapes as ``paged_decode``'s; ``first_rows``, ``counts``, ``lens``: int64 ``[S]``; ``table``: ``[S, max_blocks]``.
    """
    items, max_blocks = table.shape
    lib.kvchat_paged_verify(
        q.data_ptr(),
        q.stride(0),
        first_rows.data_ptr(),
        counts.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.shape[1],
        table.data_ptr(),
        max_blocks,
        lens.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        items,
        *attention_args(q, k_cache, scale),
        PART,
    )


def attention_args(q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> tuple[int, int, int, float, int, int]:
    """What both attention kernels' arguments end with: heads, kv heads, head dim, scale, bf16 or not, threads."""
    heads, dim = q.shape[-2:]
    return heads, k_cache.shape[2], dim, scale, int(q.dtype == torch.bfloat16), torch.get_num_threads()
