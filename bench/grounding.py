"""Grounded answers: what each way of giving the model the tenant's handbook costs and buys.

The tenant's handbook is ABCD's agent guidelines (55 sections, one per subflow; the dev split of
``bench/data/handbook_requests.jsonl`` as their example questions). Sessions are held-out CuCom conversations (the
second half of the file), replayed turn by turn through the context layer as the chat serves them, one session after
another on one engine with its prefix cache. At each agent turn every condition builds its prompt:

- ``none``: the system prompt alone;
- ``excerpt``: the system prompt with today's fixed 4,200-character handbook excerpt (``bench.workload``);
- ``sections``: the system prompt, then the section(s) the context layer chose for the topic (``backend/context``);
- ``whole``: the system prompt with every section (over the model's context: its tokens are reported, no more).

Reported per condition: prompt tokens and TTFT per turn (a greedy reply of ``--max-tokens``); the handbook tokens
prefilled against those served from the cache (``sections``: a section costs its prefill once per tenant, not per
session); the mean NLL per token of the reference agent reply, teacher-forced; and the share of generated replies
holding a URL, e-mail address or phone number that none of the grounding sources has (system prompt, handbook,
customer messages), with the contact guard off and on (``backend/context/contact_guard.py``). Then the section
choice's top-1 flow and subflow accuracy on the labelled requests, per ranking part, on the dev and held-out split,
and what choosing costs: a ranking, encoding a new request, and a turn's whole choice in the replay (``choose`` over
the epoch's customer messages, as the chat runs it at each customer message).

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.grounding
    .venv/bin/python -m bench.grounding --sessions 1 --turns 2 --model <folder>     # a smoke run

Output: tables on stdout, ``docs/benchmarks/grounding.json``. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from backend.context.builder import HANDBOOK_SECTION, ContextRequest, HistoryMessage, build_context
from backend.context.contact_guard import guarded
from backend.context.contacts import find_contacts
from backend.context.grounding import Grounding
from backend.context.handbook import HandbookFormat, Section, parse
from backend.context.rules import DEFAULT_RULES, RuleSet
from backend.context.sections import ChoiceSettings, SectionIndex, choose
from backend.context.similarity import MiniLMSimilarity
from backend.context.topic import TopicSettings, TopicTracker, identifier_keys
from backend.domain import HistoryPolicy, MessageRole
from backend.engine_client.values import SegmentedPrompt
from backend.services.shared_scorer import shared_scorer
from bench.datasets import CONVERSATIONS, DATA_DIR, GUIDELINES, DataNotFoundError, read_text, resolve
from bench.workload import render_policy, system_prompt
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
REQUESTS = DATA_DIR / "handbook_requests.jsonl"
DEFAULT_OUT = REPO / "docs" / "benchmarks" / "grounding.json"
CONDITIONS = ("none", "excerpt", "sections", "whole")
EXCERPT_CHARS = 4200
FOLDS = 10  # the dev split's folds for the section choice (see section_accuracy)
COMMAND = "flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.grounding"


@dataclass(slots=True)
class Tally:
    """One condition's figures over every scored turn."""

    prompt_tokens: list[int] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
    handbook_tokens: int = 0  # handbook tokens in the prompts (sections only)
    handbook_cached: int = 0  # of those, served from the prefix cache
    replies: int = 0
    invented_off: int = 0  # replies with a contact no source holds, as the model wrote them
    invented_on: int = 0  # the same replies after the guard
    blocked: int = 0
    over_context: int = 0  # turns whose prompt does not fit the model


@dataclass(frozen=True, slots=True)
class Turn:
    role: MessageRole
    text: str


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for path in (args.data, args.guidelines, args.requests):
        try:
            resolve(path)
        except DataNotFoundError as exc:
            print(f"error: {exc} (the vendored data lives in bench/data/)", file=sys.stderr)
            return 1
    guidelines = read_text(args.guidelines)
    requests = [json.loads(line) for line in read_text(args.requests).splitlines() if line.strip()]
    sections = with_examples(parse(guidelines, HandbookFormat.ABCD), requests)
    embedder = MiniLMSimilarity()
    started = time.monotonic()
    index = SectionIndex(sections, embedder)
    _progress(f"handbook: {len(sections)} sections indexed in {time.monotonic() - started:.1f}s")
    choice = section_accuracy(sections, requests, embedder)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device="cpu", max_kv_memory_mb=1024))
    info = engine.load()
    _progress(f"model {args.model}: {info.dtype}, context {info.max_model_len}")
    excerpt = render_policy(json.loads(guidelines), 0, seed=0, max_chars=EXCERPT_CHARS)
    tallies = {c: Tally() for c in CONDITIONS}
    selection_ms: list[float] = []
    sessions = load_sessions(args.data, args.sessions, args.turns)
    for n, turns in enumerate(sessions, 1):
        replay(engine, index, sections, excerpt, turns, tallies, selection_ms, args)
        _progress(f"session {n}/{len(sessions)} ({time.monotonic() - started:.0f}s)")
    choice["cost"] |= _selection_summary(selection_ms)
    result = _result(args, info.dtype, info.max_model_len, tallies, choice, len(sessions))
    print(_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    _progress(f"wrote {args.out}")
    return 0


def with_examples(sections: list[Section], requests: list[dict[str, Any]]) -> list[Section]:
    """The handbook as a tenant would load it: each section with the dev split's requests for it as examples."""
    examples: dict[str, list[str]] = {}
    for r in requests:
        if r["split"] == "dev":
            examples.setdefault(f"{r['flow']}: {r['subflow']}", []).append(r["text"])
    return [replace(s, examples=tuple(examples.get(s.title, ()))) for s in sections]


def load_sessions(data: Path, n: int, turns: int) -> list[list[Turn]]:
    """Up to ``n`` held-out conversations (the file's second half), each cut after its ``turns``-th agent reply."""
    lines = [line for line in read_text(data).splitlines() if line.strip()]
    sessions = []
    for line in lines[len(lines) // 2 :][:n]:
        out: list[Turn] = []
        replies = 0
        for t in json.loads(line)["turns"]:
            role = MessageRole.USER if t["role"].lower() == "user" else MessageRole.ASSISTANT
            if not out and role is MessageRole.ASSISTANT:
                continue  # NOTE: a prompt starts with the customer
            out.append(Turn(role, t["content"]))
            replies += role is MessageRole.ASSISTANT
            if replies == turns:
                break
        sessions.append(out)
    return sessions


def replay(
    engine: LLMEngine,
    index: SectionIndex,
    sections: Sequence[Section],
    excerpt: str,
    turns: Sequence[Turn],
    tallies: dict[str, Tally],
    selection_ms: list[float],
    args: argparse.Namespace,
) -> None:
    """One session: at each agent turn, every condition's prompt, reply, NLL and contacts; and how long choosing
    the sections took (``selection_ms``: the epoch replayed as the chat does it, earlier queries' vectors cached)."""
    rules = RuleSet.compile(DEFAULT_RULES)
    settings = TopicSettings()
    tracker = TopicTracker(settings, shared_scorer(settings.backend), identifier_keys(rules))
    history: list[HistoryMessage] = []
    epoch_messages: list[str] = []
    head = system_prompt(0, "")
    whole = tuple(s.rendered() for s in sections)
    for seq, turn in enumerate(turns, 1):
        if turn.role is MessageRole.USER:
            update = tracker.observe_customer(turn.text)
            epoch_messages = [turn.text] if update.shift else [*epoch_messages, turn.text]
        elif history:
            started = time.perf_counter()
            picked = choose(index, epoch_messages, ChoiceSettings())
            selection_ms.append(1000 * (time.perf_counter() - started))
            chosen = tuple(sections[i].rendered() for i in picked)
            customer = tuple(m.content for m in history if m.role is MessageRole.USER)
            systems = {
                "none": (head, ()),
                "excerpt": (system_prompt(0, excerpt), ()),
                "sections": (head, chosen),
                "whole": (head, whole),
            }
            for condition, (system, shown) in systems.items():
                grounding = Grounding((system, *shown, *customer))
                score_turn(engine, system, shown, history, turn.text, grounding, tallies[condition], args)
        if turn.role is MessageRole.ASSISTANT:
            tracker.observe_context(turn.text)
        history.append(HistoryMessage(seq, turn.role, turn.text, 0))


def score_turn(
    engine: LLMEngine,
    system: str,
    sections: tuple[str, ...],
    history: Sequence[HistoryMessage],
    reference: str,
    grounding: Grounding,
    tally: Tally,
    args: argparse.Namespace,
) -> None:
    """Build the prompt as the chat does; generate the reply (TTFT, contacts) and score the reference (NLL)."""
    request = ContextRequest(
        system_prompt=system,
        history=tuple(history),
        current_epoch=0,
        policy=HistoryPolicy.FULL,
        budget_tokens=1 << 30,  # NOTE: nothing is dropped: a prompt over the model's context is reported as such
        sections=sections,
    )
    built = build_context(request, lambda p: len(engine.tokenize(p)))
    tally.prompt_tokens.append(built.tokens)
    reference_tokens = len(engine.tokenizer.encode(reference, add_special_tokens=False))
    if built.tokens + max(args.max_tokens, reference_tokens) + 8 > engine.info.max_model_len:
        tally.over_context += 1
        return
    [reply] = engine.generate_sync([built.prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0))
    stats = reply.stats
    tally.ttft_ms.append(1000 * stats.ttft_s)
    tally.handbook_tokens += stats.prompt_tokens_by_type.get(HANDBOOK_SECTION, 0)
    tally.handbook_cached += stats.cached_tokens_by_type.get(HANDBOOK_SECTION, 0)
    tally.replies += 1
    tally.invented_off += invents(reply.text, grounding)
    shown = guarded(reply.text, grounding)
    tally.invented_on += invents(shown, grounding)
    tally.blocked += shown != reply.text
    tally.nll.append(reference_nll(engine, built.prompt, reference))


def invents(text: str, grounding: Grounding) -> bool:
    """Whether ``text`` holds a URL, e-mail or phone number that no grounding text holds (by normal form)."""
    known = {c.normal for source in grounding.texts for c in find_contacts(source)}
    return any(c.normal not in known for c in find_contacts(text))


def reference_nll(engine: LLMEngine, prompt: SegmentedPrompt, reply: str) -> float:
    """The mean NLL per token of ``reply`` after ``prompt`` (teacher-forced, with prompt log-probabilities)."""
    messages = prompt.as_messages()
    prefix = engine.tokenize(prompt)
    full = engine.tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": reply}], add_generation_prompt=False
    )
    empty = engine.tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": ""}], add_generation_prompt=False
    )
    n_reply = len(full) - len(empty)
    if full[: len(prefix)] != prefix or n_reply < 1:
        raise RuntimeError("the chat template does not extend the prompt with the reply; cannot score it")
    [done] = engine.generate_sync([full], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True))
    if done.prompt_logprobs is None:
        raise RuntimeError("the engine returned no prompt log-probabilities")
    logprobs = [lp for lp in done.prompt_logprobs[len(prefix) : len(prefix) + n_reply] if lp is not None]
    return -statistics.fmean(logprobs)


# ---------------------------------------------------------------------------------------------------- section choice


def section_accuracy(
    sections: Sequence[Section], requests: Sequence[dict[str, Any]], embedder: MiniLMSimilarity
) -> dict[str, Any]:
    """Top-1 flow and subflow accuracy of each ranking part and the mix, per split; and what a ranking costs.

    NOTE: the examples are the dev split's requests, so a dev request must be ranked by a handbook without its own
    example: the dev split is cut in ``FOLDS`` folds, and each fold's requests are ranked by an index built without
    that fold's examples (the group classifier, fitted on the examples, never sees them either). Held-out requests
    never serve as examples.
    """
    plain = SectionIndex([replace(s, examples=()) for s in sections], embedder)
    default = ChoiceSettings()
    methods: dict[str, tuple[float, float, float]] = {
        "bm25": (1.0, 0.0, 0.0),
        "head vectors": (0.0, 0.0, 0.0),
        "bm25 + head vectors": (default.bm25_weight, 0.0, 0.0),
        "bm25 + head vectors + examples": (default.bm25_weight, default.example_weight, 0.0),
        "+ group classifier (the default)": (default.bm25_weight, default.example_weight, default.group_weight),
    }
    dev = [r for r in requests if r["split"] == "dev"]
    fold_of = {r["text"]: n % FOLDS for n, r in enumerate(dev)}
    folds = [
        SectionIndex(_without(sections, {t for t, k in fold_of.items() if k == f}), embedder) for f in range(FOLDS)
    ]
    started = time.monotonic()
    full = SectionIndex(sections, embedder)
    build_s = time.monotonic() - started
    out: dict[str, Any] = {}
    for name, weights in methods.items():
        out[name] = {}
        for split in ("dev", "held_out"):
            rows = [r for r in requests if r["split"] == split]
            flow = subflow = 0
            for r in rows:
                index = plain
                if weights[1] or weights[2]:
                    index = folds[fold_of[r["text"]]] if split == "dev" else full
                top = sections[index.ranked(r["text"], *weights)[0].index].title
                flow += top.split(": ")[0] == r["flow"]
                subflow += top == f"{r['flow']}: {r['subflow']}"
            n = max(len(rows), 1)
            out[name][split] = {"requests": len(rows), "flow": flow / n, "subflow": subflow / n}
    return {"methods": out, "folds": FOLDS, "cost": _ranking_cost(full, embedder, requests, default, build_s)}


def _ranking_cost(
    index: SectionIndex,
    embedder: MiniLMSimilarity,
    requests: Sequence[dict[str, Any]],
    settings: ChoiceSettings,
    build_s: float,
) -> dict[str, float]:
    """Milliseconds per request: the ranking with the query's vector at hand, and encoding a new query (the part a
    customer's first message pays once; the next turns' queries grow and are encoded again)."""
    texts = [r["text"] for r in requests if r["split"] == "held_out"]
    weights = (settings.bm25_weight, settings.example_weight, settings.group_weight)
    started = time.perf_counter()
    for text in texts:
        index.ranked(text, *weights)  # NOTE: every vector was cached by the accuracy pass
    ranked_ms = 1000 * (time.perf_counter() - started) / len(texts)
    encoder = MiniLMSimilarity(embedder.encoder)  # NOTE: an empty cache over the same model
    started = time.perf_counter()
    for text in texts:
        encoder.embed([text])
    encode_ms = 1000 * (time.perf_counter() - started) / len(texts)
    return {"index_build_s": build_s, "rank_ms": ranked_ms, "encode_query_ms": encode_ms}


def _selection_summary(ms: Sequence[float]) -> dict[str, float | int | None]:
    """A turn's section choice in the replay: p50, p90 and the worst, in milliseconds."""
    ordered = sorted(ms)

    def at(q: float) -> float | None:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None

    return {
        "selection_turns": len(ordered),
        "selection_ms_p50": at(0.5),
        "selection_ms_p90": at(0.9),
        "selection_ms_max": at(1.0),
    }


def _without(sections: Sequence[Section], texts: set[str]) -> list[Section]:
    return [replace(s, examples=tuple(e for e in s.examples if e not in texts)) for s in sections]


# ---------------------------------------------------------------------------------------------------- output


def _result(
    args: argparse.Namespace,
    dtype: str,
    context: int,
    tallies: dict[str, Tally],
    choice: dict[str, Any],
    sessions: int,
) -> dict[str, Any]:
    def summary(t: Tally) -> dict[str, Any]:
        return {
            "turns": len(t.prompt_tokens),
            "prompt_tokens_mean": statistics.fmean(t.prompt_tokens) if t.prompt_tokens else None,
            "over_context": t.over_context,
            "ttft_ms_p50": statistics.median(t.ttft_ms) if t.ttft_ms else None,
            "ttft_ms_mean": statistics.fmean(t.ttft_ms) if t.ttft_ms else None,
            "nll_mean": statistics.fmean(t.nll) if t.nll else None,
            "handbook_tokens": t.handbook_tokens,
            "handbook_cached": t.handbook_cached,
            "replies": t.replies,
            "invented_guard_off": t.invented_off / t.replies if t.replies else None,
            "invented_guard_on": t.invented_on / t.replies if t.replies else None,
            "replies_changed_by_guard": t.blocked,
        }

    return {
        "command": f"{COMMAND} " + " ".join(sys.argv[1:]),
        "model": args.model,
        "dtype": dtype,
        "context_tokens": context,
        "sessions": sessions,
        "agent_turns_per_session": args.turns,
        "max_tokens": args.max_tokens,
        "conditions": {c: summary(t) for c, t in tallies.items()},
        "section_choice": choice,
        "targets": {"invented_guard_on": 0.0, "held_out_flow_accuracy": 0.85},
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['sessions']} held-out sessions, {result['agent_turns_per_session']} agent turns each, "
        f"{result['model']} {result['dtype']}, context {result['context_tokens']}",
        "| condition | turns | prompt tokens | TTFT p50 ms | NLL/token | handbook tokens cached | "
        "invented (guard off) | invented (guard on) | over context |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in result["conditions"].items():
        cached = f"{c['handbook_cached']}/{c['handbook_tokens']}" if c["handbook_tokens"] else "-"
        lines.append(
            f"| {name} | {c['turns']} | {_fmt(c['prompt_tokens_mean'], '.0f')} | {_fmt(c['ttft_ms_p50'], '.1f')} | "
            f"{_fmt(c['nll_mean'], '.4f')} | {cached} | {_fmt(c['invented_guard_off'], '.1%')} | "
            f"{_fmt(c['invented_guard_on'], '.1%')} | {c['over_context']} |"
        )
    lines += [
        "",
        "| section choice | dev flow | dev subflow | held-out flow | held-out subflow |",
        "|---|---|---|---|---|",
    ]
    for name, s in result["section_choice"]["methods"].items():
        lines.append(
            f"| {name} | {s['dev']['flow']:.1%} | {s['dev']['subflow']:.1%} | {s['held_out']['flow']:.1%} | "
            f"{s['held_out']['subflow']:.1%} |"
        )
    cost = result["section_choice"]["cost"]
    lines += [
        "",
        f"handbook index built in {cost['index_build_s']:.1f} s; ranking {cost['rank_ms']:.2f} ms per request with "
        f"its vector at hand, encoding a new request {cost['encode_query_ms']:.1f} ms",
        f"a turn's section choice in the replay ({cost['selection_turns']} turns): p50 "
        f"{_fmt(cost['selection_ms_p50'], '.1f')} ms, p90 {_fmt(cost['selection_ms_p90'], '.1f')} ms, worst "
        f"{_fmt(cost['selection_ms_max'], '.1f')} ms",
    ]
    return "\n".join(lines) + f"\n\ncommand: {result['command']}"


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.grounding", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--data", type=Path, default=CONVERSATIONS, help="CuCom conversations; the second half is used")
    p.add_argument("--guidelines", type=Path, default=GUIDELINES, help="the ABCD agent handbook (json)")
    p.add_argument("--requests", type=Path, default=REQUESTS, help="labelled customer requests (jsonl)")
    p.add_argument("--model", default="smollm2", help="smollm2, a safetensors folder or a .gguf file")
    p.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU has it), float32 or bfloat16")
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=4, help="agent turns scored per session")
    p.add_argument("--max-tokens", type=int, default=48, help="the greedy reply's length")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


if __name__ == "__main__":
    sys.exit(main())
