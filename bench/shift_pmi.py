"""The model's own surprise as a topic-shift signal: pointwise mutual information of a customer message with its topic.

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.shift_pmi             # 30 pairs per part and set

For each scored customer message m of the ``masked`` and ``second-issue`` sets (``bench/shift_sets.py``), with the
true topic so far as its epoch (as ``bench.topic_shift --train`` reads features):

    PMI(m) = [log p(m | system prompt, the epoch's last --window turns) - log p(m | system prompt)] / tokens(m)

both from the engine's prompt log-probabilities (SmolLM2). A follow-up ("so i should just wait?") is far likelier
after its topic than out of the blue; a new problem is not. Candidates, each with its threshold chosen on the tuning
part (the most recall with at most 5 % false shifts) and reported on the held-out part, message by message:

- ``pmi``: shift when PMI is under the threshold;
- ``clf-static``: the default classifier's probability (``backend/context/shift_classifier.py``), for comparison on
  exactly these messages;
- ``clf-static+pmi``: a logistic regression on the classifier's logit and the PMI, fitted on the tuning messages.

Also measured: the seconds each message's two scorings took. NOTE: a request with prompt log-probabilities takes no
prefix-cache hit in this engine, so both prompts are computed in full here; in serving, the epoch's prompt is the
reply's prompt (cached) and only the message's own tokens would be new, but that needs an engine call that returns
log-probabilities of a prompt's tail after a cached prefix. The system prompt here is the workload's without its
handbook excerpt, to keep those full recomputations affordable.

Writes ``docs/benchmarks/shift_pmi.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from backend.context.rules import DEFAULT_RULES, RuleSet
from backend.context.shift_classifier import ShiftModel, model_path
from backend.context.shift_features import shift_features
from backend.context.static_embedding import StaticEmbedder
from backend.context.topic import Identify, TopicState, identifier_keys, tuned
from bench.datasets import CONVERSATIONS
from bench.shift_sets import Case, cases, load_conversations, pairs
from bench.workload import system_prompt
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "shift_pmi.json"
SETS = ("masked", "second-issue")
MAX_FALSE_SHIFTS = 0.05


@dataclass(frozen=True, slots=True)
class Message:
    """One scored customer message: its set, whether it opens the second topic, and the candidates' signals."""

    kind: str
    seam: bool
    pmi: float
    clf_logit: float


class Scorer:
    """Prompt log-probabilities of a customer message after a context, with the engine's chat template."""

    def __init__(self, engine: LLMEngine, system: str) -> None:
        self.engine = engine
        self.system = system
        self.params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True)

    def prompt(self, context: Sequence[tuple[bool, str]], message: str) -> tuple[list[int], int]:
        """The token ids with ``message`` as the last customer turn, and where that turn starts."""
        base = [{"role": "system", "content": self.system}]
        base += [{"role": "user" if customer else "assistant", "content": text} for customer, text in context]
        tok = self.engine.tokenizer
        before = tok.apply_chat_template(base, add_generation_prompt=False)
        ids = tok.apply_chat_template([*base, {"role": "user", "content": message}], add_generation_prompt=False)
        if ids[: len(before)] != before:
            raise RuntimeError("the chat template does not extend the context with the message")
        return list(ids), len(before)

    def logprobs(self, prompts: Sequence[tuple[list[int], int]]) -> list[tuple[float, int]]:
        """For each prompt: the sum of its last turn's token log-probabilities, and how many tokens that is."""
        done = self.engine.generate_sync([ids for ids, _ in prompts], self.params)
        out = []
        for (_, start), result in zip(prompts, done, strict=True):
            values = [lp for lp in (result.prompt_logprobs or ())[start:] if lp is not None]
            out.append((sum(values), len(values)))
        return out


def messages(
    sessions: list[Case], kind: str, scorer: Scorer, model: ShiftModel, ident: Identify, window: int
) -> tuple[list[Message], float]:
    """Every scored customer message of ``sessions`` with its PMI and classifier logit; and the seconds it took."""
    embedder = StaticEmbedder()
    out: list[Message] = []
    seconds = 0.0
    for case in sessions:
        state, epoch_turns = TopicState(), []
        prompts, labels, logits = [], [], []
        for i, turn in enumerate(case.turns):
            found = ident(turn.text)
            if not turn.customer:
                state.remember_agent(turn.text, found, 2)
                epoch_turns.append((False, turn.text))
                continue
            if state.customer:
                p = model.shift_probability(shift_features(turn.text, found, state, embedder))
                logits.append(math.log(max(p, 1e-9) / max(1 - p, 1e-9)))
                prompts += [scorer.prompt(epoch_turns[-window:], turn.text), scorer.prompt([], turn.text)]
                labels.append(i == case.seam)
            if i == case.seam:
                state.start_epoch()
                epoch_turns = []
            state.remember_customer(turn.text, found, 2)
            epoch_turns.append((True, turn.text))
        started = time.perf_counter()
        scored = scorer.logprobs(prompts)
        seconds += time.perf_counter() - started
        for k, (seam, logit) in enumerate(zip(labels, logits, strict=True)):
            (with_topic, n), (alone, _) = scored[2 * k], scored[2 * k + 1]
            out.append(Message(kind, seam, (with_topic - alone) / max(n, 1), logit))
    return out, seconds


def threshold_at(scores: np.ndarray, seams: np.ndarray, max_false: float) -> float:
    """The highest score threshold (shift: score > threshold) whose false-shift rate is at most ``max_false``."""
    negatives = np.sort(scores[~seams])
    return float(negatives[min(len(negatives) - 1, math.ceil((1 - max_false) * len(negatives)) - 1)])


def report(scores: np.ndarray, seams: np.ndarray, threshold: float) -> dict[str, float]:
    shifts = scores > threshold
    recall = float(shifts[seams].mean())
    false_rate = float(shifts[~seams].mean())
    return {"recall": round(recall, 4), "false_shift_rate": round(false_rate, 4), "messages": len(scores)}


def evaluate(tune: list[Message], held: list[Message]) -> dict[str, Any]:
    """Each candidate's threshold on ``tune``, its recall and false-shift rate on ``held``, per set."""
    from sklearn.linear_model import LogisticRegression

    def arrays(rows: list[Message]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (
            np.array([[-r.pmi, r.clf_logit] for r in rows]),  # NOTE: low PMI is the shift: negated, higher = shift
            np.array([r.seam for r in rows]),
            np.array([r.kind for r in rows]),
        )

    x_tune, y_tune, _ = arrays(tune)
    x_held, y_held, kinds = arrays(held)
    combined = LogisticRegression(max_iter=1000).fit(x_tune, y_tune)
    candidates = {
        "pmi": (x_tune[:, 0], x_held[:, 0]),
        "clf-static": (x_tune[:, 1], x_held[:, 1]),
        "clf-static+pmi": (combined.decision_function(x_tune), combined.decision_function(x_held)),
    }
    out: dict[str, Any] = {}
    for name, (tune_scores, held_scores) in candidates.items():
        t = threshold_at(tune_scores, y_tune, MAX_FALSE_SHIFTS)
        out[name] = {kind: report(held_scores[kinds == kind], y_held[kinds == kind], t) for kind in SETS}
    out["clf-static+pmi"]["coef"] = {"-pmi": float(combined.coef_[0][0]), "clf_logit": float(combined.coef_[0][1])}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.shift_pmi", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--pairs", type=int, default=30, help="pairs per part and set")
    p.add_argument("--window", type=int, default=4, help="turns of the epoch in the context prompt")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    conversations = load_conversations(CONVERSATIONS)
    ident = functools.lru_cache(maxsize=None)(identifier_keys(RuleSet.compile(DEFAULT_RULES)))
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device="cpu", max_kv_memory_mb=1024))
    engine.load()
    scorer = Scorer(engine, system_prompt(0, ""))
    model = ShiftModel.load(model_path("minilm-static"))
    rows: dict[str, list[Message]] = {"tune": [], "held_out": []}
    seconds = 0.0
    for part in rows:
        for kind in SETS:
            found, took = messages(
                cases(kind, pairs(conversations, part, args.pairs)), kind, scorer, model, ident, args.window
            )
            rows[part] += found
            seconds += took
            print(f"{part} {kind}: {len(found)} messages, {took:.0f} s", file=sys.stderr, flush=True)
    n = len(rows["tune"]) + len(rows["held_out"])
    result = {
        "command": "flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.shift_pmi " + " ".join(sys.argv[1:]),
        "model": args.model,
        "dtype": args.dtype,
        "pairs_per_part_and_set": args.pairs,
        "window": args.window,
        "clf_static_threshold": tuned("clf-static").shift_threshold,
        "max_false_shift_rate": MAX_FALSE_SHIFTS,
        "seconds_per_message": round(seconds / n, 3),
        "results": evaluate(rows["tune"], rows["held_out"]),
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
