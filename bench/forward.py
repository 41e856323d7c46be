"""ms/step of our paged forward vs HF transformers (DynamicCache), SmolLM2-135M on CPU, at a fixed context.

Reproduce:  .venv/bin/python -m bench.forward [--context 100,2000] [--batch 16] [--steps 10] [--fp32]

Prints one row per (implementation, dtype, rows): single-stream decode (1 row) and batched decode (``--batch`` rows,
each sequence with ``--context`` tokens already cached). Our runner is measured with contiguous block tables (views,
no gather) and with shuffled ones, each with the C kernels (``engine.model.cpu_kernels``) and with the pure-torch
fallback (``KVCHAT_DISABLE_KERNELS=1`` path: a padded gather per layer + SDPA). Not a test: numbers depend on the
machine's load, so compare ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable
from functools import partial

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from engine.device import cpu_supports_bf16
from engine.model import cpu_kernels
from engine.model.loader import ResolvedModel, resolve_model
from engine.model_runner import BatchItem, ModelRunner

BLOCK = 16


def _time(fn: Callable[[], object], steps: int) -> float:
    fn()
    fn()
    started = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - started) / steps * 1e3


def _tables(batch: int, blocks_per_seq: int, shuffled: bool) -> list[list[int]]:
    ids = list(range(batch * blocks_per_seq))
    if shuffled:
        random.Random(0).shuffle(ids)
    return [ids[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)]


def bench_ours(
    model: ResolvedModel, dtype: torch.dtype, context: int, batch: int, steps: int, kernels: bool
) -> dict[str, float]:
    blocks_per_seq = context // BLOCK + 2
    if not kernels:
        cpu_kernels.load.cache_clear()
        os.environ["KVCHAT_DISABLE_KERNELS"] = "1"
    try:
        runner = ModelRunner(model, num_blocks=batch * blocks_per_seq, block_size=BLOCK, device="cpu", dtype=dtype)
        return _bench_runner(runner, context, batch, steps, "ours" if kernels else "torch-path")
    finally:
        os.environ.pop("KVCHAT_DISABLE_KERNELS", None)
        cpu_kernels.load.cache_clear()


def _bench_runner(runner: ModelRunner, context: int, batch: int, steps: int, name: str) -> dict[str, float]:
    blocks_per_seq = context // BLOCK + 2
    prompt = [(i * 7919) % (runner.vocab_size - 10) + 10 for i in range(context)]
    results = {}
    for shuffled in (False, True):
        tables = _tables(batch, blocks_per_seq, shuffled)
        with torch.inference_mode():
            for start in range(0, context, 512):
                runner.forward([BatchItem(prompt[start : start + 512], start, tables[0], False)])
            for table in tables[1:]:  # every sequence gets the same cached context; only its blocks differ
                runner.kv_pool[:, :, table] = runner.kv_pool[:, :, tables[0]]
        label = "shuffled" if shuffled else "contiguous"
        for rows in (1, batch):
            items = [BatchItem([42], context, tables[i], True) for i in range(rows)]
            results[f"{name} {label} rows={rows}"] = _time(partial(runner.forward, items), steps)
    return results


def bench_hf(model: ResolvedModel, dtype: torch.dtype, context: int, batch: int, steps: int) -> dict[str, float]:
    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=dtype).eval()
    prompt = torch.tensor([[(i * 7919) % 49000 + 10 for i in range(context)]])
    results = {}
    with torch.inference_mode():
        for rows in (1, batch):
            cache = DynamicCache(config=hf.config)
            hf(prompt, cache=cache, use_cache=True)
            if rows > 1:
                cache.batch_repeat_interleave(rows)
            token = torch.full((rows, 1), 42)

            def step(cache: DynamicCache = cache, token: torch.Tensor = token) -> None:
                hf(token, cache=cache, use_cache=True)
                cache.crop(-1)  # drop the new token: keep the context fixed

            results[f"hf DynamicCache rows={rows}"] = _time(step, steps)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context", default="100,2000", help="comma-separated cached context lengths")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--fp32", action="store_true", help="also measure float32 where bf16 is supported")
    args = parser.parse_args()
    model = resolve_model(args.model)
    dtypes = [torch.bfloat16] if cpu_supports_bf16() else [torch.float32]
    if args.fp32 and torch.float32 not in dtypes:
        dtypes.append(torch.float32)
    print(f"torch threads={torch.get_num_threads()} batch={args.batch}")
    print(f"{'implementation':<34} {'dtype':<9} {'context':>7} {'ms/step':>9} {'tok/s':>8} {'vs hf':>6}")
    for dtype in dtypes:
        for context in (int(c) for c in args.context.split(",")):
            results = bench_ours(model, dtype, context, args.batch, args.steps, kernels=True)
            results |= bench_ours(model, dtype, context, args.batch, args.steps, kernels=False)
            results |= bench_hf(model, dtype, context, args.batch, args.steps)
            for name, ms in results.items():
                rows = int(name.rsplit("=", 1)[1])
                ratio = results[f"hf DynamicCache rows={rows}"] / ms
                dt = str(dtype).removeprefix("torch.")
                print(f"{name:<34} {dt:<9} {context:>7} {ms:>9.1f} {rows * 1e3 / ms:>8.1f} {ratio:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
