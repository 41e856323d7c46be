"""Session and cache control: what the chat layer asks of the cache besides a prefix match.

Invalidate a changed part of a conversation, flush a namespace, release or erase a session, pin a namespace's shared
prefix, weigh eviction by a session's semantic temperature, report a session's footprint, change the cache settings
at runtime. It also owns the disk tier (opened and closed by the engine) and its upkeep between steps.

Locking. Every public method takes the engine's lock (passed in: the step loop holds the same lock while it schedules
and publishes), so no change ever lands in the middle of a step. Disk work — deleting, rewriting and fsyncing files —
never runs under it: the lock covers the memory bookkeeping, and the disk part of the same call follows after it is
released. The step loop meanwhile keeps stepping; a block that was removed from memory but not yet from disk can at
worst be promoted back, which is exact (a block's hash fixes its tokens) and only delays its removal.

The methods documented "under the engine lock" are the step loop's hooks: it calls them holding the lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.errors import InvalidRequestError
from engine.kv.block_hash import BlockHash, hash_chain, root_hash
from engine.kv.eviction import WeightedChooser
from engine.kv.kv_cache_manager import CacheFootprint, InvalidationResult, KVCacheManager
from engine.kv.session_index import SessionIndex
from engine.kv.tier_config import CacheSettings
from engine.kv.tiers import TierStats, memory_only_stats

if TYPE_CHECKING:
    from engine.kv.disk_store import RemovalHook
    from engine.kv.tiers import BlockIO, DiskTier, Prefetchable

RELEASE_REASON = "session_released"  # the invalidation reason release_session's blocks are counted under
ERASE_REASON = "session_erased"
_MAX_RELEASED_SESSIONS = 100_000
_MAX_TEMPERATURES = 100_000
_SWEEP_EVERY_S = 1.0  # how often the memory TTL is applied (with a disk tier)
_EXPIRE_EVERY_S = 60.0  # how often the disk TTL is applied
_SWEEP_MAX_BLOCKS = 256  # blocks one memory-TTL sweep demotes (the copy holds the step loop's lock)


class InFlight(Protocol):
    """What cache control needs of a request in flight (``engine.sequence.Sequence`` is one)."""

    request_id: str
    session: str | None
    root: BlockHash
    publish_limit: int | None  # its blocks from this index on are never published
    system_tokens: int  # its prompt's leading system message(s): what every conversation starts with

    @property
    def all_token_ids(self) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class PinResult:
    blocks: int  # full blocks of the pinned prefix
    tokens: int
    cached: int  # of those, cached (and so pinned) right now; the rest are pinned as soon as they are computed


@dataclass(frozen=True, slots=True)
class ErasureResult:
    memory_blocks: int  # freed now, or unpublished and freed when the request holding them ends
    disk_blocks: int


class CacheControl:
    """Session and cache operations over one ``KVCacheManager`` (and its disk tier, when open)."""

    def __init__(
        self,
        kv: KVCacheManager,
        model_fingerprint: str,
        settings: CacheSettings,
        lock: threading.Lock,
        in_flight: Callable[[], Iterable[InFlight]],
    ) -> None:
        """``lock``: the engine's; ``in_flight``: the requests in flight (called under the lock)."""
        self._kv = kv
        self._block_size = kv.block_size
        self._fingerprint = model_fingerprint
        self._settings = settings
        self._lock = lock
        self._in_flight = in_flight
        self._tier: DiskTier | None = None
        self._roots: dict[str, BlockHash] = {}
        self._sessions = SessionIndex()
        self._session_roots: dict[str, BlockHash] = {}  # the namespace root each recorded session's chain hangs from
        # NOTE: remembered (bounded) so a request that finishes after its session closed does not re-record it.
        self._released: dict[str, None] = {}
        self._temperatures: dict[str, float] = {}  # session -> semantic temperature (eviction weighs it)
        self._pins: dict[str, list[BlockHash]] = {}  # namespace -> its pinned prefix's hashes
        self._last_sweep = self._last_expire = time.monotonic()
        kv.set_chooser(WeightedChooser(lambda: self._settings, self._temperature_of))

    # ------------------------------------------------------------------ namespaces, settings

    def root(self, namespace: str) -> BlockHash:
        """The chain root of ``namespace``'s blocks (the model fingerprint and the namespace, hashed)."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = root_hash(self._fingerprint, namespace)
        return root

    @property
    def settings(self) -> CacheSettings:
        return self._settings

    def configure(self, **changes: object) -> CacheSettings:
        """Change cache settings (validated; ``InvalidRequestError`` names a bad one). A lower disk cap deletes
        files, after the lock is released."""
        with self._lock:
            settings = self._settings.changed(**changes)
            if _pinned(self._pins) > settings.pin_max_fraction * self._kv.num_blocks:
                raise InvalidRequestError(
                    f"pin_max_fraction={settings.pin_max_fraction} is below the share pinned now; unpin first"
                )
            self._settings = settings
            tier = self._tier
        if tier is not None:
            tier.apply(settings)
        return settings

    # ------------------------------------------------------------------ pinning, temperature

    def pin_prefix(self, namespace: str, token_ids: Sequence[int]) -> PinResult:
        """Pin the full blocks of ``token_ids`` (checked ids: a prefix every prompt of ``namespace`` starts with, the
        system and policy text) in memory: never evicted nor demoted while pinned. Replaces the namespace's earlier
        pin.

        Raises ``InvalidRequestError`` when all pins together would exceed ``pin_max_fraction`` of the pool.
        """
        hashes = hash_chain(self.root(namespace), token_ids, self._block_size)
        with self._lock:
            pins = {**self._pins, namespace: hashes}
            limit = int(self._settings.pin_max_fraction * self._kv.num_blocks)
            if _pinned(pins) > limit:
                raise InvalidRequestError(
                    f"pinning {len(hashes)} blocks would exceed the pinned share of the pool ({limit} blocks, "
                    f"pin_max_fraction={self._settings.pin_max_fraction})"
                )
            old = self._pins.get(namespace, [])
            self._kv.unpin([h for h in old if h not in set(hashes)])
            self._pins[namespace] = hashes
            self._kv.pin(hashes)
            cached = self._kv.num_cached(hashes)
        return PinResult(len(hashes), len(hashes) * self._block_size, cached)

    def unpin(self, namespace: str) -> int:
        """Unpin the namespace's prefix (its blocks age out like any other). Returns blocks unpinned now."""
        with self._lock:
            return self._kv.unpin(self._pins.pop(namespace, []))

    def set_temperature(self, session: str, temperature: float) -> None:
        """The session's semantic temperature (0 cold .. 1 hot): eviction takes a cold topic's blocks first."""
        with self._lock:
            self._temperatures.pop(session, None)
            self._temperatures[session] = float(temperature)
            if len(self._temperatures) > _MAX_TEMPERATURES:
                del self._temperatures[next(iter(self._temperatures))]

    def _temperature_of(self, session: str | None) -> float | None:
        return None if session is None else self._temperatures.get(session)

    # ------------------------------------------------------------------ invalidation, sessions

    def invalidate(
        self,
        namespace: str,
        *,
        session: str | None = None,
        from_position: int | None = None,
        block_hashes: Sequence[BlockHash] | None = None,
        reason: str = "invalidated",
    ) -> InvalidationResult:
        """Free cached blocks whose context changed, and every cached block that depends on them (disk copies too).

        Either ``session`` + ``from_position`` (the first token position of the session's conversation that changed:
        its recorded chain and its in-flight requests from the block holding that position on) or ``block_hashes``
        (those blocks; with ``session``, that session's blocks are not protected from it). Only ``namespace``'s
        blocks are reached. Never freed: a block another session's recorded chain lists, or a request of another
        session holds; a block a request of this session (or one without a session) holds is unpublished now and
        freed when the request ends, and that request publishes nothing from there on. The session's later turns are
        recorded as usual. ``reason`` keys the stats (``EngineStats.cache.invalidations``).

        Memory under the lock; the disk copies of the subtree (the index knows each parent) after it.
        """
        if (from_position is None) == (block_hashes is None) or (from_position is not None and session is None):
            raise InvalidRequestError("invalidate() needs session and from_position, or block_hashes")
        if from_position is not None and (
            isinstance(from_position, bool) or not isinstance(from_position, int) or from_position < 0
        ):
            raise InvalidRequestError(f"from_position must be an integer >= 0, got {from_position!r}")
        root = self.root(namespace)
        with self._lock:
            targets = list(block_hashes or ())
            if from_position is not None and session is not None:
                targets += self._cut_session(session, root, from_position // self._block_size)
            protected = self._protected_from(session)
            result = self._kv.invalidate(targets, root=root, protected=protected, reason=reason)
            tier = self._tier
        if tier is not None:
            tier.remove(targets, root, protected)
        return result

    def invalidate_prefix(
        self, namespace: str, token_ids: Sequence[int], from_position: int, reason: str = "invalidated"
    ) -> InvalidationResult:
        """Shared text changed (a tenant's handbook section): free the cached blocks of the chain ``token_ids``
        spells in ``namespace`` from the block holding ``from_position`` on, and every block that depends on them,
        whichever session's chain lists them (those chains are cut there). The blocks before it (the text before the
        change) stay. A block a running request holds is unpublished now and freed when the request ends.

        NOTE: nothing is protected: every chain through the changed text is stale for every session; a hit on it
        would still be exact (same tokens, same KV), but its text is no longer what any prompt of the tenant says.
        """
        if isinstance(from_position, bool) or not isinstance(from_position, int) or from_position < 0:
            raise InvalidRequestError(f"from_position must be an integer >= 0, got {from_position!r}")
        root = self.root(namespace)
        targets = hash_chain(root, token_ids, self._block_size)[from_position // self._block_size :]
        if not targets:
            return InvalidationResult(0, 0, 0)
        with self._lock:
            self._sessions.cut_at(set(targets))
            result = self._kv.invalidate(targets, root=root, reason=reason)
            tier = self._tier
        if tier is not None:
            tier.remove(targets, root, set())
        return result

    def flush_namespace(self, namespace: str, reason: str = "flushed") -> InvalidationResult:
        """Free every cached block of ``namespace`` (all its sessions' chains, its shared prefixes); no other
        namespace's block is reached. A block a running request holds is unpublished now and freed when the request
        ends, and that request publishes nothing from there on. The namespace's sessions keep no recorded chain.

        Memory under the lock; the namespace's disk files after it.
        """
        root = self.root(namespace)
        with self._lock:
            for session in [s for s, r in self._session_roots.items() if r == root]:
                self._sessions.truncate(session, 0)
            result = self._kv.flush_root(root, reason=reason)
            tier = self._tier
        if tier is not None:
            tier.remove_root(root)
        return result

    def release_session(self, session: str) -> int:
        """Free the cached blocks that only ``session`` used (never shared or in-use ones). Returns blocks freed.

        Its prompt's system message(s) stay cached (``SessionIndex``): the next conversation starts with them, and
        dropping them when the last open session closes made it compute them again. With a disk tier the rest are
        demoted, not dropped (copied now, written by the writer thread): a customer who comes back finds the session
        on disk."""
        with self._lock:
            self._forget(session)
            hashes = self._sessions.release(session)
            if self._tier is not None:
                self._tier.demote(self._kv.records(hashes))
            return self._kv.evict_cached(hashes, reason=RELEASE_REASON)

    def erase_session(self, session: str, namespace: str) -> ErasureResult:
        """Erasure: remove the session's blocks from every tier (a shared prefix another session wants stays).

        Memory (under the lock): its recorded chain and every block a request of the session published, with their
        dependents. Disk (after it, once queued writes are done): the same, and every block the session owned there
        (also those of an earlier process).
        """
        root = self.root(namespace)
        with self._lock:
            chain = list(self._sessions.chain(session)) if self._session_roots.get(session) == root else []
            protected = self._protected_from(session)
            self._forget(session)
            self._sessions.release(session)
            hashes = list(dict.fromkeys(chain + self._kv.owned_by(session, root)))
            result = self._kv.invalidate(hashes, root=root, protected=protected, reason=ERASE_REASON)
            tier = self._tier
        disk = tier.erase_owner(session, hashes, root, protected) if tier is not None else 0
        return ErasureResult(result.blocks_freed + result.deferred, disk)

    def footprint(self, session: str) -> CacheFootprint:
        """The blocks of ``session``'s recorded chain that are cached right now (shared ones included)."""
        with self._lock:
            blocks = self._kv.num_cached(self._sessions.chain(session))
        return CacheFootprint(blocks, blocks * self._block_size)

    def _forget(self, session: str) -> None:
        self._released[session] = None
        if len(self._released) > _MAX_RELEASED_SESSIONS:
            del self._released[next(iter(self._released))]
        self._session_roots.pop(session, None)
        self._temperatures.pop(session, None)

    def _cut_session(self, session: str, root: BlockHash, first_block: int) -> list[BlockHash]:
        """The session's hashes from ``first_block`` on (recorded chain and in-flight requests), which stop there."""
        targets: list[BlockHash] = []
        if self._session_roots.get(session) == root:
            targets += self._sessions.chain(session)[first_block:]
            self._sessions.truncate(session, first_block)
        for seq in self._in_flight():
            if seq.session == session and seq.root == root:
                targets += self._kv.request_hashes(seq.request_id)[first_block:]
                # NOTE: on the sequence too: a waiting (or preempted) request holds no blocks yet; the scheduler
                # applies the limit when it admits it.
                seq.publish_limit = first_block if seq.publish_limit is None else min(seq.publish_limit, first_block)
                self._kv.stop_publishing(seq.request_id, first_block)
        return targets

    def _protected_from(self, session: str | None) -> set[BlockHash]:
        """Hashes an invalidation on behalf of ``session`` must keep: other sessions' chains and running requests."""
        protected = self._sessions.wanted_by_others(session)
        for seq in self._in_flight():
            if seq.session is not None and seq.session != session:
                protected.update(self._kv.request_hashes(seq.request_id))
        return protected

    # ------------------------------------------------------------------ the step loop's hooks (under the engine lock)

    def reopen(self, session: str) -> None:
        """Under the engine lock: a request of ``session`` was submitted; a released session is recorded again."""
        self._released.pop(session, None)

    def record_finished(self, seq: InFlight) -> None:
        """Under the engine lock, before the request's blocks are freed: remember the chain its session now has
        (while the request still knows where it stopped publishing)."""
        if seq.session is None or seq.session in self._released:
            return
        chain = self._kv.session_chain(seq.request_id, seq.root, seq.all_token_ids, seq.publish_limit)
        self._sessions.record(seq.session, chain, head=seq.system_tokens // self._block_size)
        self._session_roots[seq.session] = seq.root

    def prefetch(self, seq: Prefetchable) -> None:
        """Under the engine lock: start loading the disk blocks that extend ``seq``'s cached prefix (it waits)."""
        if self._tier is not None:
            self._tier.start_prefetch(seq)

    def install_loaded(self) -> None:
        """Under the engine lock, before scheduling: put finished disk loads into the pool."""
        if self._tier is not None:
            self._tier.install_loaded()

    def drain_evictions(self) -> None:
        """Under the engine lock, after scheduling: demote the published blocks just handed out, before the forward
        pass overwrites them."""
        if self._tier is not None:
            self._tier.drain_evictions()

    def tier_stats(self) -> TierStats:
        """Under the engine lock: memory and disk tier occupancy and traffic."""
        usage, pinned = self._kv.usage(), self._kv.num_pinned
        if self._tier is None:
            return memory_only_stats(usage.num_used_blocks, usage.num_cached_blocks, pinned)
        return self._tier.stats(usage.num_used_blocks, usage.num_cached_blocks, pinned)

    def maintain(self) -> None:
        """Between steps: the memory TTL (idle blocks to disk, a bounded copy under the lock) and the disk TTL
        (outside it)."""
        tier = self._tier
        if tier is None:
            return
        now = time.monotonic()
        if now - self._last_sweep >= _SWEEP_EVERY_S:
            self._last_sweep = now
            with self._lock:
                tier.sweep_idle(now - self._settings.memory_ttl_s, _SWEEP_MAX_BLOCKS)
        if now - self._last_expire >= _EXPIRE_EVERY_S:
            self._last_expire = now
            tier.expire()

    # ------------------------------------------------------------------ the disk tier

    @property
    def tier(self) -> DiskTier | None:
        """The disk tier (None without one). Its methods run under the engine lock, unless they say otherwise."""
        return self._tier

    def open_tier(self, directory: str, kv_fingerprint: str, io: BlockIO, wake: Callable[[], None]) -> None:
        """Open the disk tier in ``directory`` (blocking: it scans the directory). A no-op when one is open."""
        from engine.kv.tiers import open_disk_tier

        if self._tier is None:
            self._tier = open_disk_tier(directory, kv_fingerprint, self._settings, self._kv, io, wake)

    def close_tier(self) -> None:
        """Write what memory holds back to disk (so the next process starts warm) and close the tier (blocks: the
        writes). A no-op without one."""
        with self._lock:
            tier, self._tier = self._tier, None
            if tier is None:
                return
            tier.demote_all()
            self._kv.capture_evictions(False)
        tier.close()

    def on_disk_removal(self, hook: RemovalHook | None) -> None:
        """A test seam (``engine.testing.Faults``): ``hook`` runs before each disk file is deleted."""
        if self._tier is not None:
            self._tier.on_removal(hook)


def _pinned(pins: dict[str, list[BlockHash]]) -> int:
    return len({h for hashes in pins.values() for h in hashes})
