"""The workload benchmark program: replay customer-service sessions against kvchat and its peers, write the report.

Reproduce the standard set (what ``make bench`` runs through ``bench.run_all``):

    .venv/bin/python -m bench.run --standard

A custom run, e.g.:

    .venv/bin/python -m bench.run --systems kvchat,llamacpp --concurrency 1,4,16 --turns 12 --max-tokens 32 \\
        --think-time 0 --arrival ramp --arrival-window 4

Each system runs in its own process (``bench.driver``), one after the other, never two at once. Peers that live in
``.bench-venvs/`` must be installed first (``bench/peers/install.sh``); one that is not installed, or fails to start,
is reported with its error — never silently skipped. Writes ``docs/benchmarks/workload.json``, ``workload.md``,
``workload_ttft_by_turn.png`` and ``workload_throughput.png``; ``--markdown docs/benchmarks.md`` also writes the
fragment between workload markers there (``bench.run_all`` keeps blocks it does not own).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.driver import DriverSpec, SystemResult
from bench.runners import SYSTEMS, VENV_PEERS, SystemOptions
from bench.workload import DEFAULT_DATA_DIR, REPO_ROOT, Arrival, ThinkTime, WorkloadConfig

MODULE = "bench.run"
STANDARD = {
    "systems": ",".join(SYSTEMS),
    "concurrency": "1,4,16",
    "turns": 12,
    "max_tokens": 32,
    "think_time": 0.0,
    "arrival": "ramp",
    "arrival_window": 4.0,
    "level_budget": "1=60,4=25,16=70",
    "grace": 15.0,
}
VENVS = REPO_ROOT / ".bench-venvs"
_STARTUP_ALLOWANCE_S = 300.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--standard", action="store_true", help="the standard set (time-boxed, ~15 min): " + str(STANDARD))
    p.add_argument("--systems", default="kvchat", help=f"comma list of {', '.join(SYSTEMS)} (or 'all')")
    p.add_argument("--concurrency", default="1,4,16", help="concurrent sessions per level, comma list")
    p.add_argument("--turns", type=int, default=12, help="user turns per session")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per turn (EOS ignored)")
    p.add_argument("--think-time", type=float, default=0.0, help="mean pause between a reply and the next turn (s)")
    p.add_argument("--think", choices=[t.value for t in ThinkTime], default=ThinkTime.FIXED.value)
    p.add_argument("--arrival", choices=[a.value for a in Arrival], default=Arrival.RAMP.value)
    p.add_argument("--arrival-window", type=float, default=4.0, help="sessions arrive over this many seconds")
    p.add_argument("--tenants", type=int, default=1, help="tenants (each with its own policy prefix)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--model", default="smollm2", help="smollm2 (default), a safetensors folder or a .gguf file")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-mb", type=int, default=1024, help="kvchat's KV pool (MB)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU has it), float32, bfloat16")
    p.add_argument("--level-budget", default="60", help="seconds per level: one value or 'C=S,...' per concurrency")
    p.add_argument("--grace", type=float, default=20.0, help="seconds turns in flight may take past the budget")
    p.add_argument("--out-dir", type=Path, default=REPO_ROOT / "docs" / "benchmarks")
    p.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="also write the fragment between workload markers of this file (e.g. docs/benchmarks.md)",
    )
    p.add_argument("--results-dir", type=Path, default=REPO_ROOT / "bench-results" / "workload")
    return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.standard:
        # NOTE: the preset replaces only what the caller left at its default, so `--standard --systems kvchat` works.
        defaults = vars(parser.parse_args([]))
        for key, value in STANDARD.items():
            if getattr(args, key) == defaults[key]:
                setattr(args, key, value)
    if args.systems == "all":
        args.systems = ",".join(SYSTEMS)
    return args


def level_budgets(text: str, levels: Sequence[int]) -> dict[int, float]:
    if "=" not in text:
        return dict.fromkeys(levels, float(text))
    table = {int(k): float(v) for k, v in (item.split("=") for item in text.split(","))}
    return {c: table.get(c, max(table.values())) for c in levels}


# ---------------------------------------------------------------------------------------------------- peers


def install_status(peer: str) -> dict[str, Any]:
    path = VENVS / f"{peer}.status.json"
    if not path.exists():
        return {"peer": peer, "ok": False, "error": f"not installed (run bench/peers/install.sh {peer})"}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


# ---------------------------------------------------------------------------------------------------- running


class Bar:
    """A text progress bar over every planned turn (throttled to a line every few seconds when not a terminal)."""

    def __init__(self, total: int, stream: Any = None) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self.last = 0.0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.lock = threading.Lock()

    def update(self, label: str, advance: int = 0, force: bool = False) -> None:
        with self.lock:
            self.done = min(self.done + advance, self.total)
            now = time.monotonic()
            if not (force or self.tty or now - self.last >= 10):
                return
            self.last = now
            filled = 30 * self.done // self.total
            percent = 100 * self.done // self.total
            text = f"[{'#' * filled}{'.' * (30 - filled)}] {percent:3d}% {now - self.started:5.0f}s {label}"
            self.stream.write(("\r" + text.ljust(110)[:110]) if self.tty else text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def run_one(spec: DriverSpec, results_dir: Path, bar: Bar, planned_turns: int) -> SystemResult:
    """Run one system in its own process; a crash or a hang is recorded as its result, never raised."""
    results_dir.mkdir(parents=True, exist_ok=True)
    spec_path = results_dir / f"{spec.system}.spec.json"
    out_path = results_dir / f"{spec.system}.result.json"
    log_path = results_dir / f"{spec.system}.log"
    spec_path.write_text(json.dumps(spec.to_json(), indent=2))
    out_path.unlink(missing_ok=True)
    timeout = _STARTUP_ALLOWANCE_S + sum(b + spec.grace_s for b in spec.level_budgets_s)
    command = [sys.executable, "-m", "bench.driver", "--spec", str(spec_path), "--out", str(out_path)]
    counted = 0
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            event = _progress(line)
            if event is None:
                continue
            if "turn" in event:
                counted += 1
                bar.update(f"{spec.system}: turn {event['turn']} of {event['session']}", advance=1)
            elif "started" in event:
                bar.update(f"{spec.system}: started in {event['startup_s']} s", force=True)
            elif "level_done" in event:
                bar.update(
                    f"{spec.system}: concurrency {event['level_done']} done ({event['turns']} turns)", force=True
                )
        code = proc.wait()
        timer.cancel()
    bar.update(f"{spec.system}: finished", advance=max(planned_turns - counted, 0), force=True)
    if out_path.exists():
        return SystemResult.from_json(json.loads(out_path.read_text()))
    tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
    why = "killed after its time limit" if code in (-9, 137) else f"exited with code {code}"
    return SystemResult(spec.system, SYSTEMS[spec.system], "failed", f"the driver {why}: {' | '.join(tail)}")


def _progress(line: str) -> dict[str, Any] | None:
    try:
        data = json.loads(line)
    except json.JSONDecodeError:
        return None
    event = data.get("progress") if isinstance(data, dict) else None
    return event if isinstance(event, dict) else None


def main(argv: Sequence[str] | None = None) -> int:
    from bench.report import build_report, write_outputs

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    from bench.reporting import reproduce_command

    command = reproduce_command(MODULE, argv)
    print(f"reproduce: {command}", flush=True)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        print(f"error: unknown systems {unknown}; known: {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    levels = tuple(int(c) for c in args.concurrency.split(","))
    budgets = level_budgets(args.level_budget, levels)
    workload = WorkloadConfig(
        data_dir=args.data_dir.resolve(),
        turns=args.turns,
        seed=args.seed,
        tenants=args.tenants,
        think_time_s=args.think_time,
        think=ThinkTime(args.think),
        arrival=Arrival(args.arrival),
        arrival_window_s=args.arrival_window,
    )
    results_dir = args.results_dir / time.strftime("%Y%m%d-%H%M%S")
    options = SystemOptions(args.model, args.threads, args.kv_mb, args.max_tokens, args.dtype, results_dir)
    planned = sum(c * args.turns for c in levels)
    bar = Bar(planned * len(systems))
    results: list[SystemResult] = []
    installs = {peer: install_status(peer) for peer in VENV_PEERS if peer in systems}
    started = time.monotonic()
    for system in systems:
        status = installs.get(system)
        if status is not None and not status.get("ok"):
            results.append(
                SystemResult(system, SYSTEMS[system], "unavailable", f"install failed: {status.get('error')}")
            )
            bar.update(f"{system}: not installed", advance=planned, force=True)
            continue
        # NOTE: one budget per level for every system: a slow system serves fewer turns, and ratios are taken over
        # the turns both systems served (bench.metrics.matched_mean_ttft).
        spec = DriverSpec(system, options, workload, levels, tuple(budgets[c] for c in levels), args.grace)
        results.append(run_one(spec, results_dir, bar, planned))
    bar.close()
    report = build_report(args, command, workload, results, installs, budgets, time.monotonic() - started)
    paths = write_outputs(report, args.out_dir, args.markdown)
    print(report["table_text"])
    print(report["targets_text"])
    print("wrote " + ", ".join(str(p) for p in paths))
    print(f"reproduce: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
