"""Topic-shift benchmark: how well each topic scorer finds where a session's second issue starts.

    .venv/bin/python -m bench.topic_shift                      # report: held-out sessions, every scorer, every set
    .venv/bin/python -m bench.topic_shift --train              # fit the classifiers on the tuning half, write them
    .venv/bin/python -m bench.topic_shift --tune               # grid search of the cosine scorers (prints the best)

Sets (``bench/shift_sets.py``): ``spliced`` conversation pairs, the same pairs ``masked`` (every token with a digit
removed), and ``second-issue`` (a conversation, then the opening problem of the next one without greeting and
numbers). Scored: each customer message but a session's first; the seam is the one true shift. Reported per scorer
and set: precision, recall, F1, and the false-shift rate (shifts at customer messages that are not the seam, over
all such scored messages). ``identifier-mid-issue`` has no seam (single-issue conversations whose first identifier
comes in a later customer message): its false-shift rate, and the share of sessions that shifted at the message
giving the identifier ("at identifier"). Rows:

- ``clf-static`` (the default) and ``clf-minilm``: the topic-shift classifier on static or full MiniLM sentence
  vectors (``backend/context/shift_classifier.py``), trained and its threshold chosen on the tuning half only;
- ``minilm`` and ``tfidf``: the cosine scorers at their tuned settings, and ``minilm@0.3`` at the design's threshold;
- ``identifiers-only``: the cosine scorer with a backend that always answers 1.0: only identifier evidence shifts.

``--train`` fits each classifier on the tuning half's sets (oracle epochs: the features of a message are read
against the true topic so far), chooses its threshold by 2-fold cross-fitting on the tuning pairs (the best worst-set
F1 with at most 5 % false shifts in every set and at most 2 % shifts at a mid-issue identifier, the tracker run as
it serves), refits on all tuning pairs and writes
``backend/context/models/shift_<embedder>.json``. Writes ``docs/benchmarks/topic_shift.json`` (report only).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from backend.context.rules import DEFAULT_RULES, RuleSet
from backend.context.shift_classifier import ShiftClassifier, ShiftModel, model_path
from backend.context.shift_features import Embedder, ShiftFeatures, shift_features
from backend.context.similarity import MiniLMSimilarity, TfidfSimilarity
from backend.context.static_embedding import StaticEmbedder
from backend.context.topic import (
    DESIGN_SHIFT_THRESHOLD,
    TUNED_SETTINGS,
    CosineScorer,
    Identify,
    ShiftScorer,
    TopicSettings,
    TopicState,
    TopicTracker,
    identifier_keys,
    tuned,
)
from bench.datasets import CONVERSATIONS, DataNotFoundError, resolve
from bench.shift_sets import IDENTIFIER_KIND, KINDS, Case, Conversation, Pair, cases, load_conversations, pairs

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = CONVERSATIONS
DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "topic_shift.json"
COMMAND = ".venv/bin/python -m bench.topic_shift"
SCORERS = ("clf-static", "clf-minilm", "minilm", "tfidf")
CLASSIFIERS = ("clf-static", "clf-minilm")
MAX_FALSE_SHIFTS = 0.05
MAX_IDENTIFIER_SHIFTS = 0.02  # issue 40: the first identifier of an ongoing issue is no topic change
THRESHOLDS = [round(float(x), 2) for x in np.arange(0.05, 0.96, 0.025)]


@dataclass(frozen=True, slots=True)
class Score:
    sessions: int
    seams: int  # sessions with a true shift (all of them but in identifier-mid-issue, which has none)
    true_shifts: int
    false_shifts: int
    missed_shifts: int
    scored_messages: int  # customer messages compared with a topic (all but each session's first)
    probes: int = 0  # sessions whose first identifier comes mid-issue (identifier-mid-issue)
    probe_shifts: int = 0  # ... that shifted at the message giving it

    @property
    def precision(self) -> float:
        found = self.true_shifts + self.false_shifts
        return self.true_shifts / found if found else 0.0

    @property
    def recall(self) -> float:
        return self.true_shifts / self.seams if self.seams else 0.0

    @property
    def f1(self) -> float:
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p + r else 0.0

    @property
    def false_shift_rate(self) -> float:
        inside = self.scored_messages - self.seams
        return self.false_shifts / inside if inside else 0.0

    @property
    def identifier_shift_rate(self) -> float:
        return self.probe_shifts / self.probes if self.probes else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "precision": round(self.precision, 4),
            "recall": round(self.recall, 4),
            "f1": round(self.f1, 4),
            "false_shift_rate": round(self.false_shift_rate, 4),
            "identifier_shift_rate": round(self.identifier_shift_rate, 4),
        }


class _IdentifiersOnly:
    """The ablation baseline: every message looks on topic, so only identifier evidence can shift."""

    name = "identifiers-only"

    def similarity(self, message: str, context: Sequence[str]) -> float:
        return 1.0


class _Memo:
    """Caches a similarity backend's answers: the tuning grid asks the same (message, window) many times."""

    def __init__(self, backend: Any) -> None:
        self.name = backend.name
        self.backend = backend
        self.cache: dict[tuple[str, tuple[str, ...]], float] = {}

    def similarity(self, message: str, context: Sequence[str]) -> float:
        key = (message, tuple(context))
        if key not in self.cache:
            self.cache[key] = self.backend.similarity(message, context)
        return self.cache[key]


class _MemoScorer:
    """Caches a scorer's answer per message and epoch: the threshold search replays each session at 37 thresholds,
    and most of them reach a message with the same epoch (exact: the features read nothing else)."""

    def __init__(self, scorer: ShiftScorer) -> None:
        self.name = scorer.name
        self.scorer = scorer
        self.cache: dict[tuple[Any, ...], float] = {}

    def on_topic(self, message: str, found: frozenset[str], state: TopicState, settings: TopicSettings) -> float:
        epoch = (tuple(state.customer), state.agent, frozenset(state.identifiers), state.asked_for_identifier)
        key = (message, found, *epoch)
        if key not in self.cache:
            self.cache[key] = self.scorer.on_topic(message, found, state, settings)
        return self.cache[key]


def score_cases(sessions: list[Case], settings: TopicSettings, scorer: ShiftScorer, ident: Identify) -> Score:
    """Replay each session through a ``TopicTracker`` as the chat service does, and count its shifts."""
    true_shifts = false_shifts = scored = probe_shifts = 0
    for case in sessions:
        tracker = TopicTracker(settings, scorer, ident)
        for i, turn in enumerate(case.turns):
            if not turn.customer:
                tracker.observe_context(turn.text)
                continue
            update = tracker.observe_customer(turn.text)
            if update.similarity is None:
                continue
            scored += 1
            if update.shift and i == case.seam:
                true_shifts += 1
            elif update.shift:
                false_shifts += 1
            probe_shifts += int(update.shift and i == case.probe)
    seams = sum(case.seam is not None for case in sessions)
    probes = sum(case.probe is not None for case in sessions)
    return Score(len(sessions), seams, true_shifts, false_shifts, seams - true_shifts, scored, probes, probe_shifts)


def training_rows(
    sessions: list[Case], embedder: Embedder, ident: Identify, window: int
) -> tuple[list[ShiftFeatures], list[bool]]:
    """The features of every scored customer message, read against the true topic so far (the seam starts one)."""
    rows: list[ShiftFeatures] = []
    labels: list[bool] = []
    for case in sessions:
        state = TopicState()
        for i, turn in enumerate(case.turns):
            found = ident(turn.text)
            if not turn.customer:
                state.remember_agent(turn.text, found, window)
                continue
            if state.customer:
                rows.append(shift_features(turn.text, found, state, embedder))
                labels.append(i == case.seam)
            if i == case.seam:
                state.start_epoch()
            state.remember_customer(turn.text, found, window)
    return rows, labels


def train(tuning: list[Pair], name: str, embedder: Embedder, ident: Identify) -> tuple[ShiftModel, dict[str, Any]]:
    """Fit the classifier ``name`` on the tuning pairs and choose its threshold by 2-fold cross-fitting."""
    settings = TUNED_SETTINGS.get(name, TopicSettings(backend=name))
    folds = (tuning[: len(tuning) // 2], tuning[len(tuning) // 2 :])
    totals: dict[float, list[Score]] = {t: [] for t in THRESHOLDS}
    for fit_on, judge_on in (folds, folds[::-1]):
        model = _fit(fit_on, embedder, ident, settings.window)
        scorer = _MemoScorer(ShiftClassifier(model, embedder, name))
        for kind in KINDS:
            judged = cases(kind, judge_on)
            for t in THRESHOLDS:
                totals[t].append(score_cases(judged, replace(settings, shift_threshold=t), scorer, ident))
    by_threshold = {t: _merged(scores) for t, scores in totals.items()}
    best = max(THRESHOLDS, key=lambda t: _objective(by_threshold[t]))
    _progress(f"{name}: threshold {best} (cross-fitted worst-set F1 {_objective(by_threshold[best])[1]:.3f})")
    model = _fit(tuning, embedder, ident, settings.window).with_threshold(
        best,
        command=f"{COMMAND} --train --scorers {name}",
        tuning_pairs=len(tuning),
        cross_fitted={kind: s.as_dict() for kind, s in zip(KINDS, by_threshold[best], strict=True)},
    )
    return model, {"threshold": best, "cross_fitted": model.trained["cross_fitted"]}


def _fit(tuning: list[Pair], embedder: Embedder, ident: Identify, window: int) -> ShiftModel:
    rows: list[ShiftFeatures] = []
    labels: list[bool] = []
    for kind in KINDS:
        r, y = training_rows(cases(kind, tuning), embedder, ident, window)
        rows += r
        labels += y
    return ShiftModel.fit(rows, labels, embedder.name)


def _merged(scores: list[Score]) -> tuple[Score, ...]:
    """Per set (KINDS order), the two folds' scores added up."""
    n = len(KINDS)
    return tuple(
        Score(*(sum(getattr(s, f) for s in scores[k::n]) for f in Score.__dataclass_fields__)) for k in range(n)
    )


def _objective(per_set: tuple[Score, ...]) -> tuple[bool, float, float]:
    within = all(
        s.false_shift_rate <= MAX_FALSE_SHIFTS and s.identifier_shift_rate <= MAX_IDENTIFIER_SHIFTS for s in per_set
    )
    # NOTE: a set without seams has no F1; it enters through the limits above
    return within, min(s.f1 for s in per_set if s.seams), -max(s.false_shift_rate for s in per_set)


GRID: dict[str, list[Any]] = {
    "shift_threshold": [0.01, 0.03, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4],
    "window": [2, 4, 8],
    "min_evidence_words": [0, 4],
    "new_identifier_cap": [0.0, 1.0],  # 1.0: identifiers never force a shift
}


def tune(sessions: list[Case], scorer: CosineScorer, ident: Identify) -> dict[str, Any]:
    """The grid point with the best F1 among those with ≤ 5 % false shifts (else the best F1 overall)."""
    results = []
    points = list(itertools.product(*GRID.values()))
    for n, values in enumerate(points, 1):
        point: dict[str, Any] = dict(zip(GRID, values, strict=True))
        settings = replace(TopicSettings(backend=scorer.name), **point)
        results.append((settings, score_cases(sessions, settings, scorer, ident)))
        if n % 50 == 0:
            _progress(f"  {scorer.name}: {n}/{len(points)} grid points")
    within = [r for r in results if r[1].false_shift_rate <= MAX_FALSE_SHIFTS] or results
    best, score = max(within, key=lambda r: (r[1].f1, -r[1].false_shift_rate))
    return {"settings": asdict(best), "score": score.as_dict(), "grid_points": len(points)}


class _Scorers:
    """The scorers by name, sharing one MiniLM encoder whose cache holds every text of the run."""

    def __init__(self, texts: list[str]) -> None:
        self._texts = texts
        self._minilm: MiniLMSimilarity | None = None
        self._static: StaticEmbedder | None = None

    def embedder(self, name: str) -> Embedder:
        return self.minilm() if name == "clf-minilm" else self.static()

    def static(self) -> StaticEmbedder:
        if self._static is None:
            self._static = StaticEmbedder(cache_size=len(set(self._texts)) + 1)
        return self._static

    def minilm(self) -> MiniLMSimilarity:
        if self._minilm is None:
            texts = list(dict.fromkeys(self._texts))
            self._minilm = MiniLMSimilarity(cache_size=len(texts) + 1)
            _progress(f"minilm: embedding {len(texts)} texts")
            for start in range(0, len(texts), 512):
                self._minilm.embed(texts[start : start + 512])
                _progress(f"  {min(start + 512, len(texts))}/{len(texts)}")
        return self._minilm

    def scorer(self, name: str) -> ShiftScorer:
        if name in CLASSIFIERS:
            embedder = self.embedder(name)
            return ShiftClassifier(ShiftModel.load(model_path(embedder.name)), embedder, name)
        if name == "minilm":
            return CosineScorer(_Memo(self.minilm()))
        if name == "tfidf":
            return CosineScorer(_Memo(TfidfSimilarity()))
        raise SystemExit(f"topic_shift: unknown scorer {name!r} (known: {', '.join(SCORERS)})")


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _table(kind: str, rows: dict[str, dict[str, Any]]) -> str:
    if kind == IDENTIFIER_KIND:
        head = f"{kind:<20} {'sessions':>8} {'false shifts':>12} {'at identifier':>13}"
        lines = [head, "-" * len(head)]
        for name, r in rows.items():
            s = r["score"]
            lines.append(
                f"{name:<20} {s['sessions']:>8} {s['false_shift_rate']:>11.1%} {s['identifier_shift_rate']:>12.1%}"
            )
        return "\n".join(lines)
    head = f"{kind:<20} {'sessions':>8} {'P':>6} {'R':>6} {'F1':>6} {'false shifts':>12}"
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        s = r["score"]
        lines.append(
            f"{name:<20} {s['sessions']:>8} {s['precision']:>6.3f} {s['recall']:>6.3f} {s['f1']:>6.3f} "
            f"{s['false_shift_rate']:>11.1%}"
        )
    return "\n".join(lines)


def _texts(sessions: dict[str, list[Case]]) -> list[str]:
    return [t.text for kind in sessions.values() for case in kind for t in case.turns]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.topic_shift", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the CuCom conversations (JSON lines)")
    p.add_argument("--pairs", type=int, default=200, help="held-out pairs to report (--tune: tuning pairs)")
    p.add_argument("--scorers", default=",".join(SCORERS), help=f"comma list of {', '.join(SCORERS)}")
    p.add_argument("--sets", default=",".join(KINDS), help=f"comma list of {', '.join(KINDS)} (report only)")
    p.add_argument("--train", action="store_true", help="fit the classifiers on the tuning half and write them")
    p.add_argument("--tune", action="store_true", help="grid-search the cosine scorers on the tuning part")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON report goes")
    p.add_argument("--model-dir", type=Path, default=None, help="--train: write the models here instead")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        resolve(args.data)
    except DataNotFoundError:
        print(f"topic_shift: data file not found: {args.data} (pass --data PATH)", file=sys.stderr)
        return 2
    conversations = load_conversations(args.data)
    ident = functools.lru_cache(maxsize=None)(identifier_keys(RuleSet.compile(DEFAULT_RULES)))
    names = [n for n in args.scorers.split(",") if n]
    if args.train:
        return _train(conversations, [n for n in names if n in CLASSIFIERS], ident, args.model_dir)
    if args.tune:
        return _tune(conversations, [n for n in names if n not in CLASSIFIERS], ident, args.pairs)
    return _report(conversations, names, ident, args)


def _train(conversations: list[Conversation], names: list[str], ident: Identify, model_dir: Path | None) -> int:
    tuning = pairs(conversations, "tune")
    scorers = _Scorers(_texts({k: cases(k, tuning) for k in KINDS}))
    for name in names:
        started = time.perf_counter()
        embedder = scorers.embedder(name)
        model, summary = train(tuning, name, embedder, ident)
        path = (model_dir / model_path(embedder.name).name) if model_dir else model_path(embedder.name)
        model.save(path)
        print(json.dumps({name: summary}, indent=1))
        seconds = time.perf_counter() - started
        print(f"wrote {path} ({seconds:.0f} s); set TUNED_SETTINGS[{name!r}] to {model.shift_threshold}")
    return 0


def _tune(conversations: list[Conversation], names: list[str], ident: Identify, count: int) -> int:
    sessions = cases("spliced", pairs(conversations, "tune", count))
    scorers = _Scorers(_texts({"spliced": sessions}))
    for name in names:
        scorer = scorers.scorer(name)
        assert isinstance(scorer, CosineScorer)
        best = tune(sessions, scorer, ident)
        print(f"{name}: {best['settings']} → {best['score']}")
    return 0


def _report(conversations: list[Conversation], names: list[str], ident: Identify, args: argparse.Namespace) -> int:
    held_out = pairs(conversations, "held_out", args.pairs)
    sessions = {kind: cases(kind, held_out) for kind in args.sets.split(",") if kind}
    scorers = _Scorers(_texts(sessions))
    results: dict[str, dict[str, dict[str, Any]]] = {kind: {} for kind in sessions}
    baseline = replace(TopicSettings(), shift_threshold=0.01, backend=_IdentifiersOnly.name)
    runs: list[tuple[str, TopicSettings, ShiftScorer]] = [
        (_IdentifiersOnly.name, baseline, CosineScorer(_IdentifiersOnly()))
    ]
    for name in names:
        scorer = scorers.scorer(name)
        runs.append((name, tuned(name), scorer))
        if name == "minilm":
            runs.append((f"{name}@{DESIGN_SHIFT_THRESHOLD}", replace(tuned(name), shift_threshold=0.3), scorer))
    for (label, settings, scorer), kind in itertools.product(runs, sessions):
        started = time.perf_counter()
        score = score_cases(sessions[kind], settings, scorer, ident)
        seconds = time.perf_counter() - started
        per_message = 1000 * seconds / max(score.scored_messages, 1)
        results[kind][label] = {"settings": asdict(settings), "score": score.as_dict(), "ms_per_message": per_message}
        _progress(f"{label} on {kind}: F1 {score.f1:.3f}, false shifts {score.false_shift_rate:.1%} ({seconds:.1f} s)")
    for kind, rows in results.items():
        print(_table(kind, rows) + "\n")
    report = {
        "command": COMMAND + (" " + " ".join(sys.argv[1:]) if argv_given(sys.argv) else ""),
        "part": "held_out (second half of the file; models and thresholds from the first half)",
        "data": args.data.name,
        "default_scorer": TopicSettings().backend,
        "max_false_shift_rate": MAX_FALSE_SHIFTS,
        "max_identifier_shift_rate": MAX_IDENTIFIER_SHIFTS,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(REPO_ROOT) if args.out.is_relative_to(REPO_ROOT) else args.out}")
    return 0


def argv_given(argv: list[str]) -> bool:
    """Whether this process was started as the benchmark with arguments (not imported by a test)."""
    return len(argv) > 1 and argv[0].endswith("topic_shift.py")


if __name__ == "__main__":
    raise SystemExit(main())
