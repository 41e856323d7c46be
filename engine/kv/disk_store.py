"""The disk tier of the KV cache: one safetensors file per written run of blocks, indexed by SQLite.

A run (consecutive blocks of one chain) is written atomically (temp file, fsync, rename, fsync of the directory) and
only then indexed, so a crash leaves at worst an unindexed file, which the next open moves to ``quarantine/``. Every
read is verified (sha256 of the whole file, safetensors parse, model fingerprint, block hash and token ids); a file that
fails is quarantined and the load returns the verified prefix before it. Bad data is a miss, never an exception.

Threads: one lock guards the SQLite connection; file I/O of ``write_run`` and ``load`` happens outside it, and
``contains`` reads an in-memory set without it, so the engine's step thread never waits for another thread's fsync.
The module imports torch lazily: a writer that passes numpy arrays (the crash test's child) never loads it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.errors import EngineError
from engine.kv.block_hash import BlockHash

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvchat.engine.disk")

FORMAT_VERSION = "kvchat-disk-v1"
SCHEMA_VERSION = 1
INDEX_NAME = "index.sqlite3"
LOCK_NAME = ".lock"
QUARANTINE_DIR = "quarantine"
FILE_SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
MAX_QUARANTINED_FILES = 32  # older quarantined files are deleted so a corrupting disk cannot fill itself up

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    name TEXT PRIMARY KEY,
    fingerprint TEXT NOT NULL,
    checksum TEXT NOT NULL,          -- sha256 hex of the whole file
    size INTEGER NOT NULL,
    num_blocks INTEGER NOT NULL,
    created REAL NOT NULL,
    last_access REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS blocks (
    fingerprint TEXT NOT NULL,
    hash BLOB NOT NULL,
    root BLOB NOT NULL,
    parent BLOB NOT NULL,
    token_ids TEXT NOT NULL,         -- JSON list
    block_types TEXT NOT NULL,       -- JSON list
    owner TEXT,
    file TEXT NOT NULL REFERENCES files(name),
    idx INTEGER NOT NULL,            -- position of the block in the file's kv tensor (dim 2)
    checksum TEXT NOT NULL,          -- the file's checksum, repeated so a row is verifiable on its own
    size INTEGER NOT NULL,           -- bytes of this block's K/V
    created REAL NOT NULL,
    last_access REAL NOT NULL,
    ttl_s REAL,                      -- NULL: the store's TTL (set_limits); a number overrides it for this block
    PRIMARY KEY (fingerprint, hash)
);
CREATE INDEX IF NOT EXISTS blocks_parent ON blocks(fingerprint, parent);
CREATE INDEX IF NOT EXISTS blocks_root ON blocks(fingerprint, root);
CREATE INDEX IF NOT EXISTS blocks_owner ON blocks(fingerprint, owner);
CREATE INDEX IF NOT EXISTS blocks_file ON blocks(file);
CREATE INDEX IF NOT EXISTS files_access ON files(fingerprint, last_access);
"""


class DiskStoreInUse(EngineError):
    """Another DiskStore (in this or another process) holds the directory; two writers would corrupt the index."""

    code = "disk_store_in_use"


class _BadFile(Exception):
    """A stored file failed verification (internal: always turned into a quarantine and a miss)."""


@dataclass(frozen=True, slots=True)
class DiskBlock:
    """What is stored for one block besides its K/V."""

    block_hash: BlockHash
    parent: BlockHash  # the previous block's hash, or the chain root for the first block
    root: BlockHash  # the namespace root of the chain (engine.kv.block_hash.root_hash)
    token_ids: tuple[int, ...]
    block_types: tuple[str, ...] = ()  # BlockMeta.block_types of the block (may be empty)
    owner: str | None = None  # the session key that published it (for erasure), if any


@dataclass(frozen=True, slots=True)
class LoadedBlock:
    block: DiskBlock
    kv: torch.Tensor  # [num_layers, 2, block_size, num_kv_heads, head_dim], the dtype it was written with


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


@dataclass(slots=True)
class _Row:
    block: DiskBlock
    file: str
    idx: int
    checksum: str


def _disk_free(directory: Path) -> int:
    return shutil.disk_usage(directory).free


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskStore:
    """Blocks of one model fingerprint in ``directory``; rows of other fingerprints are never returned.

    NOTE: removal works on whole files: removing any block deletes its file and every row in it, so no removed
    block's bytes stay on disk. The one exception is a ``protected`` block sharing the file: the file is then rewritten
    with only the protected blocks. Size cap and TTL evict whole files too (least recently accessed first).
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
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.ttl_s = ttl_s
        self._free_space = free_space or _disk_free
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._stored: set[BlockHash] = set()
        # Blocks reserved by a writer but not yet indexed; remove() cancels those it covers (erasure must win).
        self._pending: dict[BlockHash, DiskBlock] = {}
        self._pending_refs: Counter[BlockHash] = Counter()
        self._cancelled: set[BlockHash] = set()
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / QUARANTINE_DIR).mkdir(exist_ok=True)
        self._lock_fd = self._take_directory_lock()
        self._db = self._open_index()
        self._recover()

    # ---------------------------------------------------------------- opening

    def _take_directory_lock(self) -> int:
        fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DiskStoreInUse(f"the KV disk directory {self.directory} is in use by another DiskStore") from None
        return fd

    def _open_index(self) -> sqlite3.Connection:
        path = self.directory / INDEX_NAME
        try:
            return self._connect(path)
        except sqlite3.DatabaseError as e:
            # NOTE: a corrupt index is moved aside and rebuilt empty; every file then counts as unindexed.
            log.warning("disk KV index %s unreadable (%s); starting a new one", path, e)
            for suffix in ("", "-wal", "-shm"):
                old = Path(f"{path}{suffix}")
                if old.exists():
                    self._move_to_quarantine(old)
            return self._connect(path)

    def _connect(self, path: Path) -> sqlite3.Connection:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # a lost commit only leaves an unindexed file: quarantined
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"index schema version {version}, expected {SCHEMA_VERSION}")
            db.executescript(_SCHEMA)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            db.execute("SELECT COUNT(*) FROM blocks").fetchone()
        except BaseException:
            db.close()
            raise
        return db

    def _recover(self) -> None:
        """Quarantine files the index does not know, delete temp files, drop rows whose file is gone or truncated."""
        with self._lock:
            known = {name: size for name, size in self._db.execute("SELECT name, size FROM files")}
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
                    self._drop_file_rows_locked(name)
            rows = self._db.execute("SELECT hash FROM blocks WHERE fingerprint = ?", (self.fingerprint,))
            self._stored = {BlockHash(bytes(h)) for (h,) in rows}

    # ---------------------------------------------------------------- queries

    def contains(self, block_hash: BlockHash) -> bool:
        # NOTE: no lock: a set lookup is atomic under the GIL and must not wait for a writer holding the lock.
        return block_hash in self._stored

    def __len__(self) -> int:
        return len(self._stored)

    def hashes(self) -> frozenset[BlockHash]:
        """Every block of this fingerprint on disk (a snapshot)."""
        return frozenset(self._stored)

    def stats(self) -> DiskStats:
        with self._lock:
            files, size = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM files WHERE fingerprint = ?", (self.fingerprint,)
            ).fetchone()
        c = self._counts
        return DiskStats(
            blocks=len(self._stored),
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
        """Change the limits at runtime; a lower cap evicts at once."""
        with self._lock:
            if max_bytes is not None:
                self.max_bytes = max_bytes
            if min_free_bytes is not None:
                self.min_free_bytes = min_free_bytes
            if ttl_s is not None:
                self.ttl_s = ttl_s
            doomed = self._enforce_cap_locked(keep=None)
        self._unlink_all(doomed)

    # ---------------------------------------------------------------- writing

    def reserve(self, blocks: Sequence[DiskBlock]) -> None:
        """Mark blocks as on their way to disk, so a ``remove`` meanwhile cancels them (``DiskWriter`` calls this)."""
        with self._lock:
            for b in blocks:
                self._pending[b.block_hash] = b
                self._pending_refs[b.block_hash] += 1

    def release(self, blocks: Sequence[DiskBlock]) -> None:
        """Undo ``reserve`` for blocks that will not be written after all."""
        with self._lock:
            self._release_locked(blocks)

    def is_cancelled(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cancelled

    def write_run(
        self, blocks: Sequence[DiskBlock], kv: torch.Tensor | np.ndarray[Any, Any], *, reserved: bool = False
    ) -> bool:
        """Store ``blocks`` (``kv``: ``[layers, 2, n, block_size, kv_heads, head_dim]``) as one file.

        Blocks already stored are skipped. Returns False when the write was refused (free-space guard, a run larger
        than the cap) or cancelled by a concurrent ``remove``. ``reserved``: the caller already called ``reserve``.
        """
        if not reserved:
            self.reserve(blocks)
        try:
            _check_run(blocks, kv)
            return self._write_reserved(blocks, kv)
        finally:
            self.release(blocks)

    def _write_reserved(self, blocks: Sequence[DiskBlock], kv: torch.Tensor | np.ndarray[Any, Any]) -> bool:
        seen: set[BlockHash] = set()
        keep: list[int] = []
        for i, b in enumerate(blocks):
            if b.block_hash not in self._stored and b.block_hash not in seen:
                seen.add(b.block_hash)
                keep.append(i)
        if not keep:
            return True
        new_blocks = [blocks[i] for i in keep]
        if len(keep) < len(blocks):
            kv = _select_blocks(kv, keep)
        data = _serialize(new_blocks, kv, self.fingerprint)
        if len(data) > self.max_bytes:
            self._counts["writes_refused_cap"] += 1
            log.info("disk KV: run of %d bytes refused: larger than the cap of %d", len(data), self.max_bytes)
            return False
        if self._free_space(self.directory) - len(data) < self.min_free_bytes:
            self._counts["writes_refused_space"] += 1
            log.info("disk KV: run of %d bytes refused by the free-space guard", len(data))
            return False
        name = f"{new_blocks[0].block_hash.hex()}-{secrets.token_hex(4)}{FILE_SUFFIX}"
        self._write_file_atomically(name, data)
        with self._lock:
            # NOTE: a block indexed meanwhile by another writer also discards the run: two files holding one block's
            # bytes would let an erasure miss a copy.
            if any(b.block_hash in self._cancelled or b.block_hash in self._stored for b in new_blocks):
                self._counts["writes_cancelled"] += 1
                doomed = [name]
            else:
                self._index_file_locked(name, data, new_blocks, _block_bytes(kv))
                self._counts["writes"] += 1
                self._counts["blocks_written"] += len(new_blocks)
                doomed = self._enforce_cap_locked(keep=name)
        self._unlink_all(doomed)
        return name not in doomed

    def _write_file_atomically(self, name: str, data: bytes) -> None:
        tmp = self.directory / f".{name}{TMP_SUFFIX}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.directory / name)
        _fsync_dir(self.directory)

    def _index_file_locked(
        self, name: str, data: bytes, blocks: Sequence[DiskBlock], block_bytes: int, *, created: float | None = None
    ) -> None:
        now = self._clock()
        checksum = hashlib.sha256(data).hexdigest()
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                (name, self.fingerprint, checksum, len(data), len(blocks), created or now, now),
            )
            self._db.executemany(
                "INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL)",
                [
                    (
                        self.fingerprint,
                        b.block_hash,
                        b.root,
                        b.parent,
                        json.dumps(list(b.token_ids)),
                        json.dumps(list(b.block_types)),
                        b.owner,
                        name,
                        i,
                        checksum,
                        block_bytes,
                        created or now,
                        now,
                    )
                    for i, b in enumerate(blocks)
                ],
            )
        self._stored.update(b.block_hash for b in blocks)

    def _release_locked(self, blocks: Sequence[DiskBlock]) -> None:
        for b in blocks:
            h = b.block_hash
            self._pending_refs[h] -= 1
            if self._pending_refs[h] <= 0:
                del self._pending_refs[h]
                self._pending.pop(h, None)
                self._cancelled.discard(h)

    # ---------------------------------------------------------------- reading

    def load(self, hashes: Sequence[BlockHash]) -> list[LoadedBlock]:
        """The longest prefix of ``hashes`` that is stored and verifies; never raises on bad data.

        A file that fails verification is moved to ``quarantine/`` and its rows dropped; the blocks before it are
        returned. Loaded blocks (and their files) count as accessed for the LRU cap and the TTL.
        """
        with self._lock:
            rows = self._rows_locked(hashes)
        loaded: list[LoadedBlock] = []
        files: dict[str, _VerifiedFile] = {}
        for row in rows:
            vf = files.get(row.file)
            if vf is None:
                try:
                    vf = files[row.file] = self._read_verified(row.file, row.checksum)
                except Exception as e:  # noqa: BLE001 - any failure of a stored file is a miss, never an error
                    self._reject(row, f"{type(e).__name__}: {e}")
                    break
            if not vf.matches(row):
                self._reject(row, f"block {row.idx} differs from its index row")
                break
            loaded.append(LoadedBlock(row.block, vf.kv[row.idx]))
        with self._lock:
            self._touch_locked([lb.block.block_hash for lb in loaded], set(files))
            self._counts["loads"] += 1
            self._counts["blocks_loaded"] += len(loaded)
            if len(loaded) < len(hashes):
                self._counts["load_misses"] += 1
        return loaded

    def _reject(self, row: _Row, why: str) -> None:
        with self._lock:
            if self._quarantine_if_indexed_locked(row.file, row.checksum):
                log.warning("disk KV: %s failed verification (%s); quarantined", row.file, why)

    def _rows_locked(self, hashes: Sequence[BlockHash]) -> list[_Row]:
        rows: list[_Row] = []
        for h in hashes:
            r = self._db.execute(
                "SELECT parent, root, token_ids, block_types, owner, file, idx, checksum FROM blocks"
                " WHERE fingerprint = ? AND hash = ?",
                (self.fingerprint, h),
            ).fetchone()
            if r is None:
                break
            parent, root, token_ids, types, owner, file, idx, checksum = r
            block = DiskBlock(
                h,
                BlockHash(bytes(parent)),
                BlockHash(bytes(root)),
                tuple(json.loads(token_ids)),
                tuple(json.loads(types)),
                owner,
            )
            rows.append(_Row(block, file, idx, checksum))
        return rows

    def _read_verified(self, name: str, checksum: str) -> _VerifiedFile:
        """Read one file and check it as a whole: checksum, safetensors parse, format, fingerprint, shapes."""
        from safetensors.torch import load as st_load

        data = (self.directory / name).read_bytes()
        if hashlib.sha256(data).hexdigest() != checksum:
            raise _BadFile("checksum mismatch")
        kv = st_load(data).get("kv")
        meta = _read_metadata(data)
        if meta.get("format") != FORMAT_VERSION or meta.get("fingerprint") != self.fingerprint:
            raise _BadFile("format or model fingerprint differs")
        if kv is None:
            raise _BadFile("no kv tensor")
        vf = _VerifiedFile(kv, json.loads(meta["hashes"]), json.loads(meta["parents"]), json.loads(meta["token_ids"]))
        n = len(vf.hashes)
        if kv.dim() != 6 or kv.shape[0] != n or len(vf.parents) != n or len(vf.token_ids) != n:
            raise _BadFile("kv tensor does not match the metadata")
        return vf

    def _touch_locked(self, hashes: list[BlockHash], files: set[str]) -> None:
        if not hashes:
            return
        now = self._clock()
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                "UPDATE blocks SET last_access = ? WHERE fingerprint = ? AND hash = ?",
                [(now, self.fingerprint, h) for h in hashes],
            )
            self._db.executemany("UPDATE files SET last_access = ? WHERE name = ?", [(now, f) for f in files])

    # ---------------------------------------------------------------- removal

    def remove(
        self, hashes: Iterable[BlockHash], *, root: BlockHash | None = None, protected: Set[BlockHash] = frozenset()
    ) -> int:
        """Remove ``hashes`` and every stored descendant (within ``root`` when given), except ``protected`` blocks
        (whose descendants still go). Blocks being written meanwhile are cancelled. Returns blocks removed."""
        with self._lock:
            seeds = [h for h in hashes if root is None or self._root_of_locked(h) in (root, None)]
            doomed, removed = self._remove_locked(seeds, root, protected, lambda b: False)
        self._unlink_all(doomed)
        return removed

    def remove_root(self, root: BlockHash) -> int:
        """Remove a whole namespace."""
        with self._lock:
            seeds = self._select_hashes_locked("root = ?", root)
            doomed, removed = self._remove_locked(seeds, root, frozenset(), lambda b: b.root == root)
        self._unlink_all(doomed)
        return removed

    def remove_owner(self, owner: str) -> int:
        """Erase the blocks a session published, and their descendants (whoever published those)."""
        with self._lock:
            seeds = self._select_hashes_locked("owner = ?", owner)
            doomed, removed = self._remove_locked(seeds, None, frozenset(), lambda b: b.owner == owner)
        self._unlink_all(doomed)
        return removed

    def expire(self) -> int:
        """Remove files none of whose blocks was accessed within the TTL; returns blocks removed.

        NOTE: this covers every fingerprint in the directory, so the files of a retired model age out too.
        """
        with self._lock:
            files = [
                name
                for (name,) in self._db.execute(
                    "SELECT file FROM blocks GROUP BY file HAVING MAX(last_access + COALESCE(ttl_s, ?)) < ?",
                    (self.ttl_s, self._clock()),
                )
            ]
            removed = sum(self._drop_file_rows_locked(name) for name in files)
            self._counts["expired"] += removed
        self._unlink_all(files)
        return removed

    def _root_of_locked(self, h: BlockHash) -> BlockHash | None:
        if h in self._pending:
            return self._pending[h].root
        r = self._db.execute("SELECT root FROM blocks WHERE fingerprint = ? AND hash = ?", (self.fingerprint, h))
        row = r.fetchone()
        return None if row is None else BlockHash(bytes(row[0]))

    def _select_hashes_locked(self, where: str, value: object) -> list[BlockHash]:
        sql = f"SELECT hash FROM blocks WHERE fingerprint = ? AND {where}"
        return [BlockHash(bytes(h)) for (h,) in self._db.execute(sql, (self.fingerprint, value))]

    def _remove_locked(
        self,
        seeds: Iterable[BlockHash],
        root: BlockHash | None,
        protected: Set[BlockHash],
        pending_match: Callable[[DiskBlock], bool],
    ) -> tuple[list[str], int]:
        """Find the subtree (stored and pending), cancel the pending part, drop the files of the stored part."""
        reach = set(seeds) | {h for h, b in self._pending.items() if pending_match(b)}
        frontier = set(reach)
        while frontier:
            children = self._stored_children_locked(frontier, root)
            children.update(
                h for h, b in self._pending.items() if b.parent in frontier and (root is None or b.root == root)
            )
            frontier = children - reach
            reach |= frontier
        targets = reach - protected
        self._cancelled.update(targets & self._pending.keys())
        files = self._files_of_locked(targets & self._stored)
        doomed: list[str] = []
        removed = 0
        for name in files:
            keep = self._protected_rows_locked(name, protected)
            removed += self._drop_file_rows_locked(name)
            doomed.append(name)
            if keep and self._rewrite_locked(name, keep):
                removed -= len(keep)
        return doomed, removed

    def _stored_children_locked(self, parents: set[BlockHash], root: BlockHash | None) -> set[BlockHash]:
        out: set[BlockHash] = set()
        items = list(parents)
        for start in range(0, len(items), 500):
            chunk = items[start : start + 500]
            sql = f"SELECT hash FROM blocks WHERE fingerprint = ? AND parent IN ({','.join('?' * len(chunk))})"
            args: list[object] = [self.fingerprint, *chunk]
            if root is not None:
                sql += " AND root = ?"
                args.append(root)
            out.update(BlockHash(bytes(h)) for (h,) in self._db.execute(sql, args))
        return out

    def _files_of_locked(self, hashes: set[BlockHash]) -> set[str]:
        out: set[str] = set()
        items = list(hashes)
        for start in range(0, len(items), 500):
            chunk = items[start : start + 500]
            sql = f"SELECT DISTINCT file FROM blocks WHERE fingerprint = ? AND hash IN ({','.join('?' * len(chunk))})"
            out.update(f for (f,) in self._db.execute(sql, [self.fingerprint, *chunk]))
        return out

    def _protected_rows_locked(self, name: str, protected: Set[BlockHash]) -> list[_Row]:
        if not protected:
            return []
        hashes = [
            BlockHash(bytes(h))
            for (h,) in self._db.execute("SELECT hash FROM blocks WHERE file = ? ORDER BY idx", (name,))
        ]
        kept = [h for h in hashes if h in protected]
        rows = []
        for h in kept:
            rows.extend(self._rows_locked([h]))
        return rows

    def _rewrite_locked(self, name: str, keep: list[_Row]) -> bool:
        """Write the protected blocks of a file that is being removed into a new file (rare: I/O under the lock)."""
        try:
            vf = self._read_verified(name, keep[0].checksum)
            if not all(vf.matches(r) for r in keep):
                raise _BadFile("a protected block differs from its index row")
            kv = vf.kv[[r.idx for r in keep]].movedim(0, 2)
            blocks = [r.block for r in keep]
            data = _serialize(blocks, kv, self.fingerprint)
            new_name = f"{blocks[0].block_hash.hex()}-{secrets.token_hex(4)}{FILE_SUFFIX}"
            self._write_file_atomically(new_name, data)
            self._index_file_locked(new_name, data, blocks, _block_bytes(kv))
            return True
        except Exception as e:  # noqa: BLE001 - losing a cached copy is a miss; the removal itself must go on
            log.warning("disk KV: could not keep the protected blocks of %s (%s: %s)", name, type(e).__name__, e)
            return False

    # ---------------------------------------------------------------- cap, quarantine, files

    def _enforce_cap_locked(self, keep: str | None) -> list[str]:
        """Drop least-recently-accessed files until this fingerprint's files fit ``max_bytes``; returns their names."""
        (total,) = self._db.execute(
            "SELECT COALESCE(SUM(size), 0) FROM files WHERE fingerprint = ?", (self.fingerprint,)
        ).fetchone()
        doomed: list[str] = []
        if total <= self.max_bytes:
            return doomed
        lru = self._db.execute(
            "SELECT name, size FROM files WHERE fingerprint = ? ORDER BY last_access, created, rowid",
            (self.fingerprint,),
        ).fetchall()
        for name, size in lru:
            if total <= self.max_bytes:
                break
            if name == keep:
                continue
            self._counts["evicted_cap"] += self._drop_file_rows_locked(name)
            doomed.append(name)
            total -= size
        return doomed

    def _drop_file_rows_locked(self, name: str) -> int:
        """Delete a file's index rows (not the file); returns how many of this fingerprint's blocks went."""
        hashes = [
            BlockHash(bytes(h))
            for (h,) in self._db.execute(
                "SELECT hash FROM blocks WHERE file = ? AND fingerprint = ?", (name, self.fingerprint)
            )
        ]
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM blocks WHERE file = ?", (name,))
            self._db.execute("DELETE FROM files WHERE name = ?", (name,))
        self._stored.difference_update(hashes)
        return len(hashes)

    def _quarantine_if_indexed_locked(self, name: str, checksum: str) -> bool:
        """Quarantine ``name`` unless a concurrent removal already dropped it (then the load simply missed)."""
        row = self._db.execute("SELECT checksum FROM files WHERE name = ?", (name,)).fetchone()
        if row is None or row[0] != checksum:
            return False
        self._quarantine_locked(name)
        return True

    def _quarantine_locked(self, name: str) -> None:
        self._drop_file_rows_locked(name)
        path = self.directory / name
        if path.exists() or path.is_symlink():
            self._move_to_quarantine(path)
        self._counts["quarantined"] += 1

    def _move_to_quarantine(self, path: Path) -> None:
        qdir = self.directory / QUARANTINE_DIR
        try:
            os.replace(path, qdir / f"{int(time.time() * 1000)}-{secrets.token_hex(2)}-{path.name}")
            old = sorted(qdir.iterdir(), key=lambda p: p.name)
            for p in old[: max(0, len(old) - MAX_QUARANTINED_FILES)]:
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
        except OSError as e:
            log.warning("disk KV: could not quarantine %s (%s); deleting it", path, e)
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _unlink_all(self, names: Iterable[str]) -> None:
        removed = False
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.directory / name)
                removed = True
        if removed:
            _fsync_dir(self.directory)

    def close(self) -> None:
        """Close the index and release the directory. Idempotent."""
        with self._lock:
            if self._lock_fd < 0:
                return
            self._db.close()
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(slots=True)
class _VerifiedFile:
    kv: torch.Tensor  # [n, layers, 2, block_size, kv_heads, head_dim]: the file's block-major layout
    hashes: list[str]  # hex, from the file's metadata
    parents: list[str]
    token_ids: list[list[int]]

    def matches(self, row: _Row) -> bool:
        i = row.idx
        return (
            0 <= i < len(self.hashes)
            and self.hashes[i] == row.block.block_hash.hex()
            and self.parents[i] == row.block.parent.hex()
            and tuple(self.token_ids[i]) == row.block.token_ids
        )


def _check_run(blocks: Sequence[DiskBlock], kv: torch.Tensor | np.ndarray[Any, Any]) -> None:
    shape = tuple(kv.shape)
    if len(shape) != 6 or shape[1] != 2 or shape[2] != len(blocks):
        raise ValueError(f"kv must be [layers, 2, {len(blocks)}, block_size, kv_heads, head_dim], got {shape}")
    for b in blocks:
        if len(b.token_ids) != shape[3]:
            raise ValueError(f"block {b.block_hash.hex()} has {len(b.token_ids)} token ids, block_size is {shape[3]}")


def _select_blocks(kv: Any, idx: list[int]) -> Any:
    return kv[:, :, idx]  # advanced indexing: a copy, for numpy and torch alike


def _block_bytes(kv: torch.Tensor | np.ndarray[Any, Any]) -> int:
    itemsize = kv.itemsize if isinstance(kv, np.ndarray) else kv.element_size()
    n = 1
    for i, d in enumerate(kv.shape):
        if i != 2:
            n *= int(d)
    return n * itemsize


def _serialize(blocks: Sequence[DiskBlock], kv: torch.Tensor | np.ndarray[Any, Any], fingerprint: str) -> bytes:
    """The file of one run. NOTE: the file holds ``kv`` block-major (``[n, layers, 2, ...]``) so a load hands out each
    block as a contiguous view; slicing dim 2 of the engine's layout costs ~10x more, on the step thread."""
    meta = {
        "format": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "hashes": json.dumps([b.block_hash.hex() for b in blocks]),
        "parents": json.dumps([b.parent.hex() for b in blocks]),
        "token_ids": json.dumps([list(b.token_ids) for b in blocks]),
    }
    if isinstance(kv, np.ndarray):
        from safetensors.numpy import save as np_save

        return np_save({"kv": np.ascontiguousarray(np.moveaxis(kv, 2, 0))}, metadata=meta)
    from safetensors.torch import save as st_save

    return st_save({"kv": kv.detach().to("cpu").movedim(2, 0).contiguous()}, metadata=meta)


def _read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (8-byte little-endian header length, then the JSON header)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    meta = header.get("__metadata__")
    if not isinstance(meta, dict):
        raise _BadFile("no metadata")
    return meta
