"""Stateful property test: random admit / extend / free / finish / close-session / invalidate sequences never break
the pool's invariants; closing a session never touches a block another session or a running request still uses, and
an invalidation frees a block's whole unprotected subtree, never a protected block, and never a held block's K/V."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv.block_hash import BlockHash, hash_chain, root_hash
from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv.session_index import SessionIndex

BS = 4
NUM_BLOCKS = 12
ROOTS = (root_hash("m", "a"), root_hash("m", "b"))
# A few shared "system prompts" so random requests often hit each other's blocks.
BASES = ([1] * 12, [1] * 8 + [2] * 8, [3, 4, 5, 6] * 3)
SESSIONS = ("s0", "s1", "s2")


@dataclass
class _Req:
    root: BlockHash
    tokens: list[int]


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS)
        self.reqs: dict[str, _Req] = {}
        self.next_id = 0
        self.index = SessionIndex()
        self.chains: dict[str, list[BlockHash]] = {}  # model of the index: session -> recorded chain
        self.dropped_held: set[int] = set()  # blocks an invalidation unpublished while requests held them

    def _compute(self, rid: str) -> None:
        req = self.reqs[rid]
        self.kv.cache_full_blocks(rid, req.root, req.tokens, len(req.tokens))

    @rule(
        base=st.sampled_from(BASES),
        cut=st.integers(0, 12),
        tail=st.lists(st.integers(0, 3), max_size=6),
        ns=st.sampled_from(ROOTS),
    )
    def admit(self, base: list[int], cut: int, tail: list[int], ns: BlockHash) -> None:
        tokens = base[:cut] + tail
        if not tokens:
            return
        rid = f"r{self.next_id}"
        self.next_id += 1
        match = self.kv.match_prefix(ns, tokens)
        assert match.num_cached_tokens <= len(tokens) - 1
        assert list(match.block_hashes) == hash_chain(ns, tokens, BS)[: len(match.blocks)]
        before = (self.kv.pool.free_block_ids(), [b.ref_cnt for b in self.kv.pool.blocks])
        ok = self.kv.can_allocate(rid, len(tokens), match)
        assert self.kv.allocate_slots(rid, len(tokens), match) == ok
        if not ok:
            assert (self.kv.pool.free_block_ids(), [b.ref_cnt for b in self.kv.pool.blocks]) == before
            return
        assert self.kv.block_table(rid)[: len(match.blocks)] == list(match.blocks)
        self.reqs[rid] = _Req(ns, tokens)
        self._compute(rid)

    @precondition(lambda self: bool(self.reqs))
    @rule(pick=st.integers(0, 1000), extra=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def extend(self, pick: int, extra: list[int]) -> None:
        rid = sorted(self.reqs)[pick % len(self.reqs)]
        req = self.reqs[rid]
        if self.kv.allocate_slots(rid, len(req.tokens) + len(extra)):
            req.tokens.extend(extra)
            self._compute(rid)

    @precondition(lambda self: bool(self.reqs))
    @rule(pick=st.integers(0, 1000))
    def free(self, pick: int) -> None:
        rid = sorted(self.reqs)[pick % len(self.reqs)]
        del self.reqs[rid]
        self.kv.free(rid)
        assert self.kv.block_table(rid) == []

    @precondition(lambda self: bool(self.reqs))
    @rule(pick=st.integers(0, 1000), session=st.sampled_from(SESSIONS))
    def finish(self, pick: int, session: str) -> None:
        """A request finishes: free it and record its chain for its session (as the engine does)."""
        rid = sorted(self.reqs)[pick % len(self.reqs)]
        req = self.reqs.pop(rid)
        self.kv.free(rid)
        chain = hash_chain(req.root, req.tokens, BS)
        self.index.record(session, chain)
        self.chains[session] = chain

    @precondition(lambda self: bool(self.chains))
    @rule(pick=st.integers(0, 1000))
    def close(self, pick: int) -> None:
        """A session closes: evict what only it referenced, never what another session or a running request uses."""
        session = sorted(self.chains)[pick % len(self.chains)]
        pool = self.kv.pool
        chain = self.chains.pop(session, [])
        still_wanted = {h for other in self.chains.values() for h in other}
        released = self.index.release(session)
        assert released == [h for h in dict.fromkeys(chain) if h not in still_wanted][::-1]
        before = dict(pool.cached)
        refs_before = [b.ref_cnt for b in pool.blocks]
        queue_before = pool.free_block_ids()
        evicted = [h for h in dict.fromkeys(released) if h in before and before[h].ref_cnt == 0]
        victims = [before[h] for h in evicted]
        assert self.kv.evict_cached(released) == len(victims)
        assert [b.ref_cnt for b in pool.blocks] == refs_before
        victim_ids = [b.block_id for b in victims]
        assert pool.free_block_ids() == victim_ids + [i for i in queue_before if i not in victim_ids]
        assert set(pool.cached) == set(before) - set(evicted)
        for block in victims:
            assert block.block_hash is None
            assert block.token_ids is None

    @precondition(lambda self: bool(self.reqs) or bool(self.chains))
    @rule(pick=st.integers(0, 1000), depth=st.integers(0, 5), ns=st.sampled_from(ROOTS))
    def invalidate(self, pick: int, depth: int, ns: BlockHash) -> None:
        """Invalidate one block of a running request's or a session's chain, protecting the other sessions' chains."""
        chains = [hash_chain(r.root, r.tokens, BS) for _, r in sorted(self.reqs.items())] + list(self.chains.values())
        chain = chains[pick % len(chains)]
        if not chain:
            return
        target = chain[min(depth, len(chain) - 1)]
        owner = sorted(self.chains)[pick % len(self.chains)] if self.chains else None
        protected = {h for s, c in self.chains.items() if s != owner for h in c}
        pool = self.kv.pool
        subtree = [h for h in pool.deps.subtree(target) if pool.deps.root_of(h) == ns]
        before = {h: pool.cached[h] for h in subtree}
        free_victims = [b for h, b in before.items() if h not in protected and b.ref_cnt == 0]
        held_victims = [b for h, b in before.items() if h not in protected and b.ref_cnt > 0]
        refs_before = [b.ref_cnt for b in pool.blocks]
        result = self.kv.invalidate([target], root=ns, protected=protected)
        assert (result.blocks_freed, result.deferred) == (len(free_victims), len(held_victims))
        assert result.tokens_freed == BS * len(free_victims)
        assert [b.ref_cnt for b in pool.blocks] == refs_before
        assert pool.free_block_ids()[: len(free_victims)] == [b.block_id for b in free_victims][::-1]
        for h, block in before.items():
            assert (pool.cached.get(h) is block) == (h in protected)
        self.dropped_held.update(b.block_id for b in held_victims)

    @invariant()
    def session_counts_match_the_chains(self) -> None:
        assert len(self.index) == len(self.chains)
        counts: Counter[BlockHash] = Counter()
        for session, chain in self.chains.items():
            assert session in self.index
            counts.update(set(chain))
        for chain in self.chains.values():
            for block_hash in chain:
                assert self.index.sessions_of(block_hash) == counts[block_hash]

    @invariant()
    def free_queue_and_refs_agree(self) -> None:
        pool = self.kv.pool
        queued = [b.block_id for b in pool.free_queue]
        assert len(queued) == len(set(queued)) == pool.num_free_blocks
        for block in pool.blocks:
            in_queue = block in pool.free_queue
            assert (in_queue and block.ref_cnt == 0) or (block.ref_cnt > 0 and not in_queue)
        usage = self.kv.usage()
        assert usage.num_free_blocks + usage.num_used_blocks == NUM_BLOCKS

    @invariant()
    def hash_map_points_at_its_blocks(self) -> None:
        pool = self.kv.pool
        for block_hash, block in pool.cached.items():
            assert block.block_hash == block_hash
            assert block.token_ids is not None
            assert len(block.token_ids) == BS
        assert len(pool.cached) == sum(1 for b in pool.blocks if b.block_hash is not None)

    @invariant()
    def shared_blocks_are_cached_and_counted(self) -> None:
        holders: Counter[int] = Counter()
        for rid, req in self.reqs.items():
            table = self.kv.block_table(rid)
            assert len(table) == len(set(table)) == -(-len(req.tokens) // BS)
            holders.update(table)
        for block in self.kv.pool.blocks:
            assert block.ref_cnt == holders[block.block_id]
            if block.ref_cnt == 0:
                self.dropped_held.discard(block.block_id)
            if holders[block.block_id] > 1:
                assert block.block_hash is not None or block.block_id in self.dropped_held

    @invariant()
    def published_blocks_hold_exactly_their_tokens(self) -> None:
        for rid, req in self.reqs.items():
            chain = hash_chain(req.root, req.tokens, BS)
            for i, block_id in enumerate(self.kv.block_table(rid)):
                block = self.kv.pool.blocks[block_id]
                if block.block_hash is not None:
                    assert block.block_hash == chain[i]
                    assert block.token_ids == tuple(req.tokens[i * BS : (i + 1) * BS])


KVMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVInvariants = KVMachine.TestCase
