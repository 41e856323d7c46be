"""The engine hands its OpenMP workers back when idle (engine/openmp.py): a thread's pool really goes away."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from engine.openmp import release_thread_pool


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled(expected: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while _native_threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return _native_threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2, reason="Linux, >= 2 CPUs")
def test_release_ends_the_calling_threads_workers() -> None:
    counts: dict[str, int] = {}

    def work() -> None:
        torch.set_num_threads(2)
        counts["before"] = _native_threads()
        a = torch.randn(512, 512)
        for _ in range(3):
            a = a @ a  # large enough for a parallel region
        counts["pool"] = _native_threads()
        counts["released"] = int(release_thread_pool())
        counts["after"] = _settled(counts["before"])

    threads = torch.get_num_threads()
    try:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(threads)
    assert counts["pool"] > counts["before"]  # the region started a worker for this thread
    assert counts["released"] == 1
    assert counts["after"] == counts["before"]
