"""OpenMP thread pools, and why the engine hands its own back whenever it goes idle.

torch's CPU ops and our C kernels (``engine/model/csrc/``) share torch's libgomp. Every
thread that opens a parallel region gets its *own* pool of worker threads, which outlives the region. When libgomp
manages more threads than there are CPUs, it stops letting idle workers spin between regions and puts them to sleep
at once, so each of the ~150 parallel regions of a decode step pays a futex wake-up. Measured on 2 cores, SmolLM2
decode step: 19-22 ms with one pool in the process, 32-47 ms as soon as a second thread (the one that loaded the
model, the asyncio executor's, a benchmark's peer) still holds a pool.

So the engine loads its model on its own step thread and releases that thread's pool (``omp_pause_resource_all``,
OpenMP 5.0; it only touches the calling thread's pool) whenever it runs out of work; the next step rebuilds it in
microseconds. Code that runs torch work on another thread in the same process (benchmarks, ``generate_sync``) calls
``release_thread_pool()`` when it is done.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1


@functools.cache
def _pause() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        # NOTE: by soname: torch has already loaded its bundled libgomp.so.1, so this is that same runtime.
        lib = ctypes.CDLL("libgomp.so.1")
        fn = lib.omp_pause_resource_all
    except (OSError, AttributeError) as exc:
        log.info("cannot release OpenMP thread pools (%s); idle pools stay", exc)
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def release_thread_pool() -> bool:
    """Let the calling thread's OpenMP workers exit (they are recreated by its next parallel region).

    Returns False when it could not (no libgomp with OpenMP 5.0, or called inside a parallel region).
    """
    fn = _pause()
    return fn is not None and fn(_OMP_PAUSE_SOFT) == 0
