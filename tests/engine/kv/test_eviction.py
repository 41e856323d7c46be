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


WEIGHTED = CacheSettings(eviction_policy="weighted")


def test_a_cold_topic_and_chit_chat_go_before_policy_text_and_a_hot_topic() -> None:
    pool = BlockPool(4)
    publish(pool, 0, 1, "policy_text", "hot")
    publish(pool, 1, 2, "context", "hot")
    publish(pool, 2, 3, "context", "cold")
    publish(pool, 3, 4, "policy_text", "cold")
    release_all(pool)
    pick = chooser(WEIGHTED, {"hot": 0.9, "cold": 0.1})
    order = []
    for _ in range(4):
        block = pick.choose(pool)
        order.append(block.block_id)
        pool.free_queue.remove(block)
    assert order[0] == 2  # cold chit-chat first, although two blocks were released before it
    assert order[-1] == 0  # hot policy text last


def test_recency_still_counts() -> None:
    pool = BlockPool(2)
    publish(pool, 0, 1, "policy_text", None)
    publish(pool, 1, 2, "context", None)
    release_all(pool)
    assert chooser(WEIGHTED, {}).choose(pool).block_id == 1  # fresh, but worth a third
    pool.blocks[0].last_used = -500.0  # the policy block has been idle for 10 minutes
    assert chooser(WEIGHTED, {}).choose(pool).block_id == 0


def test_a_blank_block_goes_first_and_a_chain_head_waits_for_its_tail() -> None:
    pool = BlockPool(3)
    head = publish(pool, 0, 1, "context", None)
    publish(pool, 1, 2, "policy_text", None, parent=head)  # the tail: a leaf
    publish(pool, 2, 3, "context", None)
    release_all(pool)
    # the head (worth least) has a cached child: the youngest context leaf goes before it
    assert chooser(WEIGHTED, {}).choose(pool).block_id == 2
    pool.evict_free_blocks([pool.blocks[2]])  # a block without a hash holds nothing
    assert chooser(WEIGHTED, {}).choose(pool).block_id == 2


def test_lru_takes_the_queue_head() -> None:
    pool = BlockPool(2)
    publish(pool, 0, 1, "policy_text", None)
    publish(pool, 1, 2, "context", None)
    release_all(pool)
    assert chooser(CacheSettings(), {}).choose(pool).block_id == 0  # (LRU is the default)
