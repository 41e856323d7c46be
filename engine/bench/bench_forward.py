"""ms/step of our paged forward vs HF transformers (DynamicCache), SmolLM2-135M on CPU, at a fixed context.

Reproduce:  .venv/bin/python -m engine.bench.bench_forward [--context 2000] [--batch 16] [--steps 10]

Prints one row per (implementation, dtype, rows): single-stream decode (1 row) and batched decode (``--batch`` rows,
each sequence with ``--context`` tokens already cached). Our runner is measured with contiguous block tables (views,
no gather) and with shuffled ones (a padded gather per layer). Not a test: numbers depend on the machine's load.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from functools import partial

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from engine.device import cpu_supports_bf16
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


def bench_ours(model: ResolvedModel, dtype: torch.dtype, context: int, batch: int, steps: int) -> dict[str, float]:
    blocks_per_seq = context // BLOCK + 2
    runner = ModelRunner(model, num_blocks=batch * blocks_per_seq, block_size=BLOCK, device="cpu", dtype=dtype)
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
            results[f"ours {label} rows={rows}"] = _time(partial(runner.forward, items), steps)
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
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    model = resolve_model(args.model)
    dtypes = [torch.bfloat16, torch.float32] if cpu_supports_bf16() else [torch.float32]
    print(f"torch threads={torch.get_num_threads()} context={args.context} batch={args.batch}")
    print(f"{'implementation':<32} {'dtype':<10} {'ms/step':>9} {'tok/s':>8}")
    for dtype in dtypes:
        results = bench_ours(model, dtype, args.context, args.batch, args.steps)
        results |= bench_hf(model, dtype, args.context, args.batch, args.steps)
        for name, ms in results.items():
            rows = int(name.rsplit("=", 1)[1])
            print(f"{name:<32} {str(dtype).removeprefix('torch.'):<10} {ms:>9.1f} {rows * 1e3 / ms:>8.1f}")


if __name__ == "__main__":
    main()
