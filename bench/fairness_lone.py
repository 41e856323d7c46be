"""A lone tenant's throughput, fair scheduler against first-come-first-served, alternating in one run (issue 42).

Issue 42 asks the fair scheduler to be work-conserving: a lone tenant's throughput within 5 % of today's. Two
``kvchat serve`` processes run side by side for the whole run, each with its own empty database: this checkout (the
fair scheduler) and ``--fcfs-repo`` (a checkout of the FCFS build, e.g. ``git archive f49226f``). Tenant A keeps
``--backlog-sessions`` websocket sessions busy on one of them for ``--backlog-s`` seconds (after a warm-up, as the
``lone`` phase of ``bench.fairness``), then on the other, in alternating order round after round (fair, FCFS; FCFS,
fair; ...), so a slow patch of a shared machine falls on both. Served tokens = prompt tokens prefilled + completion
tokens of the replies that finished inside the window (``bench.fairness.Served``). The idle server's CPU time during
the other's window is recorded: it must be ~0, or the two would not be measured alone. The servers' logs are kept
in ``bench-results/fairness_lone/``.

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.fairness_lone --fcfs-repo /tmp/fcfs42 \\
        --database-url postgresql://postgres@127.0.0.1:5432/kvchat_lone_fair \\
        --fcfs-database-url postgresql://postgres@127.0.0.1:5432/kvchat_lone_fcfs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.fairness import CHAT_TOKEN, Config, backlog, running_server
from bench.hardening import Server
from bench.load import REPO_ROOT
from bench.reporting import machine_info

DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "fairness_lone.json"
BUILDS = ("fair", "fcfs")
LOG_DIR = REPO_ROOT / "bench-results" / "fairness_lone"


def keep_log(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.exists():
        shutil.copyfile(source, target)


def cpu_s(server: Server) -> float:
    """The server process's user + system CPU seconds so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def round_order(r: int) -> tuple[str, ...]:
    """Fair first in even rounds, FCFS first in odd ones."""
    return BUILDS if r % 2 == 0 else BUILDS[::-1]


def totals(windows: list[dict[str, Any]], backlog_s: float) -> dict[str, Any]:
    """Served tokens/s and completion tokens/s per build over all its windows, and fair / FCFS of each.

    NOTE: served tokens include the prefill, which prefix caching decides; two builds that cache differently serve
    different prompt tokens for the same replies, so the completion tokens (replies x reply length) are the work
    that both did alike."""
    out: dict[str, Any] = {}
    for build in BUILDS:
        mine = [w for w in windows if w["build"] == build]
        seconds = backlog_s * len(mine)
        out[build] = {
            "windows": len(mine),
            "tokens": sum(w["tokens"] for w in mine),
            "tokens_per_s": sum(w["tokens"] for w in mine) / seconds if mine else 0.0,
            "completion_per_s": sum(w["completion"] for w in mine) / seconds if mine else 0.0,
        }
    for key in ("tokens_per_s", "completion_per_s"):
        fcfs = out["fcfs"][key]
        out[f"fair_over_fcfs_{key}"] = out["fair"][key] / fcfs if fcfs else None
    out["fair_over_fcfs"] = out["fair_over_fcfs_tokens_per_s"]
    return out


async def alternate(servers: dict[str, Server], config: Config, rounds: int) -> list[dict[str, Any]]:
    windows = []
    for r in range(rounds):
        for build in round_order(r):
            idle = next(b for b in BUILDS if b != build)
            idle_before = cpu_s(servers[idle])
            served = (await backlog(servers[build], config, {"A": CHAT_TOKEN}))["A"]
            window = {"round": r, "build": build, "idle_cpu_s": cpu_s(servers[idle]) - idle_before} | served
            print(f"lone: {json.dumps(window)}", flush=True)
            windows.append(window)
    return windows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.fairness_lone", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--database-url", required=True, help="an empty Postgres database for the fair server")
    p.add_argument("--fcfs-database-url", required=True, help="another empty one, for the FCFS server")
    p.add_argument("--fcfs-repo", type=Path, required=True, help="a checkout of the FCFS build")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rounds", type=int, default=3, help="rounds of one window per build")
    p.add_argument("--backlog-sessions", type=int, default=32)
    p.add_argument("--backlog-s", type=float, default=30.0)
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--seqs", type=int, default=32, help="KVCHAT_MAX_NUM_SEQS: the engine's running slots")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fair = Config(
        args.database_url,
        REPO_ROOT,
        args.model,
        backlog_sessions=args.backlog_sessions,
        backlog_s=args.backlog_s,
        reply_tokens=args.reply_tokens,
        seqs=args.seqs,
    )
    configs = {"fair": fair, "fcfs": replace(fair, database_url=args.fcfs_database_url, repo=args.fcfs_repo.resolve())}
    with ExitStack() as stack:
        servers = {}
        for build, config in configs.items():
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"kvchat-lone-{build}-")))
            # the server's log outlives its temporary directory (copied once the server has stopped)
            stack.callback(keep_log, workdir / "server.log", LOG_DIR / f"{build}.server.log")
            servers[build] = stack.enter_context(running_server(config, workdir))
        windows = asyncio.run(alternate(servers, fair, args.rounds))
    summary = totals(windows, args.backlog_s)
    command = "flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.fairness_lone " + shlex.join(
        sys.argv[1:] if argv is None else list(argv)
    )
    report = {
        "command": command,
        "machine": machine_info(),
        "config": asdict(fair) | {"database_url": "(see command)", "repo": str(REPO_ROOT), "rounds": args.rounds},
        "fcfs_repo": str(configs["fcfs"].repo),
        "windows": windows,
        "totals": summary,
    }
    for build in BUILDS:
        rates = [round(w["tokens_per_s"], 1) for w in windows if w["build"] == build]
        done = summary[build]["completion_per_s"]
        print(
            f"{build}: {summary[build]['tokens_per_s']:.1f} served tokens/s (windows: {rates}), {done:.1f} completion"
        )
    print(f"fair / FCFS: {summary['fair_over_fcfs']} served, {summary['fair_over_fcfs_completion_per_s']} completion")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
