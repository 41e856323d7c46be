"""When verifying drafts pays: a cost model per CPU kind and dtype, measured (``bench/suffix_decoding.py --cost``).

A decode step streams every weight once whatever its row count, so on a CPU a few extra rows cost little next to
the step; but the rows' arithmetic grows with the batch, and once a step holds enough decode rows to be bound by
arithmetic rather than by the weight stream, each draft row costs about what a decoded token does and a rejected
one is pure loss. The model says, for the number of sequences decoding in a step, how many draft tokens each may
verify: the count that maximises the tokens per millisecond of the step (``DraftCostModel``), none where no count
gains enough.

The figures per CPU kind come from ``bench/suffix_decoding.py --cost`` (the step time with k extra rows per
sequence against the batch size; docs/benchmarks.md). A kind that was not measured gets at most 4 drafts for a lone
decoding sequence (where a verified row is cheapest next to the weight stream); CUDA gets none (not measured).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.device import cpu_kind


@dataclass(frozen=True, slots=True)
class DraftCostModel:
    """Measured step costs, and the draft length that maximises tokens per millisecond for a batch.

    With ``b`` sequences decoding and ``k`` drafts each, a step takes ``step_ms(b) + b * k * row_ms`` and yields
    ``b * (1 + a + a**2 + ... + a**k)`` tokens for a per-token acceptance ``a``. Drafts are verified when the best
    ``k`` gains at least ``MIN_GAIN`` over ``k = 0``.
    """

    base_ms: tuple[tuple[int, float], ...]  # (sequences decoding, step ms without drafts), ascending
    row_ms: float  # what one draft row adds to a step (its linear rows and its decode attention)
    acceptance: float  # the chance that a draft token is accepted (measured on the replay; the prior of ``Live``)
    max_draft_tokens: int = 16
    max_decoding: int = 1 << 30  # no drafts above this many decoding sequences (for kinds not measured)

    def step_ms(self, decoding: int) -> float:
        """The step without drafts, interpolated between the measured batch sizes (linear beyond them)."""
        points = self.base_ms
        if decoding <= points[0][0]:
            return points[0][1]
        for (b0, t0), (b1, t1) in itertools.pairwise(points):
            if decoding <= b1:
                return t0 + (t1 - t0) * (decoding - b0) / (b1 - b0)
        (b0, t0), (b1, t1) = points[-2], points[-1]
        return t1 + (t1 - t0) * (decoding - b1) / (b1 - b0)

    def gain(self, decoding: int, k: int, acceptance: float | None = None) -> float:
        """Tokens per millisecond with ``k`` drafts each, over those without (at ``acceptance``, else the model's)."""
        a = self.acceptance if acceptance is None else acceptance
        accepted = sum(a**i for i in range(1, k + 1))
        base = self.step_ms(decoding)
        return (1 + accepted) * base / (base + decoding * k * self.row_ms)

    def limit(self, decoding: int, acceptance: float | None = None) -> int:
        """The most draft tokens each of ``decoding`` sequences may verify in one step (0: decode one token)."""
        if decoding <= 0 or decoding > self.max_decoding:
            return 0
        best = max(range(self.max_draft_tokens + 1), key=lambda k: self.gain(decoding, k, acceptance))
        return best if self.gain(decoding, best, acceptance) >= MIN_GAIN else 0


@dataclass(slots=True)
class LiveCostModel:
    """The model at the acceptance measured as the engine runs (an exponential average over verify steps).

    NOTE: the estimate is kept in [0.3, 0.9]: at 0.3 a lone sequence still verifies a draft, so a workload whose
    drafts start to pass again is seen; at 0.9 a lucky run cannot push large batches into long drafts.
    """

    model: DraftCostModel
    acceptance: float = -1.0

    def __post_init__(self) -> None:
        if self.acceptance < 0:
            self.acceptance = self.model.acceptance

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.acceptance = min(0.9, max(0.3, 0.95 * self.acceptance + 0.05 * accepted / drafted))

    def limit(self, decoding: int) -> int:
        return self.model.limit(decoding, self.acceptance)


MIN_GAIN = 1.05  # below a 5 % gain, drafts are not worth the measurement noise and the rejected rows' energy
F32, BF16 = torch.float32, torch.bfloat16
# NOTE: a kind that was not measured: drafts for a lone decoding sequence only, at most 4.
UNMEASURED = DraftCostModel(((1, 8.0), (2, 16.0)), row_ms=1.0, acceptance=0.5, max_draft_tokens=4, max_decoding=1)

# (CPU kind, dtype) -> the model measured there with SmolLM2-135M at 1k-token contexts (bench/suffix_decoding.py
# --cost; docs/benchmarks.md); the acceptance from the 1-session replay (bench/suffix_decoding.py).
# NOTE: AMX's row cost was measured while each verify row re-read its sequence's K/V (before the verify kernel): an
# upper bound there now. Zen 4's (also the kind of Zen 5, not measured there) are with the verify kernel, the median
# over the batches and draft counts of (step - step without drafts) / rows; its attention is ~0.44 ms of the 1.06 at
# 1k in bf16 (bench/verify_attention.py), the rest the row's linear products.
MEASURED: dict[tuple[str, torch.dtype], DraftCostModel] = {
    ("AMX", BF16): DraftCostModel(
        base_ms=((1, 16.0), (2, 17.2), (4, 20.9), (8, 26.5), (16, 39.8)), row_ms=1.06, acceptance=0.5
    ),
    ("AVX-512 + AVX512-BF16", BF16): DraftCostModel(
        base_ms=((1, 10.1), (2, 10.9), (4, 11.9), (8, 18.5), (16, 29.2)), row_ms=1.06, acceptance=0.5
    ),
    ("AVX-512 + AVX512-BF16", F32): DraftCostModel(
        base_ms=((1, 24.3), (2, 21.5), (4, 29.4), (8, 31.3), (16, 55.6)), row_ms=1.99, acceptance=0.5
    ),
}


def for_machine(dtype: torch.dtype, device: str = "cpu", flags: frozenset[str] | None = None) -> DraftCostModel | None:
    """The cost model for this CPU kind and dtype (None: drafts are off on this device)."""
    if device != "cpu":
        return None
    return MEASURED.get((cpu_kind(flags), dtype), UNMEASURED)
