"""Static MiniLM sentence vectors: the mean of the model's own input token embeddings, unit length, cached."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from backend.context.minilm import packaged_model_dir
from backend.context.static_embedding import StaticEmbedder


@pytest.fixture(scope="module")
def static() -> StaticEmbedder:
    return StaticEmbedder(cache_size=2)


def test_a_vector_is_the_normalised_mean_of_the_texts_wordpiece_embeddings(static: StaticEmbedder) -> None:
    folder = packaged_model_dir()
    table = load_file(str(folder / "model.safetensors"))["embeddings.word_embeddings.weight"]
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()  # (the file pads to 128 tokens)
    ids = tokenizer.encode("my parcel is late").ids[1:-1]
    assert len(ids) == 4
    expected = table[ids].mean(axis=0)
    np.testing.assert_allclose(static.embed(["my parcel is late"])[0], expected / np.linalg.norm(expected), atol=1e-6)


def test_rows_are_unit_vectors_an_empty_text_is_zeros_and_the_cache_is_bounded(static: StaticEmbedder) -> None:
    vectors = static.embed(["refund please", "", "refund please", "where is it"])
    assert vectors.shape == (4, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors[[0, 3]], axis=1), 1.0, atol=1e-5)
    assert not vectors[1].any()
    np.testing.assert_array_equal(vectors[0], vectors[2])
    assert list(static._cache) == ["refund please", "where is it"]  # the least recently used ("") went first
    assert static.embed([]).shape == (0, 384)
