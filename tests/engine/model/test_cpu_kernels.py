"""The C paged-decode kernel against the pure-torch gather + SDPA path, and the fallback when it cannot be built."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from engine.model import build, cpu_kernels, kernels, paged_attention
from engine.model.kernels import Op
from engine.model.paged_attention import attend, build_plan

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")


def _case(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, lens: list[int], prefill: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int, list[int]]]]:
    """Random caches ``[blocks, 4, kv_heads, dim]``, queries, and shuffled block tables: one decode row per ``lens``
    entry, plus one prefill chunk of ``prefill`` tokens (none when 0) in the middle of the batch."""
    gen = torch.Generator().manual_seed(seed)
    bs, rng = 4, random.Random(seed)
    seqs = [(length - 1, 1) for length in lens]
    if prefill:
        seqs.insert(len(seqs) // 2, (3, prefill))
    free = list(range(sum(-(-(s + n) // bs) for s, n in seqs) + 2))
    rng.shuffle(free)
    items = []
    for start, n in seqs:
        used = -(-(start + n) // bs)
        items.append((start, n, free[:used]))
        del free[:used]
    shape = (len(free) + sum(len(t) for _, _, t in items), bs, kv_heads, dim)
    k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(sum(n for _, n, _ in items), heads + 2 * kv_heads, dim, generator=gen).to(dtype)[:, :heads]
    return q, k, v, items


@needs_compiler
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "lens", "prefill"),
    [
        (9, 3, 64, [1], 0),
        (9, 3, 64, [300, 7, 513, 256, 257], 0),  # several parts (cpu_kernels.PART tokens each), uneven lengths
        (4, 4, 128, [40, 3], 5),  # no GQA, a prefill chunk between the decode rows
        (8, 1, 24, [600], 2),  # MQA, a head size that is not a multiple of 16
        (10, 2, 128, [300, 17, 520], 33),  # group 5 (register tiles of 4 + 1 rows), head dim 128
        (16, 2, 64, [700, 650, 30, 512], 0),  # group 8, enough parts for one work item per (sequence, part)
        (6, 2, 96, [200, 3, 130], 0),  # head dim 96: bf16 pair-product scores, values by the plain loop
        (9, 3, 64, [1, 700, 5, 260, 513, 2, 256, 31], 0),  # empty items between and after others (the prefetch
        # of a thread's next item), a next item longer than the current one, odd lengths (the bf16 value pairs)
    ],
)
def test_kernel_matches_torch_path(
    dtype: torch.dtype, tol: float, heads: int, kv_heads: int, dim: int, lens: list[int], prefill: int
) -> None:
    lib = cpu_kernels.load()
    assert lib is not None
    q, k, v, items = _case(dtype, heads, kv_heads, dim, lens, prefill, seed=len(lens) + dim)
    plan = build_plan(items, 4, torch.device("cpu"))
    attend(q, k, v, plan)
    # the plan runs what the kernel table picks on this machine (a lone bf16 row may go to SDPA: kernels.py)...
    picked = [(key, chosen is not None) for key, chosen in plan.kernels.items() if key[0] is Op.DECODE_ATTENTION]
    assert [(key, kernels.choose(*key[:2], int(key[2])).library is not None) for key, _ in picked] == picked
    # ...and the C kernel itself, wherever it runs, matches the torch rows
    plan.kernels = {key: lib if key[0] is Op.DECODE_ATTENTION else None for key in plan.kernels}
    ours = attend(q, k, v, plan)
    plan.kernels = dict.fromkeys(plan.kernels)  # (the torch rows)
    ref = attend(q, k, v, plan)
    assert ours.dtype == dtype
    assert (ours.float() - ref.float()).abs().max().item() <= tol


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_row_gives_the_same_bits_alone_and_in_a_batch(dtype: torch.dtype) -> None:
    # a batch this size takes (sequence, part) work items over all kv heads; a lone row takes one per kv head
    q, k, v, items = _case(dtype, 9, 3, 64, [700, 33, 520, 300, 9, 256], 0, seed=4)
    batch = attend(q, k, v, build_plan(items, 4, torch.device("cpu")))
    for i, item in enumerate(items):
        alone = attend(q[i : i + 1], k, v, build_plan([item], 4, torch.device("cpu")))
        assert torch.equal(alone, batch[i : i + 1])


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pipelined_prefetch_leaves_the_bits_alone(dtype: torch.dtype) -> None:
    # a build told L2 is 64 MiB prefetches a thread's next work item while it computes one; a build told 1 KiB has
    # every item fetch its own tokens ahead instead (whichever this machine's L2 would pick)
    q, k, v, items = _case(dtype, 9, 3, 64, [700, 33, 520, 300, 9, 256, 1, 640], 0, seed=5)
    plan = build_plan(items, 4, torch.device("cpu"))
    outputs = []
    for l2 in (64 << 20, 1024):
        lib = build.open_library("cpu_kernels", "nothing (the test fails)", [f"-DKVCHAT_L2_BYTES={l2}"])
        assert lib is not None
        plan.kernels[(Op.DECODE_ATTENTION, dtype, True)] = cpu_kernels.bind(lib)
        outputs.append(attend(q, k, v, plan))
    assert torch.equal(outputs[0], outputs[1])


def test_missing_compiler_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setattr(cpu_kernels, "load", cpu_kernels.load.__wrapped__)
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert cpu_kernels.load() is None
    monkeypatch.delenv("CC")
    assert cpu_kernels.load() is None
    q, k, v, items = _case(torch.float32, 4, 2, 8, [5, 9], 3, seed=0)
    plan = build_plan(items, 4, torch.device("cpu"))
    assert attend(q, k, v, plan).shape == q.shape
    assert [lib for (op, *_), lib in plan.kernels.items() if op is Op.DECODE_ATTENTION] == [None]  # the torch row


def test_disabled_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "load", cpu_kernels.load.__wrapped__)
    monkeypatch.setenv("KVCHAT_DISABLE_KERNELS", "1")
    assert paged_attention.cpu_kernels.load() is None


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("hidden", [96, 100])  # 100: a tail past the last 16-lane vector
def test_rms_norm_matches_transformers_rounding(dtype: torch.dtype, rows: int, hidden: int) -> None:
    lib = cpu_kernels.load()
    assert lib is not None
    gen = torch.Generator().manual_seed(rows)
    x, delta = (torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(hidden, generator=gen).to(dtype)
    summed = x + delta
    normed = summed.float() * torch.rsqrt(summed.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    ref = weight * normed.to(dtype)  # LlamaRMSNorm
    out = cpu_kernels.rms_norm(lib, x, weight, 1e-5, delta)
    assert torch.equal(x, summed)  # the residual was added in place
    ulp = 1e-6 if dtype == torch.float32 else 1e-2
    assert (out.float() - ref.float()).abs().max().item() <= ulp * ref.float().abs().max().item()


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "inter"), [(1, 1536), (3, 37), (40, 16)])  # 37: a tail past the last vector
def test_silu_mul_matches_torch(dtype: torch.dtype, rows: int, inter: int) -> None:
    lib = cpu_kernels.load()
    assert lib is not None
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = (4 * torch.randn(rows, 2 * inter, generator=gen)).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, 100.0, 0.0, -0.0])
    assert cpu_kernels.silu_mul_supported(gate_up)
    out = cpu_kernels.silu_mul(lib, gate_up)
    gate, up = gate_up[:, :inter].double(), gate_up[:, inter:].double()
    exact = gate * torch.sigmoid(gate)
    if dtype == torch.bfloat16:  # torch's F.silu(gate) * up rounds the silu to bf16 before the multiply
        exact = exact.to(dtype).double()
        allowed = 2.0 ** (torch.floor(torch.log2((exact * up).abs().clamp_min(1e-30))) - 7)  # one bf16 ulp
    else:
        allowed = 4e-7 * (exact * up).abs() + 1e-30
    assert out.shape == (rows, inter) and out.dtype == dtype
    assert bool(((out.double() - exact * up).abs() <= allowed).all())
    assert abs(out[0, 0].item()) <= 1e-30 and torch.equal(out[0, 1], gate_up[0, inter + 1] * 100)  # silu(100) = 100


@needs_compiler
def test_silu_mul_keeps_non_finite_values_and_refuses_strided_input() -> None:
    lib = cpu_kernels.load()
    assert lib is not None
    gate_up = torch.ones(2, 64)
    gate_up[0, 5] = float("nan")
    gate_up[1, 32 + 7] = float("inf")
    out = cpu_kernels.silu_mul(lib, gate_up)
    assert out[0, 5].isnan() and out[1, 7].isinf() and out[1, 7] > 0
    assert not cpu_kernels.silu_mul_supported(torch.ones(4, 64)[:, :32])  # not contiguous
    assert not cpu_kernels.silu_mul_supported(torch.ones(4, 63))  # no even split
    assert not cpu_kernels.silu_mul_supported(torch.ones(4, 64, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_is_bit_identical_to_the_torch_path(dtype: torch.dtype) -> None:
    """The fused C RoPE + K/V store rounds exactly as ``_apply_rope`` + ``index_copy_`` do, in fp32 and bf16."""
    from engine.model.llama import _apply_rope, rope_tables
    from engine.model.spec import ModelSpec

    lib = cpu_kernels.load()
    if lib is None:
        pytest.skip("no C compiler")
    spec = ModelSpec.from_hf_config(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
         "max_position_embeddings": 512, "rope_theta": 10000.0}
    )  # fmt: skip
    heads, kv_heads, dim, n = 4, 2, 32, 7
    table = rope_tables(spec, 512, dtype, torch.device("cpu"))
    positions = torch.tensor([0, 1, 5, 100, 101, 300, 511])
    slots = torch.tensor([3, 9, 0, 17, 4, 30, 12])
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, dtype=dtype)

    k_ref, v_ref = torch.zeros(32, kv_heads, dim, dtype=dtype), torch.zeros(32, kv_heads, dim, dtype=dtype)
    rope = table.index_select(0, positions)
    qk = _apply_rope(qkv[:, : (heads + kv_heads) * dim].view(n, heads + kv_heads, dim), rope[:, 0:1], rope[:, 1:2])
    k_ref.index_copy_(0, slots, qk[:, heads:])
    v_ref.index_copy_(0, slots, qkv[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim))

    k_out, v_out = torch.zeros_like(k_ref), torch.zeros_like(v_ref)
    q = cpu_kernels.rope_store(lib, qkv, heads, kv_heads, table, positions, slots, k_out, v_out)
    assert torch.equal(q, qk[:, :heads])
    assert torch.equal(k_out, k_ref)
    assert torch.equal(v_out, v_ref)


@needs_compiler
@pytest.mark.parametrize(("rows", "cols"), [(1, 49152), (16, 49152), (3, 7), (5, 33), (2, 16), (40, 100)])
def test_argmax_matches_torch(rows: int, cols: int) -> None:
    lib = cpu_kernels.load()
    assert lib is not None
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols))
    assert cpu_kernels.argmax(lib, x) == x.argmax(dim=-1).tolist()


@needs_compiler
def test_argmax_takes_the_first_of_ties_and_nan_as_torch_does() -> None:
    lib = cpu_kernels.load()
    assert lib is not None
    x = torch.randn(6, 100, generator=torch.Generator().manual_seed(3))
    x[0, 10] = x[0, 90] = 1e9  # a tie: the first
    x[1, 50] = x[1, 70] = float("nan")  # NaN wins, the first one
    x[2] = float("-inf")  # all -inf: index 0
    x[3] = 0.0
    x[3, 5] = -0.0  # -0.0 == 0.0: index 0
    x[4, 99] = float("inf")  # the last element
    x[5, 0] = float("nan")
    assert cpu_kernels.argmax(lib, x) == x.argmax(dim=-1).tolist() == [10, 50, 0, 0, 99, 0]
    assert not cpu_kernels.argmax_supported(x.t())  # (strided)
    assert not cpu_kernels.argmax_supported(x.to(torch.bfloat16))
