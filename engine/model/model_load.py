"""``load_model(folder, device, dtype)``: a resolved model folder (``loader.resolve_model``) as the ``LoadedModel``
that ``engine.model_runner.ModelRunner`` runs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model import build, kernels
from engine.model.kernels import Layout
from engine.model.llama import LlamaModel, ModelWeights
from engine.model.loader import eos_token_ids, open_checkpoint, read_config
from engine.model.spec import ModelSpec

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
    cache_dir: str | Path | None = None,
) -> LoadedModel:
    """Read config + safetensors of ``folder`` into fused weights on ``device`` in ``dtype``, the linear weights in the
    layout ``kernels.weight_layout`` picks for this CPU. On CPU the
    embeddings and the linear weights are held in transparent huge pages (``huge_pages``). ``cache_dir``
    (``EngineConfig.cache_dir``) is where the kernels are built."""
    started = time.monotonic()
    if cache_dir is not None:
        build.use_cache_dir(cache_dir)
    spec = ModelSpec.from_hf_config(read_config(folder))
    with open_checkpoint(folder) as get:
        weights = ModelWeights.from_tensors(spec, get, dtype, device)
    layout = kernels.weight_layout(dtype, device.type)
    if layout is Layout.BF16_PANELS:
        weights = weights.with_bf16_panels(keep_dense=kernels.dense_copy_rows(dtype, device.type) is not None)
    elif layout is Layout.FP32_PANELS:
        weights = weights.with_panels()
    if device.type == "cpu":
        weights = weights.in_huge_pages()
    log.info(
        "loaded %s (%s, %s, linear weights as %s: %d as panels) in %.1fs",
        folder,
        spec.model_type,
        dtype,
        layout,
        weights.num_panels,
        time.monotonic() - started,
    )
    return LoadedModel(spec, weights, folder, eos_token_ids(folder, spec), device, dtype, fingerprint)
