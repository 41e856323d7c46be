"""Turns a scheduled batch into tensors, runs the model over the paged KV pool, returns logits.

The runner owns the KV pool: one preallocated tensor ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``
(see ``engine.model.paged_attention``). It never clears blocks: a block's slots are overwritten before any query can
attend to them, because every attended position ``< start_pos + len`` was written by this or an earlier step.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.device import resolve_device, resolve_dtype
from engine.errors import InvalidRequestError
from engine.model import huge_pages
from engine.model.loader import ResolvedModel, resolve_model
from engine.model.model_load import LoadedModel, load_model
from engine.model.paged_attention import build_plan
from engine.model.spec import ModelSpec


@dataclass(slots=True)
class BatchItem:
    token_ids: list[int]  # the tokens to compute this step (a prefill chunk, or the one decode token)
    start_pos: int  # tokens of this sequence already in the KV pool (their positions are 0..start_pos-1)
    block_table: list[int]  # physical blocks covering start_pos + len(token_ids) tokens
    need_logits: bool  # False for a prefill chunk that does not end the prompt
    prompt: bool = False  # the tokens are prompt tokens (a lone one is attended as a prefill chunk: paged_attention)
    request_id: str = ""  # whose tokens these are (for logs and fault injection, engine.testing)
    # Prompt log-probabilities: the ids that follow the item's first len(logprob_targets) tokens; ``forward`` fills
    # ``prompt_logprobs[i]`` with log p(logprob_targets[i] | every token up to and including token_ids[i]).
    logprob_targets: list[int] | None = None
    prompt_logprobs: list[float] | None = None
    # A decode token followed by draft tokens (engine.spec): every row needs logits, and each row is attended as a
    # decode row of its own (paged_attention.build_plan), so it gets the bits its token would get decoded alone.
    verify: bool = False


def kv_bytes_per_token(spec: ModelSpec, dtype: torch.dtype) -> int:
    return spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * dtype.itemsize


def num_blocks_for_budget(spec: ModelSpec, max_kv_memory_mb: int, block_size: int, dtype: torch.dtype) -> int:
    """How many KV blocks fit in ``max_kv_memory_mb`` MiB (at least one, or the budget is an error)."""
    per_block = kv_bytes_per_token(spec, dtype) * block_size
    blocks = max_kv_memory_mb * (1 << 20) // per_block
    if blocks < 1:
        raise InvalidRequestError(
            f"invalid engine config: max_kv_memory_mb={max_kv_memory_mb} holds no KV block of {per_block} bytes"
        )
    return int(blocks)


_LOGPROB_ROWS = 256  # prompt log-probability rows per LM-head call (bounds the logits held at once)

ForwardHook = Callable[[list[BatchItem], torch.Tensor], None]


class ModelRunner:
    """Owns the model and its KV pool; ``forward`` computes one scheduled batch.

    ``fault_hook`` (None in production) is called after each forward pass with the batch and its logits; it may raise
    (failing the pass, after the K/V was written, like a real late failure) or overwrite logit rows. It is how tests
    make one request poison a batch (engine.testing).
    """

    def __init__(
        self,
        model: str | Path | ResolvedModel | LoadedModel,
        num_blocks: int,
        block_size: int = 16,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        cache_dir: str | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise InvalidRequestError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.loaded = _load(model, device, dtype, cache_dir)
        self.spec = self.loaded.spec
        self.device = self.loaded.device
        self.dtype = self.loaded.dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = min(max_model_len or self.spec.max_model_len, self.spec.max_model_len)
        self.model = self.loaded.build(self.max_model_len)
        self.fault_hook: ForwardHook | None = None
        s = self.spec
        # NOTE: zeros, not empty: padded decode attention reads (masked) slots of block 0, and 0 * NaN would leak.
        # (on CPU in transparent huge pages: reads of scattered blocks need few TLB entries; see huge_pages.py)
        shape = (s.num_layers, 2, num_blocks, block_size, s.num_kv_heads, s.head_dim)
        if self.device.type == "cpu":
            self.kv_pool = huge_pages.zeros(shape, self.dtype)
        else:
            self.kv_pool = torch.zeros(shape, dtype=self.dtype, device=self.device)

    @classmethod
    def from_config(cls, config: EngineConfig) -> ModelRunner:
        """Load ``config.model`` and size the KV pool from ``config.max_kv_memory_mb``."""
        if config.num_threads is not None and config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        loaded = _load(config.model, config.device, config.dtype, config.cache_dir)
        if config.quantization == "int8":
            if loaded.device.type != "cpu":
                raise InvalidRequestError("quantization='int8' (weight-only, CPU kernel) needs device='cpu'")
            loaded = dataclasses.replace(loaded, weights=loaded.weights.quantized_int8())
        blocks = num_blocks_for_budget(loaded.spec, config.max_kv_memory_mb, config.block_size, loaded.dtype)
        return cls(loaded, blocks, config.block_size, max_model_len=config.max_model_len)

    @property
    def model_path(self) -> Path:
        return Path(self.loaded.path)

    @property
    def architecture(self) -> str:
        return self.spec.model_type

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.loaded.eos_token_ids

    @property
    def fingerprint(self) -> str | None:
        return self.loaded.fingerprint

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.spec, self.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's K/V, all layers (what a tier copies per block)."""
        return self.kv_bytes_per_token * self.block_size

    def kv_fingerprint(self, model_fingerprint: str, quantization: str | None) -> str:
        """What K/V on disk must match to be reused: the model and tokenizer (``model_fingerprint``), and everything
        that changes K/V bits (dtype, weight quantization, block geometry, the CPU's kernel family)."""
        cpu = torch.backends.cpu.get_cpu_capability() if self.device.type == "cpu" else str(self.device)
        dtype = str(self.dtype).removeprefix("torch.")
        parts = [model_fingerprint, dtype, str(quantization), cpu]
        parts += [str(self.block_size), str(self.kv_bytes_per_token)]
        return hashlib.sha256("\x00".join(parts).encode()).hexdigest()

    @torch.inference_mode()
    def forward(self, items: list[BatchItem]) -> torch.Tensor:
        """Float32 logits for the last token of each item that needs logits, and for every token of a ``verify``
        item, in batch order: ``[rows, vocab]``."""
        if not items:
            return torch.empty((0, self.vocab_size), dtype=torch.float32)
        ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        for item in items:
            self._check(item)
            ids.extend(item.token_ids)
            positions.extend(range(item.start_pos, item.start_pos + len(item.token_ids)))
            if item.verify:
                logit_rows.extend(range(len(ids) - len(item.token_ids), len(ids)))
            elif item.need_logits:
                logit_rows.append(len(ids) - 1)
        plan = build_plan(
            [(it.start_pos, len(it.token_ids), it.block_table) for it in items],
            self.block_size,
            self.device,
            [it.prompt for it in items],
            [it.verify for it in items] if any(it.verify for it in items) else None,
        )
        rows = None if len(logit_rows) == len(ids) else torch.tensor(logit_rows, device=self.device)
        if not logit_rows:
            rows = torch.empty(0, dtype=torch.long, device=self.device)
        input_ids = torch.tensor(ids, device=self.device)
        pos = torch.tensor(positions, device=self.device)
        if any(item.logprob_targets for item in items):
            hidden = self.model.hidden_states(input_ids, pos, plan, self.kv_pool)
            logits = self.model.logits(hidden if rows is None else hidden.index_select(0, rows))
            self._prompt_logprobs(items, hidden)
        else:
            logits = self.model.forward(input_ids, pos, plan, self.kv_pool, rows)
        if self.fault_hook is not None:
            self.fault_hook(items, logits)
        return logits

    def _prompt_logprobs(self, items: list[BatchItem], hidden: torch.Tensor) -> None:
        """Fill ``prompt_logprobs`` of the items that ask for it from the step's hidden states.

        NOTE: log-softmax and gather run here, ``_LOGPROB_ROWS`` rows at a time, so neither a [tokens x vocab] tensor
        leaves the runner nor more than ``_LOGPROB_ROWS`` rows of logits exist at once (the vocab may be ~50k). The
        rows go through the same final norm and LM head as the sampled rows.
        """
        first = 0
        for item in items:
            targets = item.logprob_targets
            if targets:
                out: list[float] = []
                for at in range(0, len(targets), _LOGPROB_ROWS):
                    chunk = targets[at : at + _LOGPROB_ROWS]
                    logits = self.model.logits(hidden[first + at : first + at + len(chunk)])
                    index = torch.tensor(chunk, device=logits.device).unsqueeze(1)
                    out += torch.log_softmax(logits, dim=-1).gather(1, index).squeeze(1).tolist()
                item.prompt_logprobs = out
            first += len(item.token_ids)

    def _check(self, item: BatchItem) -> None:
        end = item.start_pos + len(item.token_ids)
        if not item.token_ids or item.start_pos < 0:
            raise ValueError(
                f"batch item needs >= 1 token and start_pos >= 0, got {len(item.token_ids)}, {item.start_pos}"
            )
        if end > self.max_model_len:
            raise ValueError(f"position {end - 1} is beyond max_model_len={self.max_model_len}")
        if len(item.block_table) * self.block_size < end:
            raise ValueError(f"block table of {len(item.block_table)} blocks cannot hold {end} tokens")
        if min(item.token_ids) < 0 or max(item.token_ids) >= self.vocab_size:
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        if min(item.block_table) < 0 or max(item.block_table) >= self.num_blocks:
            raise ValueError(f"block id out of range [0, {self.num_blocks})")
        targets = item.logprob_targets or []
        if len(targets) > len(item.token_ids) or any(not 0 <= t < self.vocab_size for t in targets):
            raise ValueError("logprob_targets must be at most one per token, each in the vocabulary")

    def clear_blocks(self, block_ids: list[int]) -> None:
        """Zero the K/V of ``block_ids`` (after a failed step, before the blocks go back to the free queue)."""
        if block_ids:
            self.kv_pool[:, :, block_ids] = 0

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the blocks' K/V, ``[layers, 2, len(block_ids), block_size, kv_heads, head_dim]`` (for tiers)."""
        return self.kv_pool[:, :, block_ids].clone()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Overwrite blocks with K/V previously returned by ``read_blocks`` (same model, dtype and block size)."""
        self.kv_pool[:, :, block_ids] = data.to(device=self.device, dtype=self.dtype)


def _load(
    model: str | Path | ResolvedModel | LoadedModel,
    device: str | torch.device,
    dtype: str | torch.dtype,
    cache_dir: str | None,
) -> LoadedModel:
    if isinstance(model, LoadedModel):
        return model
    resolved = model if isinstance(model, ResolvedModel) else resolve_model(str(model), cache_dir)
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    return load_model(resolved.path, dev, resolve_dtype(dtype, dev), resolved.fingerprint, cache_dir=cache_dir)
