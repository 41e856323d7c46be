"""Which free block a new allocation takes: plain LRU (the default), or a weighted choice among the least recent.

The weighted policy looks at the ``window`` blocks at the head of the free queue (the least recently released) and
hands out the one worth least, where the worth of the block at position ``i`` of the queue is

    type weight x (0.25 + its session's semantic temperature) / (1 + idle seconds / 60) x (1 + i / 8)

so a block of a cold topic or of chit-chat goes before policy text, identifiers and a hot topic, and recency still
counts. A block with a cached child is never taken while a leaf is in the window: evicting a chain's head would
strand its tail (a prefix match walks from the root). A block without a hash holds nothing and goes first.

NOTE: past hits are not weighed: on the replay of ``bench/tier_eviction.py`` a term for them took the newest blocks of
live sessions (whose next turn needs them) before the well-hit blocks of finished ones, and lost to LRU by 1.7 points
of hit rate; without it the policy is within noise of LRU there. LRU stays the default (docs/benchmarks.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from engine.kv.block_pool import BlockPool, KVBlock
from engine.kv.tier_config import CacheSettings

DEFAULT_WINDOW = 32
UNKNOWN_TEMPERATURE = 0.5  # a block no session owns (a stateless API request), or a session never scored


class WeightedChooser:
    def __init__(
        self,
        settings: Callable[[], CacheSettings],
        temperature: Callable[[str | None], float | None],
        window: int = DEFAULT_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._temperature = temperature
        self.window = window
        self._clock = clock

    def choose(self, pool: BlockPool) -> KVBlock:
        settings = self._settings()
        if settings.eviction_policy == "lru":
            return pool.free_queue.head()
        now = self._clock()
        best: KVBlock | None = None
        best_worth = math.inf
        fallback: KVBlock | None = None
        for i, block in enumerate(pool.free_queue):
            if i >= self.window:
                break
            if block.block_hash is None:
                return block
            if fallback is None:
                fallback = block
            if self._has_cached_child(pool, block):
                continue
            worth = self.worth(block, settings, now) * (1.0 + i / 8.0)
            if worth < best_worth:
                best, best_worth = block, worth
        if best is not None:
            return best
        return fallback if fallback is not None else pool.free_queue.head()

    def worth(self, block: KVBlock, settings: CacheSettings, now: float) -> float:
        types = block.meta.block_types if block.meta is not None else frozenset()
        temperature = self._temperature(block.owner)
        t = UNKNOWN_TEMPERATURE if temperature is None else min(1.0, max(0.0, temperature))
        idle = max(0.0, now - block.last_used)
        return settings.type_weight(types) * (0.25 + t) / (1.0 + idle / 60.0)

    @staticmethod
    def _has_cached_child(pool: BlockPool, block: KVBlock) -> bool:
        assert block.block_hash is not None
        return any(child in pool.cached for child in pool.deps.children(block.block_hash))
