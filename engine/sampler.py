"""Logits -> next token, one per sequence in the batch.

``Sampler.sample(logits, states)`` takes float32 logits ``[n, vocab]`` and one ``SamplerState`` per row and returns
one outcome per row: the chosen token id, or a ``RowError`` when that row cannot be sampled (the model gave NaN or
+inf logits, or sampling it raised). A failed row never affects the others: the engine fails that request alone.
A state is made once per request with ``Sampler.new_state(params, eos_token_ids)`` and lives as long as the request.

* Greedy (``temperature == 0``) is an argmax; a batch that is greedy throughout costs a single argmax call.
* Otherwise: min-tokens masking, then temperature, then top-k, then top-p (nucleus), then one multinomial draw.
  Every parameter value ``SamplingParams`` accepts gives finite probabilities: the logits are shifted to a maximum
  of 0 before the division by the temperature (no overflow), and top-k/top-p always keep the most likely token.
* A request with a ``seed`` owns a ``torch.Generator`` seeded once at request start and advanced only by that
  request's draws, so its tokens do not depend on the batch it lands in or its row in it. Unseeded requests share
  the sampler's generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.model import cpu_kernels, kernels
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
    request_id: str = ""  # for logs and fault injection (engine.testing)

    @property
    def masks_stop_tokens(self) -> bool:
        return self.num_generated < self.params.min_tokens and bool(self.stop_token_ids)

    def is_stop_token(self, token_id: int) -> bool:
        """True when ``token_id`` ends the request (the engine checks this after each step)."""
        return token_id in self.stop_token_ids


@dataclass(frozen=True, slots=True)
class RowError:
    """Why one row of the batch could not be sampled (the engine logs it and fails that request alone)."""

    reason: str


SampleOutcome = int | RowError
FaultHook = Callable[[SamplerState], None]


class Sampler:
    """Turns a batch of logits into next tokens; stateless apart from the shared generator for unseeded requests.

    ``fault_hook`` (None in production) is called with each row's state before the row is sampled; an exception it
    raises fails that row alone. It is how tests inject a failure into one request of a batch (engine.testing).
    """

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.device = torch.device(device)
        self._generator = _make_generator(self.device, seed)
        self.fault_hook: FaultHook | None = None

    def new_state(self, params: SamplingParams, eos_token_ids: tuple[int, ...], request_id: str = "") -> SamplerState:
        """Per-request state; seeds the request's own generator when ``params.seed`` is set."""
        eos = () if params.ignore_eos else eos_token_ids
        generator = None if params.seed is None else _make_generator(self.device, params.seed)
        return SamplerState(
            params=params,
            stop_token_ids=frozenset((*eos, *params.stop_token_ids)),
            generator=generator,
            request_id=request_id,
        )

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, states: list[SamplerState]) -> list[SampleOutcome]:
        """Pick one token per row (or say why a row failed); counts the row in its state's ``num_generated``."""
        _check_batch(logits, states)
        logits = logits.to(self.device)
        failed = _non_finite_rows(logits) | self._hook_failures(states)
        if all(s.params.greedy and not s.masks_stop_tokens for s in states):
            tokens = _argmax(logits)  # NOTE: the fast path: one call, no copies.
        else:
            tokens = self._sample_mixed(_mask_stop_tokens(logits, states), states, failed)
        for state in states:
            state.num_generated += 1
        return [failed.get(row, token) for row, token in enumerate(tokens)]

    def _sample_mixed(self, logits: torch.Tensor, states: list[SamplerState], failed: dict[int, RowError]) -> list[int]:
        """Argmax for greedy rows, one draw for the others; a row that raises is recorded in ``failed``."""
        tokens = _argmax(logits)
        for row, state in enumerate(states):
            if state.params.greedy or row in failed:
                continue
            generator = state.generator if state.generator is not None else self._generator
            try:
                tokens[row] = _sample_row(logits[row], state.params, generator)
            except Exception as exc:  # noqa: BLE001 - one bad row must not fail the batch
                failed[row] = RowError(f"sampling raised {type(exc).__name__}: {exc}")
        return tokens

    def _hook_failures(self, states: list[SamplerState]) -> dict[int, RowError]:
        if self.fault_hook is None:
            return {}
        failed: dict[int, RowError] = {}
        for row, state in enumerate(states):
            try:
                self.fault_hook(state)
            except Exception as exc:  # noqa: BLE001 - the hook stands for any failure inside one row
                failed[row] = RowError(f"sampling raised {type(exc).__name__}: {exc}")
        return failed


def _argmax(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first of equal values), with the C kernel on CPU where it is built."""
    _, lib = kernels.choose_with_library(kernels.Op.ARGMAX, logits.dtype, device=logits.device.type)
    if lib is not None and cpu_kernels.argmax_supported(logits):
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


def _non_finite_rows(logits: torch.Tensor) -> dict[int, RowError]:
    """Rows with a NaN or +inf logit, or without any finite one: nothing sensible can be sampled from them.

    NOTE: one reduction over the batch: a row's max is NaN when it holds a NaN, +inf with a +inf, and -inf when no
    logit is finite; -inf entries (masked tokens) are fine as long as one logit is finite.
    """
    row_max = logits.amax(dim=-1)
    bad = (~torch.isfinite(row_max)).nonzero().flatten().tolist()
    return {row: RowError("the model produced non-finite logits") for row in bad}


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
        masked = logits[row].index_fill(0, torch.tensor(ids, dtype=torch.long, device=logits.device), float("-inf"))
        # NOTE: when every token the model can emit is a stop token, min_tokens cannot be met: the mask is skipped
        # (the request stops) rather than leaving a row with nothing to sample.
        if bool(torch.isfinite(masked).any()):
            logits[row] = masked
    return logits


def _sample_row(row: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One draw from one row.

    NOTE: rows are sampled one at a time, on a 1-D view, so a seeded request's result depends only on its own
    logits and generator, never on the batch size or its position in the batch.
    NOTE: the row is shifted to a maximum of 0 before the division, so no temperature can overflow it to inf: the
    most likely token keeps logit 0 and the softmax below always has a positive sum.
    """
    scaled = (row - row.max()) / params.temperature
    filtered = _top_p(_top_k(scaled, params.top_k), params.top_p)
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
    # NOTE: a token is dropped when the tokens before it already reach p. The most likely token is kept explicitly:
    # a p below float32's smallest subnormal (1e-300) compares as 0.0, and ``mass_before >= 0`` holds everywhere.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    drop_sorted[0] = False
    return logits.index_fill(0, order[drop_sorted], float("-inf"))
