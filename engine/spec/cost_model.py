"""When verifying drafts pays: a cost model per CPU kind and dtype, measured (``bench/suffix_decoding.py --cost``).

A decode step streams every weight once whatever its row count, so on a CPU a few extra rows cost little next to
the step; but the rows' arithmetic grows with the batch, and once a step holds enough decode rows to be bound by
arithmetic rather than by the weight stream, each draft row costs about what a decoded token does and a rejected
one is pure loss. The model says, for the number of sequences decoding in a step, how many draft tokens each may
verify: for each draft, the count that maximises the tokens per millisecond of its sequence's share of the step
(``DraftCostModel.rows``), from the chance that its first tokens pass: the suffix tree's estimate for each token,
scaled by the acceptance measured against what the requests produced (``Acceptance``). None where no count gains
enough.

The figures per CPU kind come from ``bench/suffix_decoding.py --cost`` (the step time with k extra rows per
sequence against the batch size; docs/benchmarks.md). A kind that was not measured gets at most 4 drafts for a lone
decoding sequence (where a verified row is cheapest next to the weight stream); CUDA gets none (not measured).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.device import cpu_kind


@dataclass(frozen=True, slots=True)
class DraftCostModel:
    """Measured step costs, and the draft length that maximises tokens per millisecond for a sequence in a batch.

    With ``b`` sequences decoding, a sequence's share of the step is ``step_ms(b) / b``; each draft row it verifies
    adds ``row_cost(b)`` (one figure, or measured points where it grows with the batch: on AVX2 in fp32 a row costs
    ~1.5 ms beside 1-2 sequences and ~3 ms beside 8-16, where the step is bound by arithmetic), and verifying at all
    adds ``verify_ms / b`` (the verify path; NOTE: charged as if all ``b`` sequences verify, since it was measured
    for a lone one). A draft whose first ``i`` tokens all pass with chance
    ``c_i`` yields ``1 + c_1 + ... + c_k`` tokens when its first ``k`` are verified; ``rows`` picks the ``k`` with
    the most tokens per millisecond of the sequence's share, none where it gains less than ``MIN_GAIN`` over ``k = 0``.
    """

    base_ms: tuple[tuple[int, float], ...]  # (sequences decoding, step ms without drafts), ascending
    # what one draft row adds to a step (its linear rows and its decode attention): one figure, or (sequences
    # decoding, ms) points, ascending
    row_ms: float | tuple[tuple[int, float], ...]
    acceptance: float  # the prior of the per-token acceptance against the tree's estimate (``LiveCostModel``)
    verify_ms: float = 0.0  # what verifying adds to a lone sequence's step beyond its rows
    max_draft_tokens: int = 24  # the tree's depth, as vLLM's suffix method (num_speculative_tokens = depth)
    max_decoding: int = 1 << 30  # no drafts above this many decoding sequences (for kinds not measured)

    def step_ms(self, decoding: int) -> float:
        """The step without drafts, interpolated between the measured batch sizes (linear beyond them)."""
        return _interpolate(self.base_ms, decoding)

    def row_cost(self, decoding: int) -> float:
        """What one draft row adds to a step of ``decoding`` sequences."""
        return _interpolate(self.row_ms, decoding) if isinstance(self.row_ms, tuple) else self.row_ms

    def gain(self, decoding: int, chances: Sequence[float]) -> float:
        """Tokens per millisecond of a sequence verifying a draft whose first ``i`` tokens all pass with chance
        ``chances[i - 1]``, over the same sequence without drafts."""
        share = self.step_ms(decoding) / decoding
        extra = self.verify_ms / decoding + len(chances) * self.row_cost(decoding) if chances else 0.0
        return (1 + sum(chances)) * share / (share + extra)

    def rows(self, decoding: int, chances: Sequence[float]) -> int:
        """How many tokens of a draft (``chances`` as in ``gain``) one of ``decoding`` sequences verifies (0: none)."""
        if decoding <= 0 or decoding > self.max_decoding:
            return 0
        chances = chances[: self.max_draft_tokens]
        best = max(range(len(chances) + 1), key=lambda k: self.gain(decoding, chances[:k]))
        return best if best and self.gain(decoding, chances[:best]) >= MIN_GAIN else 0

    def limit(self, decoding: int) -> int:
        """The most draft tokens each of ``decoding`` sequences may verify in one step: what a draft sure to pass
        would verify (0: not even those pay at this batch)."""
        return self.rows(decoding, [1.0] * self.max_draft_tokens)


@dataclass(slots=True)
class Acceptance:
    """How often draft tokens pass against what the suffix tree expected: accepted / expected, both decayed sums.

    The tree gives each draft token the chance ``r`` that it follows the ones before it (the share of its node's
    count in its parent's); a token is expected to pass with chance ``min(1, q * r)``, ``q`` being this rate. It is
    measured against the tokens the request produced next, whether or not its draft was verified (``score``), so a
    rate that fell is seen to rise again without spending verify rows on it.
    """

    prior: float
    weight: float = 4.0  # how many tried tokens the prior counts for
    accepted: float = 0.0
    expected: float = 0.0

    def observe(self, accepted: int, expected: float) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.expected = DECAY * self.expected + expected

    def rate(self, prior: float | None = None) -> float:
        p = self.prior if prior is None else prior
        return min(1.0, (self.accepted + self.weight * p) / (self.expected + self.weight))


def chances(probs: Sequence[float], rate: float) -> list[float]:
    """The chance that a draft's first ``i`` tokens all pass, from the tree's estimates ``probs`` (the chance of its
    path to each token, falling along the draft) and the measured ``rate``."""
    out, path, prev = [], 1.0, 1.0
    for p in probs:
        path *= min(1.0, rate * p / prev) if prev > 0 else 0.0
        prev = p
        out.append(path)
    return out


def score(draft: Sequence[int], probs: Sequence[float], produced: Sequence[int]) -> tuple[int, float]:
    """How a draft fared against the tokens the request produced after it: (tokens that passed, tokens expected to
    pass at q = 1 over the positions tried). A position is tried when the tokens before it passed and the request
    produced a token there."""
    n = min(len(draft), len(produced))
    passed = 0
    while passed < n and draft[passed] == produced[passed]:
        passed += 1
    tried = min(passed + 1, n)
    expected, prev = 0.0, 1.0
    for p in probs[:tried]:
        expected += p / prev if prev > 0 else 0.0
        prev = p
    return passed, expected


@dataclass(slots=True)
class LiveCostModel:
    """The model with the engine's measured acceptance (``Acceptance``, over every request's drafts): the prior of
    each request's own rate."""

    model: DraftCostModel
    acceptance: Acceptance = field(init=False)

    def __post_init__(self) -> None:
        self.acceptance = Acceptance(self.model.acceptance, weight=16.0)

    def limit(self, decoding: int) -> int:
        return self.model.limit(decoding)

    def rows(self, decoding: int, probs: Sequence[float], own: Acceptance | None = None) -> int:
        """How many tokens of a draft (the tree's ``probs``) to verify, at the request's rate (``own``, whose prior
        is the engine's) or the engine's."""
        rate = self.acceptance.rate()
        if own is not None:
            rate = own.rate(rate)
        return self.model.rows(decoding, chances(probs, rate))


def _interpolate(points: tuple[tuple[int, float], ...], x: int) -> float:
    """Linear between measured (x, y) points, flat below the first, extended along the last two beyond them."""
    if x <= points[0][0] or len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


DECAY = 0.95  # per scored draft: about the last 20 drafts count
MIN_GAIN = 1.05  # below a 5 % gain, drafts are not worth the measurement noise and the rejected rows' energy
F32, BF16 = torch.float32, torch.bfloat16
# NOTE: a kind that was not measured: drafts for a lone decoding sequence only, at most 4.
UNMEASURED = DraftCostModel(((1, 8.0), (2, 16.0)), row_ms=1.0, acceptance=0.5, max_draft_tokens=4, max_decoding=1)

# (CPU kind, dtype) -> the model measured there with SmolLM2-135M at 1k-token contexts (bench/suffix_decoding.py
# --cost; docs/benchmarks.md); the acceptance from the 1-session replay (bench/suffix_decoding.py).
# NOTE: AMX's row cost was measured while each verify row re-read its sequence's K/V (before the verify kernel): an
# upper bound there now. Zen 4's (also the kind of Zen 5, not measured there) are with the verify kernel, the median
# over the batches and draft counts of (step - step without drafts) / rows; its attention is ~0.44 ms of the 1.06 at
# 1k in bf16 (bench/verify_attention.py), the rest the row's linear products. A lone sequence's verify step costs
# 1.3 ms more than its rows there (the mean over k = 2, 4, 8, 16 of step(k) - step(0) - 1.06 k at B = 1); none is seen
# in the other tables beyond their noise. AVX2 (Zen 3, fp32; no bf16 path there) gives the row cost per batch size
# (the median over k = 2, 4, 8, 16 at each B): 1.3-1.6 ms beside 1-2 sequences, 2.8-3.1 ms beside 8-16, where the
# step's linears are bound by arithmetic and a draft row costs about what a decode row does.
# AVX-512 without AVX512-BF16 (an Intel Xeon, family 6 model 207, whose AMX and bf16 the VM hides; fp32; 2026-12-07):
# the row cost per batch size as on AVX2, the median over k = 2, 4, 8, 16: 1.3 ms beside 1-2 sequences, 1.6-1.8 ms
# beside 4-16. Before it the kind was unmeasured (at most 4 drafts, a lone sequence only): 3.3 accepted a verify
# step against vLLM suffix's 6.6 in the 1-session replay.
MEASURED: dict[tuple[str, torch.dtype], DraftCostModel] = {
    ("AMX", BF16): DraftCostModel(
        base_ms=((1, 16.0), (2, 17.2), (4, 20.9), (8, 26.5), (16, 39.8)), row_ms=1.06, acceptance=0.5
    ),
    ("AVX-512 + AVX512-BF16", BF16): DraftCostModel(
        base_ms=((1, 10.1), (2, 10.9), (4, 11.9), (8, 18.5), (16, 29.2)), row_ms=1.06, verify_ms=1.3, acceptance=0.5
    ),
    ("AVX-512 + AVX512-BF16", F32): DraftCostModel(
        base_ms=((1, 24.3), (2, 21.5), (4, 29.4), (8, 31.3), (16, 55.6)), row_ms=1.99, acceptance=0.5
    ),
    ("AVX-512", F32): DraftCostModel(
        base_ms=((1, 26.2), (2, 28.2), (4, 34.5), (8, 46.9), (16, 67.6)),
        row_ms=((1, 1.3), (2, 1.3), (4, 1.6), (8, 1.8), (16, 1.8)),
        acceptance=0.5,
    ),
    ("AVX2 + FMA", F32): DraftCostModel(
        base_ms=((1, 28.5), (2, 30.4), (4, 35.7), (8, 50.4), (16, 103.2)),
        row_ms=((1, 1.56), (2, 1.34), (4, 2.04), (8, 2.78), (16, 3.12)),
        acceptance=0.5,
    ),
}


def for_machine(dtype: torch.dtype, device: str = "cpu", flags: frozenset[str] | None = None) -> DraftCostModel | None:
    """The cost model for this CPU kind and dtype (None: drafts are off on this device)."""
    if device != "cpu":
        return None
    return MEASURED.get((cpu_kind(flags), dtype), UNMEASURED)
