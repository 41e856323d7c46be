"""The topic-shift classifier: a logistic regression over ``shift_features``, trained on spliced conversations.

``ShiftModel`` is the trained model (a few hundred numbers, kept as JSON next to this file and written by
``python -m bench.topic_shift --train``); ``ShiftClassifier`` is the tracker's scorer that asks it. Its answer is the
probability that a message stays on topic; the tracker shifts when that falls below ``TopicSettings.shift_threshold``
(tuned with the model and stored with it).

The model adds one feature to ``FEATURES``: ``opening_like``, how much more the message's sentence vector points to
the mean of the training set's opening messages than to the mean of its follow-ups, i.e. whether it reads like
someone stating a new problem ("my refund never arrived") or like a turn of an ongoing one ("so i should just wait?").
The two mean vectors are part of the model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from backend.context.errors import InvalidSettingsError
from backend.context.minilm import Array
from backend.context.shift_features import FEATURES, Embedder, ShiftFeatures, meaning_text, shift_features

if TYPE_CHECKING:
    from backend.context.topic import TopicSettings, TopicState

MODEL_DIR = Path(__file__).resolve().parent / "models"
OPENING_LIKE = "opening_like"


@dataclass(frozen=True, slots=True)
class ShiftModel:
    """Standardised logistic regression: p(shift) = sigmoid(((x - mean) / scale) · coef + intercept)."""

    embedder: str  # the ``Embedder.name`` whose vectors it was trained on
    features: tuple[str, ...]
    mean: Array
    scale: Array
    coef: Array
    intercept: float
    opening: Array  # unit mean vector of opening messages
    follow_up: Array  # unit mean vector of follow-ups
    shift_threshold: float = 0.5  # on-topic probability below which the tracker shifts
    trained: dict[str, Any] = field(default_factory=dict)  # how it was made: the command, the rows

    def shift_probability(self, f: ShiftFeatures) -> float:
        x = np.append(f.values, float(f.vector @ self.opening - f.vector @ self.follow_up))
        z = float(((x - self.mean) / self.scale) @ self.coef) + self.intercept
        return float(1.0 / (1.0 + np.exp(-z)))

    @classmethod
    def fit(cls, rows: Sequence[ShiftFeatures], shifts: Sequence[bool], embedder: str, c: float = 1.0) -> ShiftModel:
        """Fit on labelled rows (True: the message opened a new topic)."""
        from sklearn.linear_model import LogisticRegression  # NOTE: only training needs scikit-learn's solver

        y = np.asarray(shifts, dtype=bool)
        if y.all() or not y.any():
            raise InvalidSettingsError("training needs both shifts and follow-ups")
        vectors = np.stack([r.vector for r in rows])
        opening, follow_up = _unit(vectors[y].mean(axis=0)), _unit(vectors[~y].mean(axis=0))
        x = np.column_stack([np.stack([r.values for r in rows]), vectors @ opening - vectors @ follow_up])
        mean, scale = x.mean(axis=0), x.std(axis=0)
        scale[scale == 0] = 1.0
        lr = LogisticRegression(C=c, max_iter=5000).fit((x - mean) / scale, y)
        return cls(
            embedder,
            (*FEATURES, OPENING_LIKE),
            mean.astype(np.float32),
            scale.astype(np.float32),
            lr.coef_[0].astype(np.float32),
            float(lr.intercept_[0]),
            opening,
            follow_up,
        )

    def with_threshold(self, shift_threshold: float, **trained: Any) -> ShiftModel:
        return replace(self, shift_threshold=shift_threshold, trained={**self.trained, **trained})

    def save(self, path: Path) -> None:
        body = {
            "embedder": self.embedder,
            "features": list(self.features),
            "shift_threshold": self.shift_threshold,
            "intercept": round(self.intercept, 6),
            "coef": _rounded(self.coef),
            "mean": _rounded(self.mean),
            "scale": _rounded(self.scale),
            "opening": _rounded(self.opening),
            "follow_up": _rounded(self.follow_up),
            "trained": self.trained,
        }
        path.write_text(json.dumps(body, indent=1, ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, path: Path) -> ShiftModel:
        body = json.loads(path.read_text())
        if tuple(body["features"]) != (*FEATURES, OPENING_LIKE):
            raise InvalidSettingsError(f"{path.name} was trained on other features: retrain it (bench.topic_shift)")

        def array(key: str) -> Array:
            return np.asarray(body[key], dtype=np.float32)

        return cls(
            body["embedder"],
            tuple(body["features"]),
            array("mean"),
            array("scale"),
            array("coef"),
            float(body["intercept"]),
            array("opening"),
            array("follow_up"),
            float(body["shift_threshold"]),
            body.get("trained", {}),
        )


def model_path(embedder: str) -> Path:
    """Where the model trained on ``embedder``'s vectors is kept."""
    return MODEL_DIR / f"shift_{embedder}.json"


class ShiftClassifier:
    """The tracker's scorer: the probability that a customer message continues the epoch's topic."""

    def __init__(self, model: ShiftModel, embedder: Embedder, name: str) -> None:
        if model.embedder != embedder.name:
            raise InvalidSettingsError(f"the model was trained on {model.embedder} vectors, not {embedder.name}")
        self.model = model
        self.embedder = embedder
        self.name = name

    def on_topic(self, message: str, found: frozenset[str], state: TopicState, settings: TopicSettings) -> float:
        return 1.0 - self.model.shift_probability(shift_features(message, found, state, self.embedder))

    def prepare(self, text: str) -> None:
        """Embed ``text`` now (an agent reply, off the customer's path) so the next message finds it cached."""
        self.embedder.embed([meaning_text(text)])


def _unit(v: Array) -> Array:
    return (v / max(float(np.linalg.norm(v)), 1e-12)).astype(np.float32)


def _rounded(a: Array) -> list[float]:
    return [float(f"{x:.6g}") for x in a.tolist()]
