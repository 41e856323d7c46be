"""The weighted eviction choice over a pool of integers: temperature, block type, reuse, recency, leaves first."""

from __future__ import annotations

from engine.kv.block_hash import hash_block, root_hash
from engine.kv.block_meta import BlockMeta
from engine.kv.block_pool import BlockPool
from engine.kv.eviction import WeightedChooser
from engine.kv.tier_config import CacheSettings

ROOT = root_hash("model", "ns")


def publish(
    pool: BlockPool, block_id: int, seed: int, block_type: str, owner: str | None, parent: bytes = ROOT
) -> bytes:
    block = pool.get_new_blocks(1)[0]
    assert block.block_id == block_id
    h = hash_block(parent, (seed,))  # type: ignore[arg-type]
    pool.cache_block(block, h, (seed,), parent=parent, root=ROOT, meta=BlockMeta(((block_type, 1),)), owner=owner)  # type: ignore[arg-type]
    return h


def chooser(settings: CacheSettings, temps: dict[str, float], now: float = 100.0) -> WeightedChooser:
    return WeightedChooser(lambda: settings, temps.get, clock=lambda: now)  # type: ignore[arg-type]


def release_all(pool: BlockPool) -> None:
    pool.free_blocks([b for b in pool.blocks if b.ref_cnt])
    for block in pool.blocks:
        block.last_used = 100.0


def test_a_cold_topic_and_chit_chat_go_before_policy_text_and_a_hot_topic() -> None:
    pool = BlockPool(4)
    publish(pool, 0, 1, "policy_text", "hot")
    publish(pool, 1, 2, "context", "hot")
    publish(pool, 2, 3, "context", "cold")
    publish(pool, 3, 4, "policy_text", "cold")
    release_all(pool)
    pick = chooser(CacheSettings(), {"hot": 0.9, "cold": 0.1})
    assert pick.choose(pool).block_id == 2  # cold chit-chat first
    pool.free_queue.remove(pool.blocks[2])
    assert pick.choose(pool).block_id == 3  # then cold policy (weight 3 x 0.35) before hot context (1 x 1.15)


def test_reuse_and_recency_keep_a_block() -> None:
    pool = BlockPool(2)
    publish(pool, 0, 1, "context", None)
    publish(pool, 1, 2, "context", None)
    release_all(pool)
    pool.blocks[0].num_hits = 5
    assert chooser(CacheSettings(), {}).choose(pool).block_id == 1
    pool.blocks[0].num_hits = 0
    pool.blocks[0].last_used = 0.0  # idle for 100 s
    assert chooser(CacheSettings(), {}).choose(pool).block_id == 0


def test_a_blank_block_goes_first_and_a_chain_head_waits_for_its_tail() -> None:
    pool = BlockPool(3)
    head = publish(pool, 0, 1, "policy_text", None)
    publish(pool, 1, 2, "context", None, parent=head)  # the tail: a leaf, worth less
    publish(pool, 2, 3, "policy_text", None)
    release_all(pool)
    pool.blocks[1].num_hits = 50  # the tail is worth more than the head now, but the head has a cached child
    assert chooser(CacheSettings(), {}).choose(pool).block_id == 2
    pool.evict_free_blocks([pool.blocks[2]])  # a block without a hash holds nothing
    assert chooser(CacheSettings(), {}).choose(pool).block_id == 2


def test_lru_takes_the_queue_head() -> None:
    pool = BlockPool(2)
    publish(pool, 0, 1, "policy_text", None)
    publish(pool, 1, 2, "context", None)
    release_all(pool)
    assert chooser(CacheSettings(eviction_policy="lru"), {}).choose(pool).block_id == 0
