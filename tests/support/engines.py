"""Engines on the tiny test model, and a thread policy for tests that drive it step by step."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


def make_engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    """An fp32 CPU engine on ``model_dir`` (not started); ``overrides`` are EngineConfig fields."""
    options: dict[str, Any] = {"model": str(model_dir), "dtype": "float32", "device": "cpu", "max_kv_memory_mb": 8}
    return LLMEngine(EngineConfig(**(options | overrides)))


@contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """NOTE: the tiny model gains nothing from intra-op threads, and on busy cores every small op then waits at an
    OpenMP barrier (a 50-token SDPA took 10 ms instead of 35 us with 2 threads); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
