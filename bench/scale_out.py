"""Scale-out: 32 replayed chat sessions on two ``kvchat engine-serve`` replicas behind vllm-router, ``consistent_hash``
(session affinity on ``X-Session-ID``) against ``round_robin``, with one replica as the reference; and the router's
added latency (the same request direct to a replica and through the router, interleaved).

Each session replays a CuCom conversation (``bench/datasets.py``): a shared system prompt with the agent handbook,
then the customer's turns, with the dataset's agent replies as history, so every scenario sends exactly the same
token ids (tokenized here with the model's chat template, as the backend does). Each scenario uses its own namespace
(``cache_salt``), so every scenario starts cold. Replicas get enough KV memory that nothing is evicted: the hit rate
then measures routing alone. Hit rate = cached prompt tokens / prompt tokens, as the replicas report them; TTFT is
measured here, from sending the request to its first streamed token.

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.scale_out

Writes ``docs/benchmarks/scale_out.json``. NOTE: on a 2-core machine the replicas share the same cores, so two of them
cannot serve more than one; the throughput of N replicas on N machines is projected from one replica's measured
figures (``projection`` in the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.datasets import CONVERSATIONS, GUIDELINES
from bench.metrics import percentile
from bench.reporting import machine_info, reproduce_command, write_json
from bench.workload import load_conversations, load_guidelines, render_policy, system_prompt

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "scale_out.json"
ROUTER = Path(sys.executable).parent / "vllm-router"
SECRET = "bench-scale-out"
AUTH = {"Authorization": f"Bearer {SECRET}"}
TARGET_HIT_POINTS = 3.0  # consistent_hash's hit rate within this many points of one replica's
TARGET_ROUTER_P50_MS = 2.0


@dataclass(frozen=True, slots=True)
class Request:
    session: str
    turn: int
    token_ids: list[int]


@dataclass(frozen=True, slots=True)
class Result:
    session: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float


# ---------------------------------------------------------------------------------------------- processes


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _process(args: list[str], env: dict[str, str], log: Path, health: str) -> Iterator[None]:
    with log.open("ab") as out:
        proc = subprocess.Popen(args, cwd=REPO_ROOT, env=os.environ | env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{args[0]} exited: see {log}")
            try:
                if httpx.get(health, timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{health} did not answer within 600 s: see {log}")
            time.sleep(0.2)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def replica(model: str, kv_mb: int, workdir: Path, name: str) -> Iterator[str]:
    port = _free_port()
    env = {
        "KVCHAT_MODEL": model, "KVCHAT_ENGINE_DEVICE": "cpu", "KVCHAT_MAX_KV_MEMORY_MB": str(kv_mb),
        "KVCHAT_KV_DISK_CACHE": "false", "KVCHAT_DATA_DIR": str(workdir / name), "KVCHAT_ENGINE_SECRET": SECRET,
        "KVCHAT_LOG_LEVEL": "warning",
    }  # fmt: skip
    args = [sys.executable, "-m", "backend.cli", "engine-serve", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with _process(args, env, workdir / f"{name}.log", f"{url}/health"):
        yield url


@contextmanager
def router(workers: Sequence[str], policy: str, workdir: Path) -> Iterator[str]:
    port = _free_port()
    args = [
        str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers, "--policy", policy,
        "--prometheus-port", str(_free_port()), "--health-check-endpoint", "/health", "--log-level", "warning",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with _process(args, {}, workdir / f"router-{policy}.log", f"{url}/health"):
        yield url


# ---------------------------------------------------------------------------------------------- the workload


def sessions(tokenizer: Any, args: argparse.Namespace) -> list[list[Request]]:
    """``args.sessions`` sessions of at most ``args.turns`` customer turns each, tokenized with the chat template;
    messages cut at ``args.message_chars``, and a session ends before a prompt past ``args.max_prompt_tokens``."""
    policy = render_policy(load_guidelines(GUIDELINES), 0, 0, args.policy_chars)
    system = {"role": "system", "content": system_prompt(0, policy)}
    out: list[list[Request]] = []
    for i, conversation in enumerate(load_conversations(CONVERSATIONS)[: args.sessions]):
        history: list[dict[str, str]] = [system]
        replay: list[Request] = []
        for t, (user, agent) in enumerate(conversation.pairs[: args.turns]):
            history.append({"role": "user", "content": user[: args.message_chars]})
            ids = tokenizer.apply_chat_template(history)
            if len(ids) > args.max_prompt_tokens:
                break
            replay.append(Request(f"s{i}", t, ids))
            history.append({"role": "assistant", "content": agent[: args.message_chars]})
        out.append(replay)
    return out


async def replay(url: str, salt: str, workload: list[list[Request]], parallel: int, max_tokens: int) -> list[Result]:
    """Every session's turns in order; ``parallel`` sessions at a time."""
    limit = asyncio.Semaphore(parallel)
    results: list[Result] = []
    async with httpx.AsyncClient(headers=AUTH, timeout=120) as http:

        async def run(session: list[Request]) -> None:
            async with limit:
                for request in session:
                    results.append(await _turn(http, url, salt, request, max_tokens))

        await asyncio.gather(*(run(s) for s in workload))
    return results


async def _turn(http: httpx.AsyncClient, url: str, salt: str, request: Request, max_tokens: int) -> Result:
    body = {
        "prompt": request.token_ids, "max_tokens": max_tokens, "stream": True, "cache_salt": salt,
        "kvchat": {"session": f"{salt}-{request.session}"},
    }  # fmt: skip
    start, first, usage = time.perf_counter(), None, None
    headers = {"X-Session-ID": f"{salt}-{request.session}"}
    async with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if first is None and data["choices"] and data["choices"][0]["token_ids"]:
                first = time.perf_counter()
            usage = data.get("usage") or usage
    assert usage is not None and first is not None
    cached = int(usage["prompt_tokens_details"]["cached_tokens"])
    return Result(request.session, request.turn, int(usage["prompt_tokens"]), cached, (first - start) * 1000)


def summary(results: Sequence[Result], wall_s: float) -> dict[str, Any]:
    ttft = sorted(r.ttft_ms for r in results)
    prompt = sum(r.prompt_tokens for r in results)
    later = [r for r in results if r.turn > 0]
    return {
        "requests": len(results),
        "hit_rate": sum(r.cached_tokens for r in results) / prompt,
        "hit_rate_turn2_on": sum(r.cached_tokens for r in later) / max(1, sum(r.prompt_tokens for r in later)),
        "ttft_ms_mean": statistics.fmean(ttft),
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p99": percentile(ttft, 99),
        "wall_s": wall_s,
        "requests_per_s": len(results) / wall_s,
        "prompt_tokens_per_s": prompt / wall_s,
    }


async def router_latency(direct: str, routed: str, n: int) -> dict[str, Any]:
    """The same tiny request direct and through the router, interleaved; latency of the whole answer."""
    body = {"prompt": [1, 2, 3], "max_tokens": 1, "cache_salt": "latency"}
    times: dict[str, list[float]] = {"direct": [], "router": []}
    async with httpx.AsyncClient(headers=AUTH | {"X-Session-ID": "latency"}, timeout=60) as http:
        for i in range(n + 20):
            for name, url in (("direct", direct), ("router", routed)):
                start = time.perf_counter()
                (await http.post(f"{url}/v1/completions", json=body)).raise_for_status()
                if i >= 20:  # (the first 20 warm the connections and the cache)
                    times[name].append((time.perf_counter() - start) * 1000)
    out: dict[str, Any] = {}
    for name, values in times.items():
        ordered = sorted(values)
        out[name] = {"p50": percentile(ordered, 50), "p99": percentile(ordered, 99)}
    out["added_ms_p50"] = out["router"]["p50"] - out["direct"]["p50"]
    out["added_ms_p99"] = out["router"]["p99"] - out["direct"]["p99"]
    return out


def _timed(url: str, salt: str, workload: list[list[Request]], args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    results = asyncio.run(replay(url, salt, workload, args.parallel, args.max_tokens))
    return summary(results, time.perf_counter() - start)


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from engine.model.loader import resolve_model
    from engine.testing import build_tiny_model
    from engine.tokenizer import Tokenizer

    model = str(build_tiny_model(workdir / "tiny", suppress_eos=True)) if args.model == "tiny" else args.model
    tokenizer = Tokenizer(resolve_model(model).path)
    workload = sessions(tokenizer, args)
    scenarios: dict[str, Any] = {}
    with replica(model, args.kv_mb, workdir, "r1") as r1, replica(model, args.kv_mb, workdir, "r2") as r2:
        print("replicas up; one replica, direct", flush=True)
        scenarios["one_replica"] = _timed(r1, "one", workload, args)
        for policy in ("consistent_hash", "round_robin"):
            with router([r1, r2], policy, workdir) as url:
                print(f"two replicas, {policy}", flush=True)
                scenarios[policy] = _timed(url, policy, workload, args)
                if policy == "consistent_hash":
                    scenarios["router_latency"] = asyncio.run(router_latency(r1, url, args.latency_requests))
    prompt_tokens = [len(r.token_ids) for s in workload for r in s]
    return {
        "model": args.model,
        "scenarios": scenarios,
        "requests": len(prompt_tokens),
        "sessions": len(workload),
        "prompt_tokens_mean": statistics.fmean(prompt_tokens),
        "config": {k: str(v) for k, v in vars(args).items()},
    }


def projection(one: dict[str, Any], replicas: Sequence[int] = (1, 2, 4, 8)) -> list[dict[str, Any]]:
    """N replicas on N machines like this one: affinity keeps each replica's hit rate, so each serves what one does
    (the router's added latency is per request, not per replica): throughput scales with N until the router or the
    backend is the bound."""
    return [{"replicas": n, "requests_per_s": n * one["requests_per_s"]} for n in replicas]


def markdown(report: dict[str, Any]) -> str:
    s = report["scenarios"]
    rows = [
        "| scenario | hit rate | hit rate, turns 2+ | TTFT mean (ms) | TTFT p99 (ms) | requests/s |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("one_replica", "consistent_hash", "round_robin"):
        r = s[name]
        rows.append(
            f"| {name} | {r['hit_rate']:.1%} | {r['hit_rate_turn2_on']:.1%} | {r['ttft_ms_mean']:.1f} | "
            f"{r['ttft_ms_p99']:.1f} | {r['requests_per_s']:.2f} |"
        )
    lat = s["router_latency"]
    rows.append("")
    rows.append(
        f"Router added latency: p50 {lat['added_ms_p50']:.2f} ms, p99 {lat['added_ms_p99']:.2f} ms "
        f"(direct p50 {lat['direct']['p50']:.2f} ms, through the router {lat['router']['p50']:.2f} ms)."
    )
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.scale_out", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny (built here, fp32), smollm2, or a model folder")
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=6, help="customer turns per session (at most)")
    p.add_argument("--policy-chars", type=int, default=1200, help="the system prompt's handbook excerpt")
    p.add_argument("--message-chars", type=int, default=300, help="each message cut at this many characters")
    p.add_argument("--max-prompt-tokens", type=int, default=1900, help="a session ends before a longer prompt")
    p.add_argument("--parallel", type=int, default=4, help="sessions replayed at once")
    p.add_argument("--max-tokens", type=int, default=8, help="reply tokens per turn")
    p.add_argument("--kv-mb", type=int, default=96, help="each replica's KV pool (enough that nothing is evicted)")
    p.add_argument("--latency-requests", type=int, default=200)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not ROUTER.exists():
        raise SystemExit("error: vllm-router is not installed (pip install -e '.[dev]')")
    with tempfile.TemporaryDirectory(prefix="kvchat-scale-out-") as workdir:
        report = run(args, Path(workdir))
    s = report["scenarios"]
    gap = 100 * (s["one_replica"]["hit_rate"] - s["consistent_hash"]["hit_rate"])
    added = s["router_latency"]["added_ms_p50"]
    report["targets"] = {
        "hit_rate_gap_points": gap,
        "hit_rate_gap_met": gap <= TARGET_HIT_POINTS,
        "router_added_ms_p50": added,
        "router_added_met": added <= TARGET_ROUTER_P50_MS,
    }
    report["projection"] = projection(s["one_replica"])
    report["command"] = "flock /tmp/kvchat-bench.lock " + reproduce_command("bench.scale_out", sys.argv[1:])
    report["machine"] = machine_info(dtype="float32" if args.model == "tiny" else None)
    print(markdown(report))
    print(f"affinity hit-rate gap {gap:.2f} points (target ≤ {TARGET_HIT_POINTS:g}); router adds {added:.2f} ms p50 "
          f"(target ≤ {TARGET_ROUTER_P50_MS:g})")  # fmt: skip
    write_json(args.out, report)
    print(f"wrote {args.out}\nreproduce: {report['command']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
