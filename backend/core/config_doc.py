"""``docs/configuration.md``, written from the settings class so the reference cannot drift from the code.

``python -m backend.core.config_doc`` rewrites the file; ``--check`` exits 1 when it differs (a test runs the same
comparison). Each row is one ``Settings`` field: its ``KVCHAT_`` variable, its default and its ``description``.
"""

from __future__ import annotations

import argparse
import json
import sys
from enum import Enum
from pathlib import Path

from pydantic.fields import FieldInfo

from backend.core.config import Settings

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

_HEADER = """\
# Configuration

Every setting is an environment variable with the prefix `KVCHAT_` (a `.env` file is not read). The server reads them
once at start; the operator changes the KV cache's settings at runtime through `/admin/cache/settings`, and a
tenant's own settings (reply settings, tools, rules, handbook) live in the database, edited on the dashboard's
settings page (`/settings`) or through the admin API.

This page is generated from `backend/core/config.py` by `python -m backend.core.config_doc`; a test fails when the
two differ, so edit the field's `description` there, not this file. Outside the settings class, the engine reads
`KVCHAT_DISABLE_KERNELS=1` (run every operation in torch, build no C kernels; `kvchat doctor` shows the choice).

| variable | default | meaning |
|---|---|---|
"""


class MissingDescriptionError(ValueError):
    """A settings field without a ``description``: it would be an undocumented knob."""


def render() -> str:
    """The whole Markdown page, one table row per settings field, in the class's order."""
    rows = [_row(name, info) for name, info in Settings.model_fields.items()]
    return _HEADER + "\n".join(rows) + "\n"


def _row(name: str, info: FieldInfo) -> str:
    if not info.description:
        raise MissingDescriptionError(f"Settings.{name} has no description")
    variable = f"`KVCHAT_{name.upper()}`"
    meaning = info.description.replace("|", "\\|")
    return f"| {variable} | {_default(info.default)} | {meaning} |"


def _default(value: object) -> str:
    if value is None or value == "":
        return "unset"
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list):
        return f"`{json.dumps(value)}`"
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    if isinstance(value, Path):
        return f"`{value.as_posix()}`"
    return f"`{value}`"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.core.config_doc", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/configuration.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if DOC_PATH.read_text(encoding="utf-8") != text:
            print(f"{DOC_PATH} is out of date: run python -m backend.core.config_doc", file=sys.stderr)
            return 1
        return 0
    DOC_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
