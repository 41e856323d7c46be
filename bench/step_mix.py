"""What one engine step costs by its mix: prefill chunks of n rows alone, decode steps of b rows, and b decode rows
beside a prefill chunk: the figures behind a CPU kind's ``long_prefill_chunk`` (``engine/model/kernels.py``: ~200 ms
of prefill) and behind a newcomer's TTFT beside a full batch (docs/benchmarks.md, fair share).

Through ``ModelRunner.forward`` as the engine calls it (``bench.roofline.Bench``: SmolLM2, decode rows at
``--context`` cached tokens each). Prints a table, writes JSON; the median of ``--repeats`` (and every sample)::

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.step_mix --out /tmp/step_mix.json
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.reporting import format_table, machine_info, write_json
from bench.roofline import Bench, timed
from engine.model_runner import BatchItem


def measure(
    bench: Bench, prefill_rows: Sequence[int], decodes: Sequence[int], context: int, repeats: int
) -> list[dict[str, Any]]:
    """One row per mix: ``decode`` rows at ``context`` beside a cold chunk of ``prefill`` rows (either may be 0)."""
    rows = []
    mixes = [(0, n) for n in prefill_rows] + [(b, 0) for b in decodes]
    mixes += [(max(decodes) - 1, n) for n in prefill_rows]
    for b, n in mixes:
        items = [BatchItem([42], context, bench.table(i), True) for i in range(b)]
        if n:
            items.append(BatchItem(bench.tokens(n), 0, bench.table(b), True, prompt=True))
        summary = timed(functools.partial(bench.runner.forward, items), repeats)
        rows.append(
            {"decode_rows": b, "prefill_rows": n, "ms_median": 1000 * summary.median, "samples_s": summary.samples}
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--context", type=int, default=512, help="cached tokens of each decode row")
    p.add_argument("--prefill-rows", default="32,64,96,128,192,256")
    p.add_argument("--decodes", default="1,8,16,32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("bench-results/step_mix.json"))
    args = p.parse_args(argv)
    prefill = [int(x) for x in args.prefill_rows.split(",")]
    decodes = [int(x) for x in args.decodes.split(",")]
    bench = Bench(args.model, getattr(torch, args.dtype), max(decodes), args.context * 2, args.repeats)
    rows = measure(bench, prefill, decodes, args.context, args.repeats)
    table = [[r["decode_rows"], r["prefill_rows"], f"{r['ms_median']:.1f}"] for r in rows]
    print(format_table(["decode rows", "prefill rows", "step ms (median)"], table))
    command = "flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.step_mix " + " ".join(argv or sys.argv[1:])
    write_json(args.out, {"name": "step_mix", "command": command, "machine": machine_info(), "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
