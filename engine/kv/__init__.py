"""Pure-Python KV block bookkeeping (no torch): chained block hashes, the block pool, per-request block tables."""

from engine.kv.block_hash import BlockHash, hash_block, hash_chain, root_hash
from engine.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock
from engine.kv.kv_cache_manager import KVCacheManager, KVCacheUsage, MatchResult

__all__ = [
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "KVBlock",
    "KVCacheManager",
    "KVCacheUsage",
    "MatchResult",
    "hash_block",
    "hash_chain",
    "root_hash",
]
