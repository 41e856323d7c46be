"""Do chat replies loop? The repetition rate of replies under candidate reply settings, on held-out dev turns.

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.reply_repetition

``--turns`` (200) turns of the held-out part of the dev conversations (its last 1,000): conversation i of that part,
at a turn drawn with a fixed seed, with the workload's system prompt (a store's instruction and an agent-handbook
excerpt) and the conversation's own earlier turns (the recorded agent replies) as history. Each candidate setting
answers every turn with the real model (``--max-tokens`` 256, the chat default), all turns in one continuous batch.

Per candidate: the **repetition rate** (the share of replies in which some word 4-gram occurs twice or more; a
phrase said twice, "I'm so sorry to hear that. I'm so sorry about ...", counts), the share in which one occurs three
times or more (a loop that goes on), the share of replies cut off at ``max_tokens`` (a loop runs until it is cut),
the mean reply length in words, and the word-overlap F1 with the turn's recorded agent reply (a rough check that a
setting does not trade loops for nonsense). And the **handbook quote rate**: the share of replies that contain some
word 4-gram of the system prompt (the store's instruction and the handbook excerpt), a rough proxy for grounded
answers (the CuCom handbook has no phone numbers or URLs to count). Sampled candidates are seeded per turn, so a
rerun gives the same replies.

Writes ``docs/benchmarks/reply_repetition.json`` (and prints a table).
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.datasets import CONVERSATIONS, GUIDELINES
from bench.reporting import REPO_ROOT, format_table, machine_info, reproduce_command, write_json
from bench.workload import DEFAULT_POLICY_CHARS, load_conversations, load_guidelines, render_policy, system_prompt
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import FinishReason, RequestFinished
from engine.request_table import Collector
from engine.sampling_params import RepetitionScope, SamplingParams

DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "reply_repetition.json"
HELD_OUT = 1000  # the last 1,000 conversations of the file
_WORD = re.compile(r"[a-z0-9']+")

# name -> SamplingParams fields (max_tokens added); "greedy" is the chat's setting before this measurement.
CANDIDATES: dict[str, dict[str, Any]] = {
    "greedy": {},
    "greedy, repetition 1.1": {"repetition_penalty": 1.1},
    "greedy, repetition 1.2": {"repetition_penalty": 1.2},
    # the same penalty on the reply's own tokens only: the prompt's words stay free to quote (and to be drafted)
    "greedy, repetition 1.2 (reply)": {"repetition_penalty": 1.2, "repetition_penalty_scope": RepetitionScope.REPLY},
    "greedy, frequency 0.5": {"frequency_penalty": 0.5},
    # the output-only penalties (frequency, presence) leave the prompt's words, and so suffix drafts, unpenalised
    "greedy, frequency 1.0": {"frequency_penalty": 1.0},
    "greedy, presence 0.5": {"presence_penalty": 0.5},
    "greedy, frequency 0.3, presence 0.3": {"frequency_penalty": 0.3, "presence_penalty": 0.3},
    "greedy, repetition 1.1, frequency 0.3": {"repetition_penalty": 1.1, "frequency_penalty": 0.3},
    "greedy, repetition 1.2, frequency 0.3": {"repetition_penalty": 1.2, "frequency_penalty": 0.3},
    "t 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "t 0.7, top_p 0.9, repetition 1.1": {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1},
}


@dataclass(frozen=True, slots=True)
class DevTurn:
    messages: list[dict[str, str]]
    reference: str  # the recorded agent reply


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def repeats_4gram(text: str, times: int = 2) -> bool:
    """Whether some word 4-gram occurs ``times`` times or more in ``text``."""
    w = words(text)
    grams = Counter(tuple(w[i : i + 4]) for i in range(len(w) - 3))
    return any(n >= times for n in grams.values())


def grams4(text: str) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i : i + 4]) for i in range(len(w) - 3)}


def quotes_prompt(reply: str, system: str) -> bool:
    """Whether ``reply`` contains some word 4-gram of the system prompt (the handbook excerpt)."""
    return not grams4(reply).isdisjoint(grams4(system))


def overlap_f1(reply: str, reference: str) -> float:
    """Word-overlap F1 (SQuAD's): the shared words counted with multiplicity."""
    a, b = Counter(words(reply)), Counter(words(reference))
    common = sum((a & b).values())
    if common == 0:
        return 0.0
    precision, recall = common / sum(a.values()), common / sum(b.values())
    return 2 * precision * recall / (precision + recall)


def dev_turns(data: Path, guidelines: Path, n: int, seed: int, policy_chars: int) -> list[DevTurn]:
    conversations = load_conversations(data)[-HELD_OUT:]
    system = system_prompt(0, render_policy(load_guidelines(guidelines), 0, seed, policy_chars))
    rng = random.Random(seed)
    turns = []
    for conversation in conversations[:n]:
        k = rng.randrange(len(conversation.pairs))
        messages = [{"role": "system", "content": system}]
        for user, agent in conversation.pairs[:k]:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": agent}]
        messages.append({"role": "user", "content": conversation.pairs[k][0]})
        turns.append(DevTurn(messages, conversation.pairs[k][1]))
    return turns


def fitted(engine: LLMEngine, turn: DevTurn, max_tokens: int) -> DevTurn:
    """The turn with its oldest history pairs dropped until it fits the model's context with a full reply."""
    messages = turn.messages
    while len(messages) > 2 and len(engine.tokenize(messages)) + max_tokens > engine.prompt_limit:
        messages = [messages[0], *messages[3:]]
    return DevTurn(messages, turn.reference)


def answer(engine: LLMEngine, turns: list[DevTurn], fields: dict[str, Any], max_tokens: int) -> list[RequestFinished]:
    collect = Collector()
    ids = []
    for i, turn in enumerate(turns):
        seeded: dict[str, Any] = {"seed": i} if fields.get("temperature") else {}
        params = SamplingParams(max_tokens=max_tokens, **(fields | seeded))
        ids.append(engine.submit(turn.messages, params, "bench", collect))
    engine.run_until_idle()
    return collect.results(ids)


def score(turns: list[DevTurn], results: list[RequestFinished]) -> dict[str, Any]:
    n = len(results)
    looping = [repeats_4gram(r.text) for r in results]
    return {
        "replies": n,
        "repetition_rate": sum(looping) / n,
        "thrice_rate": sum(repeats_4gram(r.text, 3) for r in results) / n,
        "cut_at_max_tokens_rate": sum(r.finish_reason is FinishReason.LENGTH for r in results) / n,
        "mean_words": statistics.fmean(len(words(r.text)) for r in results),
        "overlap_f1": statistics.fmean(overlap_f1(r.text, t.reference) for t, r in zip(turns, results, strict=True)),
        "handbook_quote_rate": statistics.fmean(
            quotes_prompt(r.text, t.messages[0]["content"]) for t, r in zip(turns, results, strict=True)
        ),
        "looping_examples": [r.text[:300] for r, loop in zip(results, looping, strict=True) if loop][:3],
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2, a safetensors folder or a .gguf file")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--data", type=Path, default=CONVERSATIONS)
    p.add_argument("--guidelines", type=Path, default=GUIDELINES)
    p.add_argument("--turns", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy-chars", type=int, default=DEFAULT_POLICY_CHARS, help="the handbook excerpt's size")
    p.add_argument("--candidates", nargs="*", default=list(CANDIDATES), choices=list(CANDIDATES))
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    given = sys.argv[1:] if argv is None else list(argv)

    config = EngineConfig(model=args.model, dtype=args.dtype, device="cpu", max_kv_memory_mb=2048, max_num_seqs=32)
    engine = LLMEngine(config)
    info = engine.load()
    turns = dev_turns(args.data, args.guidelines, args.turns, args.seed, args.policy_chars)
    turns = [fitted(engine, t, args.max_tokens) for t in turns]
    results: dict[str, dict[str, Any]] = {}
    for name in args.candidates:
        started = time.perf_counter()
        replies = answer(engine, turns, CANDIDATES[name], args.max_tokens)
        results[name] = {"settings": CANDIDATES[name], **score(turns, replies)}
        results[name]["seconds"] = time.perf_counter() - started
        print(f"{name}: {results[name]['repetition_rate']:.1%} ({results[name]['seconds']:.0f}s)", file=sys.stderr)
    rows = [
        [
            *(name, f"{r['repetition_rate']:.1%}", f"{r['thrice_rate']:.1%}", f"{r['cut_at_max_tokens_rate']:.1%}"),
            *(round(r["mean_words"], 1), round(r["overlap_f1"], 3), f"{r['handbook_quote_rate']:.1%}"),
        ]
        for name, r in results.items()
    ]
    headers = ["settings", "4-gram repeated", "4-gram 3 times", "cut at max_tokens", "words", "F1 vs agent"]
    headers.append("quotes handbook")
    print(format_table(headers, rows))
    payload = {
        "name": "reply_repetition",
        "command": "flock /tmp/kvchat-bench.lock " + reproduce_command("bench.reply_repetition", given),
        "machine": machine_info(dtype=info.dtype),
        "model": args.model,
        "turns": len(turns),
        "max_tokens": args.max_tokens,
        "mean_prompt_messages": statistics.fmean(len(t.messages) for t in turns),
        "results": results,
    }
    print(f"wrote {write_json(args.out, payload)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
