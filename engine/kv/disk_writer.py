"""Background writer of the disk tier: the engine's step loop hands runs over and never waits for the disk.

Submitted runs wait in a bounded queue; one thread drains it, merges consecutive runs of the same namespace (and
tensor layout) into files of up to ``max_blocks_per_file`` blocks (a single run is never split, so a chain's run stays
in one file) and calls ``DiskStore.write_run``. Until a block is indexed, ``pending`` serves its K/V so a promotion
can read a block that is still on its way to disk.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.kv.block_hash import BlockHash
from engine.kv.disk_format import DiskBlock
from engine.kv.disk_store import DiskStore

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvchat.engine.disk")

KV = Any  # torch.Tensor, or a numpy array (tests write without torch)


@dataclass(slots=True)
class _Run:
    blocks: list[DiskBlock]
    kv: KV  # [layers, 2, n, block_size, kv_heads, head_dim]


class DiskWriter:
    """Runs ``write_run`` on a background thread so the engine's step loop never waits for the disk.

    The caller hands over ``kv`` and must not modify it afterwards (pass a copy of the pool's blocks, which indexing
    the pool with a list of block ids already is).
    """

    def __init__(self, store: DiskStore, max_pending_blocks: int = 4096, max_blocks_per_file: int = 64) -> None:
        self.store = store
        self.max_pending_blocks = max_pending_blocks
        self.max_blocks_per_file = max_blocks_per_file
        self.dropped = 0  # submissions refused because the queue was full (or the writer was closed)
        self.failed = 0  # runs whose write raised (logged; the blocks are simply not on disk)
        self._cond = threading.Condition()
        self._queue: deque[_Run] = deque()
        self._queued_blocks = 0  # blocks in the queue or being written
        self._pending: dict[BlockHash, tuple[KV, int]] = {}  # hash -> (run kv, index in the run)
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kvchat-disk-writer", daemon=True)
        self._thread.start()

    def submit(self, blocks: Sequence[DiskBlock], kv: torch.Tensor | np.ndarray[Any, Any]) -> bool:
        """Queue a run for writing; False (and counted in ``dropped``) when the queue is full. Never blocks on I/O."""
        if not blocks:
            return True
        if kv.shape[2] != len(blocks):
            raise ValueError(f"kv holds {kv.shape[2]} blocks, {len(blocks)} were given")
        with self._cond:
            if self._closed or self._queued_blocks + len(blocks) > self.max_pending_blocks:
                self.dropped += 1
                return False
            self.store.reserve(blocks)
            self._queue.append(_Run(list(blocks), kv))
            self._queued_blocks += len(blocks)
            for i, b in enumerate(blocks):
                self._pending[b.block_hash] = (kv, i)
            self._cond.notify_all()
        return True

    def pending(self, block_hash: BlockHash) -> torch.Tensor | None:
        """K/V (``[layers, 2, block_size, kv_heads, head_dim]``, a view) of a block queued but not yet written."""
        with self._cond:
            entry = self._pending.get(block_hash)
        if entry is None or self.store.is_cancelled(block_hash):
            return None
        kv, i = entry
        out: torch.Tensor = kv[:, :, i]
        return out

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything submitted so far is written (or ``timeout`` seconds pass)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self) -> None:
        """Write what is queued, then stop the thread. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed and drained
                runs = list(self._queue)
                self._queue.clear()
                self._busy = True
            try:
                for group in _group(runs, self.max_blocks_per_file):
                    self._write(group)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, group: list[_Run]) -> None:
        blocks = [b for run in group for b in run.blocks]
        try:
            try:
                kv = group[0].kv if len(group) == 1 else _concat([run.kv for run in group])
            except Exception:
                self.store.release(blocks)  # write_run releases the reservation; here it never ran
                raise
            self.store.write_run(blocks, kv, reserved=True)
        except Exception:
            # NOTE: a failed write only loses cached copies; the thread must live on for the next runs.
            self.failed += 1
            log.exception("disk KV: writing a run of %d blocks failed", len(blocks))
        finally:
            with self._cond:
                # NOTE: dropped from `pending` only after write_run returns, when the index serves them: no gap.
                for b in blocks:
                    entry = self._pending.get(b.block_hash)
                    if entry is not None and any(entry[0] is run.kv for run in group):
                        del self._pending[b.block_hash]
                self._queued_blocks -= len(blocks)


def _layout(kv: KV) -> tuple[object, ...]:
    shape = tuple(kv.shape)
    return (type(kv), kv.dtype, shape[:2], shape[3:])


def _group(runs: list[_Run], max_blocks: int) -> list[list[_Run]]:
    """Merge consecutive runs of one namespace root and tensor layout, up to ``max_blocks`` (a run is never split)."""
    groups: list[list[_Run]] = []
    size = 0
    for run in runs:
        last = groups[-1] if groups else None
        if (
            last is not None
            and size + len(run.blocks) <= max_blocks
            and last[0].blocks[0].root == run.blocks[0].root
            and _layout(last[0].kv) == _layout(run.kv)
        ):
            last.append(run)
            size += len(run.blocks)
        else:
            groups.append([run])
            size = len(run.blocks)
    return groups


def _concat(kvs: list[KV]) -> KV:
    if isinstance(kvs[0], np.ndarray):
        return np.concatenate(kvs, axis=2)
    import torch

    return torch.cat(kvs, dim=2)
