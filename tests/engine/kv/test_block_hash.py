from __future__ import annotations

import hashlib
import struct

from engine.kv.block_hash import HASH_NUM_BYTES, hash_block, hash_chain, root_hash


def test_root_is_16_bytes_and_deterministic() -> None:
    root = root_hash("model-a", "tenant-1")
    assert isinstance(root, bytes)
    assert len(root) == HASH_NUM_BYTES == 16
    assert root == root_hash("model-a", "tenant-1")


def test_root_depends_on_model_and_namespace() -> None:
    roots = {root_hash("model-a", "t1"), root_hash("model-a", "t2"), root_hash("model-b", "t1")}
    assert len(roots) == 3


def test_root_parts_are_length_prefixed() -> None:
    assert root_hash("ab", "c") != root_hash("a", "bc")


def test_root_matches_the_documented_construction() -> None:
    h = hashlib.sha256()
    for part in (b"kvchat-root-v1", b"m", b"ns"):
        h.update(struct.pack("<Q", len(part)) + part)
    assert root_hash("m", "ns") == h.digest()[:16]


def test_block_hash_depends_on_parent_and_tokens() -> None:
    r1, r2 = root_hash("m", "a"), root_hash("m", "b")
    assert hash_block(r1, [1, 2, 3]) == hash_block(r1, (1, 2, 3))
    assert hash_block(r1, [1, 2, 3]) != hash_block(r2, [1, 2, 3])
    assert hash_block(r1, [1, 2, 3]) != hash_block(r1, [1, 2, 4])
    assert hash_block(r1, [1, 2, 3]) != hash_block(r1, [3, 2, 1])
    assert len(hash_block(r1, [7])) == 16


def test_large_token_ids_do_not_collide() -> None:
    root = root_hash("m", "a")
    assert hash_block(root, [2**32]) != hash_block(root, [0])


def test_chain_hashes_full_blocks_only() -> None:
    root = root_hash("m", "a")
    tokens = list(range(37))
    chain = hash_chain(root, tokens, 16)
    h0 = hash_block(root, tokens[:16])
    h1 = hash_block(h0, tokens[16:32])
    assert chain == [h0, h1]
    assert hash_chain(root, tokens[:15], 16) == []
    assert hash_chain(root, tokens[:16], 16) == [h0]


def test_same_block_under_different_prefix_differs() -> None:
    root = root_hash("m", "a")
    a = hash_chain(root, [1] * 16 + [5] * 16, 16)
    b = hash_chain(root, [2] * 16 + [5] * 16, 16)
    assert a[1] != b[1]
