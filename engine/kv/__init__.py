"""Pure-Python KV block bookkeeping (no torch): chained block hashes, the block pool, per-request block tables, the
per-session index used to release a closed session's cache, the dependency index used to invalidate a block's
descendants, block-type labels and cache statistics."""

from engine.kv.block_hash import BlockHash, hash_block, hash_chain, root_hash
from engine.kv.block_meta import BlockMeta, SpanMap, TokenSpan
from engine.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock
from engine.kv.cache_stats import CacheStats, InvalidationCounts
from engine.kv.dependency_index import DependencyIndex
from engine.kv.kv_cache_manager import CacheFootprint, InvalidationResult, KVCacheManager, KVCacheUsage, MatchResult
from engine.kv.session_index import SessionIndex

__all__ = [
    "BlockHash",
    "BlockMeta",
    "BlockPool",
    "CacheFootprint",
    "CacheStats",
    "DependencyIndex",
    "FreeBlockQueue",
    "InvalidationCounts",
    "InvalidationResult",
    "KVBlock",
    "KVCacheManager",
    "KVCacheUsage",
    "MatchResult",
    "SessionIndex",
    "SpanMap",
    "TokenSpan",
    "hash_block",
    "hash_chain",
    "root_hash",
]
