"""Per-request KV block tables over one ``BlockPool``, with exact prefix caching.

Protocol for one request (the scheduler drives it)::

    match = kv.match_prefix(root, token_ids)                    # pure
    ok = kv.allocate_slots(rid, total_tokens_after_step, match)  # check, then commit; False changes nothing
    ... the model runner fills the slots ...
    kv.cache_full_blocks(rid, root, token_ids, num_computed)     # publish the blocks the step filled
    kv.free(rid)                                                 # when the request finishes or is preempted

When a chat session closes, ``kv.evict_cached(session_index.release(key))`` drops the cached blocks only that session
wanted (see ``engine.kv.session_index``). When part of a context changes, ``kv.invalidate(hashes, root=...)`` frees
those blocks and every cached block that depends on them (``engine.kv.dependency_index``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass, field

from engine.kv.block_hash import BlockHash, hash_block, hash_chain
from engine.kv.block_meta import BlockMeta, SpanMap
from engine.kv.block_pool import BlockPool, EvictedBlock, KVBlock, VictimChooser
from engine.kv.cache_stats import CacheStats, CacheStatsRecorder


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The longest cached prefix of a prompt: physical block ids, their chain hashes and the tokens they cover."""

    blocks: tuple[int, ...] = ()
    block_hashes: tuple[BlockHash, ...] = ()
    num_cached_tokens: int = 0
    num_query_tokens: int = 0


@dataclass(frozen=True, slots=True)
class KVCacheUsage:
    num_blocks: int
    num_free_blocks: int  # in the free queue (includes evictable ones)
    num_used_blocks: int  # ref > 0
    num_cached_blocks: int  # blocks that carry a published hash (used or free)
    num_evictable_blocks: int  # free blocks that carry a hash
    num_query_tokens: int  # prompt tokens looked up at admission
    num_hit_tokens: int  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


@dataclass(frozen=True, slots=True)
class InvalidationResult:
    blocks_freed: int  # cached blocks freed now
    tokens_freed: int
    deferred: int  # blocks in-flight requests hold: unpublished now, back in the free queue when released


@dataclass(frozen=True, slots=True)
class CacheFootprint:
    """What a session still occupies in the cache: its recorded chain's blocks that are cached right now."""

    blocks: int
    tokens: int


@dataclass(slots=True)
class _RequestBlocks:
    blocks: list[KVBlock] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)  # chain hashes of blocks[: len(hashes)]
    spans: SpanMap = field(default_factory=SpanMap)
    publish_limit: int | None = None  # blocks at this index or later are never published (an invalidation hit them)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._requests: dict[str, _RequestBlocks] = {}
        self._stats = CacheStatsRecorder()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, root: BlockHash, token_ids: Sequence[int]) -> MatchResult:
        """Longest run of cached full blocks at the start of ``token_ids``. No side effects."""
        if not self.enable_prefix_caching:
            return MatchResult(num_query_tokens=len(token_ids))
        # NOTE: at most (len-1)//block_size blocks: the last prompt token is always recomputed because the model needs
        # its logits to sample the next token, and a cached block carries K/V only, never logits.
        max_blocks = (len(token_ids) - 1) // self.block_size
        ids: list[int] = []
        hashes: list[BlockHash] = []
        parent = root
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = hash_block(parent, tokens)
            block = self.pool.get_cached_block(parent)
            # NOTE: compare the tokens too: a hash match with different tokens is a miss, so reuse stays exact.
            if block is None or block.token_ids != tokens:
                break
            ids.append(block.block_id)
            hashes.append(parent)
        return MatchResult(tuple(ids), tuple(hashes), len(ids) * self.block_size, len(token_ids))

    def can_allocate(self, request_id: str, num_total_tokens: int, match: MatchResult | None = None) -> bool:
        """Whether ``allocate_slots`` with the same arguments would succeed. No side effects."""
        return self._num_new_blocks(request_id, num_total_tokens, match) <= self._free_after_touch(match)

    def allocate_slots(
        self, request_id: str, num_total_tokens: int, match: MatchResult | None = None, spans: SpanMap | None = None
    ) -> bool:
        """Make the request's block table cover ``num_total_tokens`` tokens.

        ``match`` and ``spans`` are only for a request's first allocation: the match's blocks are shared (ref + 1,
        revived from the free queue when they were free); ``spans`` labels the request's token positions (block
        types for the stats and for each block it publishes). Returns False and changes nothing when the pool is short
        of blocks.
        """
        num_new = self._num_new_blocks(request_id, num_total_tokens, match)
        if num_new > self._free_after_touch(match):
            return False
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestBlocks(spans=spans or SpanMap())
        if match is not None:
            hit_blocks = [self.pool.blocks[i] for i in match.blocks]
            if any(b.block_hash != h for b, h in zip(hit_blocks, match.block_hashes, strict=True)):
                raise ValueError("stale MatchResult: a matched block was reused; match and allocate in the same step")
            self.pool.touch(hit_blocks)
            for block in hit_blocks:
                block.num_hits += 1
            state.blocks.extend(hit_blocks)
            state.hashes.extend(match.block_hashes)
            self._stats.lookup(
                state.spans.tokens_by_type(0, match.num_query_tokens),
                state.spans.tokens_by_type(0, match.num_cached_tokens),
            )
        if num_new > 0:
            state.blocks.extend(self.pool.get_new_blocks(num_new, after=state.blocks[-1] if state.blocks else None))
        return True

    def cache_full_blocks(
        self,
        request_id: str,
        root: BlockHash,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        owner: str | None = None,
    ) -> None:
        """Hash and publish every block of the request that ``num_computed_tokens`` has filled since the last call.

        ``owner``: the session the request belongs to (recorded on each block it publishes).
        """
        state = self._requests.get(request_id)
        if state is None or not self.enable_prefix_caching:
            return
        if num_computed_tokens > len(token_ids):
            raise ValueError(f"num_computed_tokens={num_computed_tokens} > {len(token_ids)} tokens")
        num_full = min(num_computed_tokens // self.block_size, len(state.blocks))
        bs = self.block_size
        for i in range(len(state.hashes), num_full):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = state.hashes[-1] if state.hashes else root
            block_hash = hash_block(parent, tokens)
            state.hashes.append(block_hash)
            if state.publish_limit is not None and i >= state.publish_limit:
                continue
            # NOTE: when another block already holds this hash (two requests prefilled the same prefix at once) the
            # existing mapping wins and this block simply stays unpublished; it is freed like any other block.
            meta = state.spans.block_meta(i * bs, (i + 1) * bs)
            self.pool.cache_block(state.blocks[i], block_hash, tokens, parent=parent, root=root, meta=meta, owner=owner)

    def request_hashes(self, request_id: str) -> tuple[BlockHash, ...]:
        """Chain hashes of the request's full blocks computed so far (published or not), in chain order."""
        state = self._requests.get(request_id)
        return () if state is None else tuple(state.hashes)

    def session_chain(
        self, request_id: str, root: BlockHash, token_ids: Sequence[int], publish_limit: int | None = None
    ) -> list[BlockHash]:
        """What a chat session should remember of this request: the chain hash of every full block of ``token_ids``,
        cut where an invalidation stopped the request publishing (``publish_limit``, or ``stop_publishing``).

        NOTE: every full block, cached or not, so that index ``i`` of a recorded chain is block ``i`` of the
        conversation: an invalidation from token position ``p`` starts at chain index ``p // block_size``.
        """
        chain = hash_chain(root, token_ids, self.block_size)
        state = self._requests.get(request_id)
        limits = [n for n in (publish_limit, state.publish_limit if state else None) if n is not None]
        return chain[: min(limits)] if limits else chain

    def stop_publishing(self, request_id: str, from_block: int) -> None:
        """The request publishes none of its blocks at index ``from_block`` or later (an invalidation reached it)."""
        state = self._requests.get(request_id)
        if state is not None:
            state.publish_limit = from_block if state.publish_limit is None else min(state.publish_limit, from_block)

    def free(self, request_id: str) -> None:
        """Release the request's blocks. Unknown ids are ignored (a waiting request holds no blocks)."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        # NOTE: reverse order: the chain's tail reaches the free queue first and is therefore evicted first. Evicting a
        # head block would strand its descendants (matching walks the chain from the root), and heads are the blocks
        # most likely shared by the next request (system prompt, earlier turns).
        self.pool.free_blocks(reversed(state.blocks))

    def truncate(self, request_id: str, num_tokens: int) -> int:
        """Free the request's blocks past the ``blocks_needed(num_tokens)`` first ones; returns how many went.

        NOTE: for the slots of rejected draft tokens (engine.spec): the chain before them is unchanged, and the blocks
        that go were never hashed (only computed, accepted tokens are published), tail first like ``free``.
        """
        state = self._requests.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if state is None or len(state.blocks) <= keep:
            return 0
        if len(state.hashes) > keep:
            raise ValueError(f"request {request_id!r}: cannot truncate below its {len(state.hashes)} published blocks")
        extra = state.blocks[keep:]
        del state.blocks[keep:]
        self.pool.free_blocks(reversed(extra))
        return len(extra)

    def cached_chain(self, root: BlockHash, token_ids: Sequence[int]) -> list[BlockHash]:
        """Chain hashes of the full blocks of ``token_ids`` that are cached right now with exactly these tokens.

        In chain order. Unlike ``match_prefix`` it does not stop at the first miss (a block past a miss is unreachable
        for a match but still occupies a cached block) and it covers the last token too. No side effects.
        """
        bs = self.block_size
        out: list[BlockHash] = []
        parent = root
        for start in range(0, len(token_ids) - bs + 1, bs):
            tokens = tuple(token_ids[start : start + bs])
            parent = hash_block(parent, tokens)
            block = self.pool.get_cached_block(parent)
            if block is not None and block.token_ids == tokens:
                out.append(parent)
        return out

    def evict_cached(self, hashes: Sequence[BlockHash], reason: str | None = None) -> int:
        """Drop the cached blocks of ``hashes`` that no request holds; returns how many were evicted.

        Each evicted block loses its hash (later matches miss it) and moves to the head of the free queue, in the order
        of ``hashes``, so it is reused before any block that still holds a prefix. Hashes that are not cached (never
        published, or already evicted by LRU) are skipped.
        """
        victims: list[KVBlock] = []
        seen: set[int] = set()
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            # NOTE: a block with ref_cnt > 0 sits in a running request's block table: that request (of another session
            # sharing the prefix, or the closing session's own in-flight turn) is still reading its K/V and will be
            # recorded for its session when it finishes, so dropping the hash would only make that session's next turn
            # miss; and an in-use block cannot join the free queue anyway. Once freed it ages out through the LRU.
            if block is None or block.ref_cnt > 0 or block.block_id in seen:
                continue
            seen.add(block.block_id)
            victims.append(block)
        self.pool.evict_free_blocks(victims)
        if reason is not None:
            self._stats.invalidated(reason, len(victims), len(victims) * self.block_size, 0)
        return len(victims)

    def invalidate(
        self,
        hashes: Iterable[BlockHash],
        *,
        root: BlockHash,
        protected: Set[BlockHash] = frozenset(),
        reason: str = "invalidated",
    ) -> InvalidationResult:
        """Free the cached blocks of ``hashes`` and every cached block that depends on them (their subtrees).

        Only blocks of the chain rooted at ``root`` are touched (a namespace reaches its own blocks only); blocks in
        ``protected`` (wanted by other sessions, the shared prefix) are kept, their unprotected descendants are not.
        A block a running request holds is unpublished now and freed when its last holder releases it; each holder
        publishes nothing from that block on. Freed blocks go to the head of the free queue, descendants first.
        """
        deps = self.pool.deps
        targets: dict[BlockHash, None] = {}
        for block_hash in hashes:
            targets.update(dict.fromkeys(h for h in deps.subtree(block_hash) if deps.root_of(h) == root))
        victims: list[KVBlock] = []
        deferred = 0
        for block_hash in targets:
            block = self.pool.get_cached_block(block_hash)
            if block is None or block_hash in protected:
                continue
            if block.ref_cnt == 0:
                victims.append(block)
                continue
            # NOTE: a running request is still reading this block's K/V (and may be writing the blocks after it):
            # it keeps the block until it finishes, but no later match may find the block or what follows it.
            self.pool.unpublish(block)
            deferred += 1
            for rid, state in self._requests.items():
                if block in state.blocks:
                    self.stop_publishing(rid, state.blocks.index(block))
        victims.reverse()  # NOTE: descendants first, so a chain's tail is handed out before its head
        self.pool.evict_free_blocks(victims)
        result = InvalidationResult(len(victims), len(victims) * self.block_size, deferred)
        self._stats.invalidated(reason, result.blocks_freed, result.tokens_freed, deferred)
        return result

    def flush_root(self, root: BlockHash, *, reason: str = "flushed") -> InvalidationResult:
        """Free every cached block of the chain rooted at ``root`` (a whole namespace), as ``invalidate`` does.

        A block a running request holds is unpublished now and freed when its last holder releases it. Other roots'
        blocks are never touched.
        """
        deps = self.pool.deps
        own = [h for h in self.pool.cached if deps.root_of(h) == root]  # publication order: deterministic
        published = set(own)
        # NOTE: only the tops of the namespace's trees are named (a block whose parent is the root, or was evicted by
        # LRU): invalidate() takes each one's subtree, so naming every block would walk each chain once per block.
        tops = [h for h in own if deps.parent(h) not in published]
        return self.invalidate(tops, root=root, reason=reason)

    # ------------------------------------------------------------------ tiers (engine.kv.tiers drives these)

    def capture_evictions(self, on: bool) -> None:
        """Record each published block handed out for new content (for ``take_evicted``), or stop and forget them."""
        self.pool.capture_evictions = on
        if not on:
            self.pool.evicted.clear()

    def take_evicted(self) -> list[EvictedBlock]:
        """The blocks recorded since the last call (read their K/V before the next forward pass overwrites it)."""
        records, self.pool.evicted = self.pool.evicted, []
        return records

    def is_cached(self, block_hash: BlockHash) -> bool:
        return block_hash in self.pool.cached

    def take_blocks(self, n: int) -> list[int]:
        """Take ``n`` free blocks (ref 1 each) for content promoted from a lower tier; the caller checked there are."""
        return [block.block_id for block in self.pool.get_new_blocks(n)]

    def publish_promoted(self, block_ids: Sequence[int], records: Sequence[EvictedBlock]) -> int:
        """Publish blocks whose K/V was just loaded from a lower tier, then release them (most recently used).

        A hash already cached (a request computed it meanwhile) leaves its block unpublished. Returns blocks published.
        """
        published = 0
        blocks = [self.pool.blocks[i] for i in block_ids]
        for block, rec in zip(blocks, records, strict=True):
            meta = BlockMeta(tuple((t, 0) for t in rec.block_types))
            published += self.pool.cache_block(
                block, rec.block_hash, rec.token_ids, parent=rec.parent, root=rec.root, meta=meta, owner=rec.owner
            )
        self.pool.free_blocks(reversed(blocks))
        return published

    def idle_blocks(self, older_than: float, limit: int | None = None) -> list[EvictedBlock]:
        """Free, unpinned, published blocks released before ``older_than`` (``time.monotonic()``): the ``limit``
        least recently released, chain heads first."""
        out: list[EvictedBlock] = []
        for block in self.pool.free_queue:
            if limit is not None and len(out) >= limit:
                break
            if block.block_hash is not None and block.last_used < older_than:
                rec = self.pool.record_of(block)
                if rec is not None:
                    out.append(rec)
        out.reverse()  # NOTE: the queue holds chains tail first; reversed, a chain's head comes first in each run
        return out

    def records(self, hashes: Iterable[BlockHash], *, free_only: bool = True) -> list[EvictedBlock]:
        """Tier records of the cached blocks among ``hashes`` (free ones only, by default), in the given order."""
        out = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None or (free_only and block.ref_cnt > 0):
                continue
            rec = self.pool.record_of(block)
            if rec is not None:
                out.append(rec)
        return out

    def owned_by(self, owner: str, root: BlockHash) -> list[BlockHash]:
        """Hashes of the cached blocks of ``root`` that a request of session ``owner`` published."""
        deps = self.pool.deps
        return [h for h, b in self.pool.cached.items() if b.owner == owner and deps.root_of(h) == root]

    def set_chooser(self, chooser: VictimChooser | None) -> None:
        """Which free block a new allocation takes (``engine.kv.eviction``); None: the LRU head."""
        self.pool.chooser = chooser

    @property
    def num_pinned(self) -> int:
        return self.pool.num_pinned

    def pin(self, hashes: Sequence[BlockHash]) -> None:
        self.pool.pin(hashes)

    def unpin(self, hashes: Sequence[BlockHash]) -> int:
        return self.pool.unpin(hashes)

    def num_cached(self, hashes: Iterable[BlockHash]) -> int:
        """How many distinct blocks of ``hashes`` are cached right now. No side effects."""
        return sum(1 for h in set(hashes) if h in self.pool.cached)

    def block_table(self, request_id: str) -> list[int]:
        """Physical block ids of the request in logical order (empty for an unknown request)."""
        state = self._requests.get(request_id)
        return [] if state is None else [block.block_id for block in state.blocks]

    def usage(self) -> KVCacheUsage:
        pool = self.pool
        return KVCacheUsage(
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_used_blocks=pool.num_blocks - pool.num_free_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            num_evictable_blocks=pool.num_evictable_blocks,
            num_query_tokens=self._stats.num_query_tokens,
            num_hit_tokens=self._stats.num_hit_tokens,
        )

    def cache_stats(self) -> CacheStats:
        by_type: Counter[str] = Counter()
        for block in self.pool.cached.values():
            if block.meta is not None:
                by_type.update(block.meta.block_types)
        return self._stats.snapshot(self.pool.num_published, self.pool.num_reused, by_type)

    def _num_new_blocks(self, request_id: str, num_total_tokens: int, match: MatchResult | None) -> int:
        state = self._requests.get(request_id)
        if match is not None and state is not None:
            raise ValueError(f"request {request_id!r} already holds blocks; a prefix match is only for its first step")
        have = len(state.blocks) if state is not None else len(match.blocks) if match is not None else 0
        return max(0, self.blocks_needed(num_total_tokens) - have)

    def _free_after_touch(self, match: MatchResult | None) -> int:
        """Free blocks left once the match's free (ref 0) blocks are revived out of the free queue."""
        if match is None:
            return self.pool.num_free_blocks
        revived = sum(1 for i in match.blocks if self.pool.blocks[i].ref_cnt == 0)
        return self.pool.num_free_blocks - revived
