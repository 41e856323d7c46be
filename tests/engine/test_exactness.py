"""Exact KV reuse: whatever the cache, chunking or preemption did, greedy fp32 tokens equal a cold run's.

Prompts are token-id lists so their lengths, and therefore the block boundaries (block_size 16) they cross, are exact.
Expected ``cached_tokens`` follow from the contract of ``KVCacheManager.match_prefix``: only full blocks are reused, and
never the one holding the prompt's last token, so a hit covers ``min(shared // 16, (len(prompt) - 1) // 16) * 16``
tokens. Every base prompt starts with its own first token, so prompts only ever share what a case sets up.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine.fair_share import FairShare
from engine.llm_engine import LLMEngine
from engine.outputs import FinishReason, RequestFinished
from engine.request_table import Collector
from engine.sampling_params import SamplingParams
from support.engines import make_engine, one_intra_op_thread

BS = 16
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS)
FIRST_ID = 3  # token ids below are the tokenizer's special tokens


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    with one_intra_op_thread():
        yield


def make_wide_engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    # NOTE: wide batches keep the step count (and so the runtime) low; batch composition must not change any token.
    wide: dict[str, Any] = {"max_kv_memory_mb": 32, "max_num_seqs": 256, "max_num_batched_tokens": 4096}
    engine = make_engine(model_dir, **(wide | {"max_waiting": 1024} | overrides))
    engine.load()
    return engine


@pytest.fixture(scope="module")
def cold(tiny_model_dir: Path) -> LLMEngine:
    """The reference: no prefix caching, a pool large enough that nothing is ever preempted."""
    return make_wide_engine(tiny_model_dir, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def shared_warm(tiny_model_dir: Path) -> LLMEngine:
    return make_wide_engine(tiny_model_dir)


def run_cold(cold: LLMEngine, prompts: list[list[int]]) -> list[RequestFinished]:
    results = cold.generate_sync(prompts, GREEDY)
    assert all(r.stats.cached_tokens == 0 for r in results)
    return results


def fresh_tokens(rng: random.Random, n: int, first: int, vocab: int) -> list[int]:
    return [first] + [rng.randrange(FIRST_ID, vocab) for _ in range(n - 1)]


def diverge(rng: random.Random, base: list[int], shared: int, extra: int, vocab: int) -> list[int]:
    """``base[:shared]`` followed by ``extra`` tokens whose first one differs from ``base[shared]``."""
    avoid = base[shared] if shared < len(base) else -1
    first = rng.choice([t for t in range(FIRST_ID, vocab) if t != avoid])
    return base[:shared] + [first] + [rng.randrange(FIRST_ID, vocab) for _ in range(extra - 1)]


def expected_hit(shared: int, prompt_len: int) -> int:
    return min(shared // BS, (prompt_len - 1) // BS) * BS


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    prompt: list[int]
    cached: int  # expected cached_tokens on the warm engine


def mismatches(cases: list[Case], warm: list[RequestFinished], ref: list[RequestFinished]) -> list[str]:
    return [
        f"{c.name}: warm {w.token_ids} != cold {r.token_ids}"
        for c, w, r in zip(cases, warm, ref, strict=True)
        if w.token_ids != r.token_ids
    ]


# Shared-prefix lengths around every block boundary of the first four blocks (one before, on, one after).
BOUNDARY_SHARES = [1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64]


def test_prefix_hits_are_token_identical_to_cold_runs(tiny_model_dir: Path, cold: LLMEngine) -> None:
    warm = make_wide_engine(tiny_model_dir)
    vocab = warm.info.vocab_size
    rng = random.Random(20240611)
    firsts = iter(rng.sample(range(FIRST_ID, vocab), vocab - FIRST_ID))

    # Seed batch: one base per derived case, so derived prompts never share with each other.
    shares = BOUNDARY_SHARES * 12 + [rng.randrange(1, 70) for _ in range(36)]
    bases = [fresh_tokens(rng, s + rng.randrange(1, 18), next(firsts), vocab) for s in shares]
    repeat_lens = [2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 65] * 2
    repeats = [fresh_tokens(rng, n, next(firsts), vocab) for n in repeat_lens]
    continued = [fresh_tokens(rng, n, next(firsts), vocab) for n in (9, 24, 25, 40, 41, 56, 57, 70) * 2]
    seed_prompts = bases + repeats + continued
    seed_warm = warm.generate_sync(seed_prompts, GREEDY)
    seed_cold = run_cold(cold, seed_prompts)
    assert [r.stats.cached_tokens for r in seed_warm] == [0] * len(seed_prompts)
    seed_cases = [Case(f"seed[{i}]", p, 0) for i, p in enumerate(seed_prompts)]
    assert mismatches(seed_cases, seed_warm, seed_cold) == []
    assert all(r.finish_reason is FinishReason.LENGTH and len(r.token_ids) == MAX_TOKENS for r in seed_warm)

    cases: list[Case] = []
    for i, (base, shared) in enumerate(zip(bases, shares, strict=True)):
        # Tails of 1, 16 or 17 tokens put the derived prompt's own end on, or just past, a boundary too.
        prompt = diverge(rng, base, shared, (1, BS, BS + 1)[i % 3], vocab)
        cases.append(Case(f"[{i}] shared {shared} of {len(prompt)}", prompt, expected_hit(shared, len(prompt))))
    for i, prompt in enumerate(repeats):  # fully cached: the last prompt token is recomputed
        cases.append(Case(f"[{i}] repeat of {len(prompt)}", prompt, expected_hit(len(prompt), len(prompt))))
    for i, (prompt, result) in enumerate(zip(continued, seed_warm[len(bases) + len(repeats) :], strict=True)):
        # Next chat turn: prompt + reply + new tokens. The reply's last token was never computed, so the seed run
        # published the full blocks of its first len(prompt) + MAX_TOKENS - 1 tokens.
        follow = [*prompt, *result.token_ids, *fresh_tokens(rng, 5, rng.randrange(FIRST_ID, vocab), vocab)]
        computed = len(prompt) + MAX_TOKENS - 1
        cases.append(Case(f"[{i}] turn after {len(prompt)}", follow, expected_hit(computed, len(follow))))

    warm_results = warm.generate_sync([c.prompt for c in cases], GREEDY)
    cold_results = run_cold(cold, [c.prompt for c in cases])

    assert len(cases) >= 200
    assert mismatches(cases, warm_results, cold_results) == []
    assert len({c.name for c in cases}) == len(cases)
    got = {c.name: r.stats.cached_tokens for c, r in zip(cases, warm_results, strict=True)}
    assert got == {c.name: c.cached for c in cases}
    assert [r.stats.prefilled_tokens for r in warm_results] == [len(c.prompt) - c.cached for c in cases]
    assert sum(1 for c in cases if c.cached > 0) >= 150  # the comparison is mostly about hits
    assert warm.stats().kv.num_used_blocks == 0


@pytest.mark.parametrize(
    ("shared", "prompt_len", "cached"),
    [
        (31, 40, 16),  # one before a boundary: only the first block is full
        (32, 40, 32),  # on the boundary
        (33, 40, 32),  # one after: the 33rd token's block is not full
        (32, 33, 32),  # the prompt's last token starts a new block
        (15, 40, 0),  # less than one block
        (32, 32, 16),  # same 32-token prompt twice: block 2 holds the last token, so it is recomputed
        (33, 33, 32),  # same 33-token prompt twice
        (16, 16, 0),  # a one-block prompt is never served from the cache
        (17, 17, 16),
    ],
)
def test_cached_tokens_at_block_boundaries(
    shared_warm: LLMEngine, cold: LLMEngine, shared: int, prompt_len: int, cached: int
) -> None:
    warm, namespace = shared_warm, f"boundary-{shared}-{prompt_len}"  # a namespace per case: nothing else is cached
    vocab = warm.info.vocab_size
    rng = random.Random(shared * 1000 + prompt_len)
    first = fresh_tokens(rng, 40, FIRST_ID, vocab)
    second = first[:prompt_len] if shared == prompt_len else diverge(rng, first, shared, prompt_len - shared, vocab)
    assert len(second) == prompt_len

    r1, r2 = warm.generate_sync([first], GREEDY, namespace) + warm.generate_sync([second], GREEDY, namespace)

    assert (r1.stats.cached_tokens, r2.stats.cached_tokens) == (0, cached)
    assert r2.stats.prefilled_tokens == prompt_len - cached
    assert [r1.token_ids, r2.token_ids] == [r.token_ids for r in run_cold(cold, [first, second])]


def test_mixed_batch_with_chunked_prefill_equals_each_request_alone(tiny_model_dir: Path, cold: LLMEngine) -> None:
    budget = 64
    warm = make_wide_engine(tiny_model_dir, max_num_batched_tokens=budget)
    vocab = warm.info.vocab_size
    rng = random.Random(7)
    firsts = iter(rng.sample(range(FIRST_ID, vocab), 16))
    seeds = [fresh_tokens(rng, n, next(firsts), vocab) for n in (50, 130)]
    warm.generate_sync(seeds, GREEDY)

    cases = [
        Case("short", fresh_tokens(rng, 5, next(firsts), vocab), 0),
        Case("one block", fresh_tokens(rng, 16, next(firsts), vocab), 0),
        Case("budget", fresh_tokens(rng, budget, next(firsts), vocab), 0),
        Case("budget + 1", fresh_tokens(rng, budget + 1, next(firsts), vocab), 0),
        Case("three chunks", fresh_tokens(rng, 150, next(firsts), vocab), 0),
        Case("seed 0 + 20", diverge(rng, seeds[0], 50, 20, vocab), 48),
        Case("seed 0 again", list(seeds[0]), 48),
        Case("seed 1, 100 shared", diverge(rng, seeds[1], 100, 90, vocab), 96),
        Case("seed 1 again", list(seeds[1]), 128),
        Case("seed 1, 33 shared", diverge(rng, seeds[1], 33, 2, vocab), 32),
    ]
    steps_before = warm.stats().steps
    batch = warm.generate_sync([c.prompt for c in cases], GREEDY)
    steps = warm.stats().steps - steps_before

    alone = [run_cold(cold, [c.prompt])[0] for c in cases]
    assert mismatches(cases, batch, alone) == []
    got = {c.name: r.stats.cached_tokens for c, r in zip(cases, batch, strict=True)}
    assert got == {c.name: c.cached for c in cases}
    prefilled = [r.stats.prefilled_tokens for r in batch]
    assert prefilled == [len(c.prompt) - c.cached for c in cases]
    # Each step computes at most `budget` tokens; the prefill alone needs this many steps, plus decodes after it.
    assert steps >= -(-sum(prefilled) // budget) + MAX_TOKENS - 1


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_by_recompute_yields_the_same_tokens(
    tiny_model_dir: Path, cold: LLMEngine, prefix_caching: bool
) -> None:
    # 1 MiB holds 128 blocks of 16 tokens (512 bytes of K/V per token). 16 prompts of 110 tokens take 112 blocks once
    # admitted and 144 at 24 generated tokens, so running sequences must be preempted and recomputed.
    params = SamplingParams(max_tokens=24)
    small = make_wide_engine(tiny_model_dir, max_kv_memory_mb=1, enable_prefix_caching=prefix_caching)
    assert small.info.num_blocks == 128
    vocab = small.info.vocab_size
    rng = random.Random(99)
    prompts = [fresh_tokens(rng, 110, first, vocab) for first in rng.sample(range(FIRST_ID, vocab), 16)]

    constrained = small.generate_sync(prompts, params)
    reference = cold.generate_sync(prompts, params)

    assert [r.token_ids for r in constrained] == [r.token_ids for r in reference]
    assert sum(r.stats.num_preemptions for r in constrained) > 0
    assert sum(r.stats.num_preemptions for r in reference) == 0
    prefilled = [(r.stats.prefilled_tokens, r.stats.num_preemptions) for r in constrained]
    if prefix_caching:  # a recomputed prompt is mostly served by the blocks it published before its preemption
        assert all(p >= 110 for p, _ in prefilled)
    else:  # each admission computes the whole prompt again
        assert all(p == 110 * (1 + n) for p, n in prefilled)
    assert all(r.stats.cached_tokens == 0 for r in constrained)
    assert small.stats().kv.num_used_blocks == 0


def test_fair_scheduling_across_tenants_yields_the_same_tokens(tiny_model_dir: Path, cold: LLMEngine) -> None:
    """Three tenants (weights 1, 2, 1) through a narrow engine: the fair scheduler reorders admissions and chunks,
    never a token; and the tenant that arrived last is not served last."""
    narrow = make_wide_engine(tiny_model_dir, max_num_seqs=3, max_num_batched_tokens=48)
    vocab = narrow.info.vocab_size
    rng = random.Random(42)
    firsts = iter(rng.sample(range(FIRST_ID, vocab), 24))
    shares = [FairShare("A")] * 12 + [FairShare("B", 2.0)] * 6 + [FairShare("C")] * 6
    prompts = [fresh_tokens(rng, rng.randrange(5, 70), next(firsts), vocab) for _ in shares]
    collect = Collector()
    ids = [narrow.submit(p, GREEDY, "default", collect, share=s) for p, s in zip(prompts, shares, strict=True)]
    narrow.run_until_idle()
    results = collect.results(ids)

    assert [r.token_ids for r in results] == [r.token_ids for r in run_cold(cold, prompts)]
    queued = [r.stats.queue_s for r in results]
    assert max(queued[18:]) < max(queued[:12])  # FCFS would start C's six after everyone else's
    assert narrow.stats().kv.num_used_blocks == 0
