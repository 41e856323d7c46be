"""The MiniLM encoder's ONNX graph against its numpy reference forward (equal up to float rounding); no torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from backend.context.minilm import _BATCH, MAX_SEQ_LENGTH, MiniLMEncoder

TEXTS = [
    "",
    " ",
    "?",
    "ok",
    "Order #617-8899001-1122334 marked delivered but I never got the parcel.",
    "My credit card was charged twice for a subscription I cancelled last month, can you refund one of the charges?",
    "Ünïcödé façade, naïve café — 日本語の注文がまだ届きません 📦🙂, مرحبا",
    "refund " * 400,  # past the 256-token limit: truncated
    "Hi, I'd like to change the shipping address on my order before it ships. It's going to 12 Elm St, Springfield.",
]


@pytest.fixture(scope="module")
def encoder() -> MiniLMEncoder:
    return MiniLMEncoder()


def test_graph_matches_numpy_reference_on_varied_texts(encoder: MiniLMEncoder) -> None:
    lengths = [len(e.ids) for e in encoder.tokenizer.encode_batch(TEXTS)]
    assert min(lengths) == 2 and max(lengths) == MAX_SEQ_LENGTH  # an empty text is [CLS] [SEP]; the long one is cut
    ours, reference = encoder.encode(TEXTS), encoder.encode_reference(TEXTS)
    assert ours.shape == (len(TEXTS), 384) and ours.dtype == np.float32
    assert float(np.abs(ours - reference).max()) <= 1e-5
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_graph_matches_reference_across_batches_with_padding(encoder: MiniLMEncoder) -> None:
    texts = [f"{'where is my parcel ' * (i % 7)}order {i}" for i in range(_BATCH + 8)]  # two batches, mixed widths
    ours, reference = encoder.encode(texts), encoder.encode_reference(texts)
    assert float(np.abs(ours - reference).max()) <= 1e-5


def test_padding_does_not_change_a_vector(encoder: MiniLMEncoder) -> None:
    short, long = "ok thanks", "I never received the parcel that was marked as delivered yesterday afternoon."
    ids = [encoder.tokenizer.encode(t).ids for t in (short, long)]
    batch = np.zeros((2, len(ids[1])), dtype=np.int64)
    mask = np.zeros(batch.shape, dtype=np.float32)
    for r, row in enumerate(ids):
        batch[r, : len(row)], mask[r, : len(row)] = row, 1.0
    padded = encoder.forward(batch, mask)
    alone = encoder.forward(batch[:1, : len(ids[0])], mask[:1, : len(ids[0])])
    assert mask[0].sum() < mask.shape[1]  # the short text really is padded
    assert float(np.abs(padded[0] - alone[0]).max()) <= 1e-5
    assert float(np.abs(padded - encoder.reference_forward(batch, mask)).max()) <= 1e-5


def test_encoding_loads_no_torch() -> None:
    child = "import sys; from backend.context.minilm import MiniLMEncoder; MiniLMEncoder().encode(['hi']); " + (
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
