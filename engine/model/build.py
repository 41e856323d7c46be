"""Compiling the C kernels of ``csrc/`` once per CPU into the cache directory, and opening them with ctypes.

Each ``csrc/<stem>.c`` is one library, and so is each folder ``csrc/<stem>/`` (its ``.c`` files, one per operation,
linked together; its ``.h`` files are its own); the ``.h`` files of ``csrc/`` are shared. A library is built with the
system C compiler into ``<cache_dir>/kernels/<stem>-<key>.so``, ``key`` hashing the sources, the compiler, the flags
and the CPU's feature flags (``-march=native``), so a new CPU or an edited source builds once and then loads in
milliseconds.

NOTE: plain C + ctypes rather than ``torch.utils.cpp_extension``: it compiles in about a second instead of a minute of
torch headers, and ``-fopenmp`` binds to the ``libgomp.so.1`` torch has already loaded, so both share one thread
pool. Where there is no compiler, the build fails or ``KVCHAT_DISABLE_KERNELS=1``, ``open_library`` returns None and
the model takes the torch paths (``kernels.py`` says which).

The cache directory is ``EngineConfig.cache_dir`` (``load_model(cache_dir=...)`` sets it with ``use_cache_dir``), else
``$KVCHAT_CACHE_DIR``, else ``~/.cache/kvchat``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from engine.device import cpu_flags
from engine.model.loader import default_cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-Wall", "-Wextra", "-Wno-psabi")
_cache_dir: Path | None = None


def use_cache_dir(path: str | Path | None) -> None:
    """Build kernels under ``path`` (``EngineConfig.cache_dir``) from now on; None goes back to the default."""
    global _cache_dir
    _cache_dir = None if path is None else Path(path)


def cache_dir() -> Path:
    return _cache_dir or default_cache_dir()


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def disabled() -> bool:
    return os.environ.get("KVCHAT_DISABLE_KERNELS") == "1"


def sources(stem: str) -> list[Path]:
    """The files a library is built from: ``csrc/<stem>.c`` (or the files of ``csrc/<stem>/``) and every shared
    header."""
    own = [CSRC / f"{stem}.c"] if (CSRC / f"{stem}.c").is_file() else sorted((CSRC / stem).glob("*.[ch]"))
    if not own:
        raise RuntimeError(f"no C sources for the kernel library {stem!r} in {CSRC}")
    return [*own, *sorted(CSRC.glob("*.h"))]


def build_library(stem: str, extra_flags: Sequence[str] = (), into: Path | None = None) -> Path:
    """Compile library ``stem`` (``sources``) into ``<cache_dir>/kernels/<stem>-<key>.so`` unless it is there."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    flags = [*FLAGS, *extra_flags, f"-I{CSRC}"]
    digest = hashlib.sha256("\0".join([cc, *flags, *sorted(cpu_flags())]).encode())
    files = sources(stem)
    for file in files:
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    target = (into or cache_dir()) / "kernels" / f"{stem}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run(
            [cc, *flags, *(str(f) for f in files if f.suffix == ".c"), "-o", str(built)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
        if done.stderr.strip():
            log.warning("%s: compiler warnings:\n%s", stem, done.stderr.strip()[-2000:])
        os.replace(built, target)  # atomic: a concurrent build of the same key writes the same bytes
    return target


def open_library(stem: str, fallback: str, extra_flags: Sequence[str] = ()) -> ctypes.CDLL | None:
    """Build (once) and open ``csrc/<stem>.c``; None when kernels are disabled or it cannot be built (the warning
    names ``fallback``, what is used instead)."""
    if disabled():
        return None
    try:
        return ctypes.CDLL(str(build_library(stem, extra_flags)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("%s kernel unavailable, using %s: %s", stem, fallback, exc)
        return None
