"""Logits -> next token, one per sequence in the batch.

``Sampler.sample(logits, states)`` takes float32 logits ``[n, vocab]`` and one ``SamplerState`` per row and returns
the n chosen token ids. A state is made once per request with ``Sampler.new_state(params, eos_token_ids)`` and
lives as long as the request.

* Greedy (``temperature == 0``) is an argmax; a batch that is greedy throughout costs a single argmax call.
* Otherwise: min-tokens masking, then temperature, then top-k, then top-p (nucleus), then one multinomial draw.
* A request with a ``seed`` owns a ``torch.Generator`` seeded once at request start and advanced only by that
  request's draws, so its tokens do not depend on the batch it lands in or its row in it. Unseeded requests share
  the sampler's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model import cpu_kernels
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplerState:
    """What the sampler keeps per request.

    ``stop_token_ids`` are the ids that end the request: the EOS ids (unless ``ignore_eos``) plus the request's own
    ``stop_token_ids``. While fewer than ``min_tokens`` tokens have been generated they are masked out.
    """

    params: SamplingParams
    stop_token_ids: frozenset[int]
    generator: torch.Generator | None  # None: unseeded, draws come from the sampler's shared generator
    num_generated: int = 0

    @property
    def masks_stop_tokens(self) -> bool:
        return self.num_generated < self.params.min_tokens and bool(self.stop_token_ids)

    def is_stop_token(self, token_id: int) -> bool:
        """True when ``token_id`` ends the request (the engine checks this after each step)."""
        return token_id in self.stop_token_ids


class Sampler:
    """Turns a batch of logits into next tokens; stateless apart from the shared generator for unseeded requests."""

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.device = torch.device(device)
        self._generator = _make_generator(self.device, seed)

    def new_state(self, params: SamplingParams, eos_token_ids: tuple[int, ...]) -> SamplerState:
        """Per-request state; seeds the request's own generator when ``params.seed`` is set."""
        eos = () if params.ignore_eos else eos_token_ids
        generator = None if params.seed is None else _make_generator(self.device, params.seed)
        return SamplerState(
            params=params, stop_token_ids=frozenset((*eos, *params.stop_token_ids)), generator=generator
        )

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, states: list[SamplerState]) -> list[int]:
        """Pick one token per row; counts the token in each row's ``num_generated``."""
        _check_batch(logits, states)
        logits = logits.to(self.device)
        if all(s.params.greedy and not s.masks_stop_tokens for s in states):
            tokens = _argmax(logits)  # NOTE: the fast path: one call, no copies.
        else:
            tokens = self._sample_mixed(_mask_stop_tokens(logits, states), states)
        for state in states:
            state.num_generated += 1
        return tokens

    def _sample_mixed(self, logits: torch.Tensor, states: list[SamplerState]) -> list[int]:
        tokens = _argmax(logits)
        for row, state in enumerate(states):
            if not state.params.greedy:
                generator = state.generator if state.generator is not None else self._generator
                tokens[row] = _sample_row(logits[row], state.params, generator)
        return tokens


def _argmax(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first of equal values), with the C kernel on CPU where it is built."""
    lib = cpu_kernels.load() if cpu_kernels.argmax_supported(logits) else None
    if lib is not None:
        return cpu_kernels.argmax(lib, logits)
    tokens: list[int] = logits.argmax(dim=-1).tolist()
    return tokens


def _make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()  # non-deterministic seed from the OS
    else:
        generator.manual_seed(seed)
    return generator


def _check_batch(logits: torch.Tensor, states: list[SamplerState]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(f"expected logits [n={len(states)}, vocab], got {tuple(logits.shape)}")


def _mask_stop_tokens(logits: torch.Tensor, states: list[SamplerState]) -> torch.Tensor:
    """Copy of ``logits`` with the stop ids at -inf in rows that have not reached ``min_tokens`` yet."""
    rows = [row for row, state in enumerate(states) if state.masks_stop_tokens]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for row in rows:
        # NOTE: ids outside the vocabulary (a stop_token_id the model cannot emit) are simply ignored.
        ids = [t for t in states[row].stop_token_ids if t < vocab]
        logits[row, ids] = float("-inf")
    return logits


def _sample_row(row: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One draw from one row.

    NOTE: rows are sampled one at a time, on a 1-D view, so a seeded request's result depends only on its own
    logits and generator, never on the batch size or its position in the batch.
    """
    filtered = _top_p(_top_k(row / params.temperature, params.top_k), params.top_p)
    probs = torch.softmax(filtered, dim=-1)
    return int(torch.multinomial(probs, num_samples=1, generator=generator).item())


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits (ties with the k-th are kept too); ``k == 0`` disables the filter."""
    if k == 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``p``; ``p == 1`` disables it."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # NOTE: a token is dropped when the tokens before it already reach p; the most likely token is always kept.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop = order[mass_before >= p]
    return logits.index_fill(0, drop, float("-inf"))
