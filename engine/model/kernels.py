"""Which implementation runs each operation of the forward pass: one table, read top to bottom.

For an operation, dtype and row count, the first row whose CPU features are present (and none of its excluded ones)
and whose library builds is the one that runs. The loader (the weight layout), ``linear.py`` (the kernel per batch
size) and ``paged_attention.py`` (decode and prefill attention) ask ``choose``; ``kvchat doctor`` prints ``resolve()``.
The measurements behind each row are in docs/benchmarks.md, per CPU kind.

NOTE: the rows of a linear call are those of the whole batch, except where a dense copy is kept for many rows
(``dense_copy_rows``): there ``llama.row_groups`` multiplies each prefill chunk of ``WIDE_ROWS`` rows or more alone
and the other requests' rows in runs of fewer, so a row's kernel never depends on the other requests in the batch.

NOTE: the checks that depend on a tensor's shape (an input width that is a multiple of 32 for the AMX tiles, a head
dim the kernel takes) stay with each kernel's ``supports``/``takes``: the table says which kernel is preferred, the
kernel says whether it can take this call; if not, the caller takes the next row.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum

import torch

from engine.device import cpu_flags, cpu_kind


class Op(StrEnum):
    LINEAR = "linear"
    DECODE_ATTENTION = "decode attention"
    PREFILL_ATTENTION = "prefill attention"
    NORM = "norm"
    ROPE = "rope"
    ACTIVATION = "activation"
    ARGMAX = "argmax"


class Layout(StrEnum):
    """How a linear weight is held (chosen at load, by the linear row that serves one row)."""

    DENSE = "dense"
    BF16_PANELS = "bf16 pair panels"
    FP32_PANELS = "fp32 panels"
    INT8 = "int8 + scales + dense"  # opt-in (EngineConfig.quantization), lossy: never what weight_layout picks


F32, BF16 = torch.float32, torch.bfloat16
ANY_ROWS = 1 << 62


@dataclass(frozen=True, slots=True)
class Impl:
    op: Op
    name: str
    library: str | None  # the csrc/ library it runs (None: torch)
    dtypes: frozenset[torch.dtype]
    needs: frozenset[str] = frozenset()  # CPU flags it needs
    without: frozenset[str] = frozenset()  # CPU flags where another row wins
    max_rows: int = ANY_ROWS
    layout: Layout | None = None  # linear only: the weight layout it reads
    why: str = ""
    min_rows: int = 0
    opt_in: bool = False  # serves only weights the operator chose (int8): never picked for plain weights

    def takes_rows(self, rows: int) -> bool:
        return self.min_rows <= rows <= self.max_rows

    def matches(self, dtype: torch.dtype, rows: int | None, flags: frozenset[str]) -> bool:
        """Whether this row applies (``rows``: of the call; for decode attention, the rows that need a gather,
        0 for a lone row over consecutive blocks; None: any row count)."""
        fits = rows is None or self.takes_rows(rows)
        return dtype in self.dtypes and fits and self.needs <= flags and not self.without & flags


def _row(
    op: Op,
    name: str,
    library: str | None,
    dtypes: set[torch.dtype],
    why: str,
    needs: set[str] | None = None,
    without: set[str] | None = None,
    max_rows: int = ANY_ROWS,
    layout: Layout | None = None,
    min_rows: int = 0,
    opt_in: bool = False,
) -> Impl:
    needs_, without_ = frozenset(needs or ()), frozenset(without or ())
    return Impl(op, name, library, frozenset(dtypes), needs_, without_, max_rows, layout, why, min_rows, opt_in)


AMX = {"amx_bf16", "amx_tile", "avx512_bf16"}
TORCH_DTYPES = {F32, BF16, torch.float16}
# NOTE: the fewest rows of one call (one request's prefill chunk: llama.row_groups) that take the dense copy. On the AMX
# Xeon (docs/benchmarks.md) F.linear wins by 4-10 % at 384-512 rows, loses by 13 % at 640, is even at 768, wins by
# 2-8 % at 1024 and by ~30 % from 1536: from 1024 it wins at every size measured.
WIDE_ROWS = 1024

# NOTE: the longest prefill chunk of a step while other requests are in flight, and a step's prefill in all while
# several tenants have requests in flight (``SchedulerConfig.long_prefill_chunk``), by CPU kind and dtype: about
# 200 ms of prefill there (Zen 5, SmolLM2: 512 rows 211 ms in bf16, 256 rows ~200 ms in fp32; bench.roofline; Zen 3
# AVX2, fp32: 96 rows 200 ms, 128 rows 230-260 ms, 31 decodes + 96 rows ~300 ms), so a new turn or a decode waits
# behind one such chunk, not behind a whole 2048-token step (~1.2 s in bf16, ~4 s in fp32 on AVX2). A prompt alone
# still takes the whole budget. Kinds not listed were not measured with it and keep no cap.
# NOTE: Zen 4 shares Zen 5's kind but runs these chunks in ~1.8x the time (bf16 512 rows 373 ms, fp32 256 rows 297 ms;
# bench.step_mix). Half the chunk there cut a burst's mean TTFT by 17-37 % and cost 16 long replies in bf16 11-13 % of
# their tokens/s (docs/benchmarks.md): kept.
PREFILL_CHUNKS: dict[tuple[str, torch.dtype], int] = {
    ("AVX-512 + AVX512-BF16", BF16): 512,
    ("AVX-512 + AVX512-BF16", F32): 256,
    ("AVX2 + FMA", F32): 96,
}
# NOTE: the kinds and dtypes where a step's prefill in all is capped at that chunk whenever several requests are in
# flight, a tenant alone too. Zen 4 (16 sessions arriving at once, 6 turns, bench.run --arrival burst, alternating):
# a burst's prompts then finish a chunk's worth at a time instead of all at the end of one ~1.3 s (bf16) or ~2.1 s
# (fp32) step, and the later prompts find a cold shared prefix in the blocks the first published; the price is one
# weight stream per extra step (~7 ms in bf16, ~13 ms in fp32 at ~200 ms steps). AVX2's 96-token chunk was tried for
# a lone tenant and lost 10-40 % of the tokens/s of 16 sessions arriving together (commit 7d4d562): not there.
LONE_STEP_CAPPED: frozenset[tuple[str, torch.dtype]] = frozenset(
    {("AVX-512 + AVX512-BF16", BF16), ("AVX-512 + AVX512-BF16", F32)}
)

TABLE: tuple[Impl, ...] = (
    # --- linear: the weight layout is chosen at load; then the row count picks the kernel that reads it
    _row(
        Op.LINEAR,
        "F.linear_dense_copy",
        None,
        {BF16},
        "a prefill chunk of many rows: public F.linear on a dense bf16 copy kept beside the panels, 1.5x the "
        "tiles at 2048 rows (+203 MiB for SmolLM2: the layers, not the LM head); each such chunk is its own call, so "
        "its rows' bits depend on its length, never on the other requests in the batch",
        needs=AMX,
        min_rows=WIDE_ROWS,
        layout=Layout.BF16_PANELS,
    ),
    _row(
        Op.LINEAR,
        "amx_tiles",
        "amx_panels",
        {BF16},
        "tile multiplies read the pair panels in place; a batch "
        "costs what one row does, and a row gets the same bits in any batch",
        needs=AMX,
        layout=Layout.BF16_PANELS,
    ),
    _row(
        Op.LINEAR,
        "bf16_pairs",
        "bf16_panels",
        {BF16},
        "vdpbf16ps over pair panels, 2x F.linear at decode sizes "
        "(Zen 4); on AMX it serves weights whose input width is not a multiple of 32",
        needs={"avx512_bf16"},
        layout=Layout.BF16_PANELS,
    ),
    _row(
        Op.LINEAR,
        "fp32_panels",
        "panel_linear",
        {F32},
        "outer-product register tiles, 1.3-2.5x F.linear on AVX2 (Zen 1-5); the same bits for a row in any batch",
        needs={"avx2", "fma"},
        layout=Layout.FP32_PANELS,
    ),
    _row(
        Op.LINEAR,
        "int8pack_mm",
        None,
        {F32, BF16},
        "opt-in weight-only int8: aten's int8pack kernel reads 1 byte a weight, fast for a few rows only",
        max_rows=8,
        layout=Layout.INT8,
        opt_in=True,
    ),
    _row(
        Op.LINEAR,
        "F.linear",
        None,
        TORCH_DTYPES,
        "everything else (int8 weights: on their dense copy)",
        layout=Layout.DENSE,
    ),
    # --- attention
    _row(
        Op.DECODE_ATTENTION,
        "sdpa_view",
        None,
        {BF16},
        "a lone bf16 row over consecutive blocks without bf16 pair "
        "products: SDPA on a view of the pool measured faster",
        without={"avx512_bf16"},
        max_rows=0,
    ),
    _row(
        Op.DECODE_ATTENTION,
        "c_paged",
        "cpu_kernels",
        {F32, BF16},
        "reads K/V once through the block table (SDPA needs a padded gather first), split-K over the context",
    ),
    _row(Op.DECODE_ATTENTION, "sdpa", None, TORCH_DTYPES, "padded gather + one SDPA call (flash-attn on CUDA)"),
    _row(
        Op.PREFILL_ATTENTION,
        "sdpa",
        None,
        {BF16},
        "on AMX SDPA's matmuls run on the tiles: 3x faster here",
        needs={"amx_bf16"},
    ),
    _row(
        Op.PREFILL_ATTENTION,
        "c_tiles",
        "prefill_attention",
        {F32, BF16},
        "register-tiled, reads the pool in place; a row gets the same bits cold and after a cache hit",
        needs={"avx512f"},
    ),
    _row(
        Op.PREFILL_ATTENTION,
        "c_tiles",
        "prefill_attention",
        {F32},
        "8-lane softmax: 0.77-0.96x SDPA's time on AVX2 (Zen 3)",
        needs={"avx2", "fma"},
    ),
    _row(Op.PREFILL_ATTENTION, "sdpa", None, TORCH_DTYPES, "SDPA with a causal mask (flash-attn on CUDA)"),
    # --- elementwise: one C call instead of several aten ops per layer
    _row(Op.NORM, "c_rms_norm", "cpu_kernels", {F32, BF16}, "one call with the residual add (torch: ~8 ops)"),
    _row(Op.NORM, "F.rms_norm", None, TORCH_DTYPES, "no kernel"),
    _row(Op.ROPE, "c_rope_store", "cpu_kernels", {F32, BF16}, "rotates q/k and writes K/V to the pool in one call"),
    _row(Op.ROPE, "torch", None, TORCH_DTYPES, "no kernel, or Qwen3's per-head q/k norm"),
    _row(Op.ACTIVATION, "c_silu_mul", "cpu_kernels", {F32, BF16}, "one pass over the fused gate/up product"),
    _row(Op.ACTIVATION, "torch", None, TORCH_DTYPES, "F.silu(gate) * up"),
    _row(Op.ARGMAX, "c_argmax", "cpu_kernels", {F32}, "greedy sampling over the logits, 16 lanes at a time"),
    _row(Op.ARGMAX, "torch", None, TORCH_DTYPES, "torch.argmax"),
)


def _loaders() -> dict[str, Callable[[], ctypes.CDLL | None]]:
    from engine.model import amx_linear, bf16_linear, cpu_kernels, panel_linear, prefill_attention

    return {
        "amx_panels": amx_linear.load,
        "bf16_panels": bf16_linear.load,
        "panel_linear": panel_linear.load,
        "prefill_attention": prefill_attention.load,
        "cpu_kernels": cpu_kernels.load,
    }


def library(name: str, flags: frozenset[str] | None = None) -> ctypes.CDLL | None:
    """The built library ``name``: None where no row of the table that runs it applies to a CPU with ``flags`` (by
    default this one's), where it cannot be built, or where kernels are disabled.

    NOTE: the table is what says which CPUs a library is for: its rows' ``needs``, not the library module.
    """
    flags = cpu_flags() if flags is None else flags
    if not any(i.library == name and i.needs <= flags for i in TABLE):
        return None
    return _loaders()[name]()


def candidates(
    op: Op,
    dtype: torch.dtype,
    rows: int | None = 1,
    flags: frozenset[str] | None = None,
    device: str = "cpu",
    opt_in: bool = False,
) -> Iterator[tuple[Impl, ctypes.CDLL | None]]:
    """The rows of ``op`` that apply, best first, with their library (torch rows: None; ``rows`` None: for any
    row count; ``opt_in``: the rows of weights the operator chose too)."""
    flags = cpu_flags() if flags is None else flags
    for impl in TABLE:
        if impl.op != op or not impl.matches(dtype, rows, flags) or (impl.opt_in and not opt_in):
            continue
        if impl.library is None:
            yield impl, None
        elif device == "cpu" and (lib := library(impl.library, flags)) is not None:
            yield impl, lib


def choose_with_library(
    op: Op, dtype: torch.dtype, rows: int = 1, device: str = "cpu"
) -> tuple[Impl, ctypes.CDLL | None]:
    """The implementation that runs ``op`` for ``rows`` rows in ``dtype`` on this machine, and its library."""
    return next(candidates(op, dtype, rows, device=device))


def choose(op: Op, dtype: torch.dtype, rows: int = 1, device: str = "cpu") -> Impl:
    return choose_with_library(op, dtype, rows, device)[0]


def weight_layout(dtype: torch.dtype, device: str) -> Layout:
    """How the loader holds the linear weights: the layout of the linear row that serves one row."""
    impl, _ = next(candidates(Op.LINEAR, dtype, 1, device=device))
    return impl.layout or Layout.DENSE


def dense_copy_rows(dtype: torch.dtype, device: str) -> int | None:
    """The fewest rows of a call that take a dense copy kept beside pair panels here (the loader keeps one for the
    layers' weights where this is not None; ``llama.row_groups`` cuts a batch at it)."""
    if weight_layout(dtype, device) is not Layout.BF16_PANELS:
        return None
    wide = (i for i, _ in candidates(Op.LINEAR, dtype, None, device=device) if i.library is None and i.min_rows > 1)
    return next((i.min_rows for i in wide if i.layout is Layout.BF16_PANELS), None)


def same_bits_at_any_width(dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether a forward pass gives the same bits at any OpenMP thread count here: its linears and attention run our
    C kernels, whose threads split the outputs, never one output's sum (torch's GEMMs may split a sum by thread: the
    dense copy's F.linear on AMX, the torch fallbacks). ``engine.cpu_share`` changes the width only where this holds."""
    if device != "cpu" or dense_copy_rows(dtype, device) is not None:
        return False
    ops = (Op.LINEAR, Op.DECODE_ATTENTION, Op.PREFILL_ATTENTION)
    return all(choose_with_library(op, dtype, device=device)[1] is not None for op in ops)


@functools.cache
def linear_plan(layout: Layout, dtype: torch.dtype) -> tuple[tuple[Impl, ctypes.CDLL | None], ...]:
    """The linear rows that read weights held as ``layout``, best first, with their libraries (``linear.linear``
    takes the first whose row limits and shape checks take the call). Resolved once per layout and dtype."""
    rows = [
        (i, lib) for i, lib in candidates(Op.LINEAR, dtype, None, opt_in=True) if i.layout in (layout, Layout.DENSE)
    ]
    return tuple((i, lib) for i, lib in rows if i.layout is layout or layout is not Layout.BF16_PANELS)


def prefill_chunk(dtype: torch.dtype, device: str = "cpu", flags: frozenset[str] | None = None) -> int:
    """The longest prefill chunk of a step beside other requests for this CPU kind and dtype (0: no cap)."""
    return PREFILL_CHUNKS.get((cpu_kind(flags), dtype), 0) if device == "cpu" else 0


def caps_lone_steps(dtype: torch.dtype, device: str = "cpu", flags: frozenset[str] | None = None) -> bool:
    """Whether a tenant alone has its step's prefill capped at ``prefill_chunk`` too here (``LONE_STEP_CAPPED``)."""
    return device == "cpu" and (cpu_kind(flags), dtype) in LONE_STEP_CAPPED


def row_limit(name: str, dtype: torch.dtype) -> int:
    """The most rows the linear row ``name`` takes in ``dtype``."""
    return next(i.max_rows for i in TABLE if i.op is Op.LINEAR and i.name == name and dtype in i.dtypes)


def resolve(dtypes: tuple[torch.dtype, ...] = (F32, BF16)) -> list[dict[str, str]]:
    """The table as resolved on this machine: for each operation, dtype and row count, what runs and why."""
    row_counts: dict[Op, list[tuple[int, str]]] = {
        Op.LINEAR: [(1, "1"), (16, "16"), (WIDE_ROWS - 1, str(WIDE_ROWS - 1)), (WIDE_ROWS, str(WIDE_ROWS))],
        Op.DECODE_ATTENTION: [(0, "1, no gather"), (16, "16")],
    }
    out = []
    for op in Op:
        for dtype in dtypes:
            for n, label in row_counts.get(op, [(1, "any")]):
                impl = choose(op, dtype, n)
                dt = str(dtype).removeprefix("torch.")
                out.append({"op": op.value, "dtype": dt, "rows": label, "runs": impl.name, "why": impl.why})
    return out


def usable(impl: Impl, flags: frozenset[str], builds: Callable[[str], bool]) -> bool:
    """Whether ``impl`` can run on a CPU with ``flags`` where ``builds(library)`` says which libraries build.

    NOTE: a torch row that reads a kernel's weight layout (the dense copy kept beside pair panels) runs only where a
    library serving that layout builds: without one the loader never picks the layout.
    """
    if not impl.needs <= flags or impl.without & flags:
        return False  # (a row ``without`` a flag is never picked where the flag is: another row wins there)
    if impl.library is not None and not builds(impl.library):
        return False
    if impl.library is None and impl.layout not in (None, Layout.DENSE, Layout.INT8):
        return any(
            i.library is not None and i.layout is impl.layout and i.needs <= flags and builds(i.library) for i in TABLE
        )
    return True


def row_key(impl: Impl) -> str:
    """``op/name/dtypes``: how ``exercised`` and ``kvchat doctor`` name a row of the table."""
    dtypes = "+".join(sorted(str(d).removeprefix("torch.") for d in impl.dtypes))
    return f"{impl.op.value}/{impl.name}/{dtypes}"


def exercised(
    flags: frozenset[str] | None = None, builds: Callable[[str], bool] | None = None
) -> tuple[list[str], list[str]]:
    """(implementations a machine can run, those it cannot), by ``row_key`` over the whole table. By default this
    machine: its CPU flags and the libraries that build here; tests pass another CPU kind's flags and compiler."""
    flags = cpu_flags() if flags is None else flags
    builds = builds or (lambda name: library(name) is not None)
    ran: list[str] = []
    skipped: list[str] = []
    for impl in TABLE:
        (ran if usable(impl, flags, builds) else skipped).append(row_key(impl))
    return ran, skipped
