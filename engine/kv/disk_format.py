"""The file format of the disk tier: one safetensors file per run of blocks, and the checks every read passes.

A file holds one tensor ``kv`` (block-major: ``[n, layers, 2, block_size, kv_heads, head_dim]``) and metadata naming
the format, the model fingerprint, and each block's hash, parent and token ids. It is written atomically (temp file,
fsync, rename, fsync of the directory). A read verifies the whole file (sha256, safetensors parse, format, fingerprint,
shapes) and each block against its index row; any failure raises ``BadFile``, which the store turns into a quarantine
and a miss. The module imports torch lazily: a writer that passes numpy arrays never loads it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.kv.block_hash import BlockHash

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = "kvchat-disk-v1"
FILE_SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"

KV = Any  # torch.Tensor or a numpy array: [layers, 2, n, block_size, kv_heads, head_dim]


class BadFile(Exception):
    """A stored file failed verification (internal to the disk tier: always a quarantine and a miss)."""


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


@dataclass(slots=True)
class VerifiedFile:
    """A file that passed the whole-file checks; ``matches`` checks one block against its index row."""

    kv: torch.Tensor  # [n, layers, 2, block_size, kv_heads, head_dim]: the file's block-major layout
    hashes: list[str]  # hex, from the file's metadata
    parents: list[str]
    token_ids: list[list[int]]

    def matches(self, idx: int, block: DiskBlock) -> bool:
        return (
            0 <= idx < len(self.hashes)
            and self.hashes[idx] == block.block_hash.hex()
            and self.parents[idx] == block.parent.hex()
            and tuple(self.token_ids[idx]) == block.token_ids
        )


def check_run(blocks: Sequence[DiskBlock], kv: KV) -> None:
    """Raise ValueError unless ``kv`` holds exactly ``blocks`` (a caller's bug, not bad data)."""
    shape = tuple(kv.shape)
    if len(shape) != 6 or shape[1] != 2 or shape[2] != len(blocks):
        raise ValueError(f"kv must be [layers, 2, {len(blocks)}, block_size, kv_heads, head_dim], got {shape}")
    for b in blocks:
        if len(b.token_ids) != shape[3]:
            raise ValueError(f"block {b.block_hash.hex()} has {len(b.token_ids)} token ids, block_size is {shape[3]}")


def select_blocks(kv: KV, idx: list[int]) -> KV:
    return kv[:, :, idx]  # advanced indexing: a copy, for numpy and torch alike


def block_bytes(kv: KV) -> int:
    """Bytes of one block's K/V in ``kv``."""
    itemsize = kv.itemsize if isinstance(kv, np.ndarray) else kv.element_size()
    n = 1
    for i, d in enumerate(kv.shape):
        if i != 2:
            n *= int(d)
    return n * itemsize


def serialize(blocks: Sequence[DiskBlock], kv: KV, fingerprint: str) -> bytes:
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


def checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_verified(path: Path, expected_checksum: str, fingerprint: str) -> VerifiedFile:
    """Read one file and check it as a whole: checksum, safetensors parse, format, fingerprint, shapes."""
    from safetensors.torch import load as st_load

    data = path.read_bytes()
    if checksum(data) != expected_checksum:
        raise BadFile("checksum mismatch")
    kv = st_load(data).get("kv")
    meta = _read_metadata(data)
    if meta.get("format") != FORMAT_VERSION or meta.get("fingerprint") != fingerprint:
        raise BadFile("format or model fingerprint differs")
    if kv is None:
        raise BadFile("no kv tensor")
    vf = VerifiedFile(kv, json.loads(meta["hashes"]), json.loads(meta["parents"]), json.loads(meta["token_ids"]))
    n = len(vf.hashes)
    if kv.dim() != 6 or kv.shape[0] != n or len(vf.parents) != n or len(vf.token_ids) != n:
        raise BadFile("kv tensor does not match the metadata")
    return vf


def write_atomically(directory: Path, name: str, data: bytes) -> None:
    """``directory/name`` holds ``data`` completely or not at all, even across a crash."""
    tmp = directory / f".{name}{TMP_SUFFIX}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / name)
    fsync_dir(directory)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (8-byte little-endian header length, then the JSON header)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    meta = header.get("__metadata__")
    if not isinstance(meta, dict):
        raise BadFile("no metadata")
    return meta
