"""Child process of ``tests/engine/kv/test_disk_kill.py``: writes runs to a DiskStore in a loop until it is killed.

It imports numpy and the store only (never torch), so a start costs a tenth of a second and 50 kills stay fast. The
K/V of every block is a pure function of its hash (``expected_kv``), so the parent can check what survived.

    python tests/support/disk_write_child.py DIRECTORY SEED
"""

from __future__ import annotations

import random
import sys

import numpy as np

from engine.kv.block_hash import BlockHash, hash_block, root_hash
from engine.kv.disk_format import DiskBlock
from engine.kv.disk_store import DiskStore

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 4, 4, 32, 16
FINGERPRINT = "kill-test-model"
BLOCK_BYTES = LAYERS * 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 4
MAX_BYTES = 48 * BLOCK_BYTES  # small enough that the cap evicts while the child runs


def expected_kv(block_hash: BlockHash) -> np.ndarray:
    """The K/V written for ``block_hash``: ``[layers, 2, block_size, heads, head_dim]`` float32."""
    rng = np.random.default_rng(int.from_bytes(block_hash[:8], "little"))
    return rng.standard_normal((LAYERS, 2, BLOCK_SIZE, HEADS, HEAD_DIM), dtype=np.float32)


def open_store(directory: str) -> DiskStore:
    return DiskStore(directory, FINGERPRINT, max_bytes=MAX_BYTES, min_free_bytes=0, ttl_s=1e9)


def main(directory: str, seed: int) -> None:
    rng = random.Random(seed)
    store = open_store(directory)
    assert "torch" not in sys.modules, "the child must stay lean"
    print("ready", flush=True)
    root = root_hash(FINGERPRINT, f"ns-{seed % 3}")
    parent, chain = root, list[BlockHash]()
    while True:
        blocks = []
        for _ in range(rng.randint(1, 8)):
            tokens = tuple(rng.randrange(50_000) for _ in range(BLOCK_SIZE))
            h = hash_block(parent, tokens)
            blocks.append(DiskBlock(h, parent, root, tokens, ("untyped",), f"session-{seed}"))
            parent = h
        store.write_run(blocks, np.stack([expected_kv(b.block_hash) for b in blocks], axis=2))
        chain.extend(b.block_hash for b in blocks)
        if rng.random() < 0.2:  # a kill may land in a removal or a load too
            store.remove([rng.choice(chain)])
        elif rng.random() < 0.2:
            store.load(chain[:4])
        if rng.random() < 0.3:  # start a new chain now and then
            parent, chain = root, list[BlockHash]()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
