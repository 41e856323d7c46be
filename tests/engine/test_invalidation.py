"""LLMEngine.invalidate on the tiny fp32 model: exact blocks freed, the shared prefix kept, another namespace never
reached, an in-flight request finishing unchanged while its blocks are invalidated, the next turn equal to a cold run,
and release_session still freeing a session's later turns.

Prompts are token ids with a first token of their own per test (see ``fresh``), so tests share no block; each test
uses its own namespace and sessions.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.errors import EngineError, InvalidRequestError
from engine.kv.block_hash import hash_chain, root_hash
from engine.kv.cache_stats import InvalidationCounts
from engine.kv.kv_cache_manager import InvalidationResult
from engine.llm_engine import LLMEngine
from engine.outputs import GenerationEvent, RequestFinished
from engine.sampling_params import SamplingParams
from support.engines import make_engine, one_intra_op_thread

BS = 16
PARAMS = SamplingParams(max_tokens=8)  # 64 prompt tokens + 7 computed reply tokens: 4 full blocks per turn


def fresh(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [3 + seed] + [rng.randrange(3, 384) for _ in range(n - 1)]


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    engine = make_engine(tiny_model_dir)
    engine.load()
    return engine


@pytest.fixture(scope="module")
def cold(tiny_model_dir: Path) -> LLMEngine:
    engine = make_engine(tiny_model_dir, enable_prefix_caching=False)
    engine.load()
    return engine


def submit(engine: LLMEngine, prompt: list[int], ns: str, session: str | None, params: SamplingParams) -> list[object]:
    events: list[object] = []

    def sink(event: GenerationEvent | EngineError) -> None:
        events.append(event)

    engine.submit(prompt, params, ns, sink, session=session)
    return events


def run(
    engine: LLMEngine, prompt: list[int], ns: str, session: str | None = None, params: SamplingParams = PARAMS
) -> RequestFinished:
    events = submit(engine, prompt, ns, session, params)
    engine.run_until_idle()
    final = events[-1]
    assert isinstance(final, RequestFinished), final
    return final


def cold_tokens(cold: LLMEngine, prompt: list[int], params: SamplingParams = PARAMS) -> tuple[int, ...]:
    return cold.generate_sync([prompt], params)[0].token_ids


def assert_pool_idle(engine: LLMEngine) -> None:
    kv = engine.stats().kv
    assert (kv.num_used_blocks, kv.num_free_blocks) == (0, kv.num_blocks)


def test_invalidating_a_session_from_a_position_frees_its_later_blocks_only(engine: LLMEngine, cold: LLMEngine) -> None:
    ns = "inv-position"
    shared, own1, own2 = fresh(32, 60), fresh(32, 61), fresh(32, 62)
    run(engine, shared + own1, ns, "s1")
    run(engine, shared + own2, ns, "s2")
    cached = engine.stats().kv.num_cached_blocks

    # Position 40 lies in s1's block 2: blocks 2 and 3 go; blocks 0, 1 (the shared prefix, in s2's chain) stay.
    result = engine.invalidate(ns, session="s1", from_position=40, reason="context_edit")
    assert result == InvalidationResult(blocks_freed=2, tokens_freed=32, deferred=0)
    stats = engine.stats()
    assert stats.kv.num_cached_blocks == cached - 2
    assert stats.cache.invalidations["context_edit"] == InvalidationCounts(2, 32, 0)
    assert engine.invalidate(ns, session="s1", from_position=40) == InvalidationResult(0, 0, 0)

    # The next turn (its context changed from position 40 on) hits the shared prefix only and equals a cold run.
    edited = shared + own1[:8] + fresh(24, 63)
    turn = run(engine, edited, ns, "s1")
    assert turn.stats.cached_tokens == 32
    assert turn.token_ids == cold_tokens(cold, edited)
    again = run(engine, shared + own2, ns, "s2")  # s2 is untouched
    assert again.stats.cached_tokens == 48
    assert_pool_idle(engine)


def test_another_namespace_is_never_reached(engine: LLMEngine) -> None:
    ns = "inv-tenant"
    prompt = fresh(64, 64)
    run(engine, prompt, ns, "t1")
    cached = engine.stats().kv.num_cached_blocks
    own_hashes = hash_chain(root_hash(engine.info.fingerprint, ns), prompt, BS)
    assert engine.invalidate("inv-other", session="t1", from_position=0) == InvalidationResult(0, 0, 0)
    assert engine.invalidate("inv-other", block_hashes=own_hashes) == InvalidationResult(0, 0, 0)
    assert engine.stats().kv.num_cached_blocks == cached
    # Its own namespace reaches them (but the session's chain protects them from a session-less caller).
    assert engine.invalidate(ns, block_hashes=own_hashes) == InvalidationResult(0, 0, 0)
    assert engine.invalidate(ns, session="t1", block_hashes=own_hashes[1:]) == InvalidationResult(3, 48, 0)


def test_block_hashes_free_a_subtree_but_not_what_sessions_use(engine: LLMEngine, cold: LLMEngine) -> None:
    ns = "inv-hashes"
    shared, own, anon = fresh(32, 65), fresh(32, 66), fresh(32, 67)
    run(engine, shared + own, ns, "h1")
    run(engine, shared + anon, ns)  # no session: nobody protects its own blocks 2, 3
    chain = hash_chain(root_hash(engine.info.fingerprint, ns), shared, BS)
    assert engine.invalidate(ns, block_hashes=[chain[0]], reason="admin") == InvalidationResult(2, 32, 0)
    assert engine.stats().cache.invalidations["admin"] == InvalidationCounts(2, 32, 0)
    again = run(engine, shared + anon, ns)
    assert again.stats.cached_tokens == 32
    assert again.token_ids == cold_tokens(cold, shared + anon)


def test_an_in_flight_request_finishes_unchanged_and_its_blocks_are_dropped_at_release(
    engine: LLMEngine, cold: LLMEngine
) -> None:
    ns = "inv-in-flight"
    shared, own = fresh(32, 68), fresh(32, 69)
    params = SamplingParams(max_tokens=40)
    run(engine, shared + fresh(32, 70), ns, "other")  # another session uses the shared prefix
    cached = engine.stats().kv.num_cached_blocks
    events = submit(engine, shared + own, ns, "live", params)
    for _ in range(3):  # prefill (hits the 2 shared blocks, publishes 2) and two decode steps
        assert engine._step()
    assert not any(isinstance(e, RequestFinished) for e in events)
    assert engine.stats().kv.num_cached_blocks == cached + 2

    # Its own blocks 2, 3 are held: unpublished now, dropped when it ends; it publishes nothing after them either.
    result = engine.invalidate(ns, session="live", from_position=32, reason="context_edit")
    assert result == InvalidationResult(blocks_freed=0, tokens_freed=0, deferred=2)
    assert engine.stats().kv.num_cached_blocks == cached
    engine.run_until_idle()
    final = events[-1]
    assert isinstance(final, RequestFinished)
    assert final.token_ids == cold_tokens(cold, shared + own, params)
    assert engine.stats().kv.num_cached_blocks == cached  # its 6 full blocks past the shared 2 were never kept
    assert_pool_idle(engine)
    nxt = run(engine, shared + own, ns, "live")
    assert nxt.stats.cached_tokens == 32
    assert nxt.token_ids == cold_tokens(cold, shared + own)


def test_release_session_after_an_invalidation_frees_the_later_turns(engine: LLMEngine) -> None:
    ns = "inv-release"
    shared = fresh(32, 71)
    run(engine, shared + fresh(32, 72), ns, "other")
    run(engine, shared + fresh(32, 73), ns, "r1")
    assert engine.invalidate(ns, session="r1", from_position=32) == InvalidationResult(2, 32, 0)
    run(engine, shared + fresh(32, 74), ns, "r1")  # the session goes on: this turn is recorded as usual
    cached = engine.stats().kv.num_cached_blocks
    assert engine.release_session("r1") == 2
    assert engine.stats().kv.num_cached_blocks == cached - 2
    assert engine.stats().cache.invalidations["session_released"] == InvalidationCounts(2, 32, 0)
    assert_pool_idle(engine)


def test_a_turn_still_waiting_when_its_session_is_invalidated_keeps_nothing_past_the_change(
    engine: LLMEngine, cold: LLMEngine
) -> None:
    ns = "inv-waiting"
    shared = fresh(32, 75)
    run(engine, shared + fresh(32, 76), ns, "other")
    run(engine, shared + fresh(32, 77), ns, "w1")
    cached = engine.stats().kv.num_cached_blocks
    stale = shared + fresh(32, 78)
    events = submit(engine, stale, ns, "w1", PARAMS)  # queued: no step has run, it holds no block yet
    assert engine.invalidate(ns, session="w1", from_position=32) == InvalidationResult(2, 32, 0)
    engine.run_until_idle()
    final = events[-1]
    assert isinstance(final, RequestFinished)
    assert final.token_ids == cold_tokens(cold, stale)
    assert engine.stats().kv.num_cached_blocks == cached - 2  # it published nothing past the shared prefix
    assert engine.release_session("w1") == 0
    assert_pool_idle(engine)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "needs session and from_position, or block_hashes"),
        ({"from_position": 3}, "needs session and from_position"),
        ({"session": "s", "from_position": 0, "block_hashes": []}, "needs session and from_position"),
        ({"session": "s", "from_position": -1}, "from_position must be an integer >= 0"),
        ({"session": "s", "from_position": True}, "from_position must be an integer >= 0"),
    ],
)
def test_bad_invalidation_arguments_are_refused(engine: LLMEngine, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        engine.invalidate("ns", **kwargs)  # type: ignore[arg-type]


def test_invalidating_shared_text_frees_its_chain_in_every_session_and_keeps_what_came_before(
    engine: LLMEngine, cold: LLMEngine
) -> None:
    # [system 32][section A 32] is shared by s1 and s2; [system][section B] by s3. Section A's text changes.
    ns = "inv-prefix"
    system, section_a, section_b = fresh(32, 80), fresh(32, 81), fresh(32, 82)
    own1, own2, own3 = fresh(32, 83), fresh(32, 84), fresh(32, 85)
    run(engine, system + section_a + own1, ns, "p1")
    run(engine, system + section_a + own2, ns, "p2")
    run(engine, system + section_b + own3, ns, "p3")
    cached = engine.stats().kv.num_cached_blocks

    # Section A's 2 blocks and each session's 2 own blocks (the 7 reply tokens fill none): 2 + 2 * 2 = 6 blocks.
    result = engine.invalidate_prefix(ns, system + section_a, from_position=32, reason="handbook_edited")
    assert result == InvalidationResult(blocks_freed=6, tokens_freed=96, deferred=0)
    assert engine.stats().kv.num_cached_blocks == cached - 6
    assert engine.stats().cache.invalidations["handbook_edited"] == InvalidationCounts(6, 96, 0)
    assert engine.invalidate_prefix(ns, system + section_a, from_position=32) == InvalidationResult(0, 0, 0)

    # The system prompt's blocks and section B's session stay; a turn on the new text hits the system prompt only.
    assert run(engine, system + section_b + own3, ns, "p3").stats.cached_tokens == 80  # all but the last token
    edited = system + fresh(32, 86) + own1
    turn = run(engine, edited, ns, "p1")
    assert turn.stats.cached_tokens == 32
    assert turn.token_ids == cold_tokens(cold, edited)
    # Another namespace is never reached; a bad position is refused.
    assert engine.invalidate_prefix("inv-other", system + section_b, 0) == InvalidationResult(0, 0, 0)
    with pytest.raises(InvalidRequestError, match="from_position"):
        engine.invalidate_prefix(ns, system, -1)
    assert_pool_idle(engine)
