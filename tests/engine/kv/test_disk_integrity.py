"""Every corruption of a stored file is a miss: truncation at each header byte and sampled data offsets, and 1,000+
random bit flips. Each case must quarantine the file, raise nothing and never hand out wrong K/V."""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine.kv import disk_format
from engine.kv.disk_index import INDEX_NAME
from engine.kv.disk_policy import QUARANTINE_DIR
from engine.kv.disk_store import DiskStore
from support.disk_blocks import FINGERPRINT, assert_exact, chain, run_kv

BLOCKS = chain(3)
HASHES = [b.block_hash for b in BLOCKS]
KV = run_kv(BLOCKS, torch.bfloat16)


class Harness:
    """One store holding one run; ``case`` corrupts the run's file, loads, checks and restores."""

    def __init__(self, directory: Path) -> None:
        self.store = DiskStore(directory, FINGERPRINT, max_bytes=1 << 30, min_free_bytes=0, ttl_s=1e9)
        self.cases = 0
        self.restore()
        self.pristine = self.path.read_bytes()
        self.header_end = 8 + int.from_bytes(self.pristine[:8], "little")

    def restore(self) -> None:
        assert self.store.write_run(BLOCKS, KV)  # byte-identical file under a new name: a cheap re-index
        (self.path,) = self.store.directory.glob("*.safetensors")

    def case(self, corrupt: Callable[[bytes], bytes], *, expect_quarantine: bool = True) -> None:
        self.path.write_bytes(corrupt(self.pristine))
        quarantined = self.store.stats().quarantined
        loaded = self.store.load(HASHES)  # must not raise
        if expect_quarantine:
            assert loaded == []
            assert self.store.stats().quarantined == quarantined + 1
            assert not self.path.exists() and self.store.hashes() == frozenset()
            self.restore()
        else:  # the index was patched to accept the corrupt file: whatever loads must still be exact
            assert_exact(loaded, BLOCKS[: len(loaded)], torch.bfloat16)
            if len(loaded) < len(BLOCKS):
                self.restore()
        self.cases += 1


@pytest.fixture
def harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    # NOTE: durability is test_disk_kill's subject; here fsync would be 2/3 of the run time for ~4,000 writes.
    monkeypatch.setattr(disk_format.os, "fsync", lambda fd: None)
    h = Harness(tmp_path)
    yield h
    assert len(list((tmp_path / QUARANTINE_DIR).iterdir())) <= 32  # the quarantine stays bounded
    h.store.close()


def truncate(n: int) -> Callable[[bytes], bytes]:
    return lambda data: data[:n]


def flip(bit: int) -> Callable[[bytes], bytes]:
    def apply(data: bytes) -> bytes:
        out = bytearray(data)
        out[bit // 8] ^= 1 << (bit % 8)
        return bytes(out)

    return apply


def test_truncation_anywhere_is_a_miss(harness: Harness) -> None:
    size = len(harness.pristine)
    rng = random.Random(7)
    offsets = list(range(harness.header_end + 1)) + rng.sample(range(harness.header_end + 1, size), 50)
    for n in offsets:
        harness.case(truncate(n))
    harness.case(lambda data: data + b"\0")  # a longer file is as wrong as a shorter one
    assert harness.cases == len(offsets) + 1 > 300


def test_random_bit_flips_are_misses(harness: Harness) -> None:
    rng = random.Random(1234)
    bits = len(harness.pristine) * 8
    for bit in [rng.randrange(bits) for _ in range(1000)] + [rng.randrange(harness.header_end * 8) for _ in range(200)]:
        harness.case(flip(bit))
    assert harness.cases == 1200


def test_header_flips_behind_a_matching_checksum_never_raise_or_lie(harness: Harness) -> None:
    """If the checksum itself were wrong (an index restored from elsewhere), parsing and the metadata checks still
    hold: a flipped header bit either fails to parse or to match, or (in K/V-neutral spots) changes nothing."""
    import hashlib

    rng = random.Random(99)
    for bit in rng.sample(range(harness.header_end * 8), 300):
        data = flip(bit)(harness.pristine)
        with sqlite3.connect(harness.store.directory / INDEX_NAME) as db:
            digest = hashlib.sha256(data).hexdigest()
            db.execute("UPDATE files SET checksum = ? WHERE name = ?", (digest, harness.path.name))
            db.execute("UPDATE blocks SET checksum = ? WHERE file = ?", (digest, harness.path.name))
        db.close()
        harness.case(lambda _d, data=data: data, expect_quarantine=False)  # type: ignore[misc]
    assert harness.cases == 300
