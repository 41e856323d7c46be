"""Engine steps beside busy processes: a fixed OpenMP width against the width ``engine.cpu_share`` adapts.

The engine alone on the calling thread (``LLMEngine.core.step``), ``--requests`` greedy requests of ``--tokens``
tokens each, submitted together (their prompts' prefill, then their decode steps), with 0 to ``--busy`` processes
spinning on the cores beside it (what the chat backend's work for a flood of turns is to the engine's step). Each
(busy, width) cell runs ``--rounds`` times, the two widths alternating; per cell: every step's time (p50, p99, max)
and the batch's wall time (its median over the rounds)::

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.cpu_share [--out bench-results/cpu_share/cpu_share.json]

Writes the JSON and a PNG (step p50 / p99 per busy count and width) beside it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.metrics import percentile
from bench.reporting import format_table, machine_info, reproduce_command, write_json
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request_table import Collector
from engine.sampling_params import SamplingParams

DEFAULT_OUT = Path("bench-results/cpu_share/cpu_share.json")
SPIN = "while True: pass"


def batch(engine: LLMEngine, requests: int, tokens: int, label: str) -> tuple[list[float], float]:
    """Seconds of each step of one batch, and its wall time."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    sink = Collector()
    for i in range(requests):
        engine.submit(f"Customer {label}-{i}: where is my parcel? Order number {1000 + i}.", params, "ns", sink)
    steps: list[float] = []
    began = time.perf_counter()
    while True:
        t = time.perf_counter()
        if not engine.core.step():
            return steps, time.perf_counter() - began
        steps.append(time.perf_counter() - t)


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device="cpu", adapt_threads=True))
    info = engine.load()
    share = engine.core.cpu_share
    if share is None:
        raise SystemExit("the width cannot adapt here (one thread, no /proc/stat, or kernels whose bits move with it)")
    batch(engine, args.requests, args.tokens, "warm-up")
    cells: list[dict[str, Any]] = []
    for busy in range(args.busy + 1):
        hogs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
        try:
            time.sleep(0.5)
            runs: dict[str, list[tuple[list[float], float]]] = {"fixed": [], "adaptive": []}
            for r in range(args.rounds):
                for mode in ("fixed", "adaptive") if r % 2 == 0 else ("adaptive", "fixed"):
                    engine.core.cpu_share = share if mode == "adaptive" else None
                    if mode == "fixed":
                        torch.set_num_threads(share.most)
                    changes = share.changes
                    steps, wall = batch(engine, args.requests, args.tokens, f"{busy}-{r}-{mode}")
                    runs[mode].append((steps, wall))
                    if mode == "adaptive":
                        print(f"  busy {busy} round {r}: {share.changes - changes} width changes", file=sys.stderr)
            for mode, got in runs.items():
                steps = [s * 1000 for one, _ in got for s in one]
                cells.append(
                    {
                        "busy": busy,
                        "width": mode,
                        "steps": len(steps),
                        "step_p50_ms": statistics.median(steps),
                        "step_p99_ms": percentile(sorted(steps), 99),
                        "step_max_ms": max(steps),
                        "batch_s": statistics.median(w for _, w in got),
                    }
                )
        finally:
            for h in hogs:
                h.kill()
    engine.core.cpu_share = share
    return {"dtype": info.dtype, "threads": share.most, "cores": share.cores, "cells": cells}


def plot(path: Path, cells: list[dict[str, Any]], title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, color in (("fixed", "#c62828"), ("adaptive", "#2e7d32")):
        rows = [c for c in cells if c["width"] == mode]
        busy = [c["busy"] for c in rows]
        ax.plot(busy, [c["step_p50_ms"] for c in rows], "o-", color=color, label=f"{mode}: step p50")
        ax.plot(busy, [c["step_p99_ms"] for c in rows], "s--", color=color, label=f"{mode}: step p99")
    ax.set_xlabel("busy processes beside the engine")
    ax.set_ylabel("engine step, ms")
    ax.set_xticks(sorted({c["busy"] for c in cells}))
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--requests", type=int, default=8, help="requests a batch")
    p.add_argument("--tokens", type=int, default=32, help="tokens a request")
    p.add_argument("--busy", type=int, default=3, help="the most busy processes beside the engine")
    p.add_argument("--rounds", type=int, default=4, help="batches per cell (the widths alternate)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    result = run(args)
    given = sys.argv[1:] if argv is None else list(argv)
    payload = {
        "name": "cpu_share",
        "command": "flock /tmp/kvchat-bench.lock " + reproduce_command("bench.cpu_share", given),
        "machine": machine_info(dtype=result["dtype"]),
        "requests": args.requests,
        "tokens": args.tokens,
    } | result
    cells = result["cells"]
    heads = ["busy", "width", "steps", "step p50 ms", "step p99 ms", "step max ms", "batch s"]
    print(format_table(heads, [[round(v, 1) if isinstance(v, float) else v for v in c.values()] for c in cells]))
    out = write_json(args.out, payload)
    title = f"engine steps beside busy processes ({payload['machine'].get('cpu_kind', '')}, {result['dtype']})"
    png = plot(out.with_suffix(".png"), cells, title)
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
