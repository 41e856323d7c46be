"""Dependent-block invalidation, block-type labels and cache statistics in the pure-Python KV layer (exact ids)."""

from __future__ import annotations

import pytest

from engine.kv.block_hash import BlockHash, hash_chain, root_hash
from engine.kv.block_meta import GENERATED, TEMPLATE, UNTYPED, BlockMeta, SpanMap, TokenSpan
from engine.kv.cache_stats import InvalidationCounts
from engine.kv.dependency_index import DependencyIndex
from engine.kv.kv_cache_manager import InvalidationResult, KVCacheManager, MatchResult

BS = 4
ROOT = root_hash("model", "tenant-a")
OTHER_ROOT = root_hash("model", "tenant-b")
SYSTEM = [1, 1, 1, 1, 2, 2, 2, 2]  # two blocks every session shares
ALICE = [*SYSTEM, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # blocks 2, 3 of her own (+ 1 partial token)
ALICE_FORK = [*SYSTEM, 10, 11, 12, 13, 99, 98, 97, 96, 95]  # shares Alice's block 2, then branches
BOB = [*SYSTEM, 20, 21, 22, 23, 24]


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def run(kv: KVCacheManager, rid: str, tokens: list[int], spans: SpanMap | None = None) -> MatchResult:
    match = kv.match_prefix(ROOT, tokens)
    assert kv.allocate_slots(rid, len(tokens), match, spans)
    kv.cache_full_blocks(rid, ROOT, tokens, len(tokens))
    return match


# ------------------------------------------------------------------ DependencyIndex


def test_dependency_index_subtree_is_pre_order_and_survives_a_parent_removal() -> None:
    deps = DependencyIndex()
    root = h(0)
    deps.add(h(1), root, root)
    deps.add(h(2), h(1), root)
    deps.add(h(3), h(2), root)
    deps.add(h(4), h(1), root)
    assert deps.subtree(h(1)) == [h(1), h(2), h(3), h(4)]
    assert deps.subtree(root) == [h(1), h(2), h(3), h(4)]
    assert (deps.parent(h(3)), deps.root_of(h(3))) == (h(2), root)
    deps.remove(h(2))  # LRU took the parent; its child stays reachable through the parent's hash
    assert deps.subtree(h(2)) == [h(3)]
    assert deps.subtree(h(1)) == [h(1), h(4)]
    assert deps.children(h(1)) == [h(4)]
    deps.remove(h(2))  # unknown: ignored
    assert len(deps) == 3
    with pytest.raises(ValueError, match="already linked"):
        deps.add(h(3), h(2), root)


def test_the_pool_links_published_blocks_and_unlinks_evicted_ones() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    run(kv, "a", ALICE)
    chain = hash_chain(ROOT, ALICE, BS)
    assert kv.pool.deps.subtree(chain[0]) == chain
    assert kv.pool.deps.root_of(chain[3]) == ROOT
    kv.free("a")
    kv.evict_cached([chain[1]])
    assert chain[1] not in kv.pool.deps
    assert kv.pool.deps.subtree(chain[1]) == chain[2:]


# ------------------------------------------------------------------ SpanMap / BlockMeta


def test_span_map_counts_tokens_by_type_and_fills_the_gaps() -> None:
    spans = SpanMap(
        [TokenSpan(0, 3, TEMPLATE), TokenSpan(3, 9, "policy", 7), TokenSpan(10, 12, "question", 8, 7)], fill=GENERATED
    )
    assert spans.tokens_by_type(0, 4) == {TEMPLATE: 3, "policy": 1}
    assert spans.tokens_by_type(8, 14) == {"policy": 1, GENERATED: 3, "question": 2}
    assert spans.block_meta(8, 12) == BlockMeta((("generated", 1), ("policy", 1), ("question", 2)), frozenset({7, 8}))
    assert spans.block_meta(8, 12).block_types == {"generated", "policy", "question"}
    assert SpanMap().tokens_by_type(0, 4) == {UNTYPED: 4}
    with pytest.raises(ValueError, match="overlapping"):
        SpanMap([TokenSpan(0, 3, "a"), TokenSpan(2, 4, "b")])


def test_published_blocks_record_their_block_types_and_stats_add_up() -> None:
    kv = KVCacheManager(num_blocks=12, block_size=BS)
    spans = SpanMap([TokenSpan(0, 8, "system", 1), TokenSpan(8, 17, "context", 2, 1)])
    run(kv, "a", ALICE, spans)
    metas = [kv.pool.blocks[i].meta for i in kv.block_table("a")[:4]]
    assert (
        metas == [BlockMeta((("system", 4),), frozenset({1}))] * 2 + [BlockMeta((("context", 4),), frozenset({2}))] * 2
    )
    run(kv, "b", BOB, SpanMap([TokenSpan(0, 8, "system", 1), TokenSpan(8, 13, "question", 3)]))
    stats = kv.cache_stats()
    assert stats.query_tokens_by_type == {"system": 16, "context": 9, "question": 5}
    assert stats.hit_tokens_by_type == {"system": 8}
    assert (stats.num_query_tokens, stats.num_hit_tokens) == (30, 8) == (kv.usage().num_query_tokens, 8)
    assert sum(stats.query_tokens_by_type.values()) == stats.num_query_tokens
    assert (stats.num_lookups, stats.num_lookups_hit, stats.avg_reuse_depth) == (2, 1, 8.0)
    assert stats.hit_rate_of("system") == 0.5
    assert stats.cached_blocks_by_type == {"system": 2, "context": 2, "question": 1}
    # 5 blocks published, 2 reused (the system prompt): efficiency 2/5; an evicted reused block still counts.
    assert (stats.blocks_published, stats.blocks_reused, stats.cache_efficiency) == (5, 2, 0.4)
    kv.free("a")
    kv.free("b")
    kv.evict_cached(hash_chain(ROOT, ALICE, BS)[::-1])
    assert (kv.cache_stats().blocks_published, kv.cache_stats().blocks_reused) == (5, 2)


# ------------------------------------------------------------------ invalidate


def three_sessions() -> KVCacheManager:
    """Alice: blocks 0-3 (0, 1 the shared system prompt). Fork: hits 0-2, publishes 5. Bob: hits 0, 1, publishes 7.
    Every request finished: all blocks free (4, 6 and 8 held their partial last blocks)."""
    kv = KVCacheManager(num_blocks=12, block_size=BS)
    for rid, tokens in (("alice", ALICE), ("fork", ALICE_FORK), ("bob", BOB)):
        run(kv, rid, tokens)
        kv.free(rid)
    return kv


def test_three_sessions_layout() -> None:
    kv = three_sessions()
    assert [kv.pool.get_cached_block(x).block_id for x in hash_chain(ROOT, ALICE, BS)] == [0, 1, 2, 3]  # type: ignore[union-attr]
    assert [kv.pool.get_cached_block(x).block_id for x in hash_chain(ROOT, ALICE_FORK, BS)] == [0, 1, 2, 5]  # type: ignore[union-attr]
    assert [kv.pool.get_cached_block(x).block_id for x in hash_chain(ROOT, BOB, BS)] == [0, 1, 7]  # type: ignore[union-attr]


def test_invalidating_a_middle_block_frees_exactly_its_subtree() -> None:
    kv = three_sessions()
    alice = hash_chain(ROOT, ALICE, BS)
    queue = kv.pool.free_block_ids()
    result = kv.invalidate([alice[2]], root=ROOT, reason="context_edit")
    # Alice's block 2 and everything after it: her block 3 and the fork's block 5 (pre-order 2, 3, 5; freed reversed).
    assert result == InvalidationResult(blocks_freed=3, tokens_freed=12, deferred=0)
    assert kv.pool.free_block_ids()[:3] == [5, 3, 2]
    assert kv.pool.free_block_ids()[3:] == [i for i in queue if i not in (2, 3, 5)]
    assert sorted(b.block_id for b in kv.pool.cached.values()) == [0, 1, 7]
    assert kv.match_prefix(ROOT, BOB).num_cached_tokens == 12  # Bob and the shared system prompt survive
    assert kv.match_prefix(ROOT, ALICE).num_cached_tokens == 8
    assert kv.cache_stats().invalidations == {"context_edit": InvalidationCounts(3, 12, 0)}
    assert kv.invalidate([alice[2]], root=ROOT, reason="context_edit") == InvalidationResult(0, 0, 0)


def test_protected_blocks_survive_but_their_unprotected_descendants_do_not() -> None:
    kv = three_sessions()
    alice, fork = hash_chain(ROOT, ALICE, BS), hash_chain(ROOT, ALICE_FORK, BS)
    # The whole tree under Alice's first block: Alice's 2, 3, Bob's 7 go; the protected 0, 1 and fork's 5 stay.
    result = kv.invalidate([alice[0]], root=ROOT, protected={alice[0], alice[1], fork[3]})
    assert result == InvalidationResult(blocks_freed=3, tokens_freed=12, deferred=0)
    assert sorted(b.block_id for b in kv.pool.cached.values()) == [0, 1, 5]


def test_another_namespace_is_never_reached() -> None:
    kv = three_sessions()
    assert kv.invalidate(hash_chain(ROOT, ALICE, BS), root=OTHER_ROOT) == InvalidationResult(0, 0, 0)
    assert kv.pool.num_cached_blocks == 6


def test_a_held_block_is_dropped_when_its_holder_releases_it() -> None:
    kv = three_sessions()
    alice = hash_chain(ROOT, ALICE, BS)
    longer = [*ALICE, 19, 20, 21, 22, 23]  # a new turn in flight: hits blocks 0-3, then computes 2 more
    match = run(kv, "turn", longer)
    assert match.blocks == (0, 1, 2, 3)
    table = kv.block_table("turn")
    result = kv.invalidate([alice[2]], root=ROOT, reason="edit")
    # Blocks 2, 3 and the turn's new full block are held: unpublished now, freed at release; the fork's 5 goes now.
    assert result == InvalidationResult(blocks_freed=1, tokens_freed=4, deferred=3)
    assert kv.match_prefix(ROOT, longer).blocks == (0, 1)
    assert kv.block_table("turn") == table  # the running request keeps reading its K/V
    kv.allocate_slots("turn", len(longer) + 3)
    kv.cache_full_blocks("turn", ROOT, [*longer, 1, 2, 3], len(longer) + 3)  # publishes nothing past block 2
    assert kv.match_prefix(ROOT, [*longer, 1, 2, 3, 4]).blocks == (0, 1)
    held = set(table) - {0, 1}
    kv.free("turn")
    assert all(kv.pool.blocks[i].block_hash is None and kv.pool.blocks[i].ref_cnt == 0 for i in held)
    assert kv.pool.num_free_blocks == 12
    assert sorted(b.block_id for b in kv.pool.cached.values()) == [0, 1, 7]


def test_stop_publishing_keeps_a_request_from_publishing_its_tail() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    assert kv.allocate_slots("a", len(ALICE), MatchResult(num_query_tokens=len(ALICE)))
    kv.stop_publishing("a", 2)
    kv.cache_full_blocks("a", ROOT, ALICE, len(ALICE))
    assert kv.request_hashes("a") == tuple(hash_chain(ROOT, ALICE, BS))
    assert kv.pool.num_cached_blocks == 2
    kv.stop_publishing("unknown", 0)  # ignored


def test_release_reason_is_counted() -> None:
    kv = three_sessions()
    bob = hash_chain(ROOT, BOB, BS)
    assert kv.evict_cached(bob[2:], reason="session_released") == 1
    assert kv.cache_stats().invalidations == {"session_released": InvalidationCounts(1, 4, 0)}


def test_session_chain_lists_every_full_block_cut_at_the_publish_limit() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    chain = hash_chain(ROOT, ALICE, BS)
    assert kv.session_chain("unknown", ROOT, ALICE) == chain  # cached or not, index i is block i
    assert kv.session_chain("unknown", ROOT, ALICE, publish_limit=3) == chain[:3]
    run(kv, "a", ALICE)
    kv.stop_publishing("a", 2)
    assert kv.session_chain("a", ROOT, ALICE) == chain[:2]
    assert kv.session_chain("a", ROOT, ALICE, publish_limit=1) == chain[:1]
