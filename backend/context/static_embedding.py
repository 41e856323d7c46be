"""Sentence vectors in a tenth of a millisecond: the mean of all-MiniLM-L6-v2's input token embeddings.

The same packaged model as ``minilm.py`` (its WordPiece tokenizer and ``embeddings.word_embeddings`` table), without
running the six transformer layers: a bag of trained token vectors, L2-normalised. It reads less than the full
encoder (no word order, no context), but it costs nothing next to a turn, so the topic-shift classifier can embed
every customer message while the customer waits. ``bench/topic_shift.py`` reports it beside the full encoder.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from backend.context.minilm import MAX_SEQ_LENGTH, Array, packaged_model_dir

_TABLE = "embeddings.word_embeddings.weight"


class StaticEmbedder:
    """``embed(texts)``: one unit row per text (zeros for a text without tokens), with a bounded per-text cache (a
    session's epoch is read again at every message)."""

    name = "minilm-static"

    def __init__(self, model_dir: Path | None = None, cache_size: int = 4096) -> None:
        folder = model_dir or packaged_model_dir()
        self.table: Array = load_file(str(folder / "model.safetensors"))[_TABLE].astype(np.float32)
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(MAX_SEQ_LENGTH)
        self.tokenizer.no_padding()
        self._cache: OrderedDict[str, Array] = OrderedDict()
        self._cache_size = cache_size

    def embed(self, texts: Sequence[str]) -> Array:
        missing = list(dict.fromkeys(t for t in texts if t not in self._cache))
        for text, encoding in zip(missing, self.tokenizer.encode_batch(missing), strict=True):
            ids = encoding.ids[1:-1]  # NOTE: [CLS] and [SEP] are in every text: they only pull vectors together
            vector = self.table[ids].mean(axis=0) if ids else np.zeros(self.table.shape[1], dtype=np.float32)
            self._cache[text] = vector / max(float(np.linalg.norm(vector)), 1e-12)
        out = np.zeros((len(texts), self.table.shape[1]), dtype=np.float32)
        for row, text in enumerate(texts):
            out[row] = self._cache[text]
            self._cache.move_to_end(text)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return out
