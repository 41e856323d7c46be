"""The kernel build: C lives in ``csrc/`` (not in Python strings), compiles without warnings, lands in the configured
cache directory, and builds from an installed copy of kvchat."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.device import cpu_flags
from engine.model import build, kernels

ROOT = Path(__file__).resolve().parents[3]
needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")

# NOTE: written in pieces so that this file does not match itself
C_IN_STRINGS = [
    re.compile("#" + r"include\s*[<\"]"),
    re.compile("__" + r"m(512|256|128)"),
    re.compile("#" + r"pragma\s+omp"),
    re.compile(r"\b(static\s+inline|void)\s+\w+\s*\([^)]*\)\s*\{"),
]


def _buildable() -> list[str]:
    """The csrc libraries this CPU can build (the others need instructions it lacks)."""
    flags = cpu_flags()
    return sorted({i.library for i in kernels.TABLE if i.library and i.needs <= flags})


def test_no_c_source_in_python_strings() -> None:
    found = []
    for folder in ("engine", "backend", "bench", "tests"):
        for file in (ROOT / folder).rglob("*.py"):
            text = file.read_text(errors="replace")
            found += [f"{file.relative_to(ROOT)}: {p.pattern}" for p in C_IN_STRINGS if p.search(text)]
    assert not found, "C source belongs in engine/model/csrc/*.c:\n" + "\n".join(found)


def test_every_library_has_its_c_sources() -> None:
    libraries = {i.library for i in kernels.TABLE if i.library}
    files = {f.stem for f in build.CSRC.glob("*.c")} | {d.name for d in build.CSRC.iterdir() if d.is_dir()}
    assert files == libraries
    assert all(f.suffix in (".c", ".h") for lib in libraries for f in build.sources(lib))


@needs_compiler
@pytest.mark.parametrize("stem", _buildable())
def test_compiles_without_warnings(stem: str, tmp_path: Path) -> None:
    cc = build.compiler()
    assert cc is not None
    c_files = [str(f) for f in build.sources(stem) if f.suffix == ".c"]
    done = subprocess.run(
        [cc, *build.FLAGS, "-Werror", f"-I{build.CSRC}", *c_files, "-o", str(tmp_path / "x.so")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


@needs_compiler
def test_builds_into_the_configured_cache_dir(tmp_path: Path) -> None:
    build.use_cache_dir(tmp_path)
    try:
        path = build.build_library("cpu_kernels")
        assert path.parent == tmp_path / "kernels" and path.is_file()
        assert build.build_library("cpu_kernels") == path  # (once: the second call finds it)
    finally:
        build.use_cache_dir(None)


@needs_compiler
def test_an_installed_copy_builds_its_kernels(tmp_path: Path) -> None:
    # a copy of the sources outside the repository, installed as pip would, then built from where it was installed
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("engine", "backend"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "--target", str(target), str(source)], check=True, capture_output=True, timeout=300)
    shutil.rmtree(source)
    script = (
        "from engine.model import build, kernels\n"
        f"assert build.CSRC.is_relative_to({str(target)!r}), build.CSRC\n"
        f"for name in {_buildable()!r}:\n"
        "    assert kernels.library(name) is not None, name\n"
        "print(sorted(p.name for p in (build.cache_dir() / 'kernels').glob('*.so')))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target), "KVCHAT_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert len(list((tmp_path / "cache" / "kernels").glob("*.so"))) == len(_buildable())
