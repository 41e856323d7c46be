"""How long ``kvchat serve`` takes to be ready: a first start (an empty model cache and data folder, so it converts the
model and builds the C kernels) and a later start (both kept), with the time each phase of the start took.

Reproduce the committed figures (docs/benchmarks/start_time.json):

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.start_time

Each round makes a fresh temporary folder and runs ``kvchat serve`` twice on SQLite, with ``KVCHAT_CACHE_DIR``
and ``KVCHAT_DATA_DIR`` inside it. From the moment the process is started it records when ``/livez`` first answers
(the server listens) and when ``/readyz`` answers 200 (ready); the phases come from the log's ``start X.Xs: ...``
lines (``backend/core/startup.py``). Medians over ``--repeats`` rounds; a table, and JSON with the machine and command.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "start_time.json"
_PHASE_LINE = re.compile(r" kvchat: start (\d+\.\d)s: (.*)$", re.MULTILINE)
_POLL_S = 0.1


@dataclass(frozen=True, slots=True)
class Start:
    """One ``kvchat serve`` start: seconds from the process start, and the phases its log names."""

    listening_s: float  # /livez answered
    ready_s: float  # /readyz answered 200
    converting_s: float  # the model conversion (0 when the cache had it)
    loading_s: float  # loading the weights, building the kernels, starting the step loop
    phases: list[tuple[float, str]]  # (seconds since the start began, the log line's text)


def phase_durations(phases: Sequence[tuple[float, str]]) -> tuple[float, float]:
    """(converting, loading) seconds from the phase lines: each phase lasts until the next line."""
    converting = loading = 0.0
    for (at, text), (until, _) in itertools.pairwise(phases):
        if text.startswith("converting "):
            converting += until - at
        elif text.startswith("loading "):
            loading += until - at
    return converting, loading


def start_once(folder: Path, model: str, port: int, log_path: Path, timeout_s: float) -> Start:
    # NOTE: none of this shell's KVCHAT_* settings (a database URL, a port) but KVCHAT_DISABLE_KERNELS: a start
    # without the C kernels is a start worth measuring too.
    kept = {k: v for k, v in os.environ.items() if not k.startswith("KVCHAT_") or k == "KVCHAT_DISABLE_KERNELS"}
    env = kept | {
        "KVCHAT_MODEL": model,
        "KVCHAT_CACHE_DIR": str(folder / "model-cache"),
        "KVCHAT_DATA_DIR": str(folder / "data"),
        "KVCHAT_HOST": "127.0.0.1",
        "KVCHAT_PORT": str(port),
    }
    started = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", "serve"], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        listening = _until(proc, f"http://127.0.0.1:{port}/livez", started, timeout_s)
        ready = _until(proc, f"http://127.0.0.1:{port}/readyz", started, timeout_s)
    finally:
        proc.terminate()
        proc.wait(120)
    phases = [(float(at), text) for at, text in _PHASE_LINE.findall(log_path.read_text(errors="replace"))]
    converting, loading = phase_durations(phases)
    return Start(round(listening, 2), round(ready, 2), round(converting, 1), round(loading, 1), phases)


def _until(proc: subprocess.Popen[bytes], url: str, started: float, timeout_s: float) -> float:
    """Seconds from ``started`` until ``url`` answers 200."""
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"kvchat serve exited with {proc.returncode} (see its log)")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return time.monotonic() - started
        except httpx.TransportError:
            pass
        time.sleep(_POLL_S)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:.0f}s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.start_time", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--model", default="smollm2", help="KVCHAT_MODEL (default: the packaged SmolLM2 GGUF)")
    p.add_argument("--repeats", type=int, default=2, help="rounds of a first and a later start")
    p.add_argument("--port", type=int, default=18631)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a start may take")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from bench.reporting import format_table, machine_info, reproduce_command

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    rounds: list[dict[str, Start]] = []
    with tempfile.TemporaryDirectory(prefix="kvchat-start-") as tmp:
        for r in range(args.repeats):
            folder = Path(tmp) / f"round-{r}"
            folder.mkdir()
            first = start_once(folder, args.model, args.port, folder / "first.log", args.timeout)
            later = start_once(folder, args.model, args.port, folder / "later.log", args.timeout)
            rounds.append({"first": first, "later": later})
    rows = []
    summary: dict[str, dict[str, float]] = {}
    for kind in ("first", "later"):
        starts = [r[kind] for r in rounds]
        summary[kind] = {
            name: round(statistics.median(getattr(s, name) for s in starts), 2)
            for name in ("listening_s", "ready_s", "converting_s", "loading_s")
        }
        rows.append([kind, *summary[kind].values()])
    print(format_table(["start", "listening s", "ready s", "converting s", "loading s"], rows))
    report = {
        "name": "start_time",
        "command": "flock /tmp/kvchat-bench.lock " + reproduce_command("bench.start_time", argv),
        "machine": machine_info(),
        "model": args.model,
        "median": summary,
        "rounds": [{kind: asdict(s) for kind, s in r.items()} for r in rounds],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
