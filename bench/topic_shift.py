"""Topic-shift benchmark: how well the topic tracker finds the seam between two conversations spliced together.

    .venv/bin/python -m bench.topic_shift                      # report: held-out pairs, every backend
    .venv/bin/python -m bench.topic_shift --tune               # grid search on the tuning pairs only (prints best)

The conversations of ``cucom_ecommerce_dev.jsonl`` are split by position: the first half is the tuning part, the
second half the held-out part. Consecutive conversations (2k, 2k+1) of a part form a pair, spliced back to back into
one session. Only customer messages are scored (agent turns are context); the first customer message of the second
conversation is the one true shift. Reported per backend: precision, recall and F1 of shift detection, and the
false-shift rate (shifts at customer messages that are not the seam, over all such scored messages), once with the
backend's tuned settings (``topic.TUNED_SETTINGS``, found with ``--tune`` on the tuning part, never on the reported
one) and once with them but the design's shift threshold of 0.3 (row ``<backend>@0.3``). A baseline row,
``identifiers-only``, runs the default settings with a backend that always answers 1.0: what the identifier rules
find without any similarity, so the table shows what the similarity backend adds.
Writes ``docs/benchmarks/topic_shift.json``.
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

from backend.context.rules import DEFAULT_RULES, RuleSet
from backend.context.similarity import MiniLMSimilarity, SimilarityBackend, TfidfSimilarity
from backend.context.topic import DESIGN_SHIFT_THRESHOLD, Identify, TopicSettings, TopicTracker, identifier_keys, tuned
from bench.datasets import CONVERSATIONS, DataNotFoundError, read_text, resolve

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = CONVERSATIONS
DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "topic_shift.json"
COMMAND = ".venv/bin/python -m bench.topic_shift"
BACKENDS = ("tfidf", "minilm")


@dataclass(frozen=True, slots=True)
class Turn:
    customer: bool
    text: str


Conversation = list[Turn]


@dataclass(frozen=True, slots=True)
class Score:
    pairs: int
    true_shifts: int
    false_shifts: int
    missed_shifts: int
    scored_messages: int  # customer messages compared with a topic (all but each session's first)

    @property
    def precision(self) -> float:
        found = self.true_shifts + self.false_shifts
        return self.true_shifts / found if found else 0.0

    @property
    def recall(self) -> float:
        return self.true_shifts / self.pairs if self.pairs else 0.0

    @property
    def f1(self) -> float:
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p + r else 0.0

    @property
    def false_shift_rate(self) -> float:
        inside = self.scored_messages - self.pairs
        return self.false_shifts / inside if inside else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "precision": round(self.precision, 4),
            "recall": round(self.recall, 4),
            "f1": round(self.f1, 4),
            "false_shift_rate": round(self.false_shift_rate, 4),
        }


class _IdentifiersOnly:
    """The ablation baseline: every message looks on topic, so only identifier evidence can shift."""

    name = "identifiers-only"

    def similarity(self, message: str, context: Sequence[str]) -> float:
        return 1.0


class _Memo:
    """Caches a backend's answers: the tuning grid asks the same (message, window) many times."""

    def __init__(self, backend: SimilarityBackend) -> None:
        self.name = backend.name
        self.backend = backend
        self.cache: dict[tuple[str, tuple[str, ...]], float] = {}

    def similarity(self, message: str, context: Sequence[str]) -> float:
        key = (message, tuple(context))
        if key not in self.cache:
            self.cache[key] = self.backend.similarity(message, context)
        return self.cache[key]


def load_conversations(path: Path) -> list[Conversation]:
    conversations = []
    for line in read_text(path).splitlines():
        if line.strip():
            turns = json.loads(line)["turns"]
            conversations.append([Turn(t["role"].lower() == "user", t["content"]) for t in turns])
    return conversations


def make_pairs(conversations: list[Conversation], part: str, count: int) -> list[tuple[Conversation, Conversation]]:
    half = len(conversations) // 2
    pool = conversations[:half] if part == "tune" else conversations[half:]
    pairs = [(pool[2 * k], pool[2 * k + 1]) for k in range(len(pool) // 2)]
    if len(pairs) < count:
        raise SystemExit(f"topic_shift: the {part} part has only {len(pairs)} pairs, {count} asked")
    return pairs[:count]


def score_pairs(
    pairs: list[tuple[Conversation, Conversation]], settings: TopicSettings, backend: SimilarityBackend, ident: Identify
) -> Score:
    true_shifts = false_shifts = scored = 0
    for first, second in pairs:
        tracker = TopicTracker(settings, backend, ident)
        seam_seen = False
        for conv_index, conversation in enumerate((first, second)):
            for turn in conversation:
                if not turn.customer:
                    tracker.observe_context(turn.text)
                    continue
                update = tracker.observe_customer(turn.text)
                if update.similarity is None:
                    continue
                scored += 1
                seam = conv_index == 1 and not seam_seen
                seam_seen = seam_seen or conv_index == 1
                if update.shift and seam:
                    true_shifts += 1
                elif update.shift:
                    false_shifts += 1
    return Score(len(pairs), true_shifts, false_shifts, len(pairs) - true_shifts, scored)


def make_backend(name: str, pairs: list[tuple[Conversation, Conversation]]) -> SimilarityBackend:
    if name == "tfidf":
        return _Memo(TfidfSimilarity())
    texts = [t.text for pair in pairs for conv in pair for t in conv]
    minilm = MiniLMSimilarity(cache_size=len(texts) + 1)
    _progress(f"minilm: embedding {len(texts)} messages")
    for start in range(0, len(texts), 512):
        minilm.embed(texts[start : start + 512])
        _progress(f"  {min(start + 512, len(texts))}/{len(texts)}")
    return _Memo(minilm)


GRID: dict[str, list[Any]] = {
    "shift_threshold": [0.01, 0.03, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4],
    "window": [2, 4, 8],
    "min_evidence_words": [0, 4],
    "new_identifier_cap": [0.0, 1.0],  # 1.0: identifiers never force a shift
}


def tune(pairs: list[tuple[Conversation, Conversation]], backend: SimilarityBackend, ident: Identify) -> dict[str, Any]:
    """The grid point with the best F1 among those with ≤ 5 % false shifts (else the best F1 overall)."""
    results = []
    points = list(itertools.product(*GRID.values()))
    for n, values in enumerate(points, 1):
        point: dict[str, Any] = dict(zip(GRID, values, strict=True))
        settings = replace(TopicSettings(backend=backend.name), **point)
        results.append((settings, score_pairs(pairs, settings, backend, ident)))
        if n % 50 == 0:
            _progress(f"  {backend.name}: {n}/{len(points)} grid points")
    within = [r for r in results if r[1].false_shift_rate <= 0.05] or results
    best, score = max(within, key=lambda r: (r[1].f1, -r[1].false_shift_rate))
    return {"settings": asdict(best), "score": score.as_dict(), "grid_points": len(points)}


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _table(rows: dict[str, dict[str, Any]]) -> str:
    head = f"{'backend':<12} {'pairs':>5} {'P':>6} {'R':>6} {'F1':>6} {'false shifts':>12} {'seconds':>8}"
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        s = r["score"]
        lines.append(
            f"{name:<12} {s['pairs']:>5} {s['precision']:>6.3f} {s['recall']:>6.3f} {s['f1']:>6.3f} "
            f"{s['false_shift_rate']:>11.1%} {r['seconds']:>8.1f}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.topic_shift", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the CuCom conversations (JSON lines)")
    p.add_argument("--pairs", type=int, default=200, help="held-out pairs to report (tuning: pairs to tune on)")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma list of tfidf, minilm")
    p.add_argument("--tune", action="store_true", help="grid-search the tuning part instead of reporting")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON report goes")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        resolve(args.data)
    except DataNotFoundError:
        print(f"topic_shift: data file not found: {args.data} (pass --data PATH)", file=sys.stderr)
        return 2
    pairs = make_pairs(load_conversations(args.data), "tune" if args.tune else "held_out", args.pairs)
    ident = functools.lru_cache(maxsize=None)(identifier_keys(RuleSet.compile(DEFAULT_RULES)))
    rows: dict[str, dict[str, Any]] = {}
    if not args.tune:
        baseline = replace(TopicSettings(), backend=_IdentifiersOnly.name)
        score = score_pairs(pairs, baseline, _IdentifiersOnly(), ident)
        rows[_IdentifiersOnly.name] = {"settings": asdict(baseline), "score": score.as_dict(), "seconds": 0.0}
    for name in args.backends.split(","):
        started = time.perf_counter()
        backend = make_backend(name, pairs)
        if args.tune:
            rows[name] = tune(pairs, backend, ident)
        else:
            for label, settings in (
                (name, tuned(name)),
                (f"{name}@{DESIGN_SHIFT_THRESHOLD}", replace(tuned(name), shift_threshold=DESIGN_SHIFT_THRESHOLD)),
            ):
                score = score_pairs(pairs, settings, backend, ident)
                rows[label] = {"settings": asdict(settings), "score": score.as_dict()}
        seconds = round(time.perf_counter() - started, 1)
        for label in rows:
            rows[label].setdefault("seconds", seconds)
        _progress(f"{name}: done in {seconds} s")
    print(_table(rows))
    for name, r in rows.items():
        print(f"{name}: {r['settings']}")
    if args.tune:
        return 0
    report = {
        "command": COMMAND,
        "part": "held_out (second half of the file; settings tuned on the first half)",
        "data": args.data.name,
        "default_backend": TopicSettings().backend,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(REPO_ROOT) if args.out.is_relative_to(REPO_ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
