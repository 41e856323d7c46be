"""Chained block hashes: the prefix-cache key.

``h_0 = root_hash(model_fingerprint, namespace)`` and ``h_i = hash_block(h_{i-1}, tokens_of_block_i)``. Because each
hash folds in its parent, equal hashes mean equal prefixes (up to a 2^-128 collision, which the pool guards against by
also comparing token ids on every hit). Different namespaces have different roots, so they never share a block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
"""128-bit chained hash of a full block (sha256 truncated to 16 bytes). Never Python's ``hash()``."""

HASH_NUM_BYTES = 16


def _digest(*parts: bytes) -> BlockHash:
    h = hashlib.sha256()
    for part in parts:
        # NOTE: every part is length-prefixed so ("ab", "c") and ("a", "bc") can never hash alike.
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    return BlockHash(h.digest()[:HASH_NUM_BYTES])


def root_hash(model_fingerprint: str, namespace: str) -> BlockHash:
    """The seed of every chain for one (model, namespace) pair."""
    return _digest(b"kvchat-root-v1", model_fingerprint.encode(), namespace.encode())


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given its parent's hash (the root for the first block)."""
    return _digest(b"kvchat-block-v1", parent, struct.pack(f"<{len(token_ids)}q", *token_ids))


def hash_chain(root: BlockHash, token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (a trailing partial block is not hashed)."""
    hashes: list[BlockHash] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
