"""Device and dtype resolution: the one place that knows which hardware features the engine may use.

``auto`` dtype means bfloat16 where the CPU has native bf16 matmuls (AMX or AVX512-BF16, read from /proc/cpuinfo) or
on CUDA, and float32 otherwise: bf16 without hardware support is slower than fp32 on CPU.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from engine.errors import ModelLoadError

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


@functools.cache
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU feature flags of the first processor in ``cpuinfo`` (empty where the file is unreadable)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_supports_bf16() -> bool:
    return bool(cpu_flags() & _BF16_CPU_FLAGS)


def resolve_device(name: str) -> torch.device:
    """``auto`` → cuda when available, else cpu. An explicit cuda device that is absent is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ModelLoadError(f"unknown device {name!r}: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"unsupported device {name!r}: use cpu or cuda")
    return device


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` → bf16 on CUDA or on a CPU with native bf16, else float32; otherwise the named dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        if device.type == "cuda" or cpu_supports_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}: use auto, float32, bfloat16 or float16")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
