"""Restart and returning-customer benchmark of the disk tier (issue 23): warm TTFT vs a cold recompute, fp32.

Reproduce the committed figures (docs/benchmarks/tier_restart.json):

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.tier_restart

The session is the workload's (bench/workload.py): tenant 0's system prompt (instruction + agent-handbook policy)
and CuCom turns, up to the first turn whose prompt reaches ``--tokens`` tokens; its *next turn* is the same prompt
plus the recorded agent reply and the next customer message (with the generation prompt).

* **Restart.** Child process A (``python -m bench.tier_restart child``, a fresh disk directory) runs the session's
  turn and exits after ``close_disk_tier()`` (what a graceful server stop does). Child B, same disk directory, runs
  the next turn. Child C runs the next turn with prefix caching off (the cold recompute). Every child first runs a
  short unrelated warm-up prompt, so no measured request pays for the process's first forward pass.
* **Returning customer.** In this process (a disk tier and a small pool): the turn runs with ``session=``, then
  ``release_session`` (what the backend's idle sweeper calls), then other tenants' sessions fill the pool, then the
  customer's next turn; the cold recompute is the same prompt in a namespace with nothing cached.

Each scenario repeats ``--repeats`` times (fresh namespaces, so no repeat reuses another's blocks); medians are
reported. Output: a table, ``docs/benchmarks/tier_restart.json`` (with the command and the machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.workload import DEFAULT_DATA_DIR, DEFAULT_POLICY_CHARS, Session, WorkloadConfig, build_sessions
from engine.prompt import common_prefix

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "tier_restart.json"
TARGET_RATIO = 0.25
_WARMUP_TEXT = "Hello, I would like to check on an order I placed last week."
_CHILD_TIMEOUT_S = 600.0


# ---------------------------------------------------------------------------------------------------- the prompts


def engine_config(args: argparse.Namespace, **overrides: Any) -> Any:
    from engine.config import EngineConfig

    values: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "device": "cpu",
        "max_kv_memory_mb": args.kv_mb,
        "num_threads": args.threads,
    }
    return EngineConfig(**(values | overrides))


def session_turn(engine: Any, session: Session, tokens: int) -> tuple[list[int], list[int], int]:
    """(turn prompt, next-turn prompt, turn index): the first turn whose prompt reaches ``tokens`` tokens."""
    for k in range(1, len(session.turns)):
        turn = engine.tokenize(session.messages(k))
        if len(turn) >= tokens:
            return turn, engine.tokenize(session.messages(k + 1)), k
    raise SystemExit(f"tier_restart: the session never reaches {tokens} tokens (raise --session-turns)")


# ---------------------------------------------------------------------------------------------------- children


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One process's part of the restart scenario: ``cache`` (turn, then close the tier), ``resume``, ``cold``."""
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    args = argparse.Namespace(**spec["engine"])
    role = spec["role"]
    overrides: dict[str, Any] = {"enable_prefix_caching": False} if role == "cold" else {}
    if role != "cold":
        overrides["disk_cache_dir"] = spec["disk_dir"]
    started = time.perf_counter()
    engine = LLMEngine(engine_config(args, **overrides))
    engine.load()
    loaded_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=spec["max_tokens"])
    engine.generate_sync([[{"role": "user", "content": _WARMUP_TEXT}]], params, "warm-up")
    (out,) = engine.generate_sync([spec["prompt"]], params, spec["namespace"])
    if role == "cache":
        engine.close_disk_tier()
    return {
        "role": role,
        "load_s": round(loaded_s, 3),
        "ttft_s": out.stats.ttft_s,
        "token_ids": list(out.token_ids),
        "prompt_tokens": out.stats.prompt_tokens,
        "cached_tokens": out.stats.cached_tokens,
        "cached_tokens_by_tier": dict(out.stats.cached_tokens_by_tier),
    }


def spawn(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Run one child as a real ``python -m`` process; its result comes back through a JSON file."""
    spec_path = workdir / f"{spec['role']}-spec.json"
    result_path = workdir / f"{spec['role']}-result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.tier_restart", "child", str(spec_path), str(result_path)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=_CHILD_TIMEOUT_S, check=False)
    if proc.returncode != 0 or not result_path.is_file():
        raise SystemExit(f"tier_restart: child {spec['role']} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result


def restart_round(args: argparse.Namespace, turn: list[int], nxt: list[int], r: int, workdir: Path) -> dict[str, Any]:
    disk = workdir / f"kv-{r}"
    base = {
        "engine": {k: getattr(args, k) for k in ("model", "dtype", "kv_mb", "threads")},
        "disk_dir": str(disk),
        "max_tokens": args.max_tokens,
        "namespace": f"tenant-restart-{r}",
    }
    cached = spawn(base | {"role": "cache", "prompt": turn}, workdir)
    warm = spawn(base | {"role": "resume", "prompt": nxt}, workdir)
    cold = spawn(base | {"role": "cold", "prompt": nxt}, workdir)
    disk_bytes = sum(f.stat().st_size for f in disk.rglob("*") if f.is_file())
    return _round("restart", r, warm, cold) | {"disk_bytes": disk_bytes, "turn_ttft_s": round(cached["ttft_s"], 4)}


def _round(kind: str, r: int, warm: dict[str, Any], cold: dict[str, Any]) -> dict[str, Any]:
    return {
        "scenario": kind,
        "round": r,
        "warm_ttft_s": round(warm["ttft_s"], 4),
        "cold_ttft_s": round(cold["ttft_s"], 4),
        "ratio": round(warm["ttft_s"] / cold["ttft_s"], 4) if cold["ttft_s"] > 0 else None,
        "identical": warm["token_ids"] == cold["token_ids"],
        "prompt_tokens": warm["prompt_tokens"],
        "cached_tokens_by_tier": warm["cached_tokens_by_tier"],
        "cold_cached_tokens": cold["cached_tokens"],
        "warm_token_ids": warm["token_ids"],
        "cold_token_ids": cold["token_ids"],
    }


# ---------------------------------------------------------------------------------------------------- returning


def returning_round(
    engine: Any, turn: list[int], nxt: list[int], fillers: list[list[int]], r: int, params: Any
) -> dict[str, Any]:
    """Turn with ``session=``, idle sweep (``release_session``), other sessions, then the customer comes back."""
    namespace, session = f"tenant-returning-{r}", f"customer-{r}"
    done: list[Any] = []
    engine.submit(turn, params, namespace, done.append, session=session)
    engine.run_until_idle()
    released = engine.release_session(session)
    engine.generate_sync(fillers, params, f"others-{r}")
    (warm,) = engine.generate_sync([nxt], params, namespace)
    (cold,) = engine.generate_sync([nxt], params, f"cold-{r}")
    as_dict = [
        {
            "ttft_s": o.stats.ttft_s,
            "token_ids": list(o.token_ids),
            "prompt_tokens": o.stats.prompt_tokens,
            "cached_tokens": o.stats.cached_tokens,
            "cached_tokens_by_tier": dict(o.stats.cached_tokens_by_tier),
        }
        for o in (warm, cold)
    ]
    return _round("returning", r, as_dict[0], as_dict[1]) | {"released_blocks": released}


def filler_prompts(engine: Any, args: argparse.Namespace, pool_tokens: int) -> list[list[int]]:
    """Other tenants' sessions (no block shared with the customer's) whose prompts add up to more than the pool."""
    config = WorkloadConfig(
        data_dir=args.data_dir, turns=args.session_turns, tenants=4, policy_chars=args.policy_chars, seed=1
    )
    out: list[list[int]] = []
    for s in build_sessions(config, 16):
        if s.tenant == "tenant0":
            continue
        ids = engine.tokenize(s.messages(min(3, len(s.turns))))
        out.append(ids)
        if sum(len(x) for x in out) > pool_tokens * 1.2:
            return out
    return out


# ---------------------------------------------------------------------------------------------------- report


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [r["ratio"] for r in rounds if r["ratio"] is not None]
    return {
        "rounds": len(rounds),
        "warm_ttft_s_median": round(statistics.median(r["warm_ttft_s"] for r in rounds), 4),
        "cold_ttft_s_median": round(statistics.median(r["cold_ttft_s"] for r in rounds), 4),
        "ratio_median": round(statistics.median(ratios), 4) if ratios else None,
        "ratio_max": round(max(ratios), 4) if ratios else None,
        "meets_target": bool(ratios) and statistics.median(ratios) <= TARGET_RATIO,
        "outputs_identical": all(r["identical"] for r in rounds),
        "disk_tokens_median": statistics.median(r["cached_tokens_by_tier"].get("disk", 0) for r in rounds),
        "memory_tokens_median": statistics.median(r["cached_tokens_by_tier"].get("memory", 0) for r in rounds),
        "prompt_tokens": rounds[0]["prompt_tokens"],
    }


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("flags") and ":" in line:
                flags = set(line.split(":", 1)[1].split())
                return sorted(f for f in flags if f.startswith(("amx", "avx512f", "avx512_bf16", "avx2")))
    except OSError:
        pass
    return []


def machine(dtype: str, threads: int | None) -> dict[str, Any]:
    from bench.reporting import machine_info

    return machine_info(dtype, threads) | {"cpu_flags": cpu_flags()}


def table(summaries: dict[str, dict[str, Any]]) -> str:
    from bench.reporting import format_table

    headers = ["scenario", "prompt", "warm TTFT s", "cold TTFT s", "warm/cold", "target", "identical", "disk tok"]
    rows = [
        [
            name,
            s["prompt_tokens"],
            f"{s['warm_ttft_s_median']:.3f}",
            f"{s['cold_ttft_s_median']:.3f}",
            f"{s['ratio_median']:.3f}" if s["ratio_median"] is not None else "-",
            f"<= {TARGET_RATIO}",
            "yes" if s["outputs_identical"] else "NO",
            s["disk_tokens_median"],
        ]
        for name, s in summaries.items()
    ]
    return str(format_table(headers, rows))


def _progress(line: str) -> None:
    print(f"[tier_restart] {line}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.tier_restart", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (the default model), a safetensors folder or a .gguf")
    p.add_argument("--dtype", default="float32", help="float32 so warm and cold outputs compare token for token")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--tokens", type=int, default=2000, help="the cached session's length in tokens (at least)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of each scenario (medians are reported)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    p.add_argument("--kv-mb", type=int, default=512, help="KV pool of the restart children (MB)")
    p.add_argument("--returning-kv-mb", type=int, default=256, help="KV pool of the returning-customer engine (MB)")
    p.add_argument("--session-turns", type=int, default=40, help="turns the workload session is built with")
    p.add_argument("--policy-chars", type=int, default=DEFAULT_POLICY_CHARS, help="policy text in the system prompt")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="CuCom conversations + ABCD handbook")
    p.add_argument("--skip", choices=("restart", "returning"), default=None, help="leave one scenario out")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON report goes")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["child"]:
        spec = json.loads(Path(argv[1]).read_text())
        Path(argv[2]).write_text(json.dumps(run_child(spec)))
        return 0
    args = build_parser().parse_args(argv)
    from bench.reporting import reproduce_command
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvchat-tier-restart-") as tmp:
        workdir = Path(tmp)
        engine = LLMEngine(
            engine_config(args, max_kv_memory_mb=args.returning_kv_mb, disk_cache_dir=str(workdir / "returning"))
        )
        info = engine.load()
        config = WorkloadConfig(data_dir=args.data_dir, turns=args.session_turns, policy_chars=args.policy_chars)
        (session,) = build_sessions(config, 1)
        turn, nxt, k = session_turn(engine, session, args.tokens)
        shared = common_prefix(turn, nxt)
        _progress(
            f"session {session.session_id}: turn {k} has {len(turn)} tokens, the next {len(nxt)} ({shared} shared)"
        )
        rounds: list[dict[str, Any]] = []
        if args.skip != "restart":
            for r in range(args.repeats):
                _progress(f"restart round {r + 1}/{args.repeats}: child A caches, B resumes, C recomputes cold")
                rounds.append(restart_round(args, turn, nxt, r, workdir))
                _progress(f"  warm {rounds[-1]['warm_ttft_s']:.3f} s, cold {rounds[-1]['cold_ttft_s']:.3f} s")
        if args.skip != "returning":
            params = SamplingParams(max_tokens=args.max_tokens)
            fillers = filler_prompts(engine, args, info.num_blocks * info.block_size)
            engine.generate_sync([[{"role": "user", "content": _WARMUP_TEXT}]], params, "warm-up")
            for r in range(args.repeats):
                _progress(f"returning round {r + 1}/{args.repeats}: turn, release_session, {len(fillers)} others, back")
                rounds.append(returning_round(engine, turn, nxt, fillers, r, params))
                _progress(f"  warm {rounds[-1]['warm_ttft_s']:.3f} s, cold {rounds[-1]['cold_ttft_s']:.3f} s")
        tiers = engine.stats().tiers
        engine.close_disk_tier()
    summaries = {
        kind: summarize([r for r in rounds if r["scenario"] == kind])
        for kind in ("restart", "returning")
        if any(r["scenario"] == kind for r in rounds)
    }
    print(table(summaries))
    report = {
        "command": reproduce_command("bench.tier_restart", argv),
        "model": info.model_path,
        "dtype": info.dtype,
        "block_size": info.block_size,
        "session": {"id": session.session_id, "turn": k, "turn_tokens": len(turn), "next_tokens": len(nxt)},
        "shared_prefix_tokens": shared,
        "target_ratio": TARGET_RATIO,
        "summary": summaries,
        "rounds": rounds,
        "returning_engine": {"kv_mb": args.returning_kv_mb, "num_blocks": info.num_blocks, "tiers": _tiers(tiers)},
        "machine": machine(info.dtype, args.threads),
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _tiers(tiers: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return dict(asdict(tiers))


if __name__ == "__main__":
    raise SystemExit(main())
