"""The index of the disk tier: which file holds which block, in SQLite, plus an in-memory set of the blocks stored.

One row per file (checksum, size, access times) and one per block (chain links, tokens, owner, position in its file),
keyed by model fingerprint so the files of several models can share a directory; queries see this fingerprint only
(the TTL excepted: it ages out every model's files). ``stored`` mirrors this fingerprint's blocks so a lookup needs no
query and no lock. Not thread-safe: the store calls it under its lock (``stored`` lookups excepted).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.kv.block_hash import BlockHash
from engine.kv.disk_format import DiskBlock

log = logging.getLogger("kvchat.engine.disk")

INDEX_NAME = "index.sqlite3"
SCHEMA_VERSION = 1
_CHUNK = 500  # hashes per IN (...) query, under SQLite's variable limit

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
    idx INTEGER NOT NULL,            -- position of the block in the file's kv tensor (dim 0 of the file's layout)
    checksum TEXT NOT NULL,          -- the file's checksum, repeated so a row is verifiable on its own
    size INTEGER NOT NULL,           -- bytes of this block's K/V
    created REAL NOT NULL,
    last_access REAL NOT NULL,
    ttl_s REAL,                      -- NULL: the store's TTL; a number overrides it for this block
    PRIMARY KEY (fingerprint, hash)
);
CREATE INDEX IF NOT EXISTS blocks_parent ON blocks(fingerprint, parent);
CREATE INDEX IF NOT EXISTS blocks_root ON blocks(fingerprint, root);
CREATE INDEX IF NOT EXISTS blocks_owner ON blocks(fingerprint, owner);
CREATE INDEX IF NOT EXISTS blocks_file ON blocks(file);
CREATE INDEX IF NOT EXISTS files_access ON files(fingerprint, last_access);
"""


@dataclass(frozen=True, slots=True)
class IndexRow:
    """Where one block lives: its file, its position in it, and the file's checksum."""

    block: DiskBlock
    file: str
    idx: int
    checksum: str


class DiskIndex:
    """The SQLite index of one directory, seen through one model fingerprint."""

    def __init__(
        self, path: Path, fingerprint: str, move_aside: Callable[[Path], None], clock: Callable[[], float] = time.time
    ) -> None:
        """Open (or create) the index at ``path``; an unreadable one is handed to ``move_aside`` (with its WAL
        files) and a new, empty one is created: every file then counts as unindexed."""
        self.fingerprint = fingerprint
        self._clock = clock
        try:
            self._db = _connect(path)
        except sqlite3.DatabaseError as e:
            log.warning("disk KV index %s unreadable (%s); starting a new one", path, e)
            for suffix in ("", "-wal", "-shm"):
                old = Path(f"{path}{suffix}")
                if old.exists():
                    move_aside(old)
            self._db = _connect(path)
        rows = self._db.execute("SELECT hash FROM blocks WHERE fingerprint = ?", (fingerprint,))
        self.stored: set[BlockHash] = {BlockHash(bytes(h)) for (h,) in rows}

    # ---------------------------------------------------------------- files

    def file_sizes(self) -> dict[str, int]:
        """Every indexed file of the directory (all fingerprints) and its size."""
        return {name: size for name, size in self._db.execute("SELECT name, size FROM files")}

    def checksum_of(self, name: str) -> str | None:
        row = self._db.execute("SELECT checksum FROM files WHERE name = ?", (name,)).fetchone()
        return None if row is None else str(row[0])

    def totals(self) -> tuple[int, int]:
        """(files, bytes) of this fingerprint."""
        files, size = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM files WHERE fingerprint = ?", (self.fingerprint,)
        ).fetchone()
        return int(files), int(size)

    def files_by_access(self) -> list[tuple[str, int]]:
        """This fingerprint's files and sizes, least recently accessed first."""
        sql = "SELECT name, size FROM files WHERE fingerprint = ? ORDER BY last_access, created, rowid"
        return [(name, size) for name, size in self._db.execute(sql, (self.fingerprint,))]

    def files_idle_since(self, default_ttl_s: float, now: float) -> list[str]:
        """Files (every fingerprint's) none of whose blocks was accessed within its TTL."""
        sql = "SELECT file FROM blocks GROUP BY file HAVING MAX(last_access + COALESCE(ttl_s, ?)) < ?"
        return [name for (name,) in self._db.execute(sql, (default_ttl_s, now))]

    def add_file(self, name: str, checksum: str, size: int, blocks: Sequence[DiskBlock], block_bytes: int) -> None:
        """Index a file just written (atomically: its row and its blocks' rows, or nothing)."""
        now = self._clock()
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                (name, self.fingerprint, checksum, size, len(blocks), now, now),
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
                        now,
                        now,
                    )
                    for i, b in enumerate(blocks)
                ],
            )
        self.stored.update(b.block_hash for b in blocks)

    def drop_file(self, name: str) -> int:
        """Delete a file's rows (not the file); returns how many of this fingerprint's blocks went."""
        sql = "SELECT hash FROM blocks WHERE file = ? AND fingerprint = ?"
        hashes = [BlockHash(bytes(h)) for (h,) in self._db.execute(sql, (name, self.fingerprint))]
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM blocks WHERE file = ?", (name,))
            self._db.execute("DELETE FROM files WHERE name = ?", (name,))
        self.stored.difference_update(hashes)
        return len(hashes)

    # ---------------------------------------------------------------- blocks

    def rows(self, hashes: Sequence[BlockHash]) -> list[IndexRow]:
        """The rows of the longest prefix of ``hashes`` that is indexed."""
        rows: list[IndexRow] = []
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
            rows.append(IndexRow(block, file, idx, checksum))
        return rows

    def rows_in_file(self, name: str, among: Set[BlockHash]) -> list[IndexRow]:
        """The rows of ``name``'s blocks that are in ``among``, in file order."""
        if not among:
            return []
        sql = "SELECT hash FROM blocks WHERE file = ? ORDER BY idx"
        kept = [h for h in (BlockHash(bytes(h)) for (h,) in self._db.execute(sql, (name,))) if h in among]
        return [row for h in kept for row in self.rows([h])]

    def touch(self, hashes: Iterable[BlockHash], files: Iterable[str]) -> None:
        """Mark blocks and files accessed now (for the LRU cap and the TTL)."""
        hashes, files = list(hashes), list(files)
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

    def root_of(self, h: BlockHash) -> BlockHash | None:
        sql = "SELECT root FROM blocks WHERE fingerprint = ? AND hash = ?"
        row = self._db.execute(sql, (self.fingerprint, h)).fetchone()
        return None if row is None else BlockHash(bytes(row[0]))

    def hashes_where(self, column: Literal["root", "owner"], value: object) -> list[BlockHash]:
        sql = f"SELECT hash FROM blocks WHERE fingerprint = ? AND {column} = ?"
        return [BlockHash(bytes(h)) for (h,) in self._db.execute(sql, (self.fingerprint, value))]

    def children(self, parents: Iterable[BlockHash], root: BlockHash | None) -> set[BlockHash]:
        """Stored blocks whose parent is one of ``parents`` (within ``root`` when given)."""
        out: set[BlockHash] = set()
        items = list(parents)
        for start in range(0, len(items), _CHUNK):
            chunk = items[start : start + _CHUNK]
            sql = f"SELECT hash FROM blocks WHERE fingerprint = ? AND parent IN ({','.join('?' * len(chunk))})"
            args: list[object] = [self.fingerprint, *chunk]
            if root is not None:
                sql += " AND root = ?"
                args.append(root)
            out.update(BlockHash(bytes(h)) for (h,) in self._db.execute(sql, args))
        return out

    def files_of(self, hashes: Iterable[BlockHash]) -> set[str]:
        """The files holding any of ``hashes``."""
        out: set[str] = set()
        items = list(hashes)
        for start in range(0, len(items), _CHUNK):
            chunk = items[start : start + _CHUNK]
            sql = f"SELECT DISTINCT file FROM blocks WHERE fingerprint = ? AND hash IN ({','.join('?' * len(chunk))})"
            out.update(f for (f,) in self._db.execute(sql, [self.fingerprint, *chunk]))
        return out

    def close(self) -> None:
        self._db.close()


def _connect(path: Path) -> sqlite3.Connection:
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
