"""Context quality: how much each history policy costs the model, measured on real agent replies.

Sessions are made of the shared policy text (an ABCD handbook excerpt in the system prompt) plus real CuCom
conversations spliced back to back (the splice is a topic change). Each session is replayed through the context
layer exactly as the chat service runs it: every message is split into blocks and the customer's moves the topic
(``backend/context``). At each scored agent turn, the context builder makes the prompt under each policy (``full``,
``epoch``, ``budget``), the real agent reply is appended, and the engine scores it with prompt log-probabilities
(the numerics that serve). Reported per policy: the mean negative log-likelihood per reply token, relative to
``full``, and the prompt tokens used, over all scored turns and over the long sessions.

    .venv/bin/python -m bench.context_quality                  # 12 sessions, SmolLM2, writes the JSON below
    .venv/bin/python -m bench.context_quality --sessions 2 --score-last 2 --model <folder>   # a smoke run

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
from backend.context.builder import ContextRequest, HistoryMessage, build_context
from backend.context.rules import DEFAULT_RULES, RuleSet
from backend.context.splitter import Splitter
from backend.context.topic import TopicSettings, TopicTracker, identifier_keys
from backend.db.models import HistoryPolicy, MessageRole
from backend.services.context_service import shared_scorer
from bench.datasets import CONVERSATIONS, GUIDELINES, DataNotFoundError, read_text, resolve
from bench.workload import render_policy, system_prompt
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = CONVERSATIONS
DEFAULT_GUIDELINES = GUIDELINES
DEFAULT_OUT = REPO / "docs" / "benchmarks" / "context_quality.json"
POLICIES = (HistoryPolicy.FULL, HistoryPolicy.EPOCH, HistoryPolicy.BUDGET)
# NOTE: the held-out half of the data (bench/topic_shift.py tuned its thresholds on the first 1,000 conversations).
FIRST_CONVERSATION = 1000


@dataclass(frozen=True, slots=True)
class Turn:
    role: MessageRole
    text: str


@dataclass(slots=True)
class Score:
    nll: list[float] = field(default_factory=list)  # per scored reply: mean NLL per token
    prompt_tokens: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        return {"nll": statistics.fmean(self.nll), "prompt_tokens": statistics.fmean(self.prompt_tokens)}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for path in (args.data, args.guidelines):
        try:
            resolve(path)
        except DataNotFoundError as exc:
            print(f"error: {exc} (the vendored data lives in bench/data/)", file=sys.stderr)
            return 1
    sessions = load_sessions(args.data, args.sessions, args.conversations_per_session)
    guidelines = json.loads(read_text(args.guidelines))
    system = system_prompt(0, render_policy(guidelines, 0, seed=0, max_chars=args.policy_chars))
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device="cpu", max_kv_memory_mb=1024))
    info = engine.load()
    print(f"model {args.model}: {info.dtype}, context {info.max_model_len}", file=sys.stderr)
    started = time.monotonic()
    scores = {p: Score() for p in POLICIES}
    long_scores = {p: Score() for p in POLICIES}
    for i, turns in enumerate(sessions):
        per_session = score_session(engine, system, turns, args)
        long = len(turns) >= args.long_turns
        for policy, score in per_session.items():
            scores[policy].nll += score.nll
            scores[policy].prompt_tokens += score.prompt_tokens
            if long:
                long_scores[policy].nll += score.nll
                long_scores[policy].prompt_tokens += score.prompt_tokens
        print(f"session {i + 1}/{len(sessions)} done ({time.monotonic() - started:.0f}s)", file=sys.stderr)
    result = _result(args, scores, long_scores)
    print(_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def load_sessions(data: Path, n: int, per_session: int) -> list[list[Turn]]:
    """``n`` sessions, each ``per_session`` consecutive held-out conversations spliced back to back."""
    lines = read_text(data).splitlines()[FIRST_CONVERSATION:]
    conversations = [json.loads(line)["turns"] for line in lines]
    sessions = []
    for i in range(n):
        turns: list[Turn] = []
        for conv in conversations[i * per_session : (i + 1) * per_session]:
            for t in conv:
                role = MessageRole.USER if t["role"].lower() == "user" else MessageRole.ASSISTANT
                turns.append(Turn(role, t["content"]))
        sessions.append(turns)
    return sessions


def score_session(
    engine: LLMEngine, system: str, turns: list[Turn], args: argparse.Namespace
) -> dict[HistoryPolicy, Score]:
    """Replay one session through the context layer; score its last ``score_last`` agent replies per policy."""
    rules = RuleSet.compile(DEFAULT_RULES)
    settings = TopicSettings()
    tracker = TopicTracker(settings, shared_scorer(settings.backend), identifier_keys(rules))
    splitter = Splitter(rules, lambda text: len(engine.tokenizer.encode(text, add_special_tokens=False)))
    history: list[HistoryMessage] = []
    blocks: list[Block] = []
    agent_turns = [i for i, t in enumerate(turns) if t.role is MessageRole.ASSISTANT and i > 0]
    scored = set(agent_turns[-args.score_last :])
    out = {p: Score() for p in POLICIES}
    epoch = 0
    for i, turn in enumerate(turns):
        seq = i + 1
        if turn.role is MessageRole.USER:
            epoch = tracker.observe_customer(turn.text).epoch
        elif i in scored and history and history[0].role is MessageRole.USER:
            for policy in POLICIES:
                nll, tokens = score_reply(engine, system, tuple(history), epoch, policy, turn.text, args)
                out[policy].nll.append(nll)
                out[policy].prompt_tokens.append(tokens)
        if turn.role is MessageRole.ASSISTANT:
            tracker.observe_context(turn.text)
        split = splitter.split(turn.text, seq=seq, epoch=epoch, history=blocks)
        blocks += split
        history.append(HistoryMessage(seq, turn.role, turn.text, epoch, tuple(split)))
    return out


def score_reply(
    engine: LLMEngine,
    system: str,
    history: tuple[HistoryMessage, ...],
    epoch: int,
    policy: HistoryPolicy,
    reply: str,
    args: argparse.Namespace,
) -> tuple[float, int]:
    """The mean NLL per token of ``reply`` after the context ``policy`` builds, and that context's prompt tokens."""
    request = ContextRequest(
        system_prompt=system,
        history=history,
        current_epoch=epoch,
        policy=policy,
        # NOTE: the reply is scored inside the same request, so its tokens (and the end marker) need room too
        budget_tokens=min(engine.info.max_model_len, engine.info.num_blocks * engine.info.block_size)
        - len(engine.tokenizer.encode(reply, add_special_tokens=False))
        - args.reply_room,
        policy_budget_tokens=args.budget,
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
    assert done.prompt_logprobs is not None
    logprobs = [lp for lp in done.prompt_logprobs[len(prefix) : len(prefix) + n_reply] if lp is not None]
    return -statistics.fmean(logprobs), len(prefix)


def _result(
    args: argparse.Namespace,
    scores: dict[HistoryPolicy, Score],
    long_scores: dict[HistoryPolicy, Score],
) -> dict[str, Any]:
    def block(s: dict[HistoryPolicy, Score]) -> dict[str, Any]:
        if not s[HistoryPolicy.FULL].nll:
            return {}
        full = s[HistoryPolicy.FULL].summary()
        rows = {}
        for policy, score in s.items():
            summary = score.summary()
            rows[policy.value] = {
                **summary,
                "replies": len(score.nll),
                "nll_vs_full_pct": 100 * (summary["nll"] / full["nll"] - 1),
                "tokens_vs_full": summary["prompt_tokens"] / full["prompt_tokens"],
            }
        return rows

    return {
        "command": "python -m bench.context_quality " + " ".join(sys.argv[1:]),
        "model": args.model,
        "sessions": args.sessions,
        "conversations_per_session": args.conversations_per_session,
        "scored_replies_per_session": args.score_last,
        "budget_policy_tokens": args.budget,
        "long_session_turns": args.long_turns,
        "all": block(scores),
        "long": block(long_scores),
        "targets": {"nll_vs_full_pct_max": 3.0, "tokens_vs_full_max": 0.70, "policy": HistoryPolicy.EPOCH.value},
    }


def _table(result: dict[str, Any]) -> str:
    lines = []
    for part in ("all", "long"):
        rows = result[part]
        if not rows:
            continue
        lines += [
            f"\n{part} sessions",
            "| policy | replies | NLL/token | vs full | prompt tokens | vs full |",
            "|---|---|---|---|---|---|",
        ]
        for policy, r in rows.items():
            lines.append(
                f"| {policy} | {r['replies']} | {r['nll']:.4f} | {r['nll_vs_full_pct']:+.2f} % | "
                f"{r['prompt_tokens']:.0f} | {r['tokens_vs_full']:.2f} |"
            )
    return "\n".join(lines) + f"\n\ncommand: {result['command']}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.context_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="CuCom conversations (jsonl)")
    p.add_argument("--guidelines", type=Path, default=DEFAULT_GUIDELINES, help="the ABCD agent handbook (json)")
    p.add_argument("--model", default="smollm2", help="smollm2, a safetensors folder or a .gguf file")
    p.add_argument("--dtype", default="float32", help="float32 (exact scores) or bfloat16")
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--conversations-per-session", type=int, default=2, help="spliced back to back (topic changes)")
    p.add_argument("--score-last", type=int, default=4, help="agent replies scored per session (the last ones)")
    p.add_argument("--long-turns", type=int, default=24, help="a session of at least this many turns is long")
    p.add_argument("--budget", type=int, default=1024, help="the budget policy's own token limit")
    p.add_argument("--policy-chars", type=int, default=3000, help="the handbook excerpt in the system prompt")
    p.add_argument("--reply-room", type=int, default=16, help="tokens kept free beside the reply (its markers)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


if __name__ == "__main__":
    sys.exit(main())
