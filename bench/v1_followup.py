"""A follow-up turn's TTFT through ``/v1/chat/completions`` against Hugging Face transformers, and where it goes.

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.v1_followup

One ``kvchat serve`` (SmolLM2-135M-Instruct, the server's ``auto`` dtype: bf16 where the CPU has it) and, in this
process, transformers on the same weights and dtype. The conversation: the workload's system prompt (a store's
instruction and a handbook excerpt) and held-out CuCom turns, about ``--history`` tokens. The first request (not
timed) caches it; then each round asks a different ~30-token customer question after the same history, streamed, and
the client times the first content chunk. Transformers runs the same follow-up tokens on a ``DynamicCache`` that holds
the history (cropped back after each round): the prefill it must do, nothing else. The two alternate, round by round.

Where kvchat's time goes, per round:
- **engine**: arrival in the engine to its first token (``kvchat:time_to_first_token_seconds``, read from
  ``/metrics`` before and after the request: the server runs nothing else), the prefill of the new tokens included;
- **segments + template + tokenize**: the server's worker-thread step before the engine sees the prompt (the messages
  split into semantic blocks, the chat template rendered and tokenized by segment), timed here with the same
  functions (``backend.context.stateless.segment_messages``, ``engine.prompt_encoder.PromptEncoder``);
- **block hashing**: the prompt's block hash chain (``engine/kv/block_hash.py``), timed here; inside the engine's part;
- **the rest**: HTTP, the request's parsing and checks, the hops between the event loop and the worker threads, and
  the first chunk out (client time − engine − template and tokenize).

Writes ``docs/benchmarks/v1_followup.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import torch

from backend.context.stateless import segment_messages
from bench.datasets import CONVERSATIONS, GUIDELINES
from bench.load import CHAT_TOKEN, LoadConfig, Server, running_server
from bench.reporting import REPO_ROOT, machine_info, reproduce_command, write_json
from bench.workload import load_conversations, load_guidelines, render_policy, system_prompt
from engine.device import resolve_dtype
from engine.kv.block_hash import hash_chain, root_hash
from engine.model.loader import resolve_model
from engine.prompt_encoder import PromptEncoder
from engine.tokenizer import Tokenizer

DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "v1_followup.json"
TARGET = 0.7  # kvchat's TTFT over transformers' (issue 43)
_TTFT = re.compile(r"^kvchat:time_to_first_token_seconds_(sum|count) (\S+)$", re.M)
Messages = list[dict[str, str]]


def conversation(tokenizer: Tokenizer, history_tokens: int, questions: int) -> tuple[Messages, list[str]]:
    """The system prompt and held-out (customer, agent) pairs up to ``history_tokens``, and ``questions`` short
    customer messages (15 to 45 tokens) of later conversations, each asked once after that history."""
    policy = render_policy(load_guidelines(GUIDELINES), 0, 0, 4300)
    messages: Messages = [{"role": "system", "content": system_prompt(0, policy)}]
    asks: list[str] = []
    for conv in load_conversations(CONVERSATIONS)[1000:]:
        for user, agent in conv.pairs:
            if len(tokenizer.apply_chat_template(messages, add_generation_prompt=False)) < history_tokens:
                messages += [{"role": "user", "content": user}, {"role": "assistant", "content": agent}]
            elif 15 <= len(tokenizer.encode(user, add_special_tokens=False)) <= 45 and user not in asks:
                asks.append(user)
        if len(asks) >= questions:
            break
    return messages, asks


def engine_ttft(client: httpx.Client) -> tuple[float, int]:
    """The server's TTFT histogram: (sum of seconds, count)."""
    text = client.get("/metrics").text
    values = dict((m.group(1), float(m.group(2))) for m in _TTFT.finditer(text))
    return values.get("sum", 0.0), int(values.get("count", 0))


def ask(client: httpx.Client, messages: Messages) -> tuple[float, int]:
    """A streamed request; seconds to the first content chunk, and the cached prompt tokens (from the usage)."""
    body = {
        "model": "default",
        "messages": messages,
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first: float | None = None
    cached = -1
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    if first is None:
        raise RuntimeError("the reply had no content")
    return first, cached


class Transformers:
    """The same follow-up on transformers: a ``DynamicCache`` holding the history, the new tokens' prefill timed."""

    def __init__(self, model_path: Path, dtype: torch.dtype, history: Sequence[int]) -> None:
        from transformers import AutoModelForCausalLM, DynamicCache
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        self.cache = DynamicCache(config=self.model.config)
        self._forward(history)

    @torch.inference_mode()
    def _forward(self, ids: Sequence[int]) -> int:
        out = self.model(torch.tensor([list(ids)]), past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return int(out.logits[0, -1].argmax())

    def followup(self, new: Sequence[int]) -> float:
        start = time.perf_counter()
        self._forward(new)
        elapsed = time.perf_counter() - start
        self.cache.crop(-len(new))  # (back to the history alone)
        return elapsed


def _pct(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50": round(statistics.median(ordered) * 1000, 2),
        "min": round(ordered[0] * 1000, 2),
        "max": round(ordered[-1] * 1000, 2),
    }


def run(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    resolved = resolve_model("smollm2", None)
    tokenizer = Tokenizer(resolved.path)
    history, questions = conversation(tokenizer, args.history, args.rounds + 1)
    if len(questions) < args.rounds + 1:
        raise SystemExit(f"only {len(questions)} short questions in the held-out conversations")
    history_ids = tokenizer.apply_chat_template(history, add_generation_prompt=False)
    encoder = PromptEncoder(tokenizer, tokenizer.vocab_size, 1 << 20, 1 << 20)
    base = f"http://127.0.0.1:{server.port}"
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {CHAT_TOKEN}"}, timeout=120) as client:
        ask(client, [*history, {"role": "user", "content": questions[0]}])  # caches the history
        torch_dtype = resolve_dtype("auto", torch.device("cpu"))  # (the server's: KVCHAT_ENGINE_DTYPE=auto)
        hf = Transformers(resolved.path, torch_dtype, history_ids)
        rows = []
        for i, question in enumerate(questions[1 : args.rounds + 1]):
            messages = [*history, {"role": "user", "content": question}]
            ids = tokenizer.apply_chat_template(messages)
            common = len(history_ids)
            if ids[:common] != history_ids:
                raise SystemExit("the chat template does not extend the history's tokens: no common prefix to reuse")
            started = time.perf_counter()
            encoder.encode(segment_messages(messages))
            tokenize_s = time.perf_counter() - started
            started = time.perf_counter()
            hash_chain(root_hash("model", "ns"), ids, 16)
            hashing_s = time.perf_counter() - started

            def ours(messages: Messages = messages) -> tuple[float, int, float]:
                before = engine_ttft(client)
                ttft, cached = ask(client, messages)
                after = engine_ttft(client)
                return ttft, cached, (after[0] - before[0]) if after[1] == before[1] + 1 else float("nan")

            def theirs(new: Sequence[int] = ids[common:]) -> float:
                return hf.followup(new)

            if i % 2:
                hf_s = theirs()
                ttft, cached, engine_s = ours()
            else:
                ttft, cached, engine_s = ours()
                hf_s = theirs()
            rows.append(
                {
                    "prompt_tokens": len(ids),
                    "cached_tokens": cached,
                    "transformers_new_tokens": len(ids) - common,
                    "kvchat_ttft_s": ttft,
                    "transformers_s": hf_s,
                    "engine_s": engine_s,
                    "template_tokenize_s": tokenize_s,
                    "block_hashing_s": hashing_s,
                    "rest_s": ttft - engine_s - tokenize_s,
                }
            )
            print(
                f"round {i + 1}: kvchat {ttft * 1000:.1f} ms (engine {engine_s * 1000:.1f}, segments+template+tokenize "
                f"{tokenize_s * 1000:.1f}), transformers {hf_s * 1000:.1f} ms, {len(ids)} tokens, {cached} cached",
                flush=True,
            )
    ours_p50 = statistics.median(r["kvchat_ttft_s"] for r in rows)
    theirs_p50 = statistics.median(r["transformers_s"] for r in rows)
    keys = ("kvchat_ttft_s", "transformers_s", "engine_s", "template_tokenize_s", "block_hashing_s", "rest_s")
    return {
        "dtype": str(torch_dtype).removeprefix("torch."),
        "history_tokens": len(history_ids),
        "rounds": rows,
        "ms": {k: _pct([r[k] for r in rows]) for k in keys},
        "ratio_p50": round(ours_p50 / theirs_p50, 3),
        "target": TARGET,
    }


def table(result: dict[str, Any]) -> str:
    names = {
        "kvchat_ttft_s": "**kvchat through /v1** (client: request → first content chunk)",
        "engine_s": "  the engine (arrival → first token; prefill of the new tokens)",
        "template_tokenize_s": "  segments + chat template + tokenize (the server's worker step, timed here)",
        "rest_s": "  the rest: HTTP, parsing, checks, thread hops, the chunk out",
        "block_hashing_s": "  (block hashing, timed here; inside the engine's part)",
        "transformers_s": "**transformers**, DynamicCache (the new tokens' prefill)",
    }
    lines = ["| ms | p50 | min | max |", "|---|---|---|---|"]
    for key, label in names.items():
        p = result["ms"][key]
        lines.append(f"| {label} | {p['p50']:.1f} | {p['min']:.1f} | {p['max']:.1f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.v1_followup", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--history", type=int, default=2066, help="history tokens before the follow-up question")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    random.seed(args.seed)
    config = LoadConfig("smollm2", 4, 8, (1,), 0.0, 0.0, 2, 0.0, 0.0, args.seed)
    with (
        tempfile.TemporaryDirectory(prefix="kvchat-v1-followup-") as workdir,
        running_server(config, Path(workdir)) as server,
    ):
        result = run(server, args)
    print(table(result))
    verdict = "met" if result["ratio_p50"] <= TARGET else "missed"
    print(f"kvchat / transformers, p50: {result['ratio_p50']:.3f} (target ≤ {TARGET}: {verdict})")
    command = "flock /tmp/kvchat-bench.lock " + reproduce_command("bench.v1_followup", sys.argv[1:])
    write_json(args.out, {"command": command, "machine": machine_info(), "result": result})
    print(f"wrote {args.out}\nreproduce: {command}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
