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

from engine.model import gguf_blocks, onednn_linear, panel_linear
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
    whose GGUF blocks were kept (``gguf_blocks``) are also packed, unless ``packed_weights`` is False; in fp32 where
    the panel kernel runs (``panel_linear``), every linear layer is then held as panels (plus its blocks); in bf16 on a
    CPU with AMX (``onednn_linear``), every linear layer also gets oneDNN's reordered copy."""
    started = time.monotonic()
    spec = ModelSpec.from_hf_config(read_config(folder))
    with open_checkpoint(folder) as get:
        weights = ModelWeights.from_tensors(spec, get, dtype, device)
    if packed_weights and device.type == "cpu":
        blocks = gguf_blocks.read(folder)
        if blocks:
            weights = weights.with_packed(blocks)
    if device.type == "cpu" and dtype == torch.float32 and panel_linear.load() is not None:
        weights = weights.with_panels()
    if device.type == "cpu" and dtype == torch.bfloat16 and onednn_linear.available():
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
