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


# The CPU kinds the kernel table tells apart, most capable first: (label, the flags that make it).
_CPU_KINDS: tuple[tuple[str, frozenset[str]], ...] = (
    ("AMX", frozenset({"amx_bf16", "amx_tile", "avx512_bf16"})),
    ("AVX-512 + AVX512-BF16", frozenset({"avx512f", "avx512_bf16"})),
    ("AVX-512", frozenset({"avx512f"})),
    ("AVX2 + FMA", frozenset({"avx2", "fma"})),
)


def cpu_kind(flags: frozenset[str] | None = None) -> str:
    """The kind of CPU as the kernel table sees it ("AMX", "AVX-512 + AVX512-BF16", "AVX-512", "AVX2 + FMA" or
    "no vector kernels"): every benchmark figure names it, since the same code runs other kernels on another kind."""
    flags = cpu_flags() if flags is None else flags
    return next((label for label, needs in _CPU_KINDS if needs <= flags), "no vector kernels")


def cpu_description(cpuinfo: str = "/proc/cpuinfo") -> str:
    """``kind: model name (family F, model M)``, e.g. ``AVX-512 + AVX512-BF16: AMD EPYC (family 26, model 2)``."""
    try:
        lines = Path(cpuinfo).read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    family = f" (family {fields['cpu family']}, model {fields.get('model', '?')})" if "cpu family" in fields else ""
    return f"{cpu_kind(cpu_flags(cpuinfo))}: {fields.get('model name', 'unknown CPU')}{family}"


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
