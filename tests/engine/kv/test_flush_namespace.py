"""Flushing a whole namespace in the pure-Python KV layer: exact block ids, free-queue order and stats."""

from __future__ import annotations

from engine.kv.block_hash import BlockHash, hash_chain, root_hash
from engine.kv.kv_cache_manager import InvalidationResult, KVCacheManager

BS = 4
ROOT_A = root_hash("model", "tenant-a")
ROOT_B = root_hash("model", "tenant-b")
SYSTEM = [1, 1, 1, 1, 2, 2, 2, 2]
ALICE = [*SYSTEM, 10, 11, 12, 13, 14]  # 3 full blocks + 1 token
BOB = [*SYSTEM, 20, 21, 22, 23, 24]  # shares ALICE's 2 system blocks, then 1 of his own


def run(kv: KVCacheManager, rid: str, root: BlockHash, tokens: list[int], *, free: bool = True) -> None:
    match = kv.match_prefix(root, tokens)
    assert kv.allocate_slots(rid, len(tokens), match)
    kv.cache_full_blocks(rid, root, tokens, len(tokens))
    if free:
        kv.free(rid)


def test_flush_frees_every_block_of_the_namespace_and_none_of_another() -> None:
    kv = KVCacheManager(num_blocks=12, block_size=BS)
    run(kv, "alice", ROOT_A, ALICE)  # blocks 0 1 2 (+3 partial)
    run(kv, "bob", ROOT_A, BOB)  # hits 0 1, own block 4 (+5 partial)
    run(kv, "carol", ROOT_B, ALICE)  # the same tokens under tenant B: blocks 6 7 8 (+9 partial)
    assert kv.pool.num_cached_blocks == 7

    result = kv.flush_root(ROOT_A, reason="admin_flush")

    assert result == InvalidationResult(blocks_freed=4, tokens_freed=16, deferred=0)
    assert set(kv.pool.cached) == set(hash_chain(ROOT_B, ALICE, BS))
    assert kv.match_prefix(ROOT_A, ALICE).num_cached_tokens == 0
    assert kv.match_prefix(ROOT_B, ALICE).blocks == (6, 7, 8)
    # NOTE: descendants first: each tree's tail reaches the head of the free queue before its head block
    assert kv.pool.free_block_ids()[:4] == [4, 2, 1, 0]
    assert kv.cache_stats().invalidations["admin_flush"].blocks_freed == 4


def test_flush_of_an_empty_namespace_frees_nothing() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    run(kv, "carol", ROOT_B, ALICE)
    assert kv.flush_root(ROOT_A) == InvalidationResult(0, 0, 0)
    assert kv.pool.num_cached_blocks == 3


def test_a_block_held_in_flight_is_unpublished_now_and_freed_when_released() -> None:
    kv = KVCacheManager(num_blocks=12, block_size=BS)
    run(kv, "alice", ROOT_A, ALICE)  # blocks 0 1 2, free
    run(kv, "bob", ROOT_A, BOB, free=False)  # holds 0 1 and its own 4

    result = kv.flush_root(ROOT_A)

    assert result == InvalidationResult(blocks_freed=1, tokens_freed=4, deferred=3)
    assert kv.pool.num_cached_blocks == 0  # nothing of tenant A can be matched any more
    assert kv.match_prefix(ROOT_A, BOB).num_cached_tokens == 0
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 4)] == [1, 1, 1]
    kv.free("bob")
    assert kv.pool.num_free_blocks == 12
    assert kv.pool.num_cached_blocks == 0  # released, it stays unpublished


def test_tops_past_an_lru_evicted_parent_are_flushed_too() -> None:
    kv = KVCacheManager(num_blocks=12, block_size=BS)
    run(kv, "alice", ROOT_A, ALICE)
    chain = hash_chain(ROOT_A, ALICE, BS)
    kv.evict_cached([chain[0]])  # LRU-like: the head goes, its descendants stay cached
    assert kv.pool.num_cached_blocks == 2

    assert kv.flush_root(ROOT_A).blocks_freed == 2
    assert kv.pool.num_cached_blocks == 0


def test_num_cached_counts_distinct_cached_hashes() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    run(kv, "alice", ROOT_A, ALICE)
    chain = hash_chain(ROOT_A, ALICE, BS)
    assert kv.num_cached([*chain, chain[0]]) == 3
    kv.evict_cached([chain[2]])
    assert kv.num_cached(chain) == 2
    assert kv.num_cached([]) == 0
