from __future__ import annotations

import pytest

from engine.kv.block_hash import BlockHash, hash_block, root_hash
from engine.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock

ROOT = root_hash("m", "ns")


def h(i: int) -> BlockHash:
    return hash_block(ROOT, [i])


def test_new_pool_is_all_free_in_id_order() -> None:
    pool = BlockPool(4)
    assert pool.free_block_ids() == [0, 1, 2, 3]
    assert pool.num_free_blocks == 4
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_pool_rejects_empty() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_get_new_blocks_pops_head_with_ref_one() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 0, 0]
    assert pool.free_block_ids() == [3, 4]


def test_get_too_many_blocks_raises_and_changes_nothing() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.get_new_blocks(3)
    assert pool.free_block_ids() == [0, 1]


def test_free_appends_in_given_order() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks([blocks[2], blocks[0], blocks[1]])
    assert pool.free_block_ids() == [3, 4, 2, 0, 1]


def test_shared_block_joins_queue_only_at_last_reference() -> None:
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1
    assert pool.free_block_ids() == [1, 2]
    pool.free_blocks([b])
    assert pool.free_block_ids() == [1, 2, 0]


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([b])


def test_touch_revives_a_free_block_from_the_middle() -> None:
    pool = BlockPool(5)
    pool.touch([pool.blocks[2]])
    assert pool.blocks[2].ref_cnt == 1
    assert pool.free_block_ids() == [0, 1, 3, 4]
    pool.free_blocks([pool.blocks[2]])
    assert pool.free_block_ids() == [0, 1, 3, 4, 2]


def test_cache_block_publishes_and_keeps_hash_after_free() -> None:
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    assert pool.cache_block(b, h(1), (1,))
    pool.free_blocks([b])
    assert pool.get_cached_block(h(1)) is b
    assert b.block_hash == h(1)
    assert b.token_ids == (1,)
    assert pool.num_cached_blocks == 1
    assert pool.num_evictable_blocks == 1


def test_reuse_evicts_the_old_hash() -> None:
    pool = BlockPool(2)
    (b0,) = pool.get_new_blocks(1)
    pool.cache_block(b0, h(1), (1,))
    pool.free_blocks([b0])
    assert pool.free_block_ids() == [1, 0]
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [0, 1]  # (taken in queue order, handed out in ascending order)
    assert pool.get_cached_block(h(1)) is None
    assert b0.block_hash is None
    assert b0.token_ids is None
    assert pool.num_cached_blocks == 0


def test_duplicate_hash_keeps_first_mapping() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, h(1), (1,))
    assert not pool.cache_block(b, h(1), (1,))
    assert pool.get_cached_block(h(1)) is a
    assert b.block_hash is None
    # Freeing and reusing the unpublished duplicate never touches the canonical mapping.
    pool.free_blocks([b])
    pool.get_new_blocks(2)
    assert pool.get_cached_block(h(1)) is a


def test_cache_block_twice_raises() -> None:
    pool = BlockPool(1)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, h(1), (1,))
    with pytest.raises(ValueError, match="already published"):
        pool.cache_block(b, h(2), (2,))


def test_free_queue_operations() -> None:
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3]
    assert len(q) == 4
    q.remove(blocks[0])
    q.remove(blocks[3])
    q.remove(blocks[1])
    assert [b.block_id for b in q] == [2]
    assert blocks[1] not in q
    assert blocks[2] in q
    q.append(blocks[3])
    q.append(blocks[0])
    assert [b.block_id for b in q] == [2, 3, 0]
    assert q.popleft() is blocks[2]
    assert len(q) == 2
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[3])
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[2])
    q.popleft()
    q.popleft()
    assert len(q) == 0
    assert list(q) == []
    with pytest.raises(IndexError):
        q.popleft()


def test_free_queue_appendleft_puts_the_block_first() -> None:
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks[:2])
    q.appendleft(blocks[2])
    q.appendleft(blocks[3])
    assert [b.block_id for b in q] == [3, 2, 0, 1]
    assert len(q) == 4
    assert blocks[3] in q
    with pytest.raises(ValueError, match="already in the free queue"):
        q.appendleft(blocks[0])
    assert q.popleft() is blocks[3]
    q.remove(blocks[1])
    q.append(blocks[1])
    assert [b.block_id for b in q] == [2, 0, 1]
    empty = FreeBlockQueue([])
    empty.appendleft(blocks[3])
    assert list(empty) == [blocks[3]]
    assert empty.popleft() is blocks[3]
    assert len(empty) == 0


def test_evict_free_blocks_drops_hashes_and_moves_to_head_in_order() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, h(i), (i,))
    pool.free_blocks(blocks)
    assert pool.free_block_ids() == [3, 4, 0, 1, 2]
    pool.evict_free_blocks([blocks[2], blocks[0]])
    assert pool.free_block_ids() == [2, 0, 3, 4, 1]
    assert pool.get_cached_block(h(0)) is None
    assert pool.get_cached_block(h(2)) is None
    assert pool.get_cached_block(h(1)) is blocks[1]
    assert (blocks[2].block_hash, blocks[2].token_ids) == (None, None)
    assert (blocks[0].block_hash, blocks[0].token_ids) == (None, None)
    assert pool.num_cached_blocks == 1
    assert pool.num_free_blocks == 5
    # the head first (2); then 3 rather than 0: blank too, and consecutive (see get_new_blocks)
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 3]
    assert pool.free_block_ids() == [0, 4, 1]


def test_evict_free_blocks_refuses_a_used_block_and_changes_nothing() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(1), (1,))
    pool.cache_block(b, h(2), (2,))
    pool.free_blocks([a])
    with pytest.raises(ValueError, match="in use"):
        pool.evict_free_blocks([a, b])
    assert pool.free_block_ids() == [2, 0]
    assert pool.get_cached_block(h(1)) is a
    assert pool.get_cached_block(h(2)) is b


def test_evict_free_blocks_with_an_uncached_block_only_moves_it() -> None:
    pool = BlockPool(3)
    pool.evict_free_blocks([pool.blocks[2]])
    assert pool.free_block_ids() == [2, 0, 1]
    assert pool.num_cached_blocks == 0
    pool.evict_free_blocks([])
    assert pool.free_block_ids() == [2, 0, 1]


def test_new_blocks_continue_after_a_given_block_when_it_is_free_and_blank() -> None:
    pool = BlockPool(8)
    first = pool.get_new_blocks(2)  # 0, 1
    others = pool.get_new_blocks(3)  # 2, 3, 4
    pool.free_blocks(others)  # queue: 5, 6, 7, 2, 3, 4
    assert pool.free_block_ids() == [5, 6, 7, 2, 3, 4]
    more = pool.get_new_blocks(3, after=first[-1])
    assert [b.block_id for b in more] == [2, 3, 4]  # taken out of queue order: a consecutive table
    assert pool.free_block_ids() == [5, 6, 7]
    assert all(b.ref_cnt == 1 for b in more)


def test_a_block_holding_a_prefix_is_never_taken_out_of_lru_order() -> None:
    pool = BlockPool(6)
    first = pool.get_new_blocks(1)  # 0
    cached = pool.get_new_blocks(1)[0]  # 1
    pool.cache_block(cached, h(1), (1,))
    pool.free_blocks([cached])  # queue: 2, 3, 4, 5, 1 (1 still holds h(1))
    taken = pool.get_new_blocks(2, after=first[0])
    assert [b.block_id for b in taken] == [2, 3]  # not 1: it goes by the queue, then continues after 2
    assert pool.get_cached_block(h(1)) is cached
    assert pool.free_block_ids() == [4, 5, 1]


def test_recycled_blocks_are_handed_out_ascending_but_taken_in_lru_order() -> None:
    pool = BlockPool(6)
    seq = pool.get_new_blocks(6)
    for i, b in enumerate(seq):
        pool.cache_block(b, h(i), (i,))
    pool.free_blocks(reversed(seq))  # a finished request: tail first
    assert pool.free_block_ids() == [5, 4, 3, 2, 1, 0]
    taken = pool.get_new_blocks(3)
    assert [b.block_id for b in taken] == [3, 4, 5]  # the three LRU blocks, ascending
    assert pool.free_block_ids() == [2, 1, 0]
    assert [pool.get_cached_block(h(i)) for i in (3, 4, 5)] == [None, None, None]
    assert pool.get_cached_block(h(2)) is seq[2]


def test_new_blocks_past_the_given_block_lead() -> None:
    pool = BlockPool(8)
    seq = pool.get_new_blocks(8)
    for i, b in enumerate(seq):
        pool.cache_block(b, h(i), (i,))
    pool.free_blocks([seq[6], seq[1], seq[7], seq[0]])  # queue: 6, 1, 7, 0 (all holding prefixes)
    taken = pool.get_new_blocks(4, after=seq[5])
    assert [b.block_id for b in taken] == [6, 7, 0, 1]  # ascending from the first id past 5, then the rest
