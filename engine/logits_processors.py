"""What changes one row of logits before the choice, vLLM's way: logit bias, penalties, and the sampling filters.

Every function reads and writes one 1-D row and its own request's state, never another row: that is what keeps a
reply independent of its batch neighbours, and (since the state depends only on the prompt's ids and the reply so
far) of whether its prompt came from the prefix cache. The sampler applies them in vLLM's order:

    grammar mask → logit bias → min-tokens mask → penalties (repetition, frequency, presence)
    → greedy: argmax | sampled: temperature → min_p → top_k → top_p → one draw

Penalties touch only the ids a request has seen (a few hundred), not the whole vocabulary: a row costs microseconds
whatever the vocabulary size, and the values equal those of vLLM's dense form (``x * 1`` and ``x - 0`` are exact).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling_params import RepetitionScope, SamplingParams


class TokenHistory:
    """The tokens one request has seen, kept for its penalties: the prompt's and the reply's distinct ids (the
    repetition penalty) and how often each id occurs in the reply (frequency and presence penalties).

    Append-only buffers sized for the whole request up front, so recording a token writes one element.
    """

    __slots__ = ("_counts", "_num_out", "_num_seen", "_out_ids", "_out_pos", "_seen", "_seen_ids")

    def __init__(self, prompt_token_ids: Sequence[int], max_tokens: int) -> None:
        distinct = list(dict.fromkeys(prompt_token_ids))
        self._seen: set[int] = set(distinct)
        self._seen_ids = torch.empty(len(distinct) + max_tokens, dtype=torch.long)
        self._seen_ids[: len(distinct)] = torch.tensor(distinct, dtype=torch.long)
        self._num_seen = len(distinct)
        self._out_pos: dict[int, int] = {}
        self._out_ids = torch.empty(max_tokens, dtype=torch.long)
        self._counts = torch.zeros(max_tokens, dtype=torch.float32)
        self._num_out = 0

    def record(self, token_id: int) -> None:
        """Count one generated token."""
        if token_id not in self._seen:
            self._seen.add(token_id)
            self._seen_ids[self._num_seen] = token_id
            self._num_seen += 1
        pos = self._out_pos.get(token_id)
        if pos is None:
            if self._num_out == self._out_ids.shape[0]:
                return  # NOTE: only after max_tokens (a stop token sampled last): nothing is sampled after it
            pos = self._out_pos[token_id] = self._num_out
            self._out_ids[pos] = token_id
            self._num_out += 1
        self._counts[pos] += 1.0

    @property
    def seen_ids(self) -> torch.Tensor:
        return self._seen_ids[: self._num_seen]

    @property
    def output_ids(self) -> torch.Tensor:
        return self._out_ids[: self._num_out]

    @property
    def output_counts(self) -> torch.Tensor:
        return self._counts[: self._num_out]


def logit_bias_tensors(bias: Sequence[tuple[int, float]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``SamplingParams.logit_bias`` as (ids, values) tensors, built once per request."""
    ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=device)
    values = torch.tensor([b for _, b in bias], dtype=torch.float32, device=device)
    return ids, values


def apply_logit_bias(row: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> None:
    """Add each bias to its token's logit (in place; the ids are distinct)."""
    if ids.numel():
        row[ids] += values


def apply_penalties(row: torch.Tensor, history: TokenHistory, params: SamplingParams) -> None:
    """vLLM's penalties, in place: the repetition penalty on every seen id (positive logits divided, negative ones
    multiplied), or on every reply id with ``RepetitionScope.REPLY``, then the frequency penalty times each reply
    id's count, then the presence penalty once per id."""
    if params.repetition_penalty != 1.0:
        reply_only = params.repetition_penalty_scope is RepetitionScope.REPLY
        ids = history.output_ids if reply_only else history.seen_ids
        values = row[ids]
        scale = torch.where(values > 0, 1.0 / params.repetition_penalty, params.repetition_penalty)
        row[ids] = values * scale
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        ids, counts = history.output_ids, history.output_counts
        row[ids] = row[ids] - params.frequency_penalty * counts - params.presence_penalty
    # NOTE: a masked (-inf) logit stays -inf under both: the grammar and the min-tokens mask always win.


def mask_ids(row: torch.Tensor, ids: Sequence[int]) -> bool:
    """Set ``ids`` (those inside the vocabulary) to -inf in place, unless that leaves no finite logit; returns
    whether the mask was applied."""
    vocab = row.shape[0]
    index = torch.tensor([t for t in ids if t < vocab], dtype=torch.long, device=row.device)
    saved = row[index]
    row[index] = float("-inf")
    if bool(torch.isfinite(row.max())):
        return True
    row[index] = saved  # NOTE: nothing would be left to sample: the row stays as it was
    return False


def scale_by_temperature(row: torch.Tensor, temperature: float) -> torch.Tensor:
    """The row shifted to a maximum of 0, then divided by the temperature.

    NOTE: shifting first means no temperature can overflow the row to inf: the most likely token keeps logit 0 and
    every softmax after it has a positive sum.
    """
    return (row - row.max()) / temperature


def min_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Drop tokens whose probability is below ``p`` times the most likely one's; ``p == 0`` disables it."""
    if p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < p * probs.max(), float("-inf"))


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits (ties with the k-th are kept too); ``k == 0`` disables the filter."""
    if k == 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``p``; ``p == 1`` disables it."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # NOTE: a token is dropped when the tokens before it already reach p. The most likely token is kept explicitly:
    # a p below float32's smallest subnormal (1e-300) compares as 0.0, and ``mass_before >= 0`` holds everywhere.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    drop_sorted[0] = False
    return logits.index_fill(0, order[drop_sorted], float("-inf"))
