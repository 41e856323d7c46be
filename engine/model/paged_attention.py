"""Attention over the paged KV pool: a step's batch split once into decode rows and prefill chunks (``AttentionPlan``),
each attended by what ``kernels.py`` picks: the C kernels on CPU, else SDPA (flash-attn on CUDA when installed and the
block size is a multiple of 256).

Pool layout (ARCHITECTURE.md): ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``; token ``p`` of a sequence
lives in flat slot ``block_table[p // bs] * bs + p % bs``. NOTE: not heads-first: writing a step's K/V is one
``index_copy_`` over slots, whole blocks are contiguous (cheap to move between tiers), and SDPA on CPU takes the
``[kv_heads, L, head_dim]`` transposed view without a copy.

The CUDA path is tested only where a GPU is present (``gpu``-marked tests).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.model import cpu_kernels, kernels, prefill_attention
from engine.model.kernels import Op

try:  # pragma: no cover - optional CUDA extra
    from flash_attn import flash_attn_with_kvcache  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # pragma: no cover
    flash_attn_with_kvcache = None


@dataclass(slots=True)
class PrefillSpan:
    """One multi-token chunk of one sequence: query rows ``q_start:q_start+q_len`` of the flat batch."""

    q_start: int
    q_len: int
    start_pos: int
    blocks: torch.Tensor | slice  # block ids covering start_pos+q_len tokens; a slice when they are consecutive
    mask: torch.Tensor | None  # bool [q_len, kv_len], None when start_pos == 0 (plain causal)
    # NOTE: the mask as 0/-inf in the query's dtype, built once per step and reused by every layer: SDPA converts a
    # bool mask on each call (2k keys x 30 rows: ~5% of the call)
    additive: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    ids: torch.Tensor | None = None  # ``blocks`` as int64 ids, built once per step for the C kernel

    def table(self) -> torch.Tensor:
        """The block ids as an int64 tensor (for the C kernel); ``blocks`` itself stays a slice (a view for SDPA)."""
        if self.ids is None:
            blocks = self.blocks
            self.ids = blocks if isinstance(blocks, torch.Tensor) else torch.arange(blocks.start, blocks.stop)
        return self.ids

    def attn_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        if self.mask is None:
            return None
        if dtype not in self.additive:
            zeros = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self.additive[dtype] = zeros.masked_fill(~self.mask, float("-inf"))
        return self.additive[dtype]

    @property
    def kv_len(self) -> int:
        return self.start_pos + self.q_len


@dataclass(slots=True)
class DecodeGroup:
    """All single-token rows of the batch, attended in one padded SDPA call."""

    rows: torch.Tensor  # [B] row index into the flat batch
    blocks: torch.Tensor  # [B * max_blocks] block ids, padded with block 0
    max_blocks: int
    kv_len: int  # padded kv length (<= max_blocks * block_size)
    mask: torch.Tensor | None  # bool [B, 1, 1, kv_len]; None when every sequence has kv_len tokens
    all_rows: bool  # rows == arange(num_tokens): the output needs no scatter
    seq_lens: torch.Tensor  # int32 [B] kv lengths (for flash-attn)
    kv_lens: torch.Tensor  # int64 [B] kv lengths (for the C kernel)
    block_table: torch.Tensor  # int32 [B, max_blocks] (for flash-attn)
    runs: list[tuple[slice, int]] | None  # (blocks, kv_len) per row when every table is one consecutive run
    # NOTE: gather buffers reused by every layer of the step: a fresh multi-MB tensor per layer costs page faults
    # (glibc hands big blocks back to the OS), which measured as much as the gather itself.
    buffers: list[torch.Tensor] = field(default_factory=list)


@dataclass(slots=True)
class DecodeRows:
    """Some rows of the decode group, as the lone-row C kernel takes them."""

    rows: torch.Tensor  # int64 [B] row index into the flat batch
    table: torch.Tensor  # int64 [B, max_blocks]
    lens: torch.Tensor  # int64 [B] kv lengths


@dataclass(slots=True)
class VerifyGroup:
    """The step's verify items (a decode row and its drafts each), for the C verify kernel, which reads an item's K/V
    once for all its rows. The decode group holds their rows too, one by one, for the paths without that kernel."""

    first_rows: torch.Tensor  # int64 [S] each item's decode row in the flat batch (its drafts follow it)
    counts: torch.Tensor  # int64 [S] rows of each item
    lens: torch.Tensor  # int64 [S] kv length of each item's decode row
    table: torch.Tensor  # int64 [S, max_blocks]
    plain: DecodeRows | None  # the decode group's other rows (None: there are none)


@dataclass(slots=True)
class AttentionPlan:
    """Everything about a step's batch that every layer reuses; built once per forward."""

    num_tokens: int
    slots: torch.Tensor  # [num_tokens] flat pool slot of each new token
    block_size: int
    prefills: list[PrefillSpan] = field(default_factory=list)
    decode: DecodeGroup | None = None
    verify: VerifyGroup | None = None
    use_flash: bool = False
    # The C kernel the table picks per (op, dtype, gather), None for a torch row: asked once per step, not per layer.
    kernels: dict[tuple[Op, torch.dtype, bool], ctypes.CDLL | None] = field(default_factory=dict)


def build_plan(
    items: list[tuple[int, int, list[int]]],
    block_size: int,
    device: torch.device,
    prompt: list[bool] | None = None,
    verify: list[bool] | None = None,
) -> AttentionPlan:
    """``items`` = ``(start_pos, num_new_tokens, block_table)`` per sequence, in batch order. ``prompt[i]``: item i's
    tokens are prompt tokens. A lone prompt token (the last one, recomputed after a full prefix-cache hit) is attended
    as a one-row prefill chunk, not as a decode row: where the prefill kernel runs, a row then gets the same bits as in
    the cold run's longer chunk (the decode kernel sums in another order: ~4e-5 apart in SmolLM2's fp32 logits).

    ``verify[i]``: item i is a decode token followed by draft tokens (engine.spec). Each of its rows is attended as a
    decode row of its own (over the positions up to and including it), for the same reason: a draft row then gets the
    bits the token would get decoded alone, so accepting it changes no later token. Where the C kernel attends decode
    rows, the verify kernel takes them instead: the same bits per row, the item's K/V read once (``VerifyGroup``)."""
    slots: list[int] = []
    prefills: list[PrefillSpan] = []
    decode_rows: list[int] = []
    decode_items: list[tuple[int, list[int]]] = []
    decoding: set[int] = set()  # the items with decode rows
    verifying: list[tuple[int, int, int, list[int]]] = []  # (first row, rows, kv length of the first, blocks)
    plain: list[int] = []  # indexes into decode_rows of the rows that are not verify rows
    row = 0
    for i, (start_pos, n, table) in enumerate(items):
        slots.extend(_slots(table, start_pos, n, block_size))
        kv_len = start_pos + n
        used = table[: (kv_len + block_size - 1) // block_size]
        if verify is not None and verify[i]:
            for j in range(n):
                decode_rows.append(row + j)
                decode_items.append((start_pos + j + 1, table[: (start_pos + j + block_size) // block_size]))
            verifying.append((row, n, start_pos + 1, used))
            decoding.add(i)
        elif n == 1 and not (prompt is not None and prompt[i]):
            plain.append(len(decode_rows))
            decode_rows.append(row)
            decode_items.append((kv_len, used))
            decoding.add(i)
        else:
            prefills.append(PrefillSpan(row, n, start_pos, _blocks(used, device), _prefix_mask(start_pos, n, device)))
        row += n
    plan = AttentionPlan(row, torch.tensor(slots, dtype=torch.long, device=device), block_size, prefills)
    if decode_items:
        plan.decode = _decode_group(decode_rows, decode_items, row, block_size, device, len(decoding) == 1)
    if verifying and plan.decode is not None:
        plan.verify = _verify_group(verifying, plan.decode, plain, device)
    plan.use_flash = flash_attn_with_kvcache is not None and device.type == "cuda" and block_size % 256 == 0
    return plan


def _slots(table: list[int], start: int, n: int, bs: int) -> list[int]:
    return [table[p // bs] * bs + p % bs for p in range(start, start + n)]


def _blocks(blocks: list[int], device: torch.device) -> torch.Tensor | slice:
    first = blocks[0]
    if blocks == list(range(first, first + len(blocks))):
        return slice(first, first + len(blocks))
    return torch.tensor(blocks, dtype=torch.long, device=device)


def _prefix_mask(start_pos: int, n: int, device: torch.device) -> torch.Tensor | None:
    if start_pos == 0:
        return None
    # query t (absolute position start_pos + t) sees keys 0..start_pos + t
    q_pos = torch.arange(start_pos, start_pos + n, device=device).unsqueeze(1)
    return torch.arange(start_pos + n, device=device).unsqueeze(0) <= q_pos


def _decode_group(
    rows: list[int],
    items: list[tuple[int, list[int]]],
    num_tokens: int,
    bs: int,
    device: torch.device,
    one_sequence: bool,
) -> DecodeGroup:
    max_blocks = max(len(b) for _, b in items)
    kv_lens = [n for n, _ in items]
    kv_len = max(kv_lens)
    padded = [b + [0] * (max_blocks - len(b)) for _, b in items]
    mask = None
    if min(kv_lens) != kv_len:
        lens = torch.tensor(kv_lens, device=device).view(-1, 1, 1, 1)
        mask = torch.arange(kv_len, device=device).view(1, 1, 1, -1) < lens
    table = torch.tensor(padded, dtype=torch.long, device=device)
    return DecodeGroup(
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        blocks=table.view(-1),
        max_blocks=max_blocks,
        kv_len=kv_len,
        mask=mask,
        all_rows=len(rows) == num_tokens,
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        kv_lens=torch.tensor(kv_lens, dtype=torch.long, device=device),
        block_table=table.to(torch.int32),
        runs=_runs(items, one_sequence),
    )


def _verify_group(
    items: list[tuple[int, int, int, list[int]]], group: DecodeGroup, plain: list[int], device: torch.device
) -> VerifyGroup:
    width = max(len(b) for *_, b in items)
    table = torch.tensor([b + [0] * (width - len(b)) for *_, b in items], dtype=torch.long, device=device)
    rows = None
    if plain:
        index = torch.tensor(plain, dtype=torch.long, device=device)
        decode_table = group.blocks.view(-1, group.max_blocks)
        rows = DecodeRows(group.rows[index], decode_table[index], group.kv_lens[index])

    def column(at: int) -> torch.Tensor:
        return torch.tensor([item[at] for item in items], dtype=torch.long, device=device)

    return VerifyGroup(column(0), column(1), column(2), table, rows)


def _runs(items: list[tuple[int, list[int]]], one_sequence: bool) -> list[tuple[slice, int]] | None:
    # NOTE: only for the rows of one sequence (a lone decode row, or one decode row and its drafts: they then take
    # the lone row's attention, gather or not, so a draft row gets the bits its token gets decoded alone). With many
    # sequences one padded SDPA call beats a loop of per-sequence calls even counting the gather copy (SmolLM2, 16
    # rows x 2k context, bf16: ~220 vs ~250 ms/step).
    if not one_sequence:
        return None
    runs = []
    for kv_len, blocks in items:
        picked = _blocks(blocks, torch.device("cpu"))
        if not isinstance(picked, slice):
            return None
        runs.append((picked, kv_len))
    return runs


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store the step's new K/V ``[num_tokens, kv_heads, D]`` into one layer's caches ``[blocks, bs, kv_heads, D]``."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, plan.slots, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, plan.slots, v)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """Causal attention of the step's queries ``[num_tokens, heads, D]`` over the pool (new K/V already written).

    Returns ``[num_tokens, heads, D]``.
    """
    group = plan.decode
    kernel = _kernel(plan, Op.DECODE_ATTENTION, q, group.runs is None) if group is not None else None
    if group is not None and kernel is not None:
        # NOTE: a lone bf16 row over consecutive blocks takes the kernel only with pair products (head dim % 32)
        lone_without_pairs = group.runs is not None and q.dtype == torch.bfloat16 and q.shape[-1] % 32 != 0
        kernel = None if lone_without_pairs or not cpu_kernels.supports(q, k_cache, v_cache) else kernel
    if group is not None and group.all_rows and kernel is None:
        return _attend_decode(q, k_cache, v_cache, group, plan.use_flash)
    out = q.new_empty(q.shape)
    chunk_kernel = _kernel(plan, Op.PREFILL_ATTENTION, q, True) if plan.prefills else None
    if chunk_kernel is not None and not prefill_attention.supports(q, out, k_cache, v_cache):
        chunk_kernel = None
    for span in plan.prefills:
        rows = slice(span.q_start, span.q_start + span.q_len)
        if chunk_kernel is not None:
            scale = q.shape[-1] ** -0.5
            prefill_attention.prefill_attention(
                chunk_kernel, q[rows], out[rows], span.start_pos, k_cache, v_cache, span.table(), scale
            )
        else:
            out[rows] = _attend_prefill(q[rows], k_cache, v_cache, span, plan.use_flash)
    if group is not None and kernel is not None:
        _attend_c(kernel, q, k_cache, v_cache, plan, group, out)
    elif group is not None:
        out.index_copy_(0, group.rows, _attend_decode(q.index_select(0, group.rows), k_cache, v_cache, group, False))
    return out


def _attend_c(
    kernel: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    group: DecodeGroup,
    out: torch.Tensor,
) -> None:
    """The decode rows by the C kernels: verify items by the verify kernel, the other rows by the lone-row one."""
    scale = q.shape[-1] ** -0.5
    verify = plan.verify
    if verify is None:
        table = group.blocks.view(-1, group.max_blocks)
        cpu_kernels.paged_decode(kernel, q, group.rows, k_cache, v_cache, table, group.kv_lens, out, group.rows, scale)
        return
    if verify.plain is not None:
        rows = verify.plain
        cpu_kernels.paged_decode(kernel, q, rows.rows, k_cache, v_cache, rows.table, rows.lens, out, rows.rows, scale)
    cpu_kernels.paged_verify(
        kernel, q, verify.first_rows, verify.counts, k_cache, v_cache, verify.table, verify.lens, out, scale
    )


def _kernel(plan: AttentionPlan, op: Op, q: torch.Tensor, gather: bool) -> ctypes.CDLL | None:
    """The C kernel the table picks for ``op`` on ``q`` (``gather``: the rows are not one lone row over consecutive
    blocks), None where it picks a torch row; asked once per step, not per layer."""
    key = (op, q.dtype, gather)
    if key not in plan.kernels:
        plan.kernels[key] = kernels.choose_with_library(op, q.dtype, int(gather), q.device.type)[1]
    return plan.kernels[key]


def _seq_kv(cache: torch.Tensor, blocks: torch.Tensor | slice, kv_len: int) -> torch.Tensor:
    """One sequence's K or V as ``[kv_heads, kv_len, D]`` (a view when its blocks are consecutive)."""
    picked = cache[blocks] if isinstance(blocks, slice) else cache.index_select(0, blocks)
    kv_heads, head_dim = cache.shape[-2:]
    return picked.view(-1, kv_heads, head_dim)[:kv_len].transpose(0, 1)


def _attend_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, span: PrefillSpan, use_flash: bool
) -> torch.Tensor:
    if use_flash:  # pragma: no cover - CUDA only, untested here
        return _flash_prefill(q, k_cache, v_cache, span)
    k = _seq_kv(k_cache, span.blocks, span.kv_len).unsqueeze(0)
    v = _seq_kv(v_cache, span.blocks, span.kv_len).unsqueeze(0)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, D]
    out = F.scaled_dot_product_attention(
        qh, k, v, attn_mask=span.attn_mask(q.dtype), is_causal=span.mask is None, enable_gqa=qh.shape[1] != k.shape[1]
    )
    return out[0].transpose(0, 1)


def _attend_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, use_flash: bool
) -> torch.Tensor:
    if use_flash:  # pragma: no cover - CUDA only, untested here
        return _flash_decode(q, k_cache, v_cache, group)
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[-2]
    if group.runs is not None:
        # NOTE: the table is one run of consecutive blocks: attend over a view of the pool, no gather copy.
        return torch.cat(
            [_attend_run(q[i], k_cache, v_cache, run, kv_len) for i, (run, kv_len) in enumerate(group.runs)]
        )
    # NOTE: fold the GQA group into the query axis: [B, kv_heads, group, D] attends over [B, kv_heads, L, D], so
    # K/V are read once per kv head instead of being repeated per query head.
    qg = q.view(batch, kv_heads, heads // kv_heads, head_dim)
    if not group.buffers:
        shape = (group.blocks.numel(), *k_cache.shape[1:])
        group.buffers = [k_cache.new_empty(shape), v_cache.new_empty(shape)]
    k = _padded_kv(k_cache, group, batch, group.buffers[0])
    v = _padded_kv(v_cache, group, batch, group.buffers[1])
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.mask)
    return out.reshape(batch, heads, head_dim)


def _attend_run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, run: slice, kv_len: int) -> torch.Tensor:
    heads, head_dim = q.shape
    kv_heads = k_cache.shape[-2]
    # NOTE: 4-D inputs: with 3-D ones SDPA on CPU silently takes the slow math path (measured 5x slower).
    qg = q.view(1, kv_heads, heads // kv_heads, head_dim)
    k = _seq_kv(k_cache, run, kv_len).unsqueeze(0)
    out = F.scaled_dot_product_attention(qg, k, _seq_kv(v_cache, run, kv_len).unsqueeze(0))
    return out.reshape(1, heads, head_dim)


def _padded_kv(cache: torch.Tensor, group: DecodeGroup, batch: int, out: torch.Tensor) -> torch.Tensor:
    kv_heads, head_dim = cache.shape[-2:]
    picked = torch.index_select(cache, 0, group.blocks, out=out).view(batch, -1, kv_heads, head_dim)
    return picked[:, : group.kv_len].transpose(1, 2)


def _flash_prefill(  # pragma: no cover - CUDA only, untested here
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, span: PrefillSpan
) -> torch.Tensor:
    blocks = span.blocks
    if isinstance(blocks, slice):
        blocks = torch.arange(blocks.start, blocks.stop, device=q.device)
    table = blocks.to(torch.int32).unsqueeze(0)
    seq_lens = torch.tensor([span.kv_len], dtype=torch.int32, device=q.device)
    # causal in flash-attn >= 2.1 aligns the query block to the bottom-right of the key block: an offset of start_pos
    out = flash_attn_with_kvcache(
        q.unsqueeze(0), k_cache, v_cache, cache_seqlens=seq_lens, block_table=table, causal=True
    )
    return out[0]


def _flash_decode(  # pragma: no cover - CUDA only, untested here
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup
) -> torch.Tensor:
    out = flash_attn_with_kvcache(
        q.unsqueeze(1), k_cache, v_cache, cache_seqlens=group.seq_lens, block_table=group.block_table, causal=True
    )
    return out[:, 0]
