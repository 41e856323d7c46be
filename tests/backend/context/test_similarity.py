"""The two similarity backends on real text, and the MiniLM encoder against transformers' BertModel."""

from __future__ import annotations

import numpy as np
import pytest

from backend.context.errors import UnknownBackendError
from backend.context.minilm import MiniLMEncoder, packaged_model_dir
from backend.context.similarity import MiniLMSimilarity, TfidfSimilarity, make_backend

TOPIC = [
    "Order #617-8899001-1122334 marked delivered but I never got the parcel.",
    "I understand the parcel marked delivered has not arrived. Could you confirm the delivery address?",
]
ON_TOPIC = "The parcel still has not been delivered to my address, where is it?"
OFF_TOPIC = "My credit card was charged twice for a subscription I cancelled last month."


@pytest.fixture(scope="module")
def minilm() -> MiniLMSimilarity:
    return MiniLMSimilarity(MiniLMEncoder())


def test_tfidf_scores_shared_words_high_and_unrelated_text_zero() -> None:
    tfidf = TfidfSimilarity()
    on, off = tfidf.similarity(ON_TOPIC, TOPIC), tfidf.similarity(OFF_TOPIC, TOPIC)
    assert on > 0.15 and off == 0.0
    assert tfidf.similarity("ok thanks", TOPIC) == 0.0  # only stop words: no evidence
    assert tfidf.similarity(ON_TOPIC, []) == 0.0


def test_minilm_scores_paraphrase_above_a_different_problem(minilm: MiniLMSimilarity) -> None:
    on, off = minilm.similarity(ON_TOPIC, TOPIC), minilm.similarity(OFF_TOPIC, TOPIC)
    assert on > 0.5 > off
    assert minilm.similarity(ON_TOPIC, []) == 0.0


def test_minilm_embeddings_are_unit_vectors_cached_per_text(minilm: MiniLMSimilarity) -> None:
    vectors = minilm.embed([ON_TOPIC, OFF_TOPIC, ON_TOPIC])
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(vectors[0], vectors[2])
    assert ON_TOPIC in minilm._cache and OFF_TOPIC in minilm._cache


def test_minilm_matches_transformers_bert_with_mean_pooling() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    texts = [*TOPIC, ON_TOPIC, OFF_TOPIC, "短句", "a " * 300]  # a CJK text and one past the 256-token limit
    ours = MiniLMEncoder().encode(texts)
    folder = str(packaged_model_dir())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.BertModel.from_pretrained(folder).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    reference = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1).numpy()
    np.testing.assert_allclose(ours, reference, atol=2e-5)


def test_unknown_backend_is_refused_by_name() -> None:
    assert make_backend("tfidf").name == "tfidf"
    with pytest.raises(UnknownBackendError) as refused:
        make_backend("word2vec")
    assert (refused.value.code, str(refused.value)) == (
        "unknown_backend",
        "unknown similarity backend 'word2vec' (known: tfidf, minilm)",
    )
