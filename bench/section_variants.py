"""Section choice: every ranking variant tried for issue 40, with its top-1 flow accuracy on the dev and held-out
splits of ``bench/data/handbook_requests.jsonl`` (the ABCD handbook, the dev requests as its sections' examples).

The parts are computed once as matrices (request x section) and mixed here; ``bench.grounding`` measures the
default through the product's own ``SectionIndex``. As there, the dev split is cut in ``FOLDS`` folds: a dev request
is scored by examples and classifiers that never saw its fold; held-out requests by everything the handbook has.
Every weight marked "picked on dev" is the grid's best dev accuracy (the first on a tie); the held-out column is
read, never tuned on. Weights are in ``ChoiceSettings`` units: a section scores ``0.3 BM25 + 0.7 head + 2 examples
+ g x classifier``.

Variants: the parts alone (BM25, head vectors, title vectors, the best cosine over the text's lines, the examples);
the mix; the mix read per flow (the best, the sum, or the two best of its sections); a logistic regression over
MiniLM vectors, per section or per group (flow), fitted on the examples, titles, heads and text lines; that
classifier added to the mix (the default: group, examples + titles + heads, C=100, g=0.75) or fused by reciprocal
rank; and a TF-IDF group classifier added to the default.

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.section_variants

Output: a table on stdout, ``docs/benchmarks/section_variants.json``. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression

from backend.context.handbook import HandbookFormat, parse
from backend.context.minilm import Array
from backend.context.section_classifier import group_of, title_texts
from backend.context.sections import HEAD_CHARS, SectionIndex
from backend.context.similarity import MiniLMSimilarity
from bench.datasets import GUIDELINES, read_text
from bench.grounding import FOLDS, REPO, REQUESTS, with_examples

DEFAULT_OUT = REPO / "docs" / "benchmarks" / "section_variants.json"
GRID = (0.25, 0.5, 0.75, 1.5, 3.0, 6.0)
MIN_LINE = 20  # a text line shorter than this is a list marker or a fragment, not a chunk


@dataclass(frozen=True, slots=True)
class Data:
    """The vectors and labels every variant reads."""

    titles: list[str]
    group: np.ndarray  # section -> group index
    query: Array  # request vectors
    truth: np.ndarray  # request -> its flow's group index
    dev: np.ndarray  # request -> in the dev split
    fold: np.ndarray  # request -> its dev fold, -1 for held-out (scored with every example)
    bm25: Array
    heads: Array
    title_vectors: Array  # title_texts(): whole titles, then the part after the group
    lines: Array
    line_of: np.ndarray
    examples: Array
    example_of: np.ndarray
    example_fold: np.ndarray  # the fold of the dev request each example is
    example_texts: list[str]
    texts: list[str]
    section_texts: list[str]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.section_variants", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    started = time.monotonic()
    data = load()
    rows: list[dict[str, Any]] = []
    for name, scores, weight in variants(data):
        dev, held = accuracy(data, scores)
        rows.append({"variant": name, "weight": weight, "dev_flow": dev, "held_out_flow": held})
        print(f"{name} ({time.monotonic() - started:.0f}s)", file=sys.stderr, flush=True)
    print("| variant | weight | dev flow | held-out flow |\n|---|---|---|---|")
    for r in rows:
        shown = "-" if r["weight"] is None else f"{r['weight']:g}"
        print(f"| {r['variant']} | {shown} | {r['dev_flow']:.1%} | {r['held_out_flow']:.1%} |")
    command = "flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.section_variants"
    print(f"\ncommand: {command}")
    result = {"command": command, "folds": FOLDS, "grid": GRID, "variants": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def load() -> Data:
    requests = [json.loads(line) for line in read_text(REQUESTS).splitlines() if line.strip()]
    sections = with_examples(parse(read_text(GUIDELINES), HandbookFormat.ABCD), requests)
    embedder = MiniLMSimilarity()
    groups = sorted({group_of(s.title) for s in sections})
    dev_rank = {r["text"]: n for n, r in enumerate(r for r in requests if r["split"] == "dev")}
    lines = [(i, ln.strip(" -*0123456789.")) for i, s in enumerate(sections) for ln in s.text.splitlines()]
    lines = [(i, ln) for i, ln in lines if len(ln) >= MIN_LINE]
    examples = [(i, e) for i, s in enumerate(sections) for e in s.examples]
    plain = SectionIndex(sections)  # NOTE: no embedder: BM25 alone, exactly as the product scores it
    return Data(
        titles=[s.title for s in sections],
        group=np.array([groups.index(group_of(s.title)) for s in sections]),
        query=embedder.embed([r["text"] for r in requests]),
        truth=np.array([groups.index(r["flow"]) for r in requests]),
        dev=np.array([r["split"] == "dev" for r in requests]),
        fold=np.array([dev_rank[r["text"]] % FOLDS if r["split"] == "dev" else -1 for r in requests]),
        bm25=np.stack([plain.scores(r["text"], 1.0) for r in requests]),
        heads=embedder.embed([f"{s.title}. {s.text[:HEAD_CHARS]}" for s in sections]),
        title_vectors=embedder.embed(title_texts(sections)),
        lines=embedder.embed([ln for _, ln in lines]),
        line_of=np.array([i for i, _ in lines]),
        examples=embedder.embed([e for _, e in examples]),
        example_of=np.array([i for i, _ in examples]),
        example_fold=np.array([dev_rank[e] % FOLDS for _, e in examples]),
        example_texts=[e for _, e in examples],
        texts=[r["text"] for r in requests],
        section_texts=[f"{s.title}\n{s.text}" for s in sections],
    )


def accuracy(data: Data, scores: Array) -> tuple[float, float]:
    """Top-1 flow accuracy on dev and held-out: the flow of the best-scored section."""
    hit = data.group[scores.argmax(1)] == data.truth
    return float(hit[data.dev].mean()), float(hit[~data.dev].mean())


def _flow_scores(data: Data, scores: Array, how: str) -> Array:
    out = np.zeros((scores.shape[0], int(data.group.max()) + 1), dtype=np.float32)
    for g in range(out.shape[1]):
        part = np.sort(scores[:, data.group == g], axis=1)
        out[:, g] = part[:, -1] if how == "best" else part.sum(1) if how == "sum" else part[:, -2:].sum(1)
    return out


def per_fold(data: Data, score: Callable[[np.ndarray], Array]) -> Array:
    """Each request's row from ``score(kept examples)`` with its own fold's examples left out."""
    out = np.zeros((len(data.texts), len(data.titles)), dtype=np.float32)
    for fold in range(-1, FOLDS):
        rows = data.fold == fold
        if rows.any():
            out[rows] = score(data.example_fold != fold)[rows]
    return out


def _max_sim(data: Data, vectors: Array, owner: np.ndarray) -> Array:
    out = np.full((len(data.texts), len(data.titles)), -1.0, dtype=np.float32)
    sims = data.query @ vectors.T
    for column in range(len(data.titles)):
        mine = owner == column
        if mine.any():
            out[:, column] = sims[:, mine].max(1)
    return _min_max(out)


def _min_max(x: Array) -> Array:
    lo, hi = x.min(1, keepdims=True), x.max(1, keepdims=True)
    return np.asarray((x - lo) / np.maximum(hi - lo, 1e-9), dtype=np.float32)


def classifier(data: Data, level: str, parts: str, c: float) -> Array:
    """Per request and section: the probability of the section (``level="section"``) or of its group."""
    n = len(data.titles)
    label = np.arange(n) if level == "section" else data.group
    fixed_x = [data.heads, data.title_vectors] if "titles" in parts else []
    fixed_y = [label, label, label] if "titles" in parts else []
    if "lines" in parts:
        fixed_x.append(data.lines)
        fixed_y.append(label[data.line_of])

    def fit(kept: np.ndarray) -> Array:
        x = np.concatenate([*fixed_x, data.examples[kept]])
        y = np.concatenate([*fixed_y, label[data.example_of[kept]]])
        model = LogisticRegression(C=c, max_iter=3000).fit(x, y)
        p = np.zeros((len(data.texts), int(label.max()) + 1), dtype=np.float32)
        p[:, model.classes_] = model.predict_proba(data.query)
        return p[:, label]

    return per_fold(data, fit)


def tfidf_groups(data: Data, c: float) -> Array:
    """A TF-IDF (words and word pairs) logistic regression per group on titles, texts and examples."""

    def fit(kept: np.ndarray) -> Array:
        docs = [*data.titles, *data.section_texts, *(t for t, k in zip(data.example_texts, kept, strict=True) if k)]
        y = np.concatenate([data.group, data.group, data.group[data.example_of[kept]]])
        vectorizer = TfidfVectorizer(sublinear_tf=True, ngram_range=(1, 2), stop_words="english")
        model = LogisticRegression(C=c, max_iter=3000).fit(vectorizer.fit_transform(docs), y)
        return np.asarray(model.predict_proba(vectorizer.transform(data.texts))[:, data.group], dtype=np.float32)

    return per_fold(data, fit)


def _picked(data: Data, base: Array, extra: Array) -> tuple[Array, float]:
    """``base + g * extra`` with ``g`` the grid's best on dev."""
    best = max(GRID, key=lambda g: (accuracy(data, base + g * extra)[0], -g))
    return base + best * extra, best


def _rrf(*rankings: Array, k: int = 10) -> Array:
    return np.asarray(sum(1.0 / (k + 1 + np.argsort(np.argsort(-r, 1), 1)) for r in rankings), dtype=np.float32)


def variants(data: Data) -> list[tuple[str, Array, float | None]]:
    head = _min_max(data.query @ data.heads.T)
    examples = per_fold(data, lambda kept: _max_sim(data, data.examples[kept], data.example_of[kept]))
    mix = 0.3 * data.bm25 + 0.7 * head + 2.0 * examples
    out: list[tuple[str, Array, float | None]] = [
        ("BM25", data.bm25, None),
        ("head vectors", head, None),
        ("title vectors", _min_max(data.query @ data.title_vectors[: len(data.titles)].T), None),
        ("text lines, best cosine", _max_sim(data, data.lines, data.line_of), None),
        ("examples, best cosine", examples, None),
        ("BM25 + head vectors", 0.3 * data.bm25 + 0.7 * head, None),
        ("BM25 + head vectors + examples (the mix before)", mix, None),
    ]
    for how in ("best", "sum", "two best"):
        out.append(
            (f"the mix, read per flow ({how} of its sections)", _flow_scores(data, mix, how)[:, data.group], None)
        )
    configs = [("section", p, c) for p in ("examples", "examples+titles") for c in (10.0, 100.0)]
    configs += [("section", "examples+titles+lines", 10.0), ("group", "examples", 10.0), ("group", "examples", 100.0)]
    configs += [("group", "examples+titles", c) for c in (1.0, 10.0, 30.0, 100.0, 300.0)]
    configs += [("group", "examples+titles+lines", 10.0)]
    default = np.zeros_like(mix)
    for level, parts, c in configs:
        p = classifier(data, level, parts, c)
        name = f"LR per {level} on {parts.replace('titles', 'titles+heads')}, C={c:g}"
        out.append((f"{name}, alone", p, None))
        fused, g = _picked(data, mix, p)
        out.append((f"the mix + {name} (g picked on dev)", fused, g))
        if (level, parts, c) == ("group", "examples+titles", 100.0):
            default = p
            out.append((f"the mix + {name}, g=0.75 (the default)", mix + 0.75 * p, 0.75))
            out.append((f"reciprocal-rank fusion of the mix and {name}", _rrf(mix, p), None))
    tfidf, g = _picked(data, mix + 0.75 * default, tfidf_groups(data, 10.0))
    out.append(("the default + TF-IDF LR per group, C=10 (g picked on dev)", tfidf, g))
    return out


if __name__ == "__main__":
    sys.exit(main())
