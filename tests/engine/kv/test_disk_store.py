"""DiskStore: round trips, skipping, prefix loads, cap, TTL, free-space guard, restart, fingerprints, removal."""

from __future__ import annotations

import math
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.kv.block_hash import root_hash
from engine.kv.disk_index import INDEX_NAME
from engine.kv.disk_policy import QUARANTINE_DIR
from engine.kv.disk_store import DiskStore, DiskStoreInUse
from engine.kv.disk_writer import DiskWriter
from support.disk_blocks import FINGERPRINT, assert_exact, bits, block_kv, chain, run_kv


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def open_store(path: Path, **kw: object) -> DiskStore:
    args: dict[str, object] = {"max_bytes": 1 << 30, "min_free_bytes": 0, "ttl_s": 3600.0}
    args.update(kw)
    return DiskStore(path, str(args.pop("fingerprint", FINGERPRINT)), **args)  # type: ignore[arg-type]


def data_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("*.safetensors"))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DiskStore]:
    s = open_store(tmp_path)
    yield s
    s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(store: DiskStore, dtype: torch.dtype) -> None:
    blocks = chain(3)
    kv = run_kv(blocks, dtype)
    kv[0, 0, 0, 0, 0, :4] = torch.tensor([math.nan, -0.0, math.inf, -math.inf]).to(dtype)
    assert store.write_run(blocks, kv)
    loaded = store.load([b.block_hash for b in blocks])
    assert [lb.block for lb in loaded] == blocks
    for i, lb in enumerate(loaded):
        assert lb.kv.dtype == dtype
        assert lb.kv.shape == (2, 2, 4, 2, 8)
        assert torch.equal(bits(lb.kv), bits(kv[:, :, i]))
    s = store.stats()
    assert (s.blocks, s.files, s.writes, s.blocks_written, s.loads, s.blocks_loaded, s.load_misses) == (
        3,
        1,
        1,
        3,
        1,
        3,
        0,
    )
    assert s.bytes == (tmp := store.directory / data_files(store.directory)[0]).stat().st_size and tmp.exists()


def test_one_file_per_run_and_stored_blocks_are_skipped(store: DiskStore) -> None:
    blocks = chain(6)
    assert store.write_run(blocks[:4], run_kv(blocks[:4]))
    assert store.write_run(blocks, run_kv(blocks))  # the first four are skipped
    assert store.write_run(blocks, run_kv(blocks))  # nothing new: no file
    s = store.stats()
    assert (s.files, s.writes, s.blocks_written, s.blocks) == (2, 2, 6, 6)
    assert len(data_files(store.directory)) == 2
    assert_exact(store.load([b.block_hash for b in blocks]), blocks)


def test_load_returns_the_longest_prefix(store: DiskStore) -> None:
    blocks = chain(5)
    store.write_run(blocks[:3], run_kv(blocks[:3]))
    store.write_run(blocks[4:], run_kv(blocks[4:]))
    hashes = [b.block_hash for b in blocks]
    assert_exact(store.load(hashes), blocks[:3])
    assert store.load(hashes[3:]) == []
    assert_exact(store.load(hashes[4:]), blocks[4:])
    assert store.contains(hashes[4]) and not store.contains(hashes[3])
    s = store.stats()
    assert (s.loads, s.blocks_loaded, s.load_misses) == (3, 4, 2)


def test_size_cap_evicts_least_recently_accessed_files(tmp_path: Path) -> None:
    clock = Clock()
    a, b, c = chain(2, namespace="a"), chain(2, namespace="b"), chain(2, namespace="c")
    probe = open_store(tmp_path / "probe")
    probe.write_run(a, run_kv(a))
    size = probe.stats().bytes
    probe.close()
    store = open_store(tmp_path / "s", max_bytes=2 * size + size // 2, clock=clock)
    store.write_run(a, run_kv(a))
    clock.now += 1
    store.write_run(b, run_kv(b))
    clock.now += 1
    assert len(store.load([a[0].block_hash])) == 1  # a is now more recent than b
    clock.now += 1
    store.write_run(c, run_kv(c))
    assert [store.contains(x[0].block_hash) for x in (a, b, c)] == [True, False, True]
    s = store.stats()
    assert (s.evicted_cap, s.files, s.blocks) == (2, 2, 4)
    assert s.bytes <= store.max_bytes
    assert len(data_files(store.directory)) == 2
    store.set_limits(max_bytes=size)  # a lower cap evicts at once; c (written last) stays
    assert [store.contains(x[0].block_hash) for x in (a, b, c)] == [False, False, True]
    assert store.stats().evicted_cap == 4
    store.close()


def test_a_run_larger_than_the_cap_is_refused(tmp_path: Path) -> None:
    store = open_store(tmp_path, max_bytes=1000)
    blocks = chain(4)
    assert store.write_run(blocks, run_kv(blocks)) is False
    s = store.stats()
    assert (s.writes_refused_cap, s.writes, s.blocks) == (1, 0, 0)
    assert data_files(tmp_path) == [] and list(tmp_path.glob("*.tmp")) == []
    store.close()


def test_ttl_expires_files_not_accessed_in_time(tmp_path: Path) -> None:
    clock = Clock()
    store = open_store(tmp_path, ttl_s=100.0, clock=clock)
    a, b = chain(2, namespace="a"), chain(2, namespace="b")
    store.write_run(a, run_kv(a))
    store.write_run(b, run_kv(b))
    clock.now += 60
    store.load([a[0].block_hash])
    clock.now += 50  # b: 110 s idle; a: 50 s
    assert store.expire() == 2
    assert store.contains(a[0].block_hash) and store.contains(a[1].block_hash)
    assert not store.contains(b[0].block_hash)
    clock.now += 101
    assert store.expire() == 2
    assert store.stats().expired == 4 and data_files(tmp_path) == []
    store.set_limits(ttl_s=10.0)
    store.write_run(b, run_kv(b))
    clock.now += 5
    assert store.expire() == 0
    clock.now += 6
    assert store.expire() == 2
    store.close()


def test_free_space_guard_refuses_writes_without_raising(tmp_path: Path) -> None:
    free = [10_000]
    store = open_store(tmp_path, min_free_bytes=6_000, free_space=lambda d: free[0])
    blocks = chain(4)  # a ~4.6 KiB file leaves < 6000 of 10000 free; a one-block file (~1.3 KiB) does not
    assert store.write_run(blocks, run_kv(blocks)) is False
    assert store.write_run(blocks[:1], run_kv(blocks[:1])) is True
    assert store.stats().writes_refused_space == 1
    free[0] = 0
    assert store.write_run(blocks, run_kv(blocks)) is False
    assert store.stats().writes_refused_space == 2
    assert len(data_files(tmp_path)) == 1 and list(tmp_path.glob(".*tmp")) == []
    free[0] = 1 << 40
    assert store.write_run(blocks, run_kv(blocks))
    assert_exact(store.load([b.block_hash for b in blocks]), blocks)
    store.close()


def test_a_new_store_on_the_same_directory_sees_everything(tmp_path: Path) -> None:
    first = open_store(tmp_path)
    a, b = chain(3, owner="s1"), chain(2, namespace="other")
    first.write_run(a, run_kv(a, torch.bfloat16))
    first.write_run(b, run_kv(b))
    first.close()
    second = open_store(tmp_path)
    assert second.hashes() == {x.block_hash for x in a + b}
    assert_exact(second.load([x.block_hash for x in a]), a, torch.bfloat16)
    assert_exact(second.load([x.block_hash for x in b]), b)
    assert second.stats().quarantined == 0
    second.close()


def test_another_fingerprint_never_loads(tmp_path: Path) -> None:
    a = chain(2)
    with open_store(tmp_path) as first:
        first.write_run(a, run_kv(a))
    with open_store(tmp_path, fingerprint="other-model") as other:
        assert not other.contains(a[0].block_hash)
        assert other.load([a[0].block_hash]) == []
        assert other.stats().blocks == 0 and other.stats().files == 0
        assert other.remove([a[0].block_hash]) == 0
        other.write_run(a, run_kv(a))  # the same hashes under another model are separate rows and files
        assert_exact(other.load([x.block_hash for x in a]), a)
    with open_store(tmp_path) as again:  # the first model's file was neither loaded nor quarantined
        assert_exact(again.load([x.block_hash for x in a]), a)
        assert again.stats().files == 1
        assert len(data_files(tmp_path)) == 2


def test_a_file_of_another_fingerprint_swapped_in_is_rejected(tmp_path: Path) -> None:
    a = chain(2)
    with open_store(tmp_path / "x", fingerprint="other-model") as other:
        other.write_run(a, run_kv(a))
        foreign = (tmp_path / "x" / data_files(tmp_path / "x")[0]).read_bytes()
    with open_store(tmp_path / "y") as store:
        store.write_run(a, run_kv(a))
        (tmp_path / "y" / data_files(tmp_path / "y")[0]).write_bytes(foreign)
        assert store.load([a[0].block_hash]) == []
        assert store.stats().quarantined == 1 and store.stats().blocks == 0


def test_remove_takes_the_subtree_and_whole_files(store: DiskStore) -> None:
    trunk = chain(6)
    branch = chain(2, parent=trunk[1].block_hash, start=100)
    other = chain(2, namespace="other")
    for run in (trunk[:3], trunk[3:], branch, other):
        store.write_run(run, run_kv(run))
    # trunk[1] and its descendants go; trunk[0] shares their file, so it goes too (no removed bytes stay on disk).
    assert store.remove([trunk[1].block_hash]) == 3 + 3 + 2
    assert store.hashes() == {b.block_hash for b in other}
    assert len(data_files(store.directory)) == 1
    assert store.remove([trunk[1].block_hash]) == 0


def test_remove_limited_to_a_root(store: DiskStore) -> None:
    a = chain(3, namespace="a")
    store.write_run(a, run_kv(a))
    assert store.remove([a[0].block_hash], root=root_hash(FINGERPRINT, "b")) == 0
    assert store.stats().blocks == 3
    assert store.remove([a[0].block_hash], root=root_hash(FINGERPRINT, "a")) == 3
    assert store.stats().blocks == 0


def test_remove_skips_protected_blocks_but_not_their_descendants(store: DiskStore) -> None:
    blocks = chain(5)
    store.write_run(blocks[:4], run_kv(blocks[:4]))
    store.write_run(blocks[4:], run_kv(blocks[4:]))
    hashes = [b.block_hash for b in blocks]
    assert store.remove([hashes[1]], protected={hashes[1], hashes[3]}) == 3  # 0 (file mate), 2, 4; 1 and 3 kept
    assert store.hashes() == {hashes[1], hashes[3]}
    assert_exact(store.load([hashes[1]]), [blocks[1]])
    assert_exact(store.load([hashes[3]]), [blocks[3]])
    (name,) = data_files(store.directory)  # rewritten: the new file holds only the protected blocks
    raw = (store.directory / name).read_bytes()
    assert block_kv(blocks[1]).numpy().tobytes() in raw
    assert not any(block_kv(blocks[i]).numpy().tobytes() in raw for i in (0, 2, 4))


def test_remove_root_and_remove_owner(store: DiskStore) -> None:
    mine = chain(2, owner="s1")
    theirs = chain(2, parent=mine[-1].block_hash, owner="s2", start=2)
    unrelated = chain(2, owner="s2", start=50)
    other_ns = chain(3, namespace="b", owner="s1")
    for run in (mine, theirs, unrelated, other_ns):
        store.write_run(run, run_kv(run))
    assert store.remove_owner("s1") == 2 + 2 + 3  # s1's blocks and their descendants, whoever published them
    assert store.hashes() == {b.block_hash for b in unrelated}
    assert store.remove_root(root_hash(FINGERPRINT, "ns")) == 2
    assert store.stats().blocks == 0 and data_files(store.directory) == []


def test_unindexed_and_temp_files_found_at_open_are_never_loaded(tmp_path: Path) -> None:
    a, b = chain(2, namespace="a"), chain(2, namespace="b")
    with open_store(tmp_path) as first:
        first.write_run(a, run_kv(a))
        first.write_run(b, run_kv(b))
    with sqlite3.connect(tmp_path / INDEX_NAME) as db:  # as if the process died between rename and index commit
        (b_file,) = db.execute("SELECT file FROM blocks WHERE hash = ?", (b[0].block_hash,)).fetchone()
        db.execute("DELETE FROM blocks WHERE file = ?", (b_file,))
        db.execute("DELETE FROM files WHERE name = ?", (b_file,))
    db.close()
    (tmp_path / ".half-written.safetensors.tmp").write_bytes(b"\0" * 100)
    (tmp_path / "stray.bin").write_bytes(b"junk")
    with open_store(tmp_path) as store:
        assert store.load([b[0].block_hash]) == [] and not store.contains(b[0].block_hash)
        assert_exact(store.load([x.block_hash for x in a]), a)
        assert store.stats().quarantined == 2
        quarantined = sorted(p.name for p in (tmp_path / QUARANTINE_DIR).iterdir())
        assert len(quarantined) == 2 and any(n.endswith(b_file) for n in quarantined)
        assert not list(tmp_path.glob("*.tmp")) and not (tmp_path / b_file).exists()


def test_missing_or_truncated_files_at_open_drop_their_rows(tmp_path: Path) -> None:
    a, b = chain(2, namespace="a"), chain(2, namespace="b")
    with open_store(tmp_path) as first:
        first.write_run(a, run_kv(a))
        first.write_run(b, run_kv(b))
    with sqlite3.connect(tmp_path / INDEX_NAME) as db:
        (a_file,) = db.execute("SELECT file FROM blocks WHERE hash = ?", (a[0].block_hash,)).fetchone()
        (b_file,) = db.execute("SELECT file FROM blocks WHERE hash = ?", (b[0].block_hash,)).fetchone()
    db.close()
    (tmp_path / a_file).unlink()
    (tmp_path / b_file).write_bytes((tmp_path / b_file).read_bytes()[:-1])
    with open_store(tmp_path) as store:
        assert store.hashes() == frozenset()
        assert store.load([a[0].block_hash]) == [] and store.load([b[0].block_hash]) == []
        assert store.stats().quarantined == 1  # the truncated one; the missing one just lost its rows


def test_a_file_missing_at_load_is_a_miss(store: DiskStore) -> None:
    a = chain(3)
    store.write_run(a, run_kv(a))
    (store.directory / data_files(store.directory)[0]).unlink()
    assert store.load([x.block_hash for x in a]) == []
    assert store.stats().quarantined == 1 and store.stats().blocks == 0


def test_a_corrupt_index_is_rebuilt(tmp_path: Path) -> None:
    a = chain(2)
    with open_store(tmp_path) as first:
        first.write_run(a, run_kv(a))
    for p in tmp_path.glob(INDEX_NAME + "*"):
        p.write_bytes(b"this is not a database" * 100)
    with open_store(tmp_path) as store:
        assert store.stats().blocks == 0 and store.load([a[0].block_hash]) == []
        assert store.write_run(a, run_kv(a))
        assert_exact(store.load([x.block_hash for x in a]), a)


def test_one_store_per_directory(tmp_path: Path) -> None:
    first = open_store(tmp_path)
    with pytest.raises(DiskStoreInUse, match="in use"):
        open_store(tmp_path)
    first.close()
    first.close()  # idempotent
    open_store(tmp_path).close()


def test_malformed_runs_are_programming_errors(store: DiskStore) -> None:
    blocks = chain(2)
    with pytest.raises(ValueError, match="kv must be"):
        store.write_run(blocks, run_kv(blocks[:1]))
    with pytest.raises(ValueError, match="token ids"):
        store.write_run(blocks, torch.zeros(2, 2, 2, 5, 2, 8))
    assert store.stats().blocks == 0


def test_a_removal_during_a_write_cancels_it(tmp_path: Path) -> None:
    blocks = chain(3, owner="s1")
    store = open_store(tmp_path)
    store.reserve(blocks)
    assert store.remove_owner("s1") == 0  # nothing on disk yet, but the reserved run is cancelled
    assert store.is_cancelled(blocks[2].block_hash)
    assert store.write_run(blocks, run_kv(blocks), reserved=True) is False
    assert store.stats().writes_cancelled == 1 and store.stats().blocks == 0
    assert data_files(tmp_path) == []
    assert store.write_run(blocks, run_kv(blocks))  # a later write of the same blocks is not affected
    store.close()


def test_a_pending_descendant_of_a_removed_block_is_cancelled(store: DiskStore) -> None:
    blocks = chain(4)
    store.write_run(blocks[:2], run_kv(blocks[:2]))
    store.reserve(blocks[2:])
    assert store.remove([blocks[0].block_hash]) == 2
    assert store.write_run(blocks[2:], run_kv(blocks[2:]), reserved=True) is False
    assert store.hashes() == frozenset()


# ---------------------------------------------------------------- DiskWriter


def gated_store(tmp_path: Path, gate: threading.Event) -> DiskStore:
    """A store whose writes wait for ``gate`` (the free-space probe is called once per write)."""

    def free_space(_: Path) -> int:
        assert gate.wait(10)
        return 1 << 40

    return open_store(tmp_path, free_space=free_space)


def test_writer_writes_in_the_background_and_serves_pending_blocks(tmp_path: Path) -> None:
    gate = threading.Event()
    store = gated_store(tmp_path, gate)
    writer = DiskWriter(store)
    first = chain(2)
    runs = [first, chain(2, parent=first[-1].block_hash, start=2), chain(3, namespace="b")]
    for run in runs:
        assert writer.submit(run, run_kv(run))
    pending = writer.pending(runs[2][1].block_hash)
    assert pending is not None and torch.equal(pending, block_kv(runs[2][1]))
    assert not store.contains(runs[0][0].block_hash)
    gate.set()
    writer.flush(timeout=10)
    assert writer.pending(runs[2][1].block_hash) is None
    for run in runs:
        assert_exact(store.load([b.block_hash for b in run]), run)
    writer.close()
    writer.close()
    assert writer.submit(runs[0], run_kv(runs[0])) is False and writer.dropped == 1
    store.close()


def test_writer_merges_consecutive_runs_of_one_namespace(tmp_path: Path) -> None:
    gate = threading.Event()
    store = gated_store(tmp_path, gate)
    writer = DiskWriter(store, max_blocks_per_file=5)
    a1 = chain(1, namespace="a")
    gate_run = chain(1, namespace="z")
    writer.submit(gate_run, run_kv(gate_run))  # the thread takes this one and waits at the gate
    a = chain(6, namespace="a")
    for i in range(0, 6, 2):
        writer.submit(a[i : i + 2], run_kv(a[i : i + 2]))
    b = chain(2, namespace="b")
    writer.submit(b, run_kv(b))
    writer.submit(a1, run_kv(a1))  # a1 == a[0]: already queued, skipped by the store
    gate.set()
    writer.close()
    # gate_run | a[0:4] (a[4:6] would exceed 5) | a[4:6] | b | a1 (already stored: no file)
    assert store.stats().files == 4 and store.stats().writes == 4
    assert_exact(store.load([x.block_hash for x in a]), a)
    store.close()


def test_writer_refuses_when_the_queue_is_full(tmp_path: Path) -> None:
    gate = threading.Event()
    store = gated_store(tmp_path, gate)
    writer = DiskWriter(store, max_pending_blocks=4)
    a, b = chain(3, namespace="a"), chain(2, namespace="b")
    assert writer.submit(a, run_kv(a))
    assert writer.submit(b, run_kv(b)) is False
    assert writer.dropped == 1 and writer.pending(b[0].block_hash) is None
    gate.set()
    writer.close()
    assert store.stats().blocks == 3
    store.close()


def test_an_erasure_cancels_queued_runs(tmp_path: Path) -> None:
    gate = threading.Event()
    store = gated_store(tmp_path, gate)
    writer = DiskWriter(store)
    mine = chain(2, owner="s1")
    child = chain(2, parent=mine[-1].block_hash, owner="s2", start=2)
    keep = chain(2, namespace="b", owner="s2")
    for run in (mine, child, keep):
        writer.submit(run, run_kv(run))
    store.remove_owner("s1")
    assert writer.pending(child[0].block_hash) is None  # cancelled: a promotion must not read it either
    gate.set()
    writer.close()
    assert store.hashes() == {b.block_hash for b in keep}
    assert len(data_files(tmp_path)) == 1
    store.close()


def test_concurrent_writes_loads_and_removals_stay_exact(tmp_path: Path) -> None:
    store = open_store(tmp_path, max_bytes=40_000)
    writer = DiskWriter(store)
    runs = [chain(3, namespace=f"n{i % 7}", start=i) for i in range(60)]
    for i, run in enumerate(runs):
        writer.submit(run, run_kv(run, torch.bfloat16))
        loaded = store.load([b.block_hash for b in runs[i // 2]])
        assert_exact(loaded, runs[i // 2][: len(loaded)], torch.bfloat16)
        if i % 5 == 0:
            store.remove([runs[i // 3][0].block_hash])
    writer.close()
    assert store.stats().quarantined == 0 and writer.failed == 0
    assert store.stats().bytes <= 40_000
    store.close()
