from __future__ import annotations

import pytest

from engine.kv.block_hash import BlockHash, hash_chain, root_hash
from engine.kv.kv_cache_manager import KVCacheManager, KVCacheUsage, MatchResult
from engine.kv.session_index import SessionIndex

BS = 16
ROOT = root_hash("model", "tenant-a")
OTHER_ROOT = root_hash("model", "tenant-b")


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def run_prompt(kv: KVCacheManager, rid: str, tokens: list[int], root: BlockHash = ROOT) -> MatchResult:
    """Admit a request, 'compute' its whole prompt and publish the full blocks."""
    match = kv.match_prefix(root, tokens)
    assert kv.allocate_slots(rid, len(tokens), match)
    kv.cache_full_blocks(rid, root, tokens, len(tokens))
    return match


def refs(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def test_allocate_new_request_takes_blocks_from_the_head() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    assert kv.allocate_slots("a", 33)
    assert kv.block_table("a") == [0, 1, 2]
    assert refs(kv) == [1, 1, 1, 0, 0, 0]
    assert kv.pool.free_block_ids() == [3, 4, 5]


def test_allocate_grows_only_when_a_block_boundary_is_crossed() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    assert kv.allocate_slots("a", 16)
    assert kv.block_table("a") == [0]
    assert kv.allocate_slots("a", 16)
    assert kv.block_table("a") == [0]
    assert kv.allocate_slots("a", 17)
    assert kv.block_table("a") == [0, 1]


def test_allocate_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    assert kv.allocate_slots("a", 32)
    assert not kv.can_allocate("b", 32)
    assert not kv.allocate_slots("b", 32)
    assert kv.block_table("b") == []
    assert not kv.allocate_slots("a", 64)
    assert kv.block_table("a") == [0, 1]
    assert kv.pool.free_block_ids() == [2]
    assert refs(kv) == [1, 1, 0]
    assert kv.can_allocate("b", 16)


def test_free_releases_in_reverse_order() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    kv.allocate_slots("a", 48)
    kv.free("a")
    assert kv.pool.free_block_ids() == [3, 4, 2, 1, 0]
    assert refs(kv) == [0] * 5
    assert kv.block_table("a") == []
    kv.free("a")  # unknown ids are ignored
    assert kv.pool.free_block_ids() == [3, 4, 2, 1, 0]


def test_prefix_hit_shares_blocks_and_counts_refs() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = toks(40)
    assert run_prompt(kv, "a", prompt) == MatchResult((), (), 0, 40)
    match = kv.match_prefix(ROOT, prompt)
    assert match.blocks == (0, 1)
    assert match.block_hashes == tuple(hash_chain(ROOT, prompt, BS))
    assert match.num_cached_tokens == 32
    assert kv.allocate_slots("b", 40, match)
    assert kv.block_table("b") == [0, 1, 3]
    assert refs(kv)[:4] == [2, 2, 1, 1]
    assert kv.pool.free_block_ids() == [4, 5, 6, 7]


def test_match_is_pure() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    run_prompt(kv, "a", toks(33))
    kv.free("a")
    before = (kv.pool.free_block_ids(), refs(kv), kv.usage())
    assert kv.match_prefix(ROOT, toks(33)).blocks == (0, 1)
    assert (kv.pool.free_block_ids(), refs(kv), kv.usage()) == before


def test_hit_revives_freed_blocks_out_of_the_queue() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    run_prompt(kv, "a", toks(48))
    kv.free("a")
    assert kv.pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    match = kv.match_prefix(ROOT, toks(48))
    assert match.blocks == (0, 1)  # block 2 holds the last token: recomputed
    assert kv.allocate_slots("b", 48, match)
    assert kv.block_table("b") == [0, 1, 3]
    assert kv.pool.free_block_ids() == [4, 5, 2]
    assert refs(kv) == [1, 1, 0, 1, 0, 0]


def test_free_hit_blocks_count_against_new_allocations() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    run_prompt(kv, "a", toks(33))
    kv.free("a")
    match = kv.match_prefix(ROOT, toks(33))
    assert match.blocks == (0, 1)
    # 3 free blocks, but reviving 0 and 1 leaves one: 33 tokens need exactly one new block, 49 need two.
    assert kv.can_allocate("b", 33, match)
    assert not kv.can_allocate("b", 49, match)
    assert not kv.allocate_slots("b", 49, match)
    assert kv.pool.free_block_ids() == [2, 1, 0]
    assert kv.usage().num_query_tokens == 33  # the failed attempt was not counted
    assert kv.allocate_slots("b", 33, match)
    assert kv.block_table("b") == [0, 1, 2]


def test_eviction_reuses_lru_block_and_drops_its_hash() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    run_prompt(kv, "a", toks(33))
    kv.free("a")
    assert kv.pool.free_block_ids() == [2, 1, 0]
    assert kv.usage().num_cached_blocks == 2
    assert kv.allocate_slots("b", 32)
    assert kv.block_table("b") == [1, 2]  # the two LRU blocks (2, then 1), in ascending order
    assert kv.pool.free_block_ids() == [0]
    # Block 1 (the chain's tail) was evicted; block 0 (its head) still matches.
    assert kv.match_prefix(ROOT, toks(33)).blocks == (0,)
    assert kv.usage().num_cached_blocks == 1


@pytest.mark.parametrize(("prompt_len", "expected_blocks"), [(15, 0), (16, 0), (17, 1), (32, 1), (33, 2)])
def test_last_prompt_token_is_always_recomputed(prompt_len: int, expected_blocks: int) -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    run_prompt(kv, "warm", toks(64))
    match = kv.match_prefix(ROOT, toks(prompt_len))
    assert len(match.blocks) == expected_blocks
    assert match.num_cached_tokens == expected_blocks * BS
    assert match.num_cached_tokens < prompt_len


def test_only_full_blocks_are_cached() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    kv.allocate_slots("a", 20)
    kv.cache_full_blocks("a", ROOT, toks(20), 20)
    assert kv.usage().num_cached_blocks == 1
    kv.cache_full_blocks("a", ROOT, toks(20), 20)  # idempotent
    assert kv.usage().num_cached_blocks == 1
    kv.allocate_slots("a", 32)
    kv.cache_full_blocks("a", ROOT, toks(32), 32)
    assert kv.usage().num_cached_blocks == 2
    assert kv.match_prefix(ROOT, toks(33)).blocks == (0, 1)


def test_cache_full_blocks_rejects_more_computed_than_tokens() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    kv.allocate_slots("a", 16)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        kv.cache_full_blocks("a", ROOT, toks(10), 16)


def test_namespaces_never_share_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    run_prompt(kv, "a", toks(33))
    assert kv.match_prefix(OTHER_ROOT, toks(33)).blocks == ()
    run_prompt(kv, "b", toks(33), root=OTHER_ROOT)
    assert kv.block_table("b") == [3, 4, 5]
    assert kv.match_prefix(OTHER_ROOT, toks(33)).blocks == (3, 4)
    assert kv.match_prefix(ROOT, toks(33)).blocks == (0, 1)


def test_hash_match_with_different_tokens_is_a_miss() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    run_prompt(kv, "a", toks(33))
    # Simulate a hash collision: the published block 1 claims other tokens.
    kv.pool.blocks[1].token_ids = tuple(toks(16, start=1000))
    assert kv.match_prefix(ROOT, toks(33)).blocks == (0,)


def test_divergent_suffix_matches_common_head_only() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    run_prompt(kv, "a", toks(48))
    other = toks(16) + toks(32, start=500)
    assert kv.match_prefix(ROOT, other).blocks == (0,)


def test_concurrent_duplicate_prefill_keeps_the_existing_mapping() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    for rid in ("a", "b"):
        assert kv.allocate_slots(rid, 20, kv.match_prefix(ROOT, toks(20)))
    kv.cache_full_blocks("a", ROOT, toks(20), 20)
    kv.cache_full_blocks("b", ROOT, toks(20), 20)
    assert kv.block_table("a") == [0, 1]
    assert kv.block_table("b") == [2, 3]
    assert kv.pool.blocks[0].block_hash is not None
    assert kv.pool.blocks[2].block_hash is None
    assert kv.usage().num_cached_blocks == 1
    assert kv.match_prefix(ROOT, toks(20)).blocks == (0,)
    kv.free("a")
    kv.free("b")
    assert kv.pool.free_block_ids() == [4, 5, 1, 0, 3, 2]


def test_stale_match_is_refused() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    run_prompt(kv, "a", toks(17))
    kv.free("a")
    match = kv.match_prefix(ROOT, toks(17))
    assert match.blocks == (0,)
    kv.allocate_slots("x", 32)  # reuses both blocks, evicting block 0's hash
    kv.free("x")
    with pytest.raises(ValueError, match="stale"):
        kv.allocate_slots("b", 17, match)


def test_match_only_on_first_allocation() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    kv.allocate_slots("a", 5)
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.allocate_slots("a", 20, MatchResult())


def test_usage_counts_exactly() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    run_prompt(kv, "a", toks(40))  # 3 blocks, 2 published
    run_prompt(kv, "b", toks(40))  # hits 32 tokens, 1 new block
    kv.free("a")
    assert kv.usage() == KVCacheUsage(
        num_blocks=6,
        num_free_blocks=3,
        num_used_blocks=3,
        num_cached_blocks=2,
        num_evictable_blocks=0,
        num_query_tokens=80,
        num_hit_tokens=32,
    )
    kv.free("b")
    usage = kv.usage()
    assert (usage.num_free_blocks, usage.num_used_blocks, usage.num_evictable_blocks) == (6, 0, 2)
    assert usage.hit_rate == pytest.approx(0.4)
    assert KVCacheUsage(1, 1, 0, 0, 0, 0, 0).hit_rate == 0.0


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    run_prompt(kv, "a", toks(40))
    assert kv.usage().num_cached_blocks == 0
    match = kv.match_prefix(ROOT, toks(40))
    assert match == MatchResult((), (), 0, 40)


def test_invalid_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=2, block_size=0)


SYSTEM = toks(32, start=1000)  # a two-block system prompt every session starts with
ALICE = SYSTEM + toks(32)  # 4 full blocks
BOB = [*SYSTEM, *toks(16, start=500), 1]  # 3 full blocks + 1 token


def two_finished_sessions() -> tuple[KVCacheManager, SessionIndex]:
    """Alice then Bob each ran one request to completion; both chains are recorded, every block is free."""
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    index = SessionIndex()
    for rid, key, tokens in (("a1", "alice", ALICE), ("b1", "bob", BOB)):
        run_prompt(kv, rid, tokens)
        kv.free(rid)
        index.record(key, hash_chain(ROOT, tokens, BS))
    return kv, index


def test_two_sessions_share_the_system_prompt_blocks() -> None:
    kv, index = two_finished_sessions()
    # Alice: blocks 0-3 (all published). Bob: hit 0, 1, then block 4 (published) and block 5 (partial).
    assert kv.pool.free_block_ids() == [6, 7, 8, 9, 3, 2, 5, 4, 1, 0]
    assert kv.usage().num_cached_blocks == 5
    assert [index.sessions_of(h) for h in hash_chain(ROOT, ALICE, BS)] == [2, 2, 1, 1]


def test_releasing_one_session_evicts_only_its_unique_tail() -> None:
    kv, index = two_finished_sessions()
    alice = hash_chain(ROOT, ALICE, BS)
    released = index.release("alice")
    assert released == [alice[3], alice[2]]
    assert kv.evict_cached(released) == 2
    # Alice's tail blocks 3, 2 go to the head of the free queue in the released (tail-first) order.
    assert kv.pool.free_block_ids() == [3, 2, 6, 7, 8, 9, 5, 4, 1, 0]
    assert [kv.pool.blocks[i].block_hash for i in (2, 3)] == [None, None]
    assert [kv.pool.blocks[i].token_ids for i in (2, 3)] == [None, None]
    assert kv.usage().num_cached_blocks == 3
    assert kv.usage().num_evictable_blocks == 3
    assert refs(kv) == [0] * 10
    # The shared system prompt still hits, for Alice's old prompt and for Bob's.
    assert kv.match_prefix(ROOT, ALICE).blocks == (0, 1)
    assert kv.match_prefix(ROOT, BOB).blocks == (0, 1, 4)
    # The evicted blocks are the first to be reused; cached blocks are left alone.
    assert kv.allocate_slots("c", 32)
    assert kv.block_table("c") == [2, 3]
    assert kv.usage().num_cached_blocks == 3


def test_releasing_both_sessions_evicts_everything() -> None:
    kv, index = two_finished_sessions()
    assert kv.evict_cached(index.release("alice")) == 2
    bob = hash_chain(ROOT, BOB, BS)
    released = index.release("bob")
    assert released == [bob[2], bob[1], bob[0]]
    assert kv.evict_cached(released) == 3
    assert kv.pool.free_block_ids() == [4, 1, 0, 3, 2, 6, 7, 8, 9, 5]
    assert kv.usage().num_cached_blocks == 0
    assert kv.pool.cached == {}
    assert all(b.block_hash is None and b.token_ids is None for b in kv.pool.blocks)
    assert kv.match_prefix(ROOT, ALICE).blocks == ()
    assert kv.match_prefix(ROOT, BOB).blocks == ()
    assert len(index) == 0


def test_blocks_of_a_running_request_are_not_evicted() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    index = SessionIndex()
    run_prompt(kv, "a1", ALICE)
    kv.free("a1")
    index.record("alice", hash_chain(ROOT, ALICE, BS))
    # Bob's first request is still running (nothing recorded for him yet) and holds the system prompt blocks.
    run_prompt(kv, "b1", BOB)
    assert kv.block_table("b1") == [0, 1, 4, 5]
    alice = hash_chain(ROOT, ALICE, BS)
    released = index.release("alice")
    assert released == alice[::-1]
    assert kv.evict_cached(released) == 2
    assert refs(kv) == [1, 1, 0, 0, 1, 1, 0, 0, 0, 0]
    assert kv.pool.free_block_ids() == [3, 2, 6, 7, 8, 9]
    assert [kv.pool.blocks[i].block_hash for i in (0, 1)] == alice[:2]
    assert kv.match_prefix(ROOT, ALICE).blocks == (0, 1)
    # Once Bob's request finishes its blocks become ordinary LRU entries, still cached.
    kv.free("b1")
    assert kv.pool.free_block_ids() == [3, 2, 6, 7, 8, 9, 5, 4, 1, 0]
    assert kv.usage().num_cached_blocks == 3


def test_closing_session_with_a_request_in_flight_keeps_its_blocks() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    run_prompt(kv, "a1", ALICE)
    hashes = hash_chain(ROOT, ALICE, BS)
    assert kv.evict_cached(hashes[::-1]) == 0
    assert kv.usage().num_cached_blocks == 4
    assert kv.pool.free_block_ids() == [4, 5]
    kv.free("a1")
    assert kv.evict_cached(hashes[::-1]) == 4
    assert kv.pool.free_block_ids() == [3, 2, 1, 0, 4, 5]


def test_evict_cached_skips_uncached_and_duplicate_hashes() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    run_prompt(kv, "a", toks(40))  # blocks 0, 1 published; block 2 partial
    kv.free("a")
    h0, h1 = hash_chain(ROOT, toks(40), BS)
    never_cached = hash_chain(ROOT, toks(48), BS)[2]
    other_namespace = hash_chain(OTHER_ROOT, toks(40), BS)[0]
    assert kv.evict_cached([]) == 0
    assert kv.evict_cached([never_cached, other_namespace]) == 0
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]
    assert kv.evict_cached([h1, h1, never_cached]) == 1
    assert kv.pool.free_block_ids() == [1, 3, 2, 0]
    assert kv.evict_cached([h1]) == 0  # already evicted
    assert kv.pool.get_cached_block(h0) is kv.pool.blocks[0]


def test_cached_chain_lists_every_cached_full_block_in_order() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    run_prompt(kv, "a", ALICE)
    kv.free("a")
    chain = hash_chain(ROOT, ALICE, BS)
    # Covers the last prompt token's block too (match_prefix would stop one block short).
    assert kv.cached_chain(ROOT, ALICE) == chain
    assert kv.match_prefix(ROOT, ALICE).blocks == (0, 1, 2)
    assert kv.cached_chain(ROOT, [*ALICE, 5]) == chain
    assert kv.cached_chain(ROOT, ALICE[:40]) == chain[:2]
    assert kv.cached_chain(OTHER_ROOT, ALICE) == []
    # A miss in the middle strands the blocks after it for matching, but they are still listed (and evictable).
    assert kv.evict_cached([chain[1]]) == 1
    assert kv.match_prefix(ROOT, ALICE).blocks == (0,)
    assert kv.cached_chain(ROOT, ALICE) == [chain[0], chain[2], chain[3]]
    # A hash hit whose tokens differ (a collision) is not this chain's block.
    kv.pool.blocks[3].token_ids = tuple(toks(16, start=1000))
    assert kv.cached_chain(ROOT, ALICE) == [chain[0], chain[2]]
    assert kv.evict_cached(kv.cached_chain(ROOT, ALICE)[::-1]) == 2
    assert kv.usage().num_cached_blocks == 1
    assert kv.pool.free_block_ids() == [2, 0, 1, 4, 5, 6, 7, 3]


def test_evict_cached_with_prefix_caching_disabled_is_a_no_op() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    run_prompt(kv, "a", ALICE)
    kv.free("a")
    assert kv.cached_chain(ROOT, ALICE) == []
    assert kv.evict_cached(hash_chain(ROOT, ALICE, BS)) == 0
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]


def test_truncate_frees_the_draft_blocks_tail_first_and_keeps_the_chain() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    run_prompt(kv, "a", toks(20))  # block 0 published, block 1 partly filled
    assert kv.allocate_slots("a", 20 + 1 + 30)  # the next token and 30 drafts: blocks 2 and 3 too
    assert kv.block_table("a") == [0, 1, 2, 3]
    assert kv.truncate("a", 23) == 2  # 2 drafts accepted: 22 tokens computed, the next token is the 23rd
    assert kv.block_table("a") == [0, 1]
    assert kv.pool.free_block_ids()[-2:] == [3, 2]  # tail first, as free() does
    assert kv.truncate("a", 23) == 0


def test_truncate_never_goes_below_the_published_blocks() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    run_prompt(kv, "a", toks(40))
    with pytest.raises(ValueError, match="published blocks"):
        kv.truncate("a", 10)
    assert kv.block_table("a") == [0, 1, 2]
