"""The disk tier of the KV cache: runs of blocks in files (``disk_format``), indexed in SQLite (``disk_index``), kept
within a size cap and a TTL (``disk_policy``).

A run is written atomically and only then indexed, so a crash leaves at worst an unindexed file, which the next open
moves to ``quarantine/``. Every read is verified; a file that fails is quarantined and the load returns the verified
prefix before it. Bad data is a miss, never an exception.

Threads: one lock guards the index; file I/O (writing a run, reading one, deleting removed files) happens outside it,
and ``contains`` reads an in-memory set without it, so the engine's step thread never waits for another thread's fsync.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.errors import EngineError
from engine.kv.block_hash import BlockHash
from engine.kv.disk_format import (
    FILE_SUFFIX,
    KV,
    TMP_SUFFIX,
    BadFile,
    DiskBlock,
    LoadedBlock,
    VerifiedFile,
    block_bytes,
    check_run,
    checksum,
    fsync_dir,
    read_verified,
    select_blocks,
    serialize,
    write_atomically,
)
from engine.kv.disk_index import INDEX_NAME, DiskIndex, IndexRow
from engine.kv.disk_policy import QUARANTINE_DIR, DiskPolicy, Quarantine, disk_free

log = logging.getLogger("kvchat.engine.disk")

LOCK_NAME = ".lock"
RemovalHook = Callable[[str], None]


class DiskStoreInUse(EngineError):
    """Another DiskStore (in this or another process) holds the directory; two writers would corrupt the index."""

    code = "disk_store_in_use"


@dataclass(frozen=True, slots=True)
class DiskStats:
    blocks: int
    bytes: int
    files: int
    writes: int  # runs written
    blocks_written: int
    writes_refused_space: int  # refused by the free-space guard
    writes_refused_cap: int  # a single run larger than the cap
    evicted_cap: int  # blocks removed by the size cap (LRU)
    expired: int  # blocks removed by the TTL
    quarantined: int  # files that failed verification (or were found unindexed at open)
    loads: int
    blocks_loaded: int
    load_misses: int  # load() calls that returned fewer blocks than asked for
    writes_cancelled: int = 0  # runs discarded: a remove() covered them mid-write, or another writer stored them first


class DiskStore:
    """Blocks of one model fingerprint in ``directory``; rows of other fingerprints are never returned.

    NOTE: removal works on whole files: removing any block deletes its file and every row in it, so no removed
    block's bytes stay on disk. The one exception is a ``protected`` block sharing the file: the file is then rewritten
    with only the protected blocks. Size cap and TTL evict whole files too (least recently accessed first).

    ``fault_hook`` (None in production) is called with each file name before the file is deleted (a test makes
    removal slow with it).
    """

    def __init__(
        self,
        directory: str | Path,
        fingerprint: str,
        *,
        max_bytes: int,
        min_free_bytes: int,
        ttl_s: float,
        free_space: Callable[[Path], int] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.policy = DiskPolicy(max_bytes, min_free_bytes, ttl_s, free_space or disk_free, clock)
        self.fault_hook: RemovalHook | None = None
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        # Blocks reserved by a writer but not yet indexed; remove() cancels those it covers (erasure must win).
        self._pending: dict[BlockHash, DiskBlock] = {}
        self._pending_refs: Counter[BlockHash] = Counter()
        self._cancelled: set[BlockHash] = set()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._quarantine = Quarantine(self.directory)
        self._lock_fd = self._take_directory_lock()
        self._index = DiskIndex(self.directory / INDEX_NAME, fingerprint, self._quarantine.move, clock)
        self._closed = False
        self._recover()

    @property
    def max_bytes(self) -> int:
        return self.policy.max_bytes

    # ---------------------------------------------------------------- opening

    def _take_directory_lock(self) -> int:
        fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DiskStoreInUse(f"the KV disk directory {self.directory} is in use by another DiskStore") from None
        return fd

    def _recover(self) -> None:
        """Quarantine files the index does not know, delete temp files, drop rows whose file is gone or truncated."""
        with self._lock:
            known = self._index.file_sizes()
            skip = {INDEX_NAME, f"{INDEX_NAME}-wal", f"{INDEX_NAME}-shm", LOCK_NAME, QUARANTINE_DIR}
            for entry in os.scandir(self.directory):
                if entry.name in skip:
                    continue
                if entry.name.endswith(TMP_SUFFIX):
                    log.info("disk KV: deleting leftover temp file %s", entry.name)
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                elif entry.name not in known or not entry.is_file() or entry.stat().st_size != known[entry.name]:
                    log.warning("disk KV: quarantining unindexed or truncated file %s", entry.name)
                    self._quarantine_locked(entry.name)
            present = {e.name for e in os.scandir(self.directory)}
            for name in known:
                if name not in present:
                    self._index.drop_file(name)

    # ---------------------------------------------------------------- queries

    def contains(self, block_hash: BlockHash) -> bool:
        # NOTE: no lock: a set lookup is atomic under the GIL and must not wait for a writer holding the lock.
        return block_hash in self._index.stored

    def __len__(self) -> int:
        return len(self._index.stored)

    def hashes(self) -> frozenset[BlockHash]:
        """Every block of this fingerprint on disk (a snapshot)."""
        return frozenset(self._index.stored)

    def stats(self) -> DiskStats:
        with self._lock:
            files, size = self._index.totals() if not self._closed else (0, 0)
        c = self._counts
        return DiskStats(
            blocks=len(self._index.stored),
            bytes=size,
            files=files,
            writes=c["writes"],
            blocks_written=c["blocks_written"],
            writes_refused_space=c["writes_refused_space"],
            writes_refused_cap=c["writes_refused_cap"],
            evicted_cap=c["evicted_cap"],
            expired=c["expired"],
            quarantined=c["quarantined"],
            loads=c["loads"],
            blocks_loaded=c["blocks_loaded"],
            load_misses=c["load_misses"],
            writes_cancelled=c["writes_cancelled"],
        )

    def set_limits(
        self, *, max_bytes: int | None = None, min_free_bytes: int | None = None, ttl_s: float | None = None
    ) -> None:
        """Change the limits at runtime; a lower cap evicts at once (the files are deleted outside the lock)."""
        with self._lock:
            if max_bytes is not None:
                self.policy.max_bytes = max_bytes
            if min_free_bytes is not None:
                self.policy.min_free_bytes = min_free_bytes
            if ttl_s is not None:
                self.policy.ttl_s = ttl_s
            doomed = self._enforce_cap_locked(keep=None)
        self._unlink_all(doomed)

    # ---------------------------------------------------------------- writing

    def reserve(self, blocks: Sequence[DiskBlock]) -> None:
        """Mark blocks as on their way to disk, so a ``remove`` meanwhile cancels them (``DiskWriter`` calls this)."""
        with self._lock:
            self._reserve_locked(blocks)

    def _reserve_locked(self, blocks: Sequence[DiskBlock]) -> None:
        for b in blocks:
            self._pending[b.block_hash] = b
            self._pending_refs[b.block_hash] += 1

    def release(self, blocks: Sequence[DiskBlock]) -> None:
        """Undo ``reserve`` for blocks that will not be written after all."""
        with self._lock:
            for b in blocks:
                h = b.block_hash
                self._pending_refs[h] -= 1
                if self._pending_refs[h] <= 0:
                    del self._pending_refs[h]
                    self._pending.pop(h, None)
                    self._cancelled.discard(h)

    def is_cancelled(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cancelled

    def write_run(self, blocks: Sequence[DiskBlock], kv: KV, *, reserved: bool = False) -> bool:
        """Store ``blocks`` (``kv``: ``[layers, 2, n, block_size, kv_heads, head_dim]``) as one file.

        Blocks already stored are skipped. Returns False when the write was refused (free-space guard, a run larger
        than the cap) or cancelled by a concurrent ``remove``. ``reserved``: the caller already called ``reserve``.
        """
        if not reserved:
            self.reserve(blocks)
        try:
            check_run(blocks, kv)
            return self._write_reserved(blocks, kv)
        finally:
            self.release(blocks)

    def _write_reserved(self, blocks: Sequence[DiskBlock], kv: KV) -> bool:
        seen: set[BlockHash] = set()
        keep: list[int] = []
        for i, b in enumerate(blocks):
            if b.block_hash not in self._index.stored and b.block_hash not in seen:
                seen.add(b.block_hash)
                keep.append(i)
        if not keep:
            return True
        new_blocks = [blocks[i] for i in keep]
        if len(keep) < len(blocks):
            kv = select_blocks(kv, keep)
        data = serialize(new_blocks, kv, self.fingerprint)
        refused = self.policy.refusal(len(data), self.directory)
        if refused is not None:
            self._counts[refused] += 1
            return False
        name = f"{new_blocks[0].block_hash.hex()}-{secrets.token_hex(4)}{FILE_SUFFIX}"
        write_atomically(self.directory, name, data)
        with self._lock:
            # NOTE: a block indexed meanwhile by another writer also discards the run: two files holding one block's
            # bytes would let an erasure miss a copy.
            if self._closed or any(b.block_hash in self._cancelled or self.contains(b.block_hash) for b in new_blocks):
                self._counts["writes_cancelled"] += 1
                doomed = [name]
            else:
                self._index.add_file(name, checksum(data), len(data), new_blocks, block_bytes(kv))
                self._counts["writes"] += 1
                self._counts["blocks_written"] += len(new_blocks)
                doomed = self._enforce_cap_locked(keep=name)
        self._unlink_all(doomed)
        return name not in doomed

    # ---------------------------------------------------------------- reading

    def load(self, hashes: Sequence[BlockHash]) -> list[LoadedBlock]:
        """The longest prefix of ``hashes`` that is stored and verifies; never raises on bad data.

        A file that fails verification is moved to ``quarantine/`` and its rows dropped; the blocks before it are
        returned. Loaded blocks (and their files) count as accessed for the LRU cap and the TTL.
        """
        with self._lock:
            rows = self._index.rows(hashes) if not self._closed else []
        loaded: list[LoadedBlock] = []
        files: dict[str, VerifiedFile] = {}
        for row in rows:
            vf = files.get(row.file)
            if vf is None:
                try:
                    vf = files[row.file] = read_verified(self.directory / row.file, row.checksum, self.fingerprint)
                except Exception as e:  # noqa: BLE001 - any failure of a stored file is a miss, never an error
                    self._reject(row, f"{type(e).__name__}: {e}")
                    break
            if not vf.matches(row.idx, row.block):
                self._reject(row, f"block {row.idx} differs from its index row")
                break
            loaded.append(LoadedBlock(row.block, vf.kv[row.idx]))
        with self._lock:
            if not self._closed:
                self._index.touch([lb.block.block_hash for lb in loaded], files)
            self._counts["loads"] += 1
            self._counts["blocks_loaded"] += len(loaded)
            if len(loaded) < len(hashes):
                self._counts["load_misses"] += 1
        return loaded

    def _reject(self, row: IndexRow, why: str) -> None:
        """Quarantine ``row``'s file unless a concurrent removal already dropped it (then the load simply missed)."""
        with self._lock:
            if not self._closed and self._index.checksum_of(row.file) == row.checksum:
                self._quarantine_locked(row.file)
                log.warning("disk KV: %s failed verification (%s); quarantined", row.file, why)

    # ---------------------------------------------------------------- removal

    def remove(
        self, hashes: Iterable[BlockHash], *, root: BlockHash | None = None, protected: Set[BlockHash] = frozenset()
    ) -> int:
        """Remove ``hashes`` and every stored descendant (within ``root`` when given), except ``protected`` blocks
        (whose descendants still go). Blocks being written meanwhile are cancelled. Returns blocks removed."""
        with self._lock:
            seeds = [h for h in hashes if root is None or self._root_of_locked(h) in (root, None)]
            doomed, removed, keep = self._remove_locked(seeds, root, protected, lambda b: False)
        return self._finish_removal(doomed, keep, removed)

    def remove_root(self, root: BlockHash) -> int:
        """Remove a whole namespace."""
        return self._remove_where("root", root, root, lambda b: b.root == root)

    def remove_owner(self, owner: str) -> int:
        """Erase the blocks a session published, and their descendants (whoever published those)."""
        return self._remove_where("owner", owner, None, lambda b: b.owner == owner)

    def expire(self) -> int:
        """Remove files none of whose blocks was accessed within the TTL (every fingerprint's); returns blocks
        removed."""
        with self._lock:
            files = self.policy.expired(self._index) if not self._closed else []
            removed = sum(self._index.drop_file(name) for name in files)
            self._counts["expired"] += removed
        self._unlink_all(files)
        return removed

    def _remove_where(
        self,
        column: Literal["root", "owner"],
        value: object,
        root: BlockHash | None,
        match: Callable[[DiskBlock], bool],
    ) -> int:
        with self._lock:
            seeds = self._index.hashes_where(column, value) if not self._closed else []
            doomed, removed, keep = self._remove_locked(seeds, root, frozenset(), match)
        return self._finish_removal(doomed, keep, removed)

    def _root_of_locked(self, h: BlockHash) -> BlockHash | None:
        if h in self._pending:
            return self._pending[h].root
        return None if self._closed else self._index.root_of(h)

    def _remove_locked(
        self,
        seeds: Iterable[BlockHash],
        root: BlockHash | None,
        protected: Set[BlockHash],
        pending_match: Callable[[DiskBlock], bool],
    ) -> tuple[list[str], int, dict[str, list[IndexRow]]]:
        """Find the subtree (stored and pending), cancel the pending part, drop the index rows of the stored part.

        Returns the files to delete, the blocks removed, and per file the protected rows to write back first."""
        reach = set(seeds) | {h for h, b in self._pending.items() if pending_match(b)}
        frontier = set(reach)
        while frontier and not self._closed:
            children = self._index.children(frontier, root)
            children.update(
                h for h, b in self._pending.items() if b.parent in frontier and (root is None or b.root == root)
            )
            frontier = children - reach
            reach |= frontier
        targets = reach - protected
        self._cancelled.update(targets & self._pending.keys())
        if self._closed:
            return [], 0, {}
        doomed: list[str] = []
        keep: dict[str, list[IndexRow]] = {}
        removed = 0
        for name in self._index.files_of(targets & self._index.stored):
            rows = self._index.rows_in_file(name, protected)
            removed += self._index.drop_file(name)
            doomed.append(name)
            if rows:
                keep[name] = rows
                self._reserve_locked([r.block for r in rows])
        return doomed, removed, keep

    def _finish_removal(self, doomed: list[str], keep: dict[str, list[IndexRow]], removed: int) -> int:
        """Outside the lock: write the protected blocks of removed files back (rare), then delete the files."""
        for name, rows in keep.items():
            if self._rewrite(name, rows):
                removed -= len(rows)
        self._unlink_all(doomed)
        return removed

    def _rewrite(self, name: str, keep: list[IndexRow]) -> bool:
        """Write the protected blocks of a file being removed into a new file (rare). They were reserved under the
        lock with the removal, so a removal meanwhile that covers them cancels the rewrite (erasure wins).

        NOTE: between the two, a load misses these blocks: a miss, never wrong K/V."""
        blocks = [r.block for r in keep]
        try:
            vf = read_verified(self.directory / name, keep[0].checksum, self.fingerprint)
            if not all(vf.matches(r.idx, r.block) for r in keep):
                raise BadFile("a protected block differs from its index row")
            return self._write_reserved(blocks, vf.kv[[r.idx for r in keep]].movedim(0, 2))
        except Exception as e:  # noqa: BLE001 - losing a cached copy is a miss; the removal itself must go on
            log.warning("disk KV: could not keep the protected blocks of %s (%s: %s)", name, type(e).__name__, e)
            return False
        finally:
            self.release(blocks)

    # ---------------------------------------------------------------- cap, quarantine, files

    def _enforce_cap_locked(self, keep: str | None) -> list[str]:
        """Drop the index rows of the files the size cap evicts; returns their names (to delete outside the lock)."""
        if self._closed:
            return []
        doomed = self.policy.over_cap(self._index, keep)
        for name in doomed:
            self._counts["evicted_cap"] += self._index.drop_file(name)
        return doomed

    def _quarantine_locked(self, name: str) -> None:
        self._index.drop_file(name)
        path = self.directory / name
        if path.exists() or path.is_symlink():
            self._quarantine.move(path)
        self._counts["quarantined"] += 1

    def _unlink_all(self, names: Iterable[str]) -> None:
        removed = False
        for name in names:
            if self.fault_hook is not None:
                self.fault_hook(name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.directory / name)
                removed = True
        if removed:
            fsync_dir(self.directory)

    def close(self) -> None:
        """Close the index and release the directory. Idempotent; later removals and loads find nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._index.close()
            os.close(self._lock_fd)  # releases the flock

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
