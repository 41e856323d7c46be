"""``kvchat generate``: stream one completion to the terminal (and show what the cache did); ``kvchat doctor``: which
kernel runs each operation on this machine, and why (also ``python -m engine.cli doctor``)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

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


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", default=None, help="where kernels are built (EngineConfig.cache_dir)")


def doctor_command(args: argparse.Namespace) -> int:
    """Print the machine, the kernel libraries (built now if needed) and the kernel table as resolved here."""
    import platform

    import torch

    from engine.device import cpu_flags, cpu_kind
    from engine.model import build, kernels

    build.use_cache_dir(args.cache_dir)
    flags = cpu_flags()
    shown = sorted(f for f in flags if f.startswith(("amx", "avx512f", "avx512_bf16", "avx2", "fma")))
    print(f"cpu kind: {cpu_kind(flags)} (the kernel table's rows below are this kind's)")
    print(f"cpu: {_cpu_model()} ({platform.machine()}), flags: {' '.join(shown) or 'none of interest'}")
    print(f"torch {torch.__version__}, CUDA {'available' if torch.cuda.is_available() else 'not available'}")
    print(f"compiler: {build.compiler() or 'none (torch paths only)'}, kernel cache: {build.cache_dir() / 'kernels'}")
    if build.disabled():
        print("KVCHAT_DISABLE_KERNELS=1: every operation takes its torch path")
    for name in sorted({i.library for i in kernels.TABLE if i.library}):
        usable = {i.library for i in kernels.TABLE if i.needs <= flags}
        state = (
            ("built" if kernels.library(name) is not None else "unavailable") if name in usable else "not for this CPU"
        )
        print(f"  library {name}: {state}")
    print()
    rows = kernels.resolve()
    widths = [max(len(r[k]) for r in rows) for k in ("op", "dtype", "rows", "runs")]
    for r in rows:
        cells = (r[k].ljust(w) for k, w in zip(("op", "dtype", "rows", "runs"), widths, strict=True))
        print("  ".join(cells), " ", r["why"])
    dtypes = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16)}
    shown_chunks = ", ".join(f"{name} {kernels.prefill_chunk(d) or 'no cap'}" for name, d in dtypes.items())
    print(f"\nprefill chunk of a step beside other requests (EngineConfig.long_prefill_chunk=None): {shown_chunks}")
    lone = ", ".join(f"{name} {kernels.caps_lone_steps(d)}" for name, d in dtypes.items())
    print(f"a lone tenant's step prefill capped at that chunk too (EngineConfig.cap_lone_steps=None): {lone}")
    return 0


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return "unknown CPU"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown CPU")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    add_doctor_arguments(sub.add_parser("doctor", help="which kernel runs each operation here, and why"))
    add_generate_arguments(sub.add_parser("generate", help="stream one completion to the terminal"))
    args = parser.parse_args(argv)
    return doctor_command(args) if args.command == "doctor" else generate_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
