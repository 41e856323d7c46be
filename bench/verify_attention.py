"""What a verify row costs in decode attention: a decode row and its k drafts (engine.spec) attended by the lone-row
kernel (each row a decode row of its own, rereading the sequence's K/V) against the verify kernel (one pass over
the K/V for all rows), with the same bits per row (checked here on every measured case).

Reproduce (one benchmark at a time on a shared machine):

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.verify_attention

SmolLM2-135M's attention shape by default (9 heads, 3 kv heads, head dim 64, 30 layers, each layer its own pool so
K/V come from memory as in a step), one sequence at ``--contexts`` tokens, the drafts ``1..--max-drafts``; each
case is the fastest of ``--rounds`` interleaved rounds (on shared cores the slower ones are other processes' time).
A draft row's cost is ``(t(k) - t(0)) / k``: what the k draft rows add to the decode row's attention.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.reporting import format_table, machine_info, reproduce_command, write_json
from engine.device import cpu_kind
from engine.model import cpu_kernels

BLOCK = 16
REPO_ROOT = Path(__file__).resolve().parent.parent


class Case:
    """One sequence's K/V in ``layers`` pools, and the query rows of its decode row and ``max_drafts`` drafts."""

    def __init__(self, dtype: torch.dtype, context: int, max_drafts: int, shape: tuple[int, int, int, int]) -> None:
        layers, heads, kv_heads, dim = shape
        gen = torch.Generator().manual_seed(context)
        blocks = -(-(context + max_drafts + 1) // BLOCK)
        self.pools = [
            [torch.randn(blocks, BLOCK, kv_heads, dim, generator=gen).to(dtype) for _ in range(2)]
            for _ in range(layers)
        ]
        self.q = torch.randn(max_drafts + 1, heads, dim, generator=gen).to(dtype)
        self.out = torch.empty_like(self.q)
        self.table = torch.arange(blocks).unsqueeze(0)
        self.context = context
        self.lib = cpu_kernels.load()
        if self.lib is None:
            raise SystemExit("the C kernels are unavailable here")

    def lone(self, k: int) -> Callable[[], None]:
        """The k + 1 rows by the lone-row kernel: one batch of decode rows, row r over context + r + 1 tokens."""
        rows = torch.arange(k + 1)
        lens = self.context + 1 + rows
        table = self.table.expand(k + 1, -1).contiguous()
        scale = self.q.shape[-1] ** -0.5

        def run() -> None:
            for kc, vc in self.pools:
                cpu_kernels.paged_decode(self.lib, self.q, rows, kc, vc, table, lens, self.out, rows, scale)  # type: ignore[arg-type]

        return run

    def verify(self, k: int) -> Callable[[], None]:
        """The k + 1 rows by the verify kernel, in one pass over the K/V."""
        first, counts, lens = torch.tensor([0]), torch.tensor([k + 1]), torch.tensor([self.context + 1])
        scale = self.q.shape[-1] ** -0.5

        def run() -> None:
            for kc, vc in self.pools:
                cpu_kernels.paged_verify(self.lib, self.q, first, counts, kc, vc, self.table, lens, self.out, scale)  # type: ignore[arg-type]

        return run

    def same_bits(self, k: int) -> bool:
        self.lone(k)()
        lone = self.out[: k + 1].clone()
        self.verify(k)()
        return torch.equal(lone, self.out[: k + 1])


def measure(case: Case, drafts: Sequence[int], rounds: int) -> dict[str, dict[int, float]]:
    """The fastest of ``rounds`` of each (kernel, k), the cases interleaved within a round; seconds."""
    runs = {"lone": case.lone, "verify": case.verify}
    best = {name: dict.fromkeys(drafts, float("inf")) for name in runs}
    for _ in range(rounds):
        for k in drafts:
            for name, make in runs.items():
                fn = make(k)
                fn()  # (warm: the first call of a round may page in)
                t0 = time.perf_counter()
                fn()
                best[name][k] = min(best[name][k], time.perf_counter() - t0)
    return best


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--max-drafts", type=int, default=8)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--shape", type=int, nargs=4, default=[30, 9, 3, 64], help="layers, heads, kv heads, head dim")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--out", type=Path, help="the JSON (default: docs/benchmarks/verify_attention-<CPU kind>.json)")
    args = p.parse_args(argv)
    drafts = list(range(args.max_drafts + 1))
    rows: list[dict[str, Any]] = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for context in args.contexts:
            layers, heads, kv_heads, dim = args.shape
            case = Case(dtype, context, args.max_drafts, (layers, heads, kv_heads, dim))
            if not all(case.same_bits(k) for k in drafts):
                print(f"{dtype_name} at {context}: the verify kernel's bits differ", file=sys.stderr)
                return 1
            best = measure(case, drafts, args.rounds)
            for k in drafts:
                lone, verify = (1000 * best[name][k] for name in ("lone", "verify"))
                row_lone = (lone - 1000 * best["lone"][0]) / k if k else None
                row_verify = (verify - 1000 * best["verify"][0]) / k if k else None
                rows.append(
                    {"dtype": dtype_name, "context": context, "drafts": k, "lone_ms": lone, "verify_ms": verify}
                    | {"row_ms_lone": row_lone, "row_ms_verify": row_verify}
                )
    heads = ["dtype", "context", "drafts", "lone ms", "verify ms", "ms/draft row lone", "ms/draft row verify"]
    table = [[round(v, 3) if isinstance(v, float) else v for v in r.values()] for r in rows]
    print(format_table(heads, table))
    given = sys.argv[1:] if argv is None else list(argv)
    command = "flock /tmp/kvchat-bench.lock " + reproduce_command("bench.verify_attention", given)
    payload: dict[str, Any] = {
        "name": "verify_attention",
        "command": command,
        "machine": machine_info(),
        "kind": cpu_kind(),
    }
    payload |= {"shape": args.shape, "rounds": args.rounds, "rows": rows}
    kind = "-".join(re.findall(r"[a-z0-9]+", cpu_kind().lower()))
    out = args.out or REPO_ROOT / "docs" / "benchmarks" / f"verify_attention-{kind}.json"
    print(f"wrote {write_json(out, payload)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
