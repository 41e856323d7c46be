"""Context quality: how much each history policy costs the model, measured on real agent replies.

Sessions are the shared policy text (an ABCD handbook excerpt in the system prompt) plus consecutive CuCom
conversations of the held-out half of the file (its second half), spliced back to back: each splice is a topic
change. Each session is replayed through the context layer as the chat service runs it: every message is split into
blocks and the customer's messages move the topic (the default scorer, ``backend/context``). The last
``--score-per-conversation`` agent replies of every conversation are scored, so a topic the context wrongly dropped
costs NLL in every epoch: at each, every row below builds its prompt, the real reply is appended, and the engine
scores it with prompt log-probabilities (the numerics that serve). Rows:

- ``full``: every turn;
- ``epoch`` (the default policy, as it serves): the detected current topic, and the blocks of earlier topics it
  still refers to (``CarryMode.REFERENCED``);
- ``epoch-typed``: the same epochs, every identifier and clause block of earlier topics carried (``TYPED``);
- ``oracle``: the ``epoch`` policy on the true seams, so the gap that detection leaves is visible;
- ``budget``: the oldest turns dropped past ``--budget`` tokens.

Reported per row, for the sessions as they are (``plain``) and with every token that holds a digit removed
(``masked``, so identifiers cannot find the seams): the mean NLL per reply token and the mean prompt tokens,
relative to ``full``. The default configuration is the one docs/benchmarks.md reports:

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.context_quality
    .venv/bin/python -m bench.context_quality --sessions 1 --variants plain --model <folder>     # a smoke run

Output: a table on stdout, ``docs/benchmarks/context_quality.json``. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend.context.blocks import Block
from backend.context.builder import CarryMode, ContextRequest, HistoryMessage, build_context
from backend.context.rules import DEFAULT_RULES, RuleSet
from backend.context.splitter import Splitter
from backend.context.topic import TopicSettings, TopicTracker, identifier_keys
from backend.domain import HistoryPolicy, MessageRole
from backend.services.shared_scorer import shared_scorer
from bench.datasets import CONVERSATIONS, GUIDELINES, DataNotFoundError, read_text, resolve
from bench.shift_sets import mask_digits
from bench.workload import render_policy, system_prompt
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = CONVERSATIONS
DEFAULT_GUIDELINES = GUIDELINES
DEFAULT_OUT = REPO / "docs" / "benchmarks" / "context_quality.json"
VARIANTS = ("plain", "masked")


@dataclass(frozen=True, slots=True)
class Row:
    """One way to build the prompt: a policy, what it carries, and whose epochs it reads (detected or true)."""

    name: str
    policy: HistoryPolicy
    carry: CarryMode = CarryMode.REFERENCED
    oracle: bool = False


ROWS = (
    Row("full", HistoryPolicy.FULL),
    Row("epoch", HistoryPolicy.EPOCH),
    Row("epoch-typed", HistoryPolicy.EPOCH, CarryMode.TYPED),
    Row("oracle", HistoryPolicy.EPOCH, oracle=True),
    Row("budget", HistoryPolicy.BUDGET),
)


@dataclass(frozen=True, slots=True)
class Turn:
    role: MessageRole
    text: str
    conversation: int  # which of the session's spliced conversations (the true topic)


@dataclass(slots=True)
class Score:
    nll: list[float] = field(default_factory=list)  # per scored reply: mean NLL per token
    prompt_tokens: list[int] = field(default_factory=list)

    def add(self, other: Score) -> None:
        self.nll += other.nll
        self.prompt_tokens += other.prompt_tokens


@dataclass(slots=True)
class _History:
    """A session's history as one row's splitter sees it (its epochs decide the blocks' parents)."""

    messages: list[HistoryMessage] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)

    def add(self, splitter: Splitter, seq: int, turn: Turn, epoch: int) -> None:
        split = splitter.split(turn.text, seq=seq, epoch=epoch, history=self.blocks)
        self.blocks += split
        self.messages.append(HistoryMessage(seq, turn.role, turn.text, epoch, tuple(split)))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for path in (args.data, args.guidelines):
        try:
            resolve(path)
        except DataNotFoundError as exc:
            print(f"error: {exc} (the vendored data lives in bench/data/)", file=sys.stderr)
            return 1
    sessions = load_sessions(args.data, args.sessions, args.conversations_per_session)
    if not sessions:
        print(
            f"error: {args.data} has no held-out session of {args.conversations_per_session} conversations",
            file=sys.stderr,
        )
        return 1
    guidelines = json.loads(read_text(args.guidelines))
    system = system_prompt(0, render_policy(guidelines, 0, seed=0, max_chars=args.policy_chars))
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device="cpu", max_kv_memory_mb=1024))
    info = engine.load()
    print(f"model {args.model}: {info.dtype}, context {info.max_model_len}", file=sys.stderr)
    started = time.monotonic()
    scores = {v: {row.name: Score() for row in ROWS} for v in args.variants.split(",")}
    for variant, by_row in scores.items():
        for i, turns in enumerate(sessions):
            replayed = (
                [Turn(t.role, mask_digits(t.text), t.conversation) for t in turns] if variant == "masked" else turns
            )
            for name, score in score_session(engine, system, replayed, args).items():
                by_row[name].add(score)
            print(f"{variant} session {i + 1}/{len(sessions)} ({time.monotonic() - started:.0f}s)", file=sys.stderr)
    result = _result(args, scores, len(sessions))
    print(_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def load_sessions(data: Path, n: int, per_session: int) -> list[list[Turn]]:
    """Up to ``n`` sessions, each ``per_session`` consecutive conversations of the file's held-out (second) half."""
    lines = [line for line in read_text(data).splitlines() if line.strip()]
    conversations = [json.loads(line)["turns"] for line in lines[len(lines) // 2 :]]
    sessions = []
    for i in range(min(n, len(conversations) // per_session)):
        turns: list[Turn] = []
        for k, conv in enumerate(conversations[i * per_session : (i + 1) * per_session]):
            for t in conv:
                role = MessageRole.USER if t["role"].lower() == "user" else MessageRole.ASSISTANT
                turns.append(Turn(role, t["content"], k))
        sessions.append(turns)
    return sessions


def scored_replies(turns: Sequence[Turn], per_conversation: int) -> set[int]:
    """The indices of the last ``per_conversation`` agent replies of each conversation (never a session's first)."""
    scored: set[int] = set()
    for k in {t.conversation for t in turns}:
        replies = [i for i, t in enumerate(turns) if t.conversation == k and t.role is MessageRole.ASSISTANT and i > 0]
        scored |= set(replies[-per_conversation:])
    return scored


def score_session(engine: LLMEngine, system: str, turns: list[Turn], args: argparse.Namespace) -> dict[str, Score]:
    """Replay one session through the context layer; score its chosen agent replies under every row."""
    rules = RuleSet.compile(DEFAULT_RULES)
    identify = identifier_keys(rules)
    settings = TopicSettings()
    tracker = TopicTracker(settings, shared_scorer(settings.backend), identify)
    splitter = Splitter(rules, lambda text: len(engine.tokenizer.encode(text, add_special_tokens=False)))
    detected, oracle = _History(), _History()
    scored = scored_replies(turns, args.score_per_conversation)
    out = {row.name: Score() for row in ROWS}
    epoch = 0
    for i, turn in enumerate(turns):
        seq = i + 1
        if turn.role is MessageRole.USER:
            epoch = tracker.observe_customer(turn.text).epoch
        elif i in scored and detected.messages and detected.messages[0].role is MessageRole.USER:
            for row in ROWS:
                history = oracle if row.oracle else detected
                current = turn.conversation if row.oracle else epoch
                nll, tokens = score_reply(engine, system, history.messages, current, row, turn.text, identify, args)
                out[row.name].nll.append(nll)
                out[row.name].prompt_tokens.append(tokens)
        if turn.role is MessageRole.ASSISTANT:
            tracker.observe_context(turn.text)
        detected.add(splitter, seq, turn, epoch)
        oracle.add(splitter, seq, turn, turn.conversation)
    return out


def score_reply(
    engine: LLMEngine,
    system: str,
    history: Sequence[HistoryMessage],
    epoch: int,
    row: Row,
    reply: str,
    identify: Any,
    args: argparse.Namespace,
) -> tuple[float, int]:
    """The mean NLL per token of ``reply`` after the context ``row`` builds, and that context's prompt tokens."""
    request = ContextRequest(
        system_prompt=system,
        history=tuple(history),
        current_epoch=epoch,
        policy=row.policy,
        # NOTE: the reply is scored inside the same request, so its tokens (and the end marker) need room too
        budget_tokens=min(engine.info.max_model_len, engine.info.num_blocks * engine.info.block_size)
        - len(engine.tokenizer.encode(reply, add_special_tokens=False))
        - args.reply_room,
        policy_budget_tokens=args.budget,
        carry=row.carry,
        identify=identify,
    )
    built = build_context(request, lambda p: len(engine.tokenize(p)))
    if not built.fits:
        raise RuntimeError(f"even the smallest context ({built.tokens} tokens) does not fit: lower --policy-chars")
    messages = built.prompt.as_messages()
    prefix = engine.tokenize(built.prompt)
    with_reply = [*messages, {"role": "assistant", "content": reply}]
    without_reply = [*messages, {"role": "assistant", "content": ""}]
    full = engine.tokenizer.apply_chat_template(with_reply, add_generation_prompt=False)
    empty = engine.tokenizer.apply_chat_template(without_reply, add_generation_prompt=False)
    n_reply = len(full) - len(empty)
    if full[: len(prefix)] != prefix or n_reply < 1:
        raise RuntimeError("the chat template does not extend the prompt with the reply; cannot score it")
    [done] = engine.generate_sync([full], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True))
    if done.prompt_logprobs is None:
        raise RuntimeError("the engine returned no prompt log-probabilities")
    logprobs = [lp for lp in done.prompt_logprobs[len(prefix) : len(prefix) + n_reply] if lp is not None]
    return -statistics.fmean(logprobs), len(prefix)


def _result(args: argparse.Namespace, scores: dict[str, dict[str, Score]], sessions: int) -> dict[str, Any]:
    def block(by_row: dict[str, Score]) -> dict[str, Any]:
        full = by_row["full"]
        if not full.nll:
            return {}
        full_nll, full_tokens = statistics.fmean(full.nll), statistics.fmean(full.prompt_tokens)
        rows = {}
        for name, score in by_row.items():
            nll, tokens = statistics.fmean(score.nll), statistics.fmean(score.prompt_tokens)
            rows[name] = {
                "nll": nll,
                "prompt_tokens": tokens,
                "replies": len(score.nll),
                "nll_vs_full_pct": 100 * (nll / full_nll - 1),
                "tokens_vs_full": tokens / full_tokens,
            }
        return rows

    return {
        "command": "flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.context_quality " + " ".join(sys.argv[1:]),
        "model": args.model,
        "dtype": args.dtype,
        "data": Path(args.data).name,
        "sessions": sessions,
        "conversations_per_session": args.conversations_per_session,
        "scored_replies_per_conversation": args.score_per_conversation,
        "budget_policy_tokens": args.budget,
        "default_scorer": TopicSettings().backend,
        "rows": {
            row.name: {"policy": row.policy.value, "carry": row.carry.value, "oracle": row.oracle} for row in ROWS
        },
        "results": {variant: block(by_row) for variant, by_row in scores.items()},
        "targets": {"nll_vs_full_pct_max": 3.0, "tokens_vs_full_max": 0.70, "row": "epoch"},
    }


def _table(result: dict[str, Any]) -> str:
    lines = []
    for variant, rows in result["results"].items():
        if not rows:
            continue
        lines += [
            f"\n{variant} ({result['sessions']} sessions of {result['conversations_per_session']} conversations)",
            "| row | replies | NLL/token | vs full | prompt tokens | vs full |",
            "|---|---|---|---|---|---|",
        ]
        for name, r in rows.items():
            lines.append(
                f"| {name} | {r['replies']} | {r['nll']:.4f} | {r['nll_vs_full_pct']:+.2f} % | "
                f"{r['prompt_tokens']:.0f} | {r['tokens_vs_full']:.2f} |"
            )
    return "\n".join(lines) + f"\n\ncommand: {result['command']}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.context_quality", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help="CuCom conversations (jsonl); the second half is used"
    )
    p.add_argument("--guidelines", type=Path, default=DEFAULT_GUIDELINES, help="the ABCD agent handbook (json)")
    p.add_argument("--model", default="smollm2", help="smollm2, a safetensors folder or a .gguf file")
    p.add_argument("--dtype", default="float32", help="float32 (exact scores) or bfloat16")
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--conversations-per-session", type=int, default=3, help="spliced back to back (topic changes)")
    p.add_argument("--score-per-conversation", type=int, default=1, help="agent replies scored per conversation")
    p.add_argument("--variants", default=",".join(VARIANTS), help="plain, masked (digit-bearing tokens removed)")
    p.add_argument("--budget", type=int, default=1024, help="the budget policy's own token limit")
    p.add_argument("--policy-chars", type=int, default=3000, help="the handbook excerpt in the system prompt")
    p.add_argument("--reply-room", type=int, default=16, help="tokens kept free beside the reply (its markers)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


if __name__ == "__main__":
    sys.exit(main())
