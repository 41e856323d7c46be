"""What one MiniLM sentence vector costs: the encoder's ONNX Runtime graph against its numpy reference forward.

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.encoder_speed [--messages 400] [--batches 20]

Held-out CuCom customer messages (the customer turns of conversations 1000 onwards), encoded the way a turn encodes a
new message: ``MiniLMEncoder.encode([message])``, one message per call (tokenizing included), and the same call
through ``encode_reference`` (the numpy forward, BLAS on one thread) right after it, so both see the same load. Then
``--batches`` batches of 32 messages each way. Printed and written: p50/p99 ms per call, the p50 speed-up, and the
largest difference between the two vectors of any message. Writes ``docs/benchmarks/encoder_speed.json``, with the
machine it ran on and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime
from numpy.typing import NDArray

from backend.context.minilm import MiniLMEncoder
from bench.datasets import CONVERSATIONS
from bench.reporting import format_table, machine_info, reproduce_command, write_json
from bench.shift_sets import load_conversations

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "encoder_speed.json"
HELD_OUT = 1000  # the conversations before this index tune the topic-shift models; these were never seen
BATCH = 32
WARMUP = 10


def held_out_messages() -> list[str]:
    """The customer messages of the held-out conversations, in order."""
    return [t.text for c in load_conversations(CONVERSATIONS)[HELD_OUT:] for t in c if t.customer and t.text.strip()]


Encode = Callable[[Sequence[str]], NDArray[np.float32]]


def paired_ms(ways: dict[str, Encode], inputs: Sequence[list[str]]) -> tuple[dict[str, list[float]], float]:
    """Milliseconds per call of each way on each input (the ways take turns), and the ways' largest vector gap."""
    ms: dict[str, list[float]] = {name: [] for name in ways}
    gap = 0.0
    for texts in inputs:
        vectors = []
        for name, encode in ways.items():
            started = time.perf_counter()
            vectors.append(encode(texts))
            ms[name].append(1000 * (time.perf_counter() - started))
        gap = max(gap, float(np.abs(vectors[0] - vectors[1]).max()))
    return ms, gap


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50_ms": statistics.median(ordered),
        "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "mean_ms": statistics.fmean(ordered),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.encoder_speed", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--messages", type=int, default=400, help="held-out customer messages encoded one per call")
    p.add_argument("--batches", type=int, default=20, help="batches of 32 held-out messages encoded each way")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    encoder = MiniLMEncoder()
    ways: dict[str, Encode] = {"onnxruntime": encoder.encode, "numpy": encoder.encode_reference}
    messages = held_out_messages()
    singles = [[m] for m in messages[: WARMUP + args.messages]]
    paired_ms(ways, singles[:WARMUP])  # NOTE: the numpy weights load on first use; first calls fill caches
    single, single_gap = paired_ms(ways, singles[WARMUP:])
    rest = messages[WARMUP + args.messages :]
    batches = [rest[i * BATCH : (i + 1) * BATCH] for i in range(args.batches)]
    batched, batch_gap = paired_ms(ways, [b for b in batches if len(b) == BATCH])
    tokens = [len(e.ids) for e in encoder.tokenizer.encode_batch([m[0] for m in singles[WARMUP:]])]
    result: dict[str, Any] = {
        "command": reproduce_command("bench.encoder_speed", sys.argv[1:] if argv is None else list(argv)),
        "machine": machine_info(threads=1) | {"onnxruntime": onnxruntime.__version__},
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "tokens_per_message": {"p50": statistics.median(tokens), "max": max(tokens)},
        "single": {name: summary(s) for name, s in single.items()},
        "batch_of_32": {name: summary(s) for name, s in batched.items()},
        "max_abs_difference": max(single_gap, batch_gap),
    }
    rows = []
    for kind in ("single", "batch_of_32"):
        ort_ms, np_ms = result[kind]["onnxruntime"], result[kind]["numpy"]
        rows.append([kind, ort_ms["n"], np_ms["p50_ms"], np_ms["p99_ms"], ort_ms["p50_ms"], ort_ms["p99_ms"]])
        rows[-1].append(f"{np_ms['p50_ms'] / ort_ms['p50_ms']:.2f}x")
    headers = ("call", "calls", "numpy p50 ms", "numpy p99 ms", "ort p50 ms", "ort p99 ms", "speed-up p50")
    print(format_table(headers, rows))
    print(f"tokens per message: p50 {result['tokens_per_message']['p50']}, max {result['tokens_per_message']['max']}")
    print(f"largest |ort - numpy| over every vector component: {result['max_abs_difference']:.2e}")
    print(f"load average before {result['load_average_before']}, after {result['load_average_after']}")
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
