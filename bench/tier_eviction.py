"""Eviction benchmark (issue 23): the weighted policy vs plain LRU, same pool, same replay, same run.

Reproduce the committed figures (docs/benchmarks/tier_eviction.json and .png):

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.tier_eviction --disk

The replay is the workload's (bench/workload.py): ``--tenants`` tenants (each its own system prompt + agent-handbook
policy, its own namespace) and ``--sessions`` sessions of ``--turns`` CuCom turns (conversations spliced back to back:
real topic shifts). ``--active`` sessions are open at once; each step advances a random open one (seeded), so sessions
sit idle between turns, and a finished session's place goes to the next. Turns run one at a time (no queueing).

Prompts are typed as the backend's context builder types them (``engine.prompt.SegmentedPrompt``): the system
prompt and policy text as ``system_prompt`` / ``policy_text``, every message cut into blocks by the backend's splitter
(``identifier``, ``question``, ``step``, ``context``...). Before each turn the session's semantic temperature comes
from the backend's topic tracker (tf-idf, tuned settings) over the customer messages, as the chat service sets it
(``engine.set_session_temperature``). Nothing is pinned: the comparison is the eviction order alone.

Each policy runs on a fresh engine with the same ``--kv-mb`` pool (smaller than the replay's working set); with
``--disk`` each also runs with a disk tier (a fresh directory). Measured per run: hit rate (cached prompt tokens /
prompt tokens, memory and disk; and past the tenant prefix, the part eviction decides), mean and median TTFT, hit rate
per block type, and whether every output matches the other runs' (fp32: a cache hit must never change an output).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.tier_restart import machine
from bench.workload import DEFAULT_DATA_DIR, DEFAULT_POLICY_CHARS, Session, WorkloadConfig, build_sessions

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "tier_eviction.json"
DEFAULT_PNG = REPO_ROOT / "docs" / "benchmarks" / "tier_eviction.png"
POLICIES = ("lru", "weighted")
PREFIX_TYPES = ("system_prompt", "policy_text")
_HANDBOOK_HEADER = "\n\n# Agent handbook\n"


@dataclass(frozen=True, slots=True)
class Step:
    session: str
    tenant: str
    turn: int
    temperature: float
    prompt: Any  # engine.prompt.SegmentedPrompt


# ---------------------------------------------------------------------------------------------------- the replay


def schedule(sessions: Sequence[Session], active: int, seed: int) -> list[tuple[int, int]]:
    """(session index, turn) in replay order: ``active`` sessions open at once, a random open one advances."""
    rng = random.Random(f"eviction:{seed}")
    waiting = list(range(len(sessions)))
    open_: list[int] = []
    next_turn = [1] * len(sessions)
    order: list[tuple[int, int]] = []
    while waiting or open_:
        while waiting and len(open_) < active:
            open_.append(waiting.pop(0))
        s = rng.choice(open_)
        order.append((s, next_turn[s]))
        next_turn[s] += 1
        if next_turn[s] > len(sessions[s].turns):
            open_.remove(s)
    return order


def build_steps(sessions: Sequence[Session], active: int, seed: int) -> list[Step]:
    from backend.context.rules import DEFAULT_RULES, RuleSet
    from backend.context.similarity import TfidfSimilarity
    from backend.context.splitter import Splitter, word_count
    from backend.context.topic import CosineScorer, TopicTracker, identifier_keys, tuned

    rules = RuleSet.compile(DEFAULT_RULES)
    splitter = Splitter(rules, word_count)
    ident = functools.lru_cache(maxsize=None)(identifier_keys(rules))
    scorer = CosineScorer(TfidfSimilarity())
    temperatures: dict[tuple[int, int], float] = {}
    for i, session in enumerate(sessions):
        tracker = TopicTracker(tuned("tfidf"), scorer, ident)
        for turn in session.turns:
            temperatures[(i, turn.index)] = tracker.observe_customer(turn.user).temperature
            tracker.observe_context(turn.reference_reply)
    return [
        Step(
            sessions[i].session_id, sessions[i].tenant, k, temperatures[(i, k)], typed_prompt(sessions[i], k, splitter)
        )
        for i, k in schedule(sessions, active, seed)
    ]


def typed_prompt(session: Session, turn: int, splitter: Any) -> Any:
    """The turn's messages as the backend's builder types them (same text, so the same token ids)."""
    from engine.prompt import Segment, SegmentedPrompt

    head, _, policy = session.system_prompt.partition(_HANDBOOK_HEADER)
    system = [Segment(head, "system_prompt")]
    if policy:
        system.append(Segment(_HANDBOOK_HEADER + policy, "policy_text"))
    messages: list[tuple[str, list[Any]]] = [("system", system)]
    for m in session.messages(turn)[1:]:
        messages.append((m["role"], message_segments(m["content"], splitter)))
    return SegmentedPrompt.of(*messages)


def message_segments(text: str, splitter: Any) -> list[Any]:
    """Cut at the splitter's blocks; each block takes the gap before it, the last one the text after (as the
    backend's ``message_segments`` does)."""
    from engine.prompt import Segment

    blocks = splitter.split(text, seq=0, epoch=0)
    if not blocks:
        return [Segment(text, "context")]
    out, pos = [], 0
    for i, block in enumerate(blocks):
        end = len(text) if i == len(blocks) - 1 else block.end
        out.append(Segment(text[pos:end], block.type.value))
        pos = end
    return out


# ---------------------------------------------------------------------------------------------------- one run


def replay(args: argparse.Namespace, steps: Sequence[Step], policy: str, disk: Path | None) -> dict[str, Any]:
    from engine.config import EngineConfig
    from engine.kv.tier_config import CacheSettings
    from engine.llm_engine import LLMEngine
    from engine.outputs import RequestFinished
    from engine.sampling_params import SamplingParams

    label = f"{policy}{' + disk' if disk else ''}"
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device="cpu",
        max_kv_memory_mb=args.kv_mb,
        num_threads=args.threads,
        disk_cache_dir=str(disk) if disk else None,
        cache_settings=CacheSettings(eviction_policy=policy),
    )
    engine = LLMEngine(config)
    info = engine.load()
    params = SamplingParams(max_tokens=args.max_tokens)
    engine.generate_sync([[{"role": "user", "content": "Hello, is anyone there?"}]], params, "warm-up")
    turns: list[dict[str, Any]] = []
    started = time.perf_counter()
    for n, step in enumerate(steps, 1):
        engine.set_session_temperature(step.session, step.temperature)
        done: list[Any] = []
        engine.submit(step.prompt, params, step.tenant, done.append, session=step.session)
        engine.run_until_idle()
        (out,) = (e for e in done if isinstance(e, RequestFinished))
        s = out.stats
        turns.append(
            {
                "session": step.session,
                "turn": step.turn,
                "temperature": round(step.temperature, 3),
                "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens,
                "cached_tokens_by_tier": dict(s.cached_tokens_by_tier),
                "prompt_tokens_by_type": dict(s.prompt_tokens_by_type),
                "cached_tokens_by_type": dict(s.cached_tokens_by_type),
                "ttft_s": round(s.ttft_s, 4),
                "token_ids": list(out.token_ids),
            }
        )
        if n % 10 == 0 or n == len(steps):
            hit = sum(t["cached_tokens"] for t in turns) / max(1, sum(t["prompt_tokens"] for t in turns))
            _progress(
                f"{label}: {n}/{len(steps)} turns, hit rate so far {hit:.1%}, {time.perf_counter() - started:.0f} s"
            )
    tiers = engine.stats().tiers
    engine.close_disk_tier()
    return summarize(label, policy, disk is not None, turns, info.num_blocks) | {
        "demoted_blocks": tiers.demoted_blocks,
        "promoted_blocks": tiers.promoted_blocks,
        "seconds": round(time.perf_counter() - started, 1),
        "turns": turns,
    }


def summarize(label: str, policy: str, disk: bool, turns: list[dict[str, Any]], num_blocks: int) -> dict[str, Any]:
    prompt = sum(t["prompt_tokens"] for t in turns)
    by_tier: Counter[str] = Counter()
    typed_prompt: Counter[str] = Counter()
    typed_cached: Counter[str] = Counter()
    for t in turns:
        by_tier.update(t["cached_tokens_by_tier"])
        typed_prompt.update(t["prompt_tokens_by_type"])
        typed_cached.update(t["cached_tokens_by_type"])
    ttfts = [t["ttft_s"] for t in turns]
    # NOTE: every turn starts with its tenant's prefix (system prompt + policy), hot in both policies; what eviction
    # decides is the rest (the conversation), so its hit rate is reported on its own.
    after = prompt - sum(typed_prompt[k] for k in PREFIX_TYPES)
    after_cached = sum(t["cached_tokens"] for t in turns) - sum(typed_cached[k] for k in PREFIX_TYPES)
    return {
        "label": label,
        "policy": policy,
        "disk_tier": disk,
        "pool_blocks": num_blocks,
        "prompt_tokens": prompt,
        "cached_tokens": sum(t["cached_tokens"] for t in turns),
        "hit_rate": round(sum(t["cached_tokens"] for t in turns) / prompt, 4) if prompt else 0.0,
        "hit_rate_memory": round(by_tier["memory"] / prompt, 4) if prompt else 0.0,
        "hit_rate_disk": round(by_tier["disk"] / prompt, 4) if prompt else 0.0,
        "hit_rate_after_prefix": round(after_cached / after, 4) if after else 0.0,
        "hit_rate_by_type": {k: round(typed_cached[k] / v, 4) for k, v in sorted(typed_prompt.items()) if v},
        "mean_ttft_s": round(statistics.fmean(ttfts), 4),
        "median_ttft_s": round(statistics.median(ttfts), 4),
        "total_ttft_s": round(sum(ttfts), 3),
    }


# ---------------------------------------------------------------------------------------------------- report


def verdict(runs: list[dict[str, Any]], disk: bool) -> dict[str, Any]:
    """Which policy wins (hit rate first, mean TTFT as the tie-break within 0.5 points) among runs of one tier set."""
    lru, weighted = (next(r for r in runs if r["policy"] == p and r["disk_tier"] == disk) for p in POLICIES)
    diff = weighted["hit_rate"] - lru["hit_rate"]
    if abs(diff) >= 0.005:
        winner = "weighted" if diff > 0 else "lru"
    else:
        winner = "weighted" if weighted["mean_ttft_s"] < lru["mean_ttft_s"] else "lru"
    return {
        "tiers": "memory + disk" if disk else "memory only",
        "winner": winner,
        "hit_rate_points": round(100 * diff, 2),
        "mean_ttft_ratio_weighted_over_lru": round(weighted["mean_ttft_s"] / lru["mean_ttft_s"], 4),
    }


def outputs_agree(runs: list[dict[str, Any]]) -> dict[str, Any]:
    base = runs[0]["turns"]
    differing = {
        r["label"]: sum(a["token_ids"] != b["token_ids"] for a, b in zip(base, r["turns"], strict=True))
        for r in runs[1:]
    }
    return {"reference": runs[0]["label"], "turns_differing": differing}


def table(runs: list[dict[str, Any]]) -> str:
    from bench.reporting import format_table

    headers = ["run", "pool blocks", "hit rate", "memory", "disk", "after prefix", "mean TTFT s", "median TTFT s", "s"]
    rows = [
        [
            r["label"],
            r["pool_blocks"],
            f"{r['hit_rate']:.1%}",
            f"{r['hit_rate_memory']:.1%}",
            f"{r['hit_rate_disk']:.1%}",
            f"{r['hit_rate_after_prefix']:.1%}",
            f"{r['mean_ttft_s']:.3f}",
            f"{r['median_ttft_s']:.3f}",
            r["seconds"],
        ]
        for r in runs
    ]
    return str(format_table(headers, rows))


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in runs]
    colors = ["#888888" if r["policy"] == "lru" else "#1f77b4" for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    left.bar(labels, [100 * r["hit_rate_memory"] for r in runs], color=colors, label="from memory")
    left.bar(
        labels,
        [100 * r["hit_rate_disk"] for r in runs],
        bottom=[100 * r["hit_rate_memory"] for r in runs],
        color=colors,
        alpha=0.45,
        hatch="//",
        label="from disk",
    )
    left.set(title="Prefix-cache hit rate (cached / prompt tokens)", ylabel="%")
    left.legend(fontsize=8)
    right.bar(labels, [1e3 * r["mean_ttft_s"] for r in runs], color=colors)
    right.set(title="Mean TTFT", ylabel="ms")
    for ax in (left, right):
        ax.grid(True, axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"Eviction: weighted vs LRU, same pool ({runs[0]['pool_blocks']} blocks), same replay", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _progress(line: str) -> None:
    print(f"[tier_eviction] {line}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.tier_eviction", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (the default model), a safetensors folder or a .gguf")
    p.add_argument("--dtype", default="float32", help="float32: outputs of every run compare token for token")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--kv-mb", type=int, default=160, help="the KV pool of every run (MB): under the working set")
    p.add_argument("--tenants", type=int, default=2)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=6, help="turns per session")
    p.add_argument("--active", type=int, default=6, help="sessions open at once")
    p.add_argument(
        "--max-tokens", type=int, default=4, help="tokens generated per turn (replies are the recorded ones)"
    )
    p.add_argument("--policy-chars", type=int, default=DEFAULT_POLICY_CHARS, help="policy text per system prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disk", action="store_true", help="also run each policy with a disk tier")
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, help="CuCom conversations + ABCD handbook")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON report goes")
    p.add_argument("--png", type=Path, default=DEFAULT_PNG, help="where the plot goes")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from bench.reporting import reproduce_command

    started = time.perf_counter()
    config = WorkloadConfig(
        data_dir=args.data_dir, turns=args.turns, seed=args.seed, tenants=args.tenants, policy_chars=args.policy_chars
    )
    sessions = build_sessions(config, args.sessions)
    steps = build_steps(sessions, args.active, args.seed)
    shifts = sum(
        1
        for s in sessions
        for a, b in zip(s.turns, s.turns[1:], strict=False)
        if a.conversation_id != b.conversation_id
    )
    _progress(f"{len(sessions)} sessions, {len(steps)} turns, {args.active} open at once, {shifts} topic shifts")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvchat-tier-eviction-") as tmp:
        for disk in (False, True) if args.disk else (False,):
            for policy in POLICIES:
                directory = Path(tmp) / f"kv-{policy}" if disk else None
                runs.append(replay(args, steps, policy, directory))
                last = runs[-1]
                _progress(f"{last['label']}: hit rate {last['hit_rate']:.1%}, mean TTFT {last['mean_ttft_s']:.3f} s")
    verdicts = [verdict(runs, disk) for disk in ((False, True) if args.disk else (False,))]
    print(table(runs))
    for v in verdicts:
        print(f"{v['tiers']}: {v['winner']} wins ({v['hit_rate_points']:+.2f} hit-rate points for weighted, "
              f"mean TTFT weighted/lru {v['mean_ttft_ratio_weighted_over_lru']:.3f})")  # fmt: skip
    report = {
        "command": reproduce_command("bench.tier_eviction", argv),
        "replay": {
            "tenants": args.tenants,
            "sessions": args.sessions,
            "turns_per_session": args.turns,
            "open_at_once": args.active,
            "turns": len(steps),
            "topic_shifts": shifts,
            "max_tokens": args.max_tokens,
            "kv_mb": args.kv_mb,
            "seed": args.seed,
        },
        "verdicts": verdicts,
        "outputs": outputs_agree(runs),
        "runs": [{k: v for k, v in r.items() if k != "turns"} for r in runs],
        "turns": {r["label"]: [{k: v for k, v in t.items() if k != "token_ids"} for t in r["turns"]] for r in runs},
        "machine": machine(args.dtype, args.threads),
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(runs, args.png)
    print(f"wrote {args.out} and {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
