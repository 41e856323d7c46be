"""Prefix-cache statistics: hits by block type, reuse depth, cache efficiency, invalidations by reason.

``CacheStatsRecorder`` is the mutable tally the ``KVCacheManager`` updates as it matches, publishes, evicts and
invalidates; ``CacheStats`` is the frozen snapshot ``KVCacheManager.cache_stats()`` hands out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class InvalidationCounts:
    """What invalidations for one reason did: blocks (and their tokens) freed at once, and blocks whose drop waited
    for the in-flight requests that held them."""

    blocks_freed: int = 0
    tokens_freed: int = 0
    blocks_deferred: int = 0


@dataclass(frozen=True, slots=True)
class CacheStats:
    num_lookups: int  # admissions that looked up the prefix cache (a readmission after preemption counts again)
    num_lookups_hit: int  # of those, the ones that found at least one cached block
    num_query_tokens: int
    num_hit_tokens: int
    query_tokens_by_type: Mapping[str, int]
    hit_tokens_by_type: Mapping[str, int]
    blocks_published: int  # blocks ever published
    blocks_reused: int  # of those, blocks hit at least once (whether still cached or since evicted)
    cached_blocks_by_type: Mapping[str, int]  # cached blocks now, per block type they cover (a block may count twice)
    invalidations: Mapping[str, InvalidationCounts]  # by reason

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def hit_rate_of(self, block_type: str) -> float:
        query = self.query_tokens_by_type.get(block_type, 0)
        return self.hit_tokens_by_type.get(block_type, 0) / query if query else 0.0

    @property
    def avg_reuse_depth(self) -> float:
        """Cached tokens per lookup that hit."""
        return self.num_hit_tokens / self.num_lookups_hit if self.num_lookups_hit else 0.0

    @property
    def cache_efficiency(self) -> float:
        """Share of published blocks that were ever reused (all blocks are the same size, so also of their bytes)."""
        return self.blocks_reused / self.blocks_published if self.blocks_published else 0.0


@dataclass(slots=True)
class CacheStatsRecorder:
    num_lookups: int = 0
    num_lookups_hit: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    query_tokens_by_type: Counter[str] = field(default_factory=Counter)
    hit_tokens_by_type: Counter[str] = field(default_factory=Counter)
    invalidations: dict[str, InvalidationCounts] = field(default_factory=dict)

    def lookup(self, query_by_type: Mapping[str, int], hit_by_type: Mapping[str, int]) -> None:
        query, hit = sum(query_by_type.values()), sum(hit_by_type.values())
        self.num_lookups += 1
        self.num_lookups_hit += hit > 0
        self.num_query_tokens += query
        self.num_hit_tokens += hit
        self.query_tokens_by_type.update(query_by_type)
        self.hit_tokens_by_type.update(hit_by_type)

    def invalidated(self, reason: str, blocks_freed: int, tokens_freed: int, blocks_deferred: int) -> None:
        old = self.invalidations.get(reason, InvalidationCounts())
        self.invalidations[reason] = InvalidationCounts(
            old.blocks_freed + blocks_freed, old.tokens_freed + tokens_freed, old.blocks_deferred + blocks_deferred
        )

    def snapshot(
        self, blocks_published: int, blocks_reused: int, cached_blocks_by_type: Mapping[str, int]
    ) -> CacheStats:
        """The tally plus what the block pool counts (``BlockPool.num_published`` / ``num_reused``)."""
        return CacheStats(
            num_lookups=self.num_lookups,
            num_lookups_hit=self.num_lookups_hit,
            num_query_tokens=self.num_query_tokens,
            num_hit_tokens=self.num_hit_tokens,
            query_tokens_by_type=MappingProxyType(dict(self.query_tokens_by_type)),
            hit_tokens_by_type=MappingProxyType(dict(self.hit_tokens_by_type)),
            blocks_published=blocks_published,
            blocks_reused=blocks_reused,
            cached_blocks_by_type=MappingProxyType(dict(cached_blocks_by_type)),
            invalidations=MappingProxyType(dict(self.invalidations)),
        )
