"""The disk tier through the engine (tiny model, fp32): demotion, promotion, restart, isolation, pinning, erasure.

Every reuse is checked against a cold run of the same prompt: a block served from disk must never change an output.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.errors import InvalidRequestError
from engine.kv.block_hash import hash_chain
from engine.kv.tier_config import CacheSettings
from engine.llm_engine import LLMEngine
from engine.outputs import RequestFinished, TokenDelta
from engine.sampling_params import SamplingParams
from engine.testing import Faults
from support.engines import make_engine

FIRST_ID = 10
GREEDY = SamplingParams(max_tokens=6)


def prompt(n: int, seed: int) -> list[int]:
    """``n`` random ids; the first depends on ``seed``, so prompts of different seeds (below 370) share no block."""
    rng = random.Random(seed)
    return [FIRST_ID + seed % 370] + [rng.randrange(FIRST_ID, 384) for _ in range(n - 1)]


def tiered(model_dir: Path, disk: Path, **overrides: Any) -> LLMEngine:
    # NOTE: no free-space floor, so the tests pass on a machine with little disk left (the guard has its own test)
    defaults = {"max_kv_memory_mb": 1, "cache_settings": CacheSettings(min_free_space_gb=0)}
    engine = make_engine(model_dir, disk_cache_dir=str(disk), **(defaults | overrides))
    engine.load()
    return engine


def run(engine: LLMEngine, ids: list[int], namespace: str = "default") -> RequestFinished:
    (out,) = engine.generate_sync([ids], GREEDY, namespace)
    return out


def flush(engine: LLMEngine) -> None:
    tier = engine.core.cache.tier  # the test seam: wait for the background writer
    assert tier is not None
    tier.writer.flush()


def cold(model_dir: Path, ids: list[int]) -> tuple[int, ...]:
    return run(make_engine(model_dir, enable_prefix_caching=False), ids).token_ids


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> dict[int, tuple[int, ...]]:
    """Cold outputs of the prompts these tests use (seed -> token ids), computed without any cache."""
    engine = make_engine(tiny_model_dir, enable_prefix_caching=False)
    return {seed: run(engine, prompt(160, seed)).token_ids for seed in range(1, 4)}


def test_blocks_pushed_out_of_memory_come_back_from_disk_exactly(
    tiny_model_dir: Path, tmp_path: Path, expected: dict[int, tuple[int, ...]]
) -> None:
    engine = tiered(tiny_model_dir, tmp_path / "kv")
    first = run(engine, prompt(160, 1))
    # NOTE: fill the pool with other prompts until none of seed 1's blocks is left in memory
    filler = 100
    while engine.core.kv.num_cached(hash_chain(engine.core.cache.root("default"), prompt(160, 1), 16)):
        engine.generate_sync([prompt(160, filler + i) for i in range(4)], GREEDY)
        filler += 4
    flush(engine)
    assert engine.stats().tiers.demoted_blocks >= 9 and engine.stats().tiers.disk_blocks >= 9
    again = run(engine, prompt(160, 1))
    assert first.token_ids == again.token_ids == expected[1]
    assert again.stats.cached_tokens_by_tier == {"memory": 0, "disk": 144}  # 9 full blocks; the last is recomputed
    assert again.stats.cached_tokens == 144
    assert engine.stats().tiers.promoted_blocks == 9


def test_the_disk_tier_survives_a_restart_for_the_same_model_and_namespace_only(
    tiny_model_dir: Path, tmp_path: Path, expected: dict[int, tuple[int, ...]]
) -> None:
    disk = tmp_path / "kv"
    first = tiered(tiny_model_dir, disk)
    run(first, prompt(160, 2), "tenant-a")
    first.close_disk_tier()  # what stop() does: memory is written back, so the next process starts warm

    second = tiered(tiny_model_dir, disk)
    assert second.stats().tiers.disk_blocks == 10  # 160 prompt + 6 generated tokens: 10 full blocks
    same = run(second, prompt(160, 2), "tenant-a")
    other = run(second, prompt(160, 2), "tenant-b")
    assert same.token_ids == other.token_ids == expected[2]
    assert same.stats.cached_tokens_by_tier["disk"] == 144
    assert other.stats.cached_tokens == 0  # another namespace never reads tenant-a's blocks
    second.close_disk_tier()

    # NOTE: bf16 K/V differ from fp32 K/V: another dtype must never read these files
    third = tiered(tiny_model_dir, disk, dtype="bfloat16")
    assert run(third, prompt(160, 2), "tenant-a").stats.cached_tokens == 0


def test_a_released_session_is_demoted_and_a_returning_customer_reads_it_back(
    tiny_model_dir: Path, tmp_path: Path, expected: dict[int, tuple[int, ...]]
) -> None:
    engine = tiered(tiny_model_dir, tmp_path / "kv")
    ids = prompt(160, 3)
    rid = engine.submit(ids, GREEDY, "default", lambda event: None, session="s1")
    engine.run_until_idle()
    assert rid
    assert engine.release_session("s1") == 10  # 160 prompt + 6 generated tokens: 10 full blocks recorded
    flush(engine)
    assert engine.stats().tiers.disk_blocks >= 10
    back = run(engine, ids)
    assert back.token_ids == expected[3]
    assert back.stats.cached_tokens_by_tier == {"memory": 0, "disk": 144}


def test_idle_blocks_move_to_disk_after_the_memory_ttl(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = tiered(tiny_model_dir, tmp_path / "kv")
    run(engine, prompt(64, 4))
    assert engine.core.cache.tier is not None
    engine.configure_cache(memory_ttl_s=1e-3)
    import time

    time.sleep(0.01)
    with engine._lock:
        moved = engine.core.cache.tier.sweep_idle(time.monotonic() - engine.cache_settings().memory_ttl_s)
    flush(engine)
    assert moved >= 3 and engine.stats().kv.num_cached_blocks == 0
    assert engine.stats().tiers.disk_blocks == moved


def test_a_full_disk_refuses_writes_and_serving_goes_on(
    tiny_model_dir: Path, tmp_path: Path, expected: dict[int, tuple[int, ...]]
) -> None:
    engine = tiered(tiny_model_dir, tmp_path / "kv")
    engine.configure_cache(min_free_space_gb=1e9)  # more free space than any disk has: every write is refused
    run(engine, prompt(160, 1))
    assert engine.core.cache.tier is not None
    with engine._lock:
        engine.core.cache.tier.sweep_idle(float("inf"))
    flush(engine)
    stats = engine.stats().tiers
    assert stats.disk_blocks == 0 and stats.disk_writes_refused >= 1
    assert run(engine, prompt(160, 1)).token_ids == expected[1]


def test_invalidation_and_erasure_reach_the_disk_copies(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = tiered(tiny_model_dir, tmp_path / "kv")
    ids = prompt(160, 5)
    engine.submit(ids, GREEDY, "ns", lambda event: None, session="s1")
    engine.run_until_idle()
    assert engine.core.cache.tier is not None
    engine.core.cache.tier.demote_all()
    flush(engine)
    assert engine.stats().tiers.disk_blocks == 10
    chain = hash_chain(engine.core.cache.root("ns"), ids, 16)
    result = engine.invalidate("ns", session="s1", from_position=80)  # blocks 5.. go, in memory and on disk
    assert result.blocks_freed == 5
    # NOTE: a removal deletes its whole file (no removed block's bytes stay on disk); the file held all 10
    assert not any(engine.core.cache.tier.store.contains(h) for h in chain[5:])

    run(engine, ids, "ns")
    engine.core.cache.tier.demote_all()
    flush(engine)
    assert engine.stats().tiers.disk_blocks >= 9
    erased = engine.erase_session("s1", "ns")
    assert erased.memory_blocks == 10 and erased.disk_blocks >= 9  # the chain and what depends on it
    assert engine.stats().tiers.disk_blocks == 0 and engine.stats().kv.num_cached_blocks == 0
    assert run(engine, ids, "ns").stats.cached_tokens == 0


def test_a_pinned_prefix_survives_pressure_that_evicts_everything_else(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = make_engine(tiny_model_dir, max_kv_memory_mb=1)  # memory only: pinning needs no disk tier
    engine.load()
    system = prompt(64, 6)
    pin = engine.pin_prefix("default", system)
    assert (pin.blocks, pin.tokens, pin.cached) == (4, 64, 0)
    run(engine, system + prompt(40, 7))
    assert engine.stats().tiers.pinned_blocks == 4
    for seed in range(200, 200 + 3 * engine.info.num_blocks // 10, 4):  # several times the pool
        engine.generate_sync([prompt(160, seed + i) for i in range(4)], GREEDY)
    hit = run(engine, system + prompt(40, 8))
    assert hit.stats.cached_tokens == 64
    assert engine.unpin("default") == 4
    assert engine.stats().tiers.pinned_blocks == 0


def test_pins_are_bounded_by_their_share_of_the_pool(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    engine.load()
    too_many = engine.info.num_blocks // 4 + 1
    with pytest.raises(InvalidRequestError, match="pinned share"):
        engine.pin_prefix("default", prompt(16 * too_many, 9))
    engine.configure_cache(pin_max_fraction=0.5)
    assert engine.pin_prefix("default", prompt(16 * too_many, 9)).blocks == too_many
    with pytest.raises(InvalidRequestError, match="unpin first"):
        engine.configure_cache(pin_max_fraction=0.1)


def test_cache_settings_change_at_runtime_and_bad_values_are_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = tiered(tiny_model_dir, tmp_path / "kv")
    settings = engine.configure_cache(memory_ttl_s=5, eviction_policy="lru", type_weights={"identifier": 9})
    assert (settings.memory_ttl_s, settings.eviction_policy) == (5, "lru")
    assert settings.type_weights["identifier"] == 9 and settings.type_weights["policy_text"] == 3.0
    assert engine.cache_settings() == settings
    for bad in ({"memory_ttl_s": 0}, {"eviction_policy": "random"}, {"nope": 1}, {"disk_ttl_s": "1"}):
        with pytest.raises(InvalidRequestError):
            engine.configure_cache(**bad)
    assert engine.cache_settings() == settings


# ---------------------------------------------------------------------------------------------------- disk work


FILES = 24  # disk files of the namespace that is flushed below
REMOVAL_DELAY_S = 0.05  # per file: the flush takes >= 1.2 s of (simulated) slow disk


def fill_disk(engine: LLMEngine, namespace: str) -> None:
    """``FILES`` files of ``namespace`` on disk: each round writes one prompt's blocks as its own run."""
    tier = engine.core.cache.tier
    assert tier is not None
    for seed in range(FILES):
        engine.generate_sync([prompt(48, 300 + seed)], GREEDY, namespace)
        with engine._lock:
            tier.demote_all()
        tier.writer.flush()


async def stream(
    engine: LLMEngine, seed: int, times: list[float], until: Callable[[], bool], tenth: asyncio.Event | None = None
) -> None:
    """Stream one request (namespace "other"), appending each token's arrival time to ``times``, until ``until()``;
    ``tenth`` is set at the tenth token."""
    events = engine.generate(prompt(32, seed), SamplingParams(max_tokens=1500, ignore_eos=True), "other")
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, TokenDelta) and event.token_ids:
                times.append(time.monotonic())
                if tenth is not None and len(times) == 10:
                    tenth.set()
                if until():
                    break


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


async def unloaded_gap(engine: LLMEngine, seed: int) -> float:
    times: list[float] = []
    await stream(engine, seed, times, lambda: len(times) >= 150)
    return statistics.median(gaps(times))


@pytest.mark.anyio
async def test_the_step_loop_keeps_stepping_while_a_large_disk_removal_runs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A namespace flush that deletes many files on a slow disk must not hold the engine lock: another request keeps
    getting tokens at its unloaded pace (within 2x) while the files go."""
    engine = tiered(tiny_model_dir, tmp_path / "kv", max_kv_memory_mb=8)
    fill_disk(engine, "big")
    assert engine.stats().tiers.disk_blocks == FILES * 3  # 48 prompt + 6 generated tokens: 3 full blocks each
    await engine.start()
    faults = Faults(disk_removal_delay_s=REMOVAL_DELAY_S).install(engine)
    times: list[float] = []
    span: list[float] = []
    tenth = asyncio.Event()

    async def flush_after_a_few_tokens() -> None:
        await tenth.wait()
        span.append(time.monotonic())
        await asyncio.to_thread(engine.flush_namespace, "big")
        span.append(time.monotonic())

    try:
        before = await unloaded_gap(engine, 1)
        flushing = asyncio.create_task(flush_after_a_few_tokens())
        await stream(engine, 2, times, flushing.done, tenth)
        await flushing
        after = await unloaded_gap(engine, 3)
        left_on_disk = engine.stats().tiers.disk_blocks
    finally:
        await engine.stop()
    start, end = span
    assert faults.disk_removals == FILES and end - start >= FILES * REMOVAL_DELAY_S and left_on_disk == 0
    during = [t for t in times if start <= t <= end]
    # NOTE: generous on a busy 2-core box. Under the lock the flush would stop the stream for its whole length
    # (>= 1.2 s without a token); outside it, tokens keep their unloaded pace (the slower of two unloaded runs).
    assert len(during) >= 20
    assert statistics.median(gaps(during)) <= 2 * max(before, after)
    assert max(gaps(during)) < (end - start) / 4
