"""Llama-family models over a paged KV pool: architecture spec, weights, forward, loading.

``load_model(folder, device, dtype)`` turns a resolved model folder (see ``loader.resolve_model``) into a
``LoadedModel`` that ``engine.model_runner.ModelRunner`` runs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model import bf16_linear, gguf_blocks, onednn_linear, panel_linear
from engine.model.llama import LlamaModel, ModelWeights
from engine.model.loader import ResolvedModel, eos_token_ids, open_checkpoint, read_config, resolve_model
from engine.model.spec import ModelSpec

__all__ = ["LoadedModel", "ModelSpec", "ResolvedModel", "load_model", "resolve_model"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    spec: ModelSpec
    weights: ModelWeights
    path: Path
    eos_token_ids: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype
    fingerprint: str | None = None

    def build(self, max_len: int) -> LlamaModel:
        return LlamaModel(self.spec, self.weights, max_len, self.device)


def load_model(
    folder: Path,
    device: torch.device,
    dtype: torch.dtype,
    fingerprint: str | None = None,
    packed_weights: bool = True,
) -> LoadedModel:
    """Read config + safetensors of ``folder`` into fused weights on ``device`` in ``dtype``. On CPU, linear layers
    whose GGUF blocks were kept (``gguf_blocks``) are also packed, unless ``packed_weights`` is False or the model is
    bf16 on a CPU where ``bf16_linear`` runs: there every linear layer is held as bf16 pair panels instead; in fp32
    where the panel kernel runs (``panel_linear``), every linear layer is held as panels instead (no blocks); in
    bf16 on a CPU with AMX (``onednn_linear``), every linear layer also gets oneDNN's reordered copy. On CPU the
    embeddings and the dense linear weights or their panels are held in transparent huge pages (``huge_pages``)."""
    started = time.monotonic()
    spec = ModelSpec.from_hf_config(read_config(folder))
    with open_checkpoint(folder) as get:
        weights = ModelWeights.from_tensors(spec, get, dtype, device)
    cpu = device.type == "cpu"
    panels = cpu and dtype == torch.float32 and panel_linear.load() is not None
    pair_panels = cpu and dtype == torch.bfloat16 and bf16_linear.load() is not None
    if pair_panels:
        weights = weights.with_bf16_panels()
    if cpu and not panels:  # (fp32 panels are made below, new tensors: the dense copies are dropped)
        weights = weights.in_huge_pages()
    # NOTE: with panels (bf16 pairs, or fp32) the GGUF blocks are not kept (SmolLM2: 92 MiB). bf16: no batch would
    # read them (they serve only up to packed.PACKED_MAX_ROWS_BF16 = 4 rows, and the panels are faster even for one).
    # fp32: they would give one- and two-row batches other bits than the panels (panel_linear.py).
    if packed_weights and cpu and not pair_panels and not panels:
        blocks = gguf_blocks.read(folder)
        if blocks:
            weights = weights.with_packed(blocks)
    if panels:  # (CPU only)
        weights = weights.with_panels().in_huge_pages()
    if cpu and dtype == torch.bfloat16 and onednn_linear.available():
        weights = weights.with_onednn()
    log.info(
        "loaded %s (%s, %s, %d packed weights, %d as panels, %d reordered for oneDNN) in %.1fs",
        folder,
        spec.model_type,
        dtype,
        weights.num_packed,
        weights.num_panels,
        weights.num_reordered,
        time.monotonic() - started,
    )
    return LoadedModel(spec, weights, folder, eos_token_ids(folder, spec), device, dtype, fingerprint)
