"""Pure-Python KV block bookkeeping (no torch): chained block hashes, the block pool, per-request block tables and the
per-session index used to release a closed session's cache."""

from engine.kv.block_hash import BlockHash, hash_block, hash_chain, root_hash
from engine.kv.block_pool import BlockPool, FreeBlockQueue, KVBlock
from engine.kv.kv_cache_manager import KVCacheManager, KVCacheUsage, MatchResult
from engine.kv.session_index import SessionIndex

__all__ = [
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "KVBlock",
    "KVCacheManager",
    "KVCacheUsage",
    "MatchResult",
    "SessionIndex",
    "hash_block",
    "hash_chain",
    "root_hash",
]
