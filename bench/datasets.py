"""The data the benchmarks and their smoke tests read, vendored under ``bench/data/`` (see its README).

Files are stored xz-compressed; ``resolve`` finds ``name`` or ``name.xz`` in a folder and ``read_text`` decompresses
transparently, so ``--data`` / ``--data-dir`` may point at plain or compressed copies alike.
"""

from __future__ import annotations

import lzma
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
CONVERSATIONS_FILE = "cucom_ecommerce_dev.jsonl"
GUIDELINES_FILE = "abcd_guidelines.json"
CONVERSATIONS = DATA_DIR / CONVERSATIONS_FILE
GUIDELINES = DATA_DIR / GUIDELINES_FILE


class DataNotFoundError(FileNotFoundError):
    """Neither ``path`` nor ``path.xz`` exists."""


def resolve(path: Path) -> Path:
    """``path`` when it exists, else its ``.xz`` sibling; raises ``DataNotFoundError`` naming both."""
    path = Path(path)
    if path.is_file():
        return path
    packed = path.with_name(path.name + ".xz")
    if packed.is_file():
        return packed
    raise DataNotFoundError(f"{path} not found (nor {packed.name})")


def read_text(path: Path) -> str:
    """The text of ``path`` (or of ``path.xz``), decompressed when it is an ``.xz`` file."""
    found = resolve(path)
    if found.suffix == ".xz":
        return lzma.decompress(found.read_bytes()).decode("utf-8")
    return found.read_text(encoding="utf-8")
