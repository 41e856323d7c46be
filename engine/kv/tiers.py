"""The disk tier wired to the memory pool: demotion of blocks that leave memory, promotion of those a prompt needs.

Demotion: a published block that leaves the pool (handed out for new content, idle past the memory TTL, or released
with its session) has its K/V copied out now, on the step thread, before anything can overwrite it, and written by
``DiskWriter`` on its own thread, so the step loop never waits for the disk. Promotion: at submit, the blocks of the
prompt past the memory prefix that the disk holds are loaded on a loader thread (checksums verified there) while the
step loop serves the other requests; the request is admitted once they are installed into the pool as ordinary
published blocks, so the prefix match and the model see nothing new.

Every method but the loader's runs on the step thread or under the engine's lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.kv.block_hash import BlockHash, hash_chain
from engine.kv.block_pool import EvictedBlock
from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv.tier_config import CacheSettings

if TYPE_CHECKING:
    import torch

    from engine.kv.disk_format import LoadedBlock
    from engine.kv.disk_store import DiskStore, RemovalHook
    from engine.kv.disk_writer import DiskWriter

log = logging.getLogger("kvchat.engine.tiers")


_MAX_PENDING_BYTES = 256 * 1024 * 1024  # K/V copies waiting for the disk writer


class BlockIO(Protocol):
    """What the model runner offers the tiers: copies of blocks' K/V in and out of the pool."""

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor: ...

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None: ...

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's K/V (all layers)."""
        ...


class Prefetchable(Protocol):
    """What promotion needs of a waiting request (``engine.sequence.Sequence`` is one): its chain root and tokens, a
    flag that holds it back while its blocks load, and the hashes loaded for it."""

    root: BlockHash
    loading: bool
    promoted: frozenset[BlockHash]

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class TierStats:
    memory_blocks_used: int
    memory_blocks_cached: int
    pinned_blocks: int
    disk_blocks: int
    disk_bytes: int
    disk_writes: int
    disk_writes_refused: int  # free-space guard, size cap, or the writer's queue full
    disk_quarantined: int
    promoted_blocks: int
    demoted_blocks: int
    expired_blocks: int


@dataclass(slots=True)
class _Load:
    seq: Prefetchable
    hashes: list[BlockHash]
    loaded: list[LoadedBlock] | None = None


class DiskTier:
    def __init__(self, store: DiskStore, writer: DiskWriter, kv: KVCacheManager, io: BlockIO, wake: Callable[[], None]):
        self.store = store
        self.writer = writer
        self._kv = kv
        self._io = io
        self._wake = wake
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvchat-disk-load")
        self._done: list[_Load] = []
        self._done_lock = threading.Lock()
        self.promoted_blocks = 0
        self.demoted_blocks = 0
        kv.capture_evictions(True)

    # ------------------------------------------------------------------ demotion (step thread / engine lock)

    def demote(self, records: Sequence[EvictedBlock]) -> int:
        """Copy the K/V of these blocks out of the pool now and queue them for the disk. Returns blocks queued."""
        from engine.kv.disk_format import DiskBlock  # NOTE: here: the backend imports this module without numpy

        todo = [r for r in records if not self.store.contains(r.block_hash)]
        if not todo:
            return 0
        kv = self._io.read_blocks([r.block_id for r in todo])
        blocks = [DiskBlock(r.block_hash, r.parent, r.root, r.token_ids, r.block_types, r.owner) for r in todo]
        if not self.writer.submit(blocks, kv):
            return 0
        self.demoted_blocks += len(blocks)
        return len(blocks)

    def drain_evictions(self) -> None:
        """Demote the published blocks that allocations just handed out (before the forward pass overwrites them)."""
        records = self._kv.take_evicted()
        if records:
            self.demote(records)

    def sweep_idle(self, older_than: float, limit: int | None = None) -> int:
        """Demote free blocks idle since before ``older_than`` (the memory TTL), the oldest ``limit``, and free them."""
        records = self._kv.idle_blocks(older_than, limit)
        if not records:
            return 0
        self.demote(records)
        return self._kv.evict_cached([r.block_hash for r in records])

    def demote_all(self) -> int:
        """Write every free published block to disk (at shutdown: the next process starts warm)."""
        return self.demote(self._kv.idle_blocks(float("inf")))

    # ------------------------------------------------------------------ promotion

    def start_prefetch(self, seq: Prefetchable) -> bool:
        """Start loading the disk blocks that extend ``seq``'s memory prefix. True when ``seq`` must wait for them."""
        bs = self._kv.block_size
        tokens = seq.all_token_ids
        chain = hash_chain(seq.root, tokens[: ((len(tokens) - 1) // bs) * bs], bs)
        first = 0
        while first < len(chain) and self._kv.is_cached(chain[first]):
            first += 1
        wanted: list[BlockHash] = []
        for block_hash in chain[first:]:
            if not self.store.contains(block_hash) and self.writer.pending(block_hash) is None:
                break
            wanted.append(block_hash)
        if not wanted:
            return False
        seq.loading = True
        job = _Load(seq, wanted)
        self._loader.submit(self._load, job)
        return True

    def _load(self, job: _Load) -> None:
        """Loader thread: wait for pending writes of these blocks, then read and verify them."""
        try:
            self.writer.flush()
            job.loaded = self.store.load(job.hashes)
        except Exception:
            log.exception("loading %d blocks from disk failed; they are recomputed", len(job.hashes))
            job.loaded = []
        with self._done_lock:
            self._done.append(job)
        self._wake()

    def install_loaded(self) -> None:
        """Step thread, under the engine lock: put finished loads into the pool and release their requests."""
        with self._done_lock:
            done, self._done = self._done, []
        for job in done:
            try:
                self._install(job)
            finally:
                job.seq.loading = False

    def _install(self, job: _Load) -> None:
        import torch

        loaded = [b for b in job.loaded or [] if not self._kv.is_cached(b.block.block_hash)]
        # NOTE: never take the whole pool: leave room for the request's own tail and for the running requests.
        room = max(0, self._kv.num_free_blocks - self._kv.blocks_needed(job.seq.num_tokens) - 1)
        loaded = loaded[:room]
        if not loaded:
            return
        ids = self._kv.take_blocks(len(loaded))
        self.drain_evictions()  # NOTE: before write_blocks overwrites the blocks just taken
        self._io.write_blocks(ids, torch.stack([b.kv for b in loaded], dim=2))
        records = [
            EvictedBlock(
                i,
                b.block.block_hash,
                b.block.parent,
                b.block.root,
                b.block.token_ids,
                b.block.block_types,
                b.block.owner,
            )
            for i, b in zip(ids, loaded, strict=True)
        ]
        self._kv.publish_promoted(ids, records)
        job.seq.promoted = frozenset(b.block.block_hash for b in loaded)
        self.promoted_blocks += len(loaded)

    # ------------------------------------------------------------------ removal, stats, shutdown

    def remove(self, hashes: Sequence[BlockHash], root: BlockHash, protected: set[BlockHash]) -> int:
        """Remove these blocks' disk copies and their descendants' (file I/O: never under the engine's lock)."""
        return self.store.remove(hashes, root=root, protected=protected) if hashes else 0

    def remove_root(self, root: BlockHash) -> int:
        """Remove a whole namespace from disk (file I/O: never under the engine's lock)."""
        return self.store.remove_root(root)

    def expire(self) -> int:
        """Apply the disk TTL (file I/O: never under the engine's lock)."""
        return self.store.expire()

    def apply(self, settings: CacheSettings) -> None:
        """Take the disk limits of ``settings``; a lower cap deletes files at once (never under the engine's lock)."""
        self.store.set_limits(
            max_bytes=settings.disk_max_bytes, min_free_bytes=settings.min_free_bytes, ttl_s=settings.disk_ttl_s
        )

    def on_removal(self, hook: RemovalHook | None) -> None:
        """A test seam: ``hook`` runs before each disk file is deleted (``engine.testing.Faults``)."""
        self.store.fault_hook = hook

    def erase_owner(self, owner: str, hashes: Sequence[BlockHash], root: BlockHash, protected: set[BlockHash]) -> int:
        """Erasure: wait for queued writes (so none lands after this), then remove the session's disk blocks."""
        self.writer.flush()
        return self.store.remove_owner(owner) + self.remove(hashes, root, protected)

    def stats(self, memory_used: int, memory_cached: int, pinned: int) -> TierStats:
        disk = self.store.stats()
        refused = disk.writes_refused_space + disk.writes_refused_cap + self.writer.dropped
        return TierStats(
            memory_used, memory_cached, pinned, disk.blocks, disk.bytes, disk.writes, refused, disk.quarantined,
            self.promoted_blocks, self.demoted_blocks, disk.expired,
        )  # fmt: skip

    def close(self) -> None:
        self._loader.shutdown(wait=True)
        self.writer.close()
        self.store.close()


def open_disk_tier(
    directory: str, fingerprint: str, settings: CacheSettings, kv: KVCacheManager, io: BlockIO, wake: Callable[[], None]
) -> DiskTier:
    """Open the disk store in ``directory`` for K/V of ``fingerprint`` (``engine.model_runner.kv_fingerprint``), its
    writer, and the tier over ``kv``'s pool. ``wake`` wakes the step loop when a load is in."""
    from engine.kv.disk_store import DiskStore
    from engine.kv.disk_writer import DiskWriter

    store = DiskStore(
        directory,
        fingerprint,
        max_bytes=settings.disk_max_bytes,
        min_free_bytes=settings.min_free_bytes,
        ttl_s=settings.disk_ttl_s,
    )
    log.info("disk tier at %s: %d blocks from earlier runs", directory, len(store))
    # NOTE: a bounded queue: each pending block holds a copy of its K/V in RAM (368 KiB for SmolLM2 in bf16)
    block_bytes = max(1, io.block_bytes)
    writer = DiskWriter(store, max_pending_blocks=max(64, min(1024, _MAX_PENDING_BYTES // block_bytes)))
    return DiskTier(store, writer, kv, io, wake)


def memory_only_stats(memory_used: int, memory_cached: int, pinned: int) -> TierStats:
    """The tier stats of an engine without a disk tier."""
    return TierStats(memory_used, memory_cached, pinned, 0, 0, 0, 0, 0, 0, 0, 0)
