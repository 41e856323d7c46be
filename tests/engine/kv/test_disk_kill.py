"""Crash safety: a child writing runs (and removing, loading, evicting) is SIGKILLed at random moments, 50 times;
after each kill the store must open cleanly and every block it reports must load bit-exactly."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from engine.kv.block_hash import hash_block
from engine.kv.disk_format import FILE_SUFFIX
from support import disk_write_child as child

KILLS = 50
SCRIPT = Path(child.__file__)


def run_and_kill(directory: Path, seed: int, delay: float) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(directory), str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n", proc.stderr.read() if proc.stderr else b""
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL, err.decode()


def test_a_store_survives_being_killed_mid_write(tmp_path: Path) -> None:
    rng = random.Random(2024)
    directory = tmp_path / "store"
    leftovers = verified = 0
    started = time.perf_counter()
    for seed in range(KILLS):
        run_and_kill(directory, seed, rng.uniform(0.0, 0.15))
        leftovers += sum(1 for p in directory.iterdir() if p.name.endswith(".tmp"))
        with child.open_store(str(directory)) as store:
            leftovers += store.stats().quarantined  # files renamed but never indexed
            on_disk = {p.name for p in directory.glob("*" + FILE_SUFFIX)}
            assert store.stats().files == len(on_disk)  # every remaining file is indexed
            assert not list(directory.glob("*.tmp"))
            for h in sorted(store.hashes()):
                (lb,) = store.load([h])
                assert hash_block(lb.block.parent, lb.block.token_ids) == h
                assert np.array_equal(lb.kv.numpy().view(np.int32), child.expected_kv(h).view(np.int32))
                verified += 1
            assert store.stats().load_misses == 0  # nothing the index vouches for fails verification
    elapsed = time.perf_counter() - started
    print(f"{KILLS} kills in {elapsed:.1f} s: {verified} blocks verified, {leftovers} interrupted writes cleaned up")
    assert verified > 0
