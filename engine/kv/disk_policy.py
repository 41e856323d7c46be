"""The policy of the disk tier: what may be written (size cap, free-space guard), what goes (LRU cap, TTL), and where
bad files go (a bounded quarantine).

The cap and the TTL work on whole files, least recently accessed first: a file is one written run of a chain, so its
blocks age together. The store calls these under its lock; the only I/O here is the quarantine's rename.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from engine.kv.disk_index import DiskIndex

log = logging.getLogger("kvchat.engine.disk")

QUARANTINE_DIR = "quarantine"
MAX_QUARANTINED_FILES = 32  # older quarantined files are deleted so a corrupting disk cannot fill itself up


class Refusal(StrEnum):
    """Why a write was refused (the keys the store counts)."""

    CAP = "writes_refused_cap"
    SPACE = "writes_refused_space"


def disk_free(directory: Path) -> int:
    return shutil.disk_usage(directory).free


@dataclass(slots=True)
class DiskPolicy:
    """The limits of one store (changeable at runtime) and the decisions that follow from them."""

    max_bytes: int
    min_free_bytes: int
    ttl_s: float
    free_space: Callable[[Path], int] = disk_free
    clock: Callable[[], float] = time.time

    def refusal(self, size: int, directory: Path) -> str | None:
        """Why a file of ``size`` bytes may not be written now (a ``Refusal`` key), or None."""
        if size > self.max_bytes:
            log.info("disk KV: run of %d bytes refused: larger than the cap of %d", size, self.max_bytes)
            return Refusal.CAP
        if self.free_space(directory) - size < self.min_free_bytes:
            log.info("disk KV: run of %d bytes refused by the free-space guard", size)
            return Refusal.SPACE
        return None

    def over_cap(self, index: DiskIndex, keep: str | None) -> list[str]:
        """The least recently accessed files to drop so this fingerprint's files fit ``max_bytes`` (never ``keep``)."""
        _, total = index.totals()
        doomed: list[str] = []
        if total <= self.max_bytes:
            return doomed
        for name, size in index.files_by_access():
            if total <= self.max_bytes:
                break
            if name != keep:
                doomed.append(name)
                total -= size
        return doomed

    def expired(self, index: DiskIndex) -> list[str]:
        """Files none of whose blocks was accessed within the TTL.

        NOTE: this covers every fingerprint in the directory, so the files of a retired model age out too.
        """
        return index.files_idle_since(self.ttl_s, self.clock())


class Quarantine:
    """``directory/quarantine``: files that failed verification (kept for a post-mortem, the newest 32)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / QUARANTINE_DIR
        self.path.mkdir(parents=True, exist_ok=True)

    def move(self, path: Path) -> None:
        """Move ``path`` here (deleting it where that fails) and drop the oldest beyond the bound."""
        try:
            os.replace(path, self.path / f"{int(time.time() * 1000)}-{secrets.token_hex(2)}-{path.name}")
            old = sorted(self.path.iterdir(), key=lambda p: p.name)
            for p in old[: max(0, len(old) - MAX_QUARANTINED_FILES)]:
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
        except OSError as e:
            log.warning("disk KV: could not quarantine %s (%s); deleting it", path, e)
            with contextlib.suppress(OSError):
                os.unlink(path)
