"""When verifying drafts pays: a cost model per CPU kind and dtype, measured (``bench/suffix_decoding.py --cost``).

A decode step streams every weight once whatever its row count, so on a CPU a few extra rows cost little next to
the step; but the rows' arithmetic grows with the batch, and once a step holds enough decode rows to be bound by
arithmetic rather than by the weight stream, each draft row costs about what a decoded token does and a rejected
one is pure loss. The model says, for the number of sequences decoding in a step, how many draft tokens each may
verify: ``max_draft_tokens`` each while at most ``max_decoding`` sequences decode and the step's draft rows stay
within ``max_rows``; none above.

The figures per CPU kind come from ``bench/suffix_decoding.py --cost`` (the step time with k extra rows per
sequence against the batch size; docs/benchmarks.md). A kind that was not measured gets drafts for a lone decoding
sequence only (where a verified row is cheapest next to the weight stream); CUDA gets none (not measured).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.device import cpu_kind


@dataclass(frozen=True, slots=True)
class DraftCostModel:
    max_draft_tokens: int  # draft tokens one sequence verifies in a step, at most
    max_decoding: int  # above this many sequences decoding in a step, no drafts
    max_rows: int  # draft rows of one step in all, at most

    def limit(self, decoding: int) -> int:
        """The most draft tokens each of ``decoding`` sequences may verify in one step (0: decode one token)."""
        if decoding <= 0 or decoding > self.max_decoding:
            return 0
        return min(self.max_draft_tokens, self.max_rows // decoding)


F32, BF16 = torch.float32, torch.bfloat16
UNMEASURED = DraftCostModel(max_draft_tokens=8, max_decoding=1, max_rows=8)

# (CPU kind, dtype) -> the model measured there with SmolLM2-135M (bench/suffix_decoding.py --cost, docs/benchmarks.md)
MEASURED: dict[tuple[str, torch.dtype], DraftCostModel] = {
    ("AMX", BF16): DraftCostModel(max_draft_tokens=16, max_decoding=4, max_rows=32),
    ("AMX", F32): DraftCostModel(max_draft_tokens=16, max_decoding=4, max_rows=32),
}


def for_machine(dtype: torch.dtype, device: str = "cpu", flags: frozenset[str] | None = None) -> DraftCostModel | None:
    """The cost model for this CPU kind and dtype (None: drafts are off on this device)."""
    if device != "cpu":
        return None
    return MEASURED.get((cpu_kind(flags), dtype), UNMEASURED)
