"""``kvchat generate``: stream one completion to the terminal (and show what the cache did)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from engine.config import EngineConfig
from engine.outputs import RequestFinished, TokenDelta
from engine.sampling_params import SamplingParams


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the user message")
    parser.add_argument("--system", default=None, help="an optional system message")
    parser.add_argument("--model", default="smollm2", help="'smollm2', a safetensors folder or a .gguf file")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--repeat", type=int, default=1, help="run the same prompt N times (shows prefix reuse)")


def generate_command(args: argparse.Namespace) -> int:
    return asyncio.run(_generate(args))


async def _generate(args: argparse.Namespace) -> int:
    from engine.llm_engine import LLMEngine

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    from engine.model.loader import resolve_model

    # NOTE: a model that is not there is one clear error line, before any progress output.
    await asyncio.to_thread(resolve_model, args.model)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device))
    print("loading model…", file=sys.stderr, flush=True)
    info = await engine.start()
    print(f"model {info.architecture} ({info.dtype}, {info.device}), {info.num_blocks} KV blocks", file=sys.stderr)
    try:
        for _ in range(args.repeat):
            async for event in engine.generate(messages, params):
                if isinstance(event, TokenDelta):
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                elif isinstance(event, RequestFinished):
                    s = event.stats
                    print(
                        f"\n[{event.finish_reason}] prompt {s.prompt_tokens} tokens ({s.cached_tokens} cached, "
                        f"{s.prefilled_tokens} computed), {s.completion_tokens} generated, "
                        f"TTFT {s.ttft_s * 1000:.0f} ms, {s.decode_tokens_per_s:.1f} tok/s",
                        file=sys.stderr,
                    )
    finally:
        await engine.stop()
    return 0
